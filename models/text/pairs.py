"""Text pairs (TEI's /predict ``[a, b]``) encoded as single texts are: in one batch, on bounded windows.

A pair's ids are the tokenizer's own pair template around the two texts' ids
(``post_process(a, b)``, what ``Tokenizer.encode(a, b)`` gives), cut to ``max_length`` on the
``direction`` side as a whole (right: the first ``max_length`` ids, left: the last), or refused
with InputTooLong when truncation is off. Neither text is ever encoded whole when it is long: the
cut keeps at most ``max_length`` ids of each side, so each side is encoded on a window bounded by
that (``prompts.encode_bounded``, the single-text path's windows), and every side of every pair
goes through one ``encode_batch`` (which releases the GIL) instead of one ``Tokenizer.encode`` per
pair (which holds it for the whole text: a 1M-character pair stopped every other thread for
seconds and allocated hundreds of MB).

Invariant: the ids equal those of ``Tokenizer.encode(a, b)`` cut the same way; only the work and
memory are bounded by ``max_length``, not by the texts.
"""
from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

from models.text.prompts import CUT_SLACK, InputTooLong, _check_direction, encode_bounded


def encode_pairs(tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], *, max_length: int, truncate: bool,
                 direction: str = "right") -> list[list[int]]:
    """Token ids of each (a, b) pair with the tokenizer's pair special tokens, cut to ``max_length``.

    Raises InputTooLong naming the first pair over ``max_length`` when ``truncate`` is false.
    """
    direction = _check_direction(direction)
    texts = [t for pair in pairs for t in pair]  # a0, b0, a1, b1, ...
    encodings = encode_bounded(tokenizer, texts, keep=max_length, direction=direction)
    out: list[list[int]] = []
    for i in range(len(pairs)):
        (a, a_whole), (b, b_whole) = encodings[2 * i], encodings[2 * i + 1]
        # NOTE: a window's first (right) or last (left) max_length ids are the whole text's: all
        # that the pair's cut can keep of that side. The windows are post-processed uncut:
        # Encoding.truncate would keep the rest as overflowing pieces, which a pair's merge
        # crosses with the other side's (memory in their product).
        ids = tokenizer.post_process(a, b, add_special_tokens=True).ids
        if len(ids) > max_length:
            if not truncate:
                # a window out-counts its part of the text by at most CUT_SLACK tokens
                held = len(ids) - CUT_SLACK * ((not a_whole) + (not b_whole))
                raise InputTooLong(i, held, max_length, at_least=not (a_whole and b_whole))
            ids = ids[:max_length] if direction == "right" else ids[len(ids) - max_length:]
        out.append(list(ids))
    return out

"""Qwen3 prompt templates and truncation that never cuts the special tokens or the template.

Embedding inputs: the prompt text (e.g. "Instruct: {task}\\nQuery:") is prepended to the input
text, the text is encoded without special tokens, cut to fit, and only then does the tokenizer's
post-processor append its special tokens (<|endoftext|> for Qwen3-Embedding), so a truncated
input still ends with them. Reranker inputs follow the reference Qwen3-Reranker code: prefix and
suffix are encoded once, separately; the body
``<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}`` is encoded on its own
(no special tokens) and is the only part truncation cuts; ids = prefix + body + suffix. The body's
ids equal one encode of the whole body string, but are built from its shared part (encoded once
per request) and each document (encoded once), so a long query costs once, not once per document.
"""
from __future__ import annotations

import functools
from typing import Mapping, Sequence

from tokenizers import Encoding, Tokenizer

from models.text.pair_budget import check_pair_budget, pair_tokens

RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
DIRECTIONS = ("right", "left")


class InputTooLong(ValueError):
    """An input over ``max_length`` tokens while truncation is off."""

    def __init__(self, index: int, length: int, max_length: int, *, at_least: bool = False) -> None:
        held = f"at least {length}" if at_least else f"{length}"
        self.at_least = at_least
        super().__init__(
            f"input {index} has {held} tokens, more than the maximum of {max_length}; "
            "shorten it or set truncate=true"
        )
        self.index, self.length, self.max_length = index, length, max_length


class UnknownPrompt(ValueError):
    """A prompt_name the model does not define."""


def embedding_query_prompt(task: str) -> str:
    """The Qwen3-Embedding query prompt for a task description (documents take no prompt)."""
    return f"Instruct: {task}\nQuery:"


def format_rerank_body(instruction: str, query: str, document: str) -> str:
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def resolve_prompt(
    prompts: Mapping[str, str],
    *,
    prompt_name: str | None,
    default_prompt_name: str | None = None,
    default_prompt: str | None = None,
) -> str:
    """The prompt text to prepend: the named one, else the server default, else none ("")."""
    name = prompt_name
    if name is None:
        if default_prompt is not None:
            return default_prompt
        name = default_prompt_name
    if name is None:
        return ""
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise UnknownPrompt(f"unknown prompt_name {name!r}; this model defines: {known}")
    return prompts[name]


def _encode_ids_only(tokenizer: Tokenizer, texts: list[str]) -> list[Encoding]:
    """Batch encode without char offsets (about half the CPU and far less memory on long texts);
    ids, truncation and post-processing are unchanged. Older tokenizers lack it: plain batch encode."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    encode = fast if fast is not None else tokenizer.encode_batch
    return encode(texts, add_special_tokens=False)


# Tokens past the last kept one that a cut in the text may change (a pre-token split by the cut,
# BPE merges and normalization near it are local); the same slack count_capped relies on.
CUT_SLACK = 32
CHARS_PER_TOKEN = 4  # the first window's characters per wanted token (it doubles from there)
MAX_GROWTH = 16  # the window stops waiting for agreement at this many times its first size ...
MIN_CAP_CHARS = 65_536  # ... or at this many characters, if more


def _window(text: str, size: int, direction: str) -> str:
    return text if len(text) <= size else (text[:size] if direction == "right" else text[len(text) - size:])


def _kept_ids(enc: Encoding, keep: int, direction: str) -> list[int]:
    ids = enc.ids
    return list(ids[:keep] if direction == "right" else ids[len(ids) - keep:])


def encode_bounded(tokenizer: Tokenizer, texts: Sequence[str], *, keep: int,
                   direction: str) -> list[tuple[Encoding, bool]]:
    """Encodings (no special tokens) that agree with the full encodings' ``keep`` tokens on the
    ``direction`` side: right, the first ``keep``; left, the last ``keep``.

    A text of at most ``CHARS_PER_TOKEN x (keep + CUT_SLACK)`` characters is encoded whole. A
    longer one is encoded on a window of characters (a prefix for right, a suffix for left) of
    that size, doubling until the window holds ``CUT_SLACK`` tokens beyond the kept ones and a
    window one character longer keeps the same tokens: where the cut falls inside one long
    pre-token (a run of spaces or letters, whose BPE split depends on where it starts), the two
    disagree and the window grows, up to ``MAX_GROWTH`` times its first size (at least
    ``MIN_CAP_CHARS``). Past that, one
    pre-token longer than the window (a megabyte of one letter, say) is split where the window
    starts it: exact everywhere else, and bounded work, where the whole run would cost a BPE over
    all of it (hundreds of MB for a 1.5 MB word). The work and memory are bounded by what is kept,
    not by the text: a 2 MB text of digits costs two encodes of ~16k characters.
    Per text: (encoding, whole), whole when it is the whole text's; otherwise it holds at least
    ``keep + CUT_SLACK`` tokens (the caller cuts it to ``keep``), and the whole text at least
    ``len(ids) - CUT_SLACK``.
    """
    size = CHARS_PER_TOKEN * (keep + CUT_SLACK)
    cap = max(size * MAX_GROWTH, MIN_CAP_CHARS)
    out: list[tuple[Encoding, bool] | None] = [None] * len(texts)
    todo = list(range(len(texts)))
    while todo:
        pieces = [_window(texts[i], size, direction) for i in todo]
        longer = [_window(texts[i], size + 1, direction) for i, p in zip(todo, pieces) if len(p) < len(texts[i])]
        encs = _encode_ids_only(tokenizer, pieces + longer)
        checks = iter(encs[len(pieces):])
        later = []
        for i, piece, enc in zip(todo, pieces, encs):
            if len(piece) == len(texts[i]):
                out[i] = (enc, True)
                continue
            check = next(checks)
            settled = size >= cap or _kept_ids(enc, keep, direction) == _kept_ids(check, keep, direction)
            if len(enc.ids) >= keep + CUT_SLACK and settled:
                out[i] = (enc, False)
            else:
                later.append(i)
        todo, size = later, size * 2
    return [e for e in out if e is not None]


def _check_direction(direction: str) -> str:
    direction = direction.lower()
    if direction not in DIRECTIONS:
        raise ValueError(f"truncation direction must be right or left, not {direction!r}")
    return direction


def encode_texts(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    max_length: int,
    truncate: bool,
    direction: str = "right",
    add_special_tokens: bool = True,
) -> list[Encoding]:
    """Batch-encode ``texts``; cut the text tokens to fit, then add the special tokens.

    Raises InputTooLong (naming the first offending input) when ``truncate`` is false.
    """
    direction = _check_direction(direction)
    n_special = tokenizer.num_special_tokens_to_add(False) if add_special_tokens else 0
    budget = max_length - n_special
    if budget < 1:
        raise ValueError(f"max_length {max_length} leaves no room next to {n_special} special tokens")
    cut = functools.partial(_encode_cut, tokenizer, budget=budget, truncate=truncate, direction=direction,
                            n_special=n_special, max_length=max_length, add_special_tokens=add_special_tokens)
    if max(map(len, texts), default=0) > CHARS_PER_TOKEN * (budget + CUT_SLACK):
        return cut(texts)
    # Every text is short enough that encode_bounded would encode it whole: encode and post-process
    # in one call (the same encodings as encoding, then adding the special tokens), and cut only
    # the texts whose tokens do not fit.
    encode = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch
    out = encode(texts if isinstance(texts, list) else list(texts), add_special_tokens=add_special_tokens)
    if max(map(len, out), default=0) > max_length:
        over = [i for i, e in enumerate(out) if len(e) > max_length]
        for i, enc in zip(over, cut([texts[i] for i in over], index_of=over)):
            out[i] = enc
    return out


def _encode_cut(tokenizer: Tokenizer, texts: Sequence[str], *, budget: int, truncate: bool, direction: str,
                n_special: int, max_length: int, add_special_tokens: bool,
                index_of: Sequence[int] | None = None) -> list[Encoding]:
    """Encode the text tokens (bounded windows), cut each to ``budget`` or refuse it (naming the
    input ``index_of[i]``, default ``i``), then add the special tokens."""
    encodings = encode_bounded(tokenizer, texts, keep=budget, direction=direction)
    out = []
    for i, (enc, whole) in enumerate(encodings):
        if len(enc.ids) > budget:
            if not truncate:  # a window's count, less what its cut may add, bounds the text's from below
                held = len(enc.ids) if whole else len(enc.ids) - CUT_SLACK
                raise InputTooLong(i if index_of is None else index_of[i], held + n_special, max_length,
                                   at_least=not whole)
            enc.truncate(budget, direction=direction)
        out.append(tokenizer.post_process(enc, add_special_tokens=add_special_tokens))
    return out


def encode_embedding_inputs(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    prompt: str = "",
    max_length: int,
    truncate: bool,
    direction: str = "right",
) -> list[list[int]]:
    """Token ids of embedding inputs: prompt text prepended, special tokens kept on truncation."""
    encodings = encode_texts(
        tokenizer, [prompt + t for t in texts], max_length=max_length, truncate=truncate, direction=direction
    )
    return [e.ids for e in encodings]  # each read of ``ids`` builds a fresh list


class QueryTooLong(ValueError):
    """The shared part of a rerank input (instruction + query) leaves no room for a document."""

    def __init__(self, length: int, max_length: int, *, truncating: bool = False) -> None:
        fix = ("truncation would cut every document out of its pair; shorten the query, or truncate "
               "from the left" if truncating else "shorten the query or set truncate=true")
        super().__init__(
            f"the query and instruction alone take at least {length} tokens with the reranker template, "
            f"more than the maximum input length of {max_length}; {fix}"
        )
        self.length, self.max_length = length, max_length


def cut_body(head: list[int], tail: list[int], budget: int, direction: str) -> list[int]:
    """The body ``head + tail`` cut to ``budget`` tokens (right keeps the start, left the end),
    built without materializing the uncut concatenation (``head`` may be a huge shared query)."""
    if len(head) + len(tail) <= budget:
        return head + tail
    if direction == "right":
        return head[:budget] if len(head) >= budget else head + tail[: budget - len(head)]
    if len(tail) >= budget:
        return tail[len(tail) - budget :]
    return head[len(head) - (budget - len(tail)) :] + tail


class Cut(list):
    """Token ids of a text longer than the budget: only the ``budget`` that can be kept."""


class RerankTemplate:
    """The Qwen3-Reranker chat template with prefix/suffix encoded once.

    Per request, the shared part of every body (``<Instruct>: ...\n<Query>: ...\n<Document>:``)
    is encoded once and each document once (as `` {document}``), so the work is proportional to
    the request, not to query x documents. The split sits between the colon and the space, where
    Qwen's pre-tokenizer always cuts, so shared + piece ids equal the ids of the whole body. Each
    document's boundary is still checked on a small window (``window`` characters each side,
    encoded joined and apart); a document whose boundary would tokenize differently (another
    tokenizer family) is encoded as its whole body instead, which is exact but costs the shared
    part again.
    """

    def __init__(self, tokenizer: Tokenizer, *, window: int = 32) -> None:
        self.tokenizer = tokenizer
        self.window = window
        self.prefix_ids = list(tokenizer.encode(RERANK_PREFIX, add_special_tokens=False).ids)
        self.suffix_ids = list(tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False).ids)

    @property
    def overhead(self) -> int:
        """Tokens the template adds around the body."""
        return len(self.prefix_ids) + len(self.suffix_ids)

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(e.ids) for e in _encode_ids_only(self.tokenizer, list(texts))]

    def _kept(self, texts: Sequence[str], budget: int, direction: str) -> list[list[int]]:
        """Ids of ``texts``, each exact or (when longer than ``budget``) its ``budget`` tokens on the
        ``direction`` side: all that ``cut_body`` can keep of it, at a cost bounded by the budget."""
        out = []
        for enc, whole in encode_bounded(self.tokenizer, texts, keep=budget, direction=direction):
            ids = list(enc.ids)
            if not whole:
                ids = Cut(ids[:budget] if direction == "right" else ids[len(ids) - budget:])
            out.append(ids)
        return out

    def _splits_cleanly(self, shared: str, pieces: Sequence[str]) -> list[bool]:
        """Per piece: does ``shared | piece`` tokenize as the two sides apart (on a window)?"""
        left = shared[-self.window :]
        (left_ids,) = self._ids([left])
        heads = [p[: self.window] for p in pieces]
        joined = self._ids([left + h for h in heads])
        apart = self._ids(heads)
        return [j == left_ids + a for j, a in zip(joined, apart)]

    def encode(
        self,
        query: str,
        documents: Sequence[str],
        *,
        instruction: str = DEFAULT_INSTRUCTION,
        max_length: int,
        truncate: bool,
        direction: str = "right",
        max_pair_tokens: int = 0,
        counted: tuple[int, int] = (0, 0),
    ) -> list[list[int]]:
        """prefix + body + suffix per document; only the body is cut to fit ``max_length``.

        Raises QueryTooLong before any document is encoded when the shared part alone cannot fit
        and truncation is off or would cut from the right (every document cut out of its pair); PairBudgetExceeded when the pairs would hold more than
        ``max_pair_tokens`` tokens together (0: no limit), counted before any pair is built, on
        top of ``counted`` (tokens, pairs) that other queries of the same request hold;
        InputTooLong naming the first document that does not fit. Every text is encoded on a window
        bounded by the budget (``encode_bounded``), so a huge query or document costs what can be kept.
        """
        direction = _check_direction(direction)
        budget = max_length - self.overhead
        if budget < 1:
            raise ValueError(
                f"max_length {max_length} leaves no room for the reranker template ({self.overhead} tokens)"
            )
        whole = format_rerank_body(instruction, query, "")
        assert whole.endswith(": "), "the split below relies on the body ending with ': {document}'"
        shared_text = whole[:-1]
        pieces = [" " + d for d in documents]
        clean = self._splits_cleanly(shared_text, pieces)
        (shared,) = self._kept([shared_text], budget, direction)
        # A piece is >= 1 token (its space). Cutting the end of each body (right) would leave no
        # document in any pair (every score the same), so that is refused whether or not truncating.
        if (not truncate or direction == "right") and all(clean) and len(shared) + 1 > budget:
            raise QueryTooLong(len(shared) + 1 + self.overhead, max_length, truncating=truncate)
        piece_ids = iter(self._kept([p for p, ok in zip(pieces, clean) if ok], budget, direction))
        body_ids = iter(self._kept([shared_text + p for p, ok in zip(pieces, clean) if not ok], budget, direction))
        parts = [(shared, next(piece_ids)) if ok else (next(body_ids), []) for ok in clean]
        bodies = [len(head) + len(tail) for head, tail in parts]
        check_pair_budget(pair_tokens(overhead=self.overhead, bodies=bodies, max_length=max_length),
                          documents=len(documents), limit=max_pair_tokens, counted=counted)
        out = []
        for i, (head, tail) in enumerate(parts):
            if not truncate and len(head) + len(tail) > budget:
                raise InputTooLong(i, len(head) + len(tail) + self.overhead, max_length,
                                   at_least=isinstance(head, Cut) or isinstance(tail, Cut))
            out.append(self.prefix_ids + cut_body(head, tail, budget, direction) + self.suffix_ids)
        return out

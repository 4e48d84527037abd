"""Text pairs (TEI /predict [a, b]) encoded on bounded windows in one batch answer exactly what the
tokenizer's own whole-pair encode, cut to the limit, gives (the oracle: ``Tokenizer.encode(a, b)``),
under the fixture's ByteLevel processor and under a template that adds specials around both sides;
and a pair of a megabyte per side costs windows, not whole-text encodes."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from models.text.pairs import encode_pairs
from models.text.prompts import InputTooLong
from server.service.scoring import encode_texts
from tests.test_bounded_encode import adversarial


def _templated(path: str) -> Tokenizer:
    tok = Tokenizer.from_file(path)
    tok.add_special_tokens(["<cls>", "<sep>"])
    cls, sep = tok.token_to_id("<cls>"), tok.token_to_id("<sep>")
    tok.post_processor = TemplateProcessing(single="<cls> $A <sep>", pair="<cls> $A <sep> $B:1 <sep>:1",
                                            special_tokens=[("<cls>", cls), ("<sep>", sep)])
    return tok


@pytest.fixture(scope="module", params=["bytelevel", "template"])
def tok(request, tiny_embedding_dir):
    path = str(tiny_embedding_dir / "tokenizer.json")
    return Tokenizer.from_file(path) if request.param == "bytelevel" else _templated(path)


def oracle(tok, a: str, b: str, max_length: int, direction: str) -> list[int]:
    ids = list(tok.encode(a, b).ids)
    if len(ids) <= max_length:
        return ids
    return ids[:max_length] if direction == "right" else ids[len(ids) - max_length:]


@pytest.mark.parametrize("direction", ["right", "left"])
@pytest.mark.parametrize("max_length", [3, 100, 1000])
def test_pairs_equal_the_whole_pair_encode_cut(tok, direction, max_length):
    texts = adversarial()
    pairs = [(a, b) for a, b in zip(texts, texts[1:] + texts[:1])] + [("short", texts[0]), (texts[3], "x"), ("", "y")]
    got = encode_pairs(tok, pairs, max_length=max_length, truncate=True, direction=direction)
    assert got == [oracle(tok, a, b, max_length, direction) for a, b in pairs]


_ALPHABET = st.sampled_from(list("0123456789 \n\tab.,'-=") + ["é", "e\u0301", "🙂", "你", "ß"])
_TEXT = st.lists(_ALPHABET, max_size=400).map("".join)


@settings(max_examples=60, deadline=None)
@given(a=_TEXT, b=_TEXT, max_length=st.integers(3, 60), direction=st.sampled_from(["right", "left"]))
def test_pairs_random(tok, a, b, max_length, direction):
    (got,) = encode_pairs(tok, [(a, b)], max_length=max_length, truncate=True, direction=direction)
    assert got == oracle(tok, a, b, max_length, direction)


def test_without_truncation_a_long_pair_is_refused_by_its_place(tok):
    items = ["one", ("two", "three"), ("four " * 400, "five"), "six"]
    with pytest.raises(InputTooLong) as err:
        encode_texts(tok, items, max_length=50, truncate=False, direction="right")
    assert err.value.index == 2
    ok = encode_texts(tok, items[:2] + items[3:], max_length=50, truncate=False, direction="right")
    assert ok == [list(tok.encode("one").ids), list(tok.encode("two", "three").ids), list(tok.encode("six").ids)]


class _Counting:
    """The tokenizer, recording the characters each batch encode was given."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.chars = tok, []

    def encode_batch_fast(self, texts, **kw):
        self.chars.extend(map(len, texts))
        return self.tok.encode_batch_fast(texts, **kw)

    def encode(self, *a, **kw):  # pragma: no cover - the pair path must never call it
        raise AssertionError("a whole-text encode")

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_megabyte_pair_costs_windows(tok):
    counting = _Counting(tok)
    a, b = "1" * 1_000_000, "2" * 950_000
    (ids,) = encode_pairs(counting, [(a, b)], max_length=512, truncate=True, direction="right")
    assert ids == oracle(tok, a, b, 512, "right")
    assert max(counting.chars) < 20_000, counting.chars

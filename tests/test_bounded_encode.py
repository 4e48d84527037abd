"""Truncation tokenizes a bounded window of the text, and answers exactly what encoding the whole
text and cutting it gives (the oracle: the tokenizer's own full encode, truncated, post-processed)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from models.text import prompts
from tests.counting import CountingTokenizer


@pytest.fixture(scope="module")
def tok(tiny_embedding_dir):
    return Tokenizer.from_file(str(tiny_embedding_dir / "tokenizer.json"))


def oracle(tok, text: str, max_length: int, direction: str) -> list[int]:
    enc = tok.encode(text, add_special_tokens=False)
    enc.truncate(max_length - tok.num_special_tokens_to_add(False), direction=direction)
    return list(tok.post_process(enc, add_special_tokens=True).ids)


def adversarial() -> list[str]:
    rng = random.Random(7)
    words = ["word", "x" * 300, "1" * 50, "   ", "\n\n", "🙂", "你好世界", "e\u0301", "Ünïcödé", "'s", "=" * 64]
    return [
        "1" * 20_000,
        "word " * 4000,
        " " * 5000 + "end",
        "a" * 20_000,
        "e\u0301" * 3000,  # combining marks: NFC composes across any cut
        "🙂" * 3000,
        "你好" * 4000,
        "\n" * 3000 + "x",
        "".join(rng.choice(words) + rng.choice(["", " ", "\n", "  "]) for _ in range(3000)),
        "".join(chr(rng.randrange(32, 0x3000)) for _ in range(20_000)),
    ]


@pytest.mark.parametrize("direction", ["right", "left"])
@pytest.mark.parametrize("max_length", [2, 7, 100, 1000])
def test_truncation_equals_full_encode_then_cut(tok, direction, max_length):
    for text in adversarial():
        (ids,) = prompts.encode_embedding_inputs(tok, [text], max_length=max_length, truncate=True,
                                                 direction=direction)
        assert ids == oracle(tok, text, max_length, direction), (text[:40], max_length, direction)


_ALPHABET = st.sampled_from(list("0123456789 \n\tab.,'-=") + ["é", "e\u0301", "🙂", "你", "ß", "\u200b"])


@settings(max_examples=150, deadline=None)
@given(text=st.lists(_ALPHABET, max_size=600).map("".join), max_length=st.integers(2, 60),
       direction=st.sampled_from(["right", "left"]))
def test_truncation_equals_full_encode_random(tok, text, max_length, direction):
    (ids,) = prompts.encode_embedding_inputs(tok, [text], max_length=max_length, truncate=True, direction=direction)
    assert ids == oracle(tok, text, max_length, direction)


@pytest.mark.parametrize("direction", ["right", "left"])
def test_a_huge_text_costs_what_is_kept(tok, direction):
    """1.9M digits truncated to 4096 tokens: a window of tens of thousands of characters is encoded."""
    counting = CountingTokenizer(tok)
    text = "1" * 1_900_000
    (ids,) = prompts.encode_embedding_inputs(counting, [text], max_length=4096, truncate=True, direction=direction)
    assert len(ids) == 4096
    assert ids == oracle(tok, "1" * 8192, 4096, direction)  # the same digits throughout
    assert counting.chars <= 3 * prompts.CHARS_PER_TOKEN * (4096 + prompts.CUT_SLACK)


def test_too_long_without_truncation_is_refused_on_a_window(tok):
    counting = CountingTokenizer(tok)
    with pytest.raises(prompts.InputTooLong, match="at least") as info:
        prompts.encode_embedding_inputs(counting, ["1" * 1_900_000], max_length=512, truncate=False)
    assert info.value.length > 512
    assert counting.chars <= 3 * prompts.CHARS_PER_TOKEN * (512 + prompts.CUT_SLACK)


def test_huge_rerank_query_and_document_cost_what_is_kept(tok):
    counting = CountingTokenizer(tok)
    template = prompts.RerankTemplate(counting)
    counting.chars = 0
    doc = "word " * 200_000
    (left,) = template.encode("q " * 100_000, [doc], max_length=300, truncate=True, direction="left")
    (ref,) = prompts.RerankTemplate(tok).encode("q", [doc[-3000:]], max_length=300, truncate=True, direction="left")
    assert left == ref  # the kept end of the document is the same
    assert counting.chars < 100_000


def test_one_huge_pretoken_costs_a_bounded_window(tok):
    """A 1.5M-letter word truncated from the left: the window stops growing at its cap (a BPE over
    the whole run would take hundreds of MB); the answer still holds the kept number of tokens."""
    counting = CountingTokenizer(tok)
    (ids,) = prompts.encode_embedding_inputs(counting, ["a" * 1_500_000], max_length=4096, truncate=True,
                                             direction="left")
    assert len(ids) == 4096
    assert counting.chars <= 8 * prompts.CHARS_PER_TOKEN * (4096 + prompts.CUT_SLACK) * prompts.MAX_GROWTH
    assert counting.chars < 1_500_000


def test_a_huge_rerank_document_without_truncation_is_refused_as_at_least(tok):
    template = prompts.RerankTemplate(tok)
    with pytest.raises(prompts.InputTooLong, match="at least"):
        template.encode("q", ["short", "word " * 100_000], max_length=300, truncate=False)
    with pytest.raises(prompts.InputTooLong) as exact:
        template.encode("q", ["short", "word " * 300], max_length=300, truncate=False)
    assert "at least" not in str(exact.value)


def oracle_or_refusal(tok, texts: list[str], max_length: int, truncate: bool) -> list[list[int]] | int:
    """The oracle's ids of every text, or (truncation off) the index of the first text too long."""
    budget = max_length - tok.num_special_tokens_to_add(False)
    for i, text in enumerate(texts):
        if not truncate and len(tok.encode(text, add_special_tokens=False).ids) > budget:
            return i
    return [oracle(tok, text, max_length, "right") for text in texts]


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(st.lists(_ALPHABET, max_size=120).map("".join).filter(bool), min_size=1, max_size=6),
       max_length=st.integers(2, 60), truncate=st.booleans())
def test_a_batch_of_short_texts_equals_the_oracle_text_by_text(tok, texts, max_length, truncate):
    """Texts short enough to be encoded whole are encoded and post-processed in one call; those
    whose tokens do not fit are cut (or refused, naming the first) as the oracle says."""
    want = oracle_or_refusal(tok, texts, max_length, truncate)
    if isinstance(want, int):
        with pytest.raises(prompts.InputTooLong) as info:
            prompts.encode_embedding_inputs(tok, texts, max_length=max_length, truncate=False)
        assert info.value.index == want and not info.value.at_least
        assert info.value.length == len(tok.encode(texts[want]).ids)
    else:
        assert prompts.encode_embedding_inputs(tok, texts, max_length=max_length, truncate=truncate) == want


class CallCounting(CountingTokenizer):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.calls: list[str] = []

    def encode_batch_fast(self, texts, **kw):
        self.calls.append("encode_batch_fast")
        return super().encode_batch_fast(texts, **kw)

    def post_process(self, *a, **kw):
        self.calls.append("post_process")
        return self.inner.post_process(*a, **kw)


def test_short_texts_that_fit_cost_one_tokenizer_call(tok):
    counting = CallCounting(tok)
    texts = ["what is the capital of france", "a second short query", "🙂 third"]
    ids = prompts.encode_embedding_inputs(counting, texts, max_length=512, truncate=False)
    assert ids == [oracle(tok, t, 512, "right") for t in texts]
    assert counting.calls == ["encode_batch_fast"]
    # one text too long for max_length: only it is encoded again, through the cut
    counting.calls.clear()
    texts[1] = "word " * 30  # within the whole-encode bound (4 x (15 + 32) characters), 31 tokens
    ids = prompts.encode_embedding_inputs(counting, texts, max_length=16, truncate=True)
    assert ids == [oracle(tok, t, 16, "right") for t in texts]
    assert counting.calls == ["encode_batch_fast", "encode_batch_fast", "post_process"]

"""Qwen3 prompt assembly and truncation, against independent constructions.

Embedding: our ids equal the tokenizer's own encode of (prompt + text) with its post-processor;
truncated inputs equal the untruncated text ids cut, plus the special tokens. Reranker: our ids
equal the reference Qwen3-Reranker recipe run with transformers' AutoTokenizer (prefix and suffix
encoded separately, body through tokenizer(..., truncation='longest_first', max_length=...)).
"""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from models.text import prompts
TEXTS = [
    "What is the capital of France?",
    "The quick brown fox jumps over the lazy dog, twice, 12345 times.",
    "Ünïcödé text — with emoji 🙂 and CJK 你好世界",
]


@pytest.fixture(scope="module")
def emb_tok(tiny_embedding_dir):
    return Tokenizer.from_file(str(tiny_embedding_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def rr_tok(tiny_reranker_dir):
    return Tokenizer.from_file(str(tiny_reranker_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_rr_tok(tiny_reranker_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_reranker_dir))


def test_embedding_prompt_prepended_and_eos_appended(emb_tok):
    eos = emb_tok.token_to_id("<|endoftext|>")
    prompt = prompts.embedding_query_prompt("Given a web search query, retrieve relevant passages")
    ours = prompts.encode_embedding_inputs(emb_tok, TEXTS, prompt=prompt, max_length=512, truncate=False)
    for text, ids in zip(TEXTS, ours):
        assert ids == emb_tok.encode(f"Instruct: Given a web search query, retrieve relevant passages\nQuery:{text}").ids
        assert ids[-1] == eos
    docs = prompts.encode_embedding_inputs(emb_tok, TEXTS, max_length=512, truncate=False)
    assert docs == [emb_tok.encode(t).ids for t in TEXTS]


@pytest.mark.parametrize("direction", ["right", "left"])
def test_embedding_truncation_keeps_special_tokens(emb_tok, direction):
    eos = emb_tok.token_to_id("<|endoftext|>")
    text = TEXTS[1]
    bare = emb_tok.encode(text, add_special_tokens=False).ids
    max_length = 6
    (ids,) = prompts.encode_embedding_inputs(emb_tok, [text], max_length=max_length, truncate=True, direction=direction)
    assert len(ids) == max_length and ids[-1] == eos
    expected = bare[: max_length - 1] if direction == "right" else bare[len(bare) - (max_length - 1):]
    assert ids[:-1] == expected
    with pytest.raises(prompts.InputTooLong) as info:
        prompts.encode_embedding_inputs(emb_tok, ["hi", text], max_length=max_length, truncate=False)
    assert info.value.index == 1 and info.value.length == len(bare) + 1


def test_embedding_fits_exactly_is_not_cut(emb_tok):
    n = len(emb_tok.encode(TEXTS[0]).ids)
    (ids,) = prompts.encode_embedding_inputs(emb_tok, [TEXTS[0]], max_length=n, truncate=False)
    assert ids == emb_tok.encode(TEXTS[0]).ids


def _reference_rerank(hf_tok, query, docs, *, instruction, max_length):
    """The Qwen3-Reranker model card's process_inputs, verbatim in spirit."""
    prefix_tokens = hf_tok.encode(prompts.RERANK_PREFIX, add_special_tokens=False)
    suffix_tokens = hf_tok.encode(prompts.RERANK_SUFFIX, add_special_tokens=False)
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {d}" for d in docs]
    inputs = hf_tok(
        pairs, padding=False, truncation="longest_first", return_attention_mask=False,
        max_length=max_length - len(prefix_tokens) - len(suffix_tokens),
    )
    return [prefix_tokens + ele + suffix_tokens for ele in inputs["input_ids"]]


@pytest.mark.parametrize("max_length", [8192, 120])
def test_rerank_template_matches_reference(rr_tok, hf_rr_tok, max_length):
    template = prompts.RerankTemplate(rr_tok)
    query = "what is the capital of france"
    ours = template.encode(query, TEXTS, instruction=prompts.DEFAULT_INSTRUCTION, max_length=max_length, truncate=True)
    ref = _reference_rerank(hf_rr_tok, query, TEXTS, instruction=prompts.DEFAULT_INSTRUCTION, max_length=max_length)
    assert ours == ref
    assert all(len(ids) <= max_length for ids in ours)
    # The template tokens are the chat-format specials, intact at both ends.
    im_start = rr_tok.token_to_id("<|im_start|>")
    assert all(ids[0] == im_start and ids[-len(template.suffix_ids):] == template.suffix_ids for ids in ours)


def test_rerank_truncation_cuts_only_the_body(rr_tok):
    template = prompts.RerankTemplate(rr_tok)
    doc = "lorem ipsum dolor sit amet " * 20
    body = rr_tok.encode(prompts.format_rerank_body("inst", "q", doc), add_special_tokens=False).ids
    max_length = template.overhead + 10
    keep = 40  # more than the shared part (instruction + query), less than the body
    (right,) = template.encode("q", [doc], instruction="inst", max_length=template.overhead + keep, truncate=True)
    (left,) = template.encode("q", [doc], instruction="inst", max_length=max_length, truncate=True, direction="left")
    assert right == template.prefix_ids + body[:keep] + template.suffix_ids
    assert left == template.prefix_ids + body[-10:] + template.suffix_ids
    with pytest.raises(prompts.QueryTooLong, match="maximum input length of"):  # right: no document left
        template.encode("q", [doc], instruction="inst", max_length=max_length, truncate=True)
    with pytest.raises(prompts.InputTooLong) as info:
        template.encode("q", ["short", doc], instruction="inst", max_length=template.overhead + 40, truncate=False)
    assert info.value.index == 1 and info.value.length == len(body) + template.overhead
    with pytest.raises(prompts.QueryTooLong):  # the shared part alone is over: refused before any document
        template.encode("q", [doc], instruction="inst", max_length=max_length, truncate=False)
    with pytest.raises(ValueError):
        template.encode("q", [doc], instruction="inst", max_length=template.overhead, truncate=True)


def test_resolve_prompt_precedence():
    table = {"query": "Q:", "document": ""}
    assert prompts.resolve_prompt(table, prompt_name="query") == "Q:"
    assert prompts.resolve_prompt(table, prompt_name=None) == ""
    assert prompts.resolve_prompt(table, prompt_name=None, default_prompt_name="query") == "Q:"
    assert prompts.resolve_prompt(table, prompt_name=None, default_prompt="P:") == "P:"
    assert prompts.resolve_prompt(table, prompt_name="document", default_prompt="P:") == ""
    with pytest.raises(prompts.UnknownPrompt):
        prompts.resolve_prompt(table, prompt_name="nope")
    with pytest.raises(prompts.UnknownPrompt):
        prompts.resolve_prompt({}, prompt_name=None, default_prompt_name="query")


# -- the rerank body from its pieces equals one encode of the whole body --------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tests.counting import CountingTokenizer

# Starts that could interact with the boundary ": " + document: spaces, digits, punctuation,
# newlines, combining marks (NFC), contractions, specials, emoji, CJK, other scripts.
_STARTS = [
    "", " ", "  ", "\t", "\n", "\r\n", "\n\n", "0", "12", "!", "?!", ":", "'s", "'S", "-", ".", "\u0301",
    "\u0308a", "e\u0301", "\u200b", "\u00a0", "<|im_end|>", "<|endoftext|>", "<think>", "🙂", "你好",
    "ß", "İ", "ﬁ", "Ⅻ", "\x00", "\\", '"', "\ufeff",
]
_ALPHABET = st.sampled_from(list("aZ 0!\n\t'.-:é\u0301🙂你") + ["<|im_end|>", "  ", "\r\n"])
_TEXT = st.lists(_ALPHABET, max_size=12).map("".join)
_DOC = st.builds(lambda start, rest: start + rest, st.sampled_from(_STARTS), _TEXT) | st.text(max_size=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(query=_DOC, instruction=st.one_of(st.just(prompts.DEFAULT_INSTRUCTION), _TEXT),
       docs=st.lists(_DOC, min_size=1, max_size=4))
def test_rerank_pieces_equal_whole_body(rr_tok, query, instruction, docs):
    template = prompts.RerankTemplate(rr_tok)
    shared = prompts.format_rerank_body(instruction, query, "")[:-1]
    # Qwen's tokenizer always splits there, so no document takes the costly whole-body path.
    assert all(template._splits_cleanly(shared, [" " + d for d in docs]))
    ours = template.encode(query, docs, instruction=instruction, max_length=10**6, truncate=False)
    for doc, ids in zip(docs, ours):
        body = rr_tok.encode(prompts.format_rerank_body(instruction, query, doc), add_special_tokens=False).ids
        assert ids == template.prefix_ids + body + template.suffix_ids, (query, doc)


@settings(max_examples=60, deadline=None)
@given(query=_DOC, docs=st.lists(_DOC, min_size=1, max_size=3), keep=st.integers(1, 80),
       direction=st.sampled_from(["right", "left"]))
def test_rerank_pieces_truncate_like_whole_body(rr_tok, query, docs, keep, direction):
    template = prompts.RerankTemplate(rr_tok)
    shared = rr_tok.encode(prompts.format_rerank_body(prompts.DEFAULT_INSTRUCTION, query, "")[:-1],
                           add_special_tokens=False).ids
    if direction == "right" and len(shared) + 1 > keep:  # every document would be cut out: refused
        with pytest.raises(prompts.QueryTooLong):
            template.encode(query, docs, max_length=template.overhead + keep, truncate=True, direction=direction)
        return
    ours = template.encode(query, docs, max_length=template.overhead + keep, truncate=True, direction=direction)
    for doc, ids in zip(docs, ours):
        body = rr_tok.encode(prompts.format_rerank_body(prompts.DEFAULT_INSTRUCTION, query, doc),
                             add_special_tokens=False).ids
        cut = body[:keep] if direction == "right" else body[max(0, len(body) - keep):]
        assert ids == template.prefix_ids + cut + template.suffix_ids


@pytest.mark.parametrize("truncate", [False, True])
def test_rerank_tokenizes_each_piece_once(rr_tok, truncate):
    """A long query with many documents is tokenized once, not once per document."""
    counting = CountingTokenizer(rr_tok)
    template = prompts.RerankTemplate(counting)
    query = "lorem ipsum dolor " * 2000  # 36k chars
    docs = [f"document {i} about something" for i in range(64)]
    counting.chars = 0
    try:
        template.encode(query, docs, max_length=512, truncate=truncate)
    except prompts.QueryTooLong:
        pass  # the query alone fills the budget: refused, truncating (from the right) or not
    body = len(query) + sum(len(d) for d in docs)
    # the shared part once, each document once, plus a fixed window check per document
    assert counting.chars <= body + 200 + len(docs) * (3 * template.window + 2), counting.chars


def test_rerank_falls_back_per_document_where_the_boundary_merges(rr_tok):
    """A tokenizer whose boundary would merge (simulated) gets that document's whole body encoded."""
    template = prompts.RerankTemplate(rr_tok)
    docs = ["alpha", "beta"]
    template._splits_cleanly = lambda shared, pieces: [True, False]
    counting = CountingTokenizer(rr_tok)
    template.tokenizer = counting
    ours = template.encode("q", docs, max_length=4096, truncate=False)
    for doc, ids in zip(docs, ours):
        body = rr_tok.encode(prompts.format_rerank_body(prompts.DEFAULT_INSTRUCTION, "q", doc), add_special_tokens=False).ids
        assert ids == template.prefix_ids + body + template.suffix_ids
    shared = len(prompts.format_rerank_body(prompts.DEFAULT_INSTRUCTION, "q", ""))
    assert counting.chars >= 2 * shared  # the fallback document paid for the shared part again


@pytest.mark.parametrize("query,docs,max_length,truncate,direction", [
    ("capital of france", ["Paris is the capital.", "Berlin", ""], 4096, False, "right"),
    ("capital of france " * 10, ["Paris is the capital.", "Berlin " * 100, "x"], 120, True, "right"),
    ("capital of france " * 10, ["Berlin " * 100, "y"], 120, True, "left"),
    ("q " * 200, ["a", "b c"], 90, True, "left"),  # the shared part alone is over the limit
])
@pytest.mark.parametrize("fallback", [False, True])
def test_rerank_pair_budget_counts_the_pairs_built(rr_tok, query, docs, max_length, truncate, direction, fallback):
    """At exactly the pairs' total the encode answers as without a budget; one token less it is
    refused, naming the limit and its flag (also where a document takes the whole-body path)."""
    from models.text.pair_budget import PairBudgetExceeded

    template = prompts.RerankTemplate(rr_tok)
    if fallback:
        template._splits_cleanly = lambda shared, pieces: [i % 2 == 0 for i in range(len(pieces))]
    kw = dict(max_length=max_length, truncate=truncate, direction=direction)
    free = template.encode(query, docs, **kw)
    total = sum(len(p) for p in free)
    assert template.encode(query, docs, max_pair_tokens=total, **kw) == free
    with pytest.raises(PairBudgetExceeded, match=r"hold %d tokens.*limit of %d \(--max-rerank-pair-tokens\)"
                       % (total, total - 1)):
        template.encode(query, docs, max_pair_tokens=total - 1, **kw)

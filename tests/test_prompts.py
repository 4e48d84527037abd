"""Qwen3 prompt assembly and truncation, against independent constructions.

Embedding: our ids equal the tokenizer's own encode of (prompt + text) with its post-processor;
truncated inputs equal the untruncated text ids cut, plus the special tokens. Reranker: our ids
equal the reference Qwen3-Reranker recipe run with transformers' AutoTokenizer (prefix and suffix
encoded separately, body through tokenizer(..., truncation='longest_first', max_length=...)).
"""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from models import prompts

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
    (right,) = template.encode("q", [doc], instruction="inst", max_length=max_length, truncate=True)
    (left,) = template.encode("q", [doc], instruction="inst", max_length=max_length, truncate=True, direction="left")
    assert right == template.prefix_ids + body[:10] + template.suffix_ids
    assert left == template.prefix_ids + body[-10:] + template.suffix_ids
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

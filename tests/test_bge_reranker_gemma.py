"""bge-reranker-v2-gemma (a GemmaForCausalLM yes/no reranker) against FlagEmbedding's formula.

Oracle, built here independently of models/text/rerank_templates.py: FlagEmbedding's ``get_inputs``
layout through transformers' tokenizer ([bos] + "A: {query}" + "\\n" + "B: {passage}" + "\\n" +
prompt, each part encoded alone without special tokens, bos from config.json), and the score
``logits[:, -1, yes_loc]`` of transformers' GemmaForCausalLM in fp32, yes_loc the first id of
"Yes". Served in off/paper/compact, with and without the prefix cache, and over HTTP /rerank.
"""
from __future__ import annotations

import dataclasses
import json
import math

import httpx
import numpy as np
import pytest
import torch

import fixtures
from models.runner import load_runner
from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread

PRESET = "tiny-gemma-bge-reranker"
PROMPT = ("Given a query A and a passage B, determine whether the passage contains an answer to the query by "
          "providing a prediction of either 'Yes' or 'No'.")
QUERY = "what is the capital of france"
DOCS = ["paris is the capital of france", "berlin is the capital of germany", "pasta", "paris " * 12]
TOL = 1e-4


def flag_inputs(model_dir, query: str, passages, prompt: str = PROMPT) -> list[list[int]]:
    """FlagEmbedding's get_inputs for pairs that fit (no truncation), via transformers' tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    bos = json.loads((model_dir / "config.json").read_text())["bos_token_id"]

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    sep = enc("\n")
    return [[bos] + enc(f"A: {query}") + sep + enc(f"B: {p}") + sep + enc(prompt) for p in passages]


def yes_loc(model_dir) -> int:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    return tok("Yes", add_special_tokens=False)["input_ids"][0]


@pytest.fixture(scope="module")
def case(fixture_root):
    import transformers

    d = fixtures.cached(PRESET, root=fixture_root)
    hf = transformers.GemmaForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ids = flag_inputs(d, QUERY, DOCS)
    with torch.no_grad():
        want = torch.stack([hf(input_ids=torch.tensor([s])).logits[0, -1, yes_loc(d)] for s in ids])
    return d, ids, want


def test_template_and_score_come_from_the_checkpoint(case):
    d, ids, _ = case
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
    assert runner.rerank_template == "bge-reranker-gemma" and runner.no_id is None
    assert runner.yes_id == yes_loc(d) and runner.rerank_instruction == PROMPT
    from models.text.rerank_templates import build_template

    template = build_template(runner.rerank_template, runner.tokenizer, bos_id=runner.config.bos_token_id)
    got = template.encode(QUERY, DOCS, instruction=PROMPT, max_length=512, truncate=False)
    assert got == ids


@pytest.mark.parametrize("cache", [0, "1024tokens"])
def test_matches_flag_embedding_in_every_mode(case, cache):
    d, ids, want = case
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=cache)
    flat = np.concatenate([np.asarray(s, dtype=np.int32) for s in ids])
    cu = np.concatenate([[0], np.cumsum([len(s) for s in ids])]).astype(np.int32)
    for mode, threshold in (("off", 0.0), ("paper", 1.0), ("compact", 1.0)):
        r = dataclasses.replace(runner, radix_attention="compact" if mode == "off" else mode,
                                radix_mlp_threshold=threshold)
        for _ in range(2):  # the second run reads the prefix cache when it is on
            got = r.run(r.prepare(flat, cu))
            assert (got - want).abs().max().item() < TOL, mode
    if cache:
        assert runner.prefix_cache.stats()["hit_tokens"] > 0


def test_truncation_cuts_only_the_query_and_passage(case):
    from transformers import PreTrainedTokenizerFast

    from models.text.prompts import InputTooLong
    from models.text.rerank_templates import build_template

    d, ids, _ = case
    tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
    suffix = tok("\n", add_special_tokens=False)["input_ids"] + tok(PROMPT, add_special_tokens=False)["input_ids"]
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
    template = build_template(runner.rerank_template, runner.tokenizer, bos_id=runner.config.bos_token_id)
    limit = max(len(s) for s in ids) - 3
    for direction in ("right", "left"):
        got = template.encode(QUERY, DOCS, instruction=PROMPT, max_length=limit, truncate=True, direction=direction)
        for full, cut in zip(ids, got):
            assert len(cut) == min(len(full), limit)
            assert cut[0] == full[0] and cut[-len(suffix):] == suffix  # <bos> and "\n" + prompt kept
            body, full_body = cut[1:-len(suffix)], full[1:-len(suffix)]
            kept = full_body[:len(body)] if direction == "right" else full_body[len(full_body) - len(body):]
            assert body == kept  # the body is cut on the asked side, nothing else
    with pytest.raises(InputTooLong, match="input 3"):
        template.encode(QUERY, DOCS, instruction=PROMPT, max_length=limit, truncate=False)


def test_rerank_over_http(case):
    d, ids, want = case
    runner = load_runner(str(d), device="cpu", dtype="float32")
    srv = ServerThread(create_app(ServerConfig(model_id=str(d), radix_mlp_threshold=1.0), runner=runner)).start()
    try:
        for raw in (True, False):
            r = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": DOCS, "raw_scores": raw}, timeout=60)
            assert r.status_code == 200, r.text
            expect = {i: float(w) if raw else 1 / (1 + math.exp(-float(w))) for i, w in enumerate(want)}
            assert {x["index"]: x["score"] for x in r.json()} == pytest.approx(expect, abs=TOL)
        raw = httpx.post(srv.url + "/score", json={"text_1": QUERY, "text_2": DOCS, "use_activation": False},
                         timeout=60).json()  # vLLM's dialect, the same pairs
        assert [x["score"] for x in raw["data"]] == pytest.approx([float(w) for w in want], abs=TOL)
        cohere = httpx.post(srv.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}, timeout=60).json()
        assert {x["index"]: x["relevance_score"] for x in cohere["results"]} == pytest.approx(
            {i: 1 / (1 + math.exp(-float(w))) for i, w in enumerate(want)}, abs=TOL)
        info = httpx.get(srv.url + "/info", timeout=60).json()
        assert info["model_type"]["reranker"] == {"score": "sigmoid(logit('Yes'))", "template": "bge-reranker-gemma"}
    finally:
        srv.stop()

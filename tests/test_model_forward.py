"""Our forward (off / paper / compact) against transformers' own classes, each sequence alone.

Oracle: Qwen3Model / Qwen3ForCausalLM / Qwen2Model loaded by transformers from the same fixture
directory, fp32 on CPU, run on every distinct sequence separately. 1e-4 max abs, per DESIGN.md.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.batch import build_forward_batch
from models.runner import load_runner
from scheduler.radix import build_index, positions_from_cu_seqlens

MODES = ("off", "paper", "compact")
TOL = 1e-4

RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def _cases() -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(0)
    long = rng.integers(100, 5000, 300).tolist()
    prefix = rng.integers(100, 5000, 200).tolist()
    return {
        "single": [[1, 2, 3, 4, 5]],
        "identical": [[1, 2, 3, 4, 5]] * 2,
        "shared-prefix": [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7]],
        "no-sharing": [[1, 2, 3], [4, 5, 6]],
        "mixed-lengths": [[1, 2], [1, 2, 3, 4, 5], [1, 2, 3]],
        "complex": [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 8, 9, 10], [11, 12, 13, 14, 15]],
        "strict-prefix-after": [[1, 2, 3, 4, 5, 6], [1, 2, 3], [7, 1, 2]],
        "five-copies-300": [long] * 5,
        "one-token": [[5], [5], [9], [5, 6]],
        "64-share-200": [prefix + rng.integers(100, 5000, int(rng.integers(1, 9))).tolist()
                         for _ in range(64)],
    }


CASES = _cases()


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


def _ours(runner, seqs, mode, *, pooling=None):
    ids, cu = _pack(seqs)
    index = None if mode == "off" else build_index(ids, positions_from_cu_seqlens(cu), cu)
    if index is not None:
        assert index.ratio <= 1.0
    batch = build_forward_batch(ids, cu, index, mode=mode, mean_pooling=pooling == "mean")
    with torch.no_grad():
        hidden = runner.model(batch.input_ids, batch.positions, batch)
        if runner.kind == "reranker":
            from models.pooling import rerank_logits

            return rerank_logits(runner.model, hidden, batch, yes_id=runner.yes_id, no_id=runner.no_id)
        from models.pooling import pool

        return pool(runner.model, hidden, batch, pooling or runner.pooling)


class Oracle:
    """transformers' model on each distinct sequence alone (memoised)."""

    def __init__(self, model, *, causal_lm: bool, yes_no=None):
        self.model, self.causal_lm, self.yes_no, self.memo = model, causal_lm, yes_no, {}

    def _one(self, seq):
        key = tuple(seq)
        if key not in self.memo:
            with torch.no_grad():
                ids = torch.tensor([seq])
                if self.causal_lm:
                    logits = self.model(input_ids=ids, logits_to_keep=1).logits[0, -1]
                    self.memo[key] = (logits[self.yes_no[0]] - logits[self.yes_no[1]]).item()
                else:
                    h = self.model(input_ids=ids).last_hidden_state[0]  # [L, E]
                    self.memo[key] = (h[-1], h.mean(0), h[0])
        return self.memo[key]

    def embed(self, seqs, pooling):
        which = {"last-token": 0, "mean": 1, "cls": 2}[pooling]
        return torch.stack([self._one(s)[which] for s in seqs])

    def scores(self, seqs):
        return torch.tensor([self._one(s) for s in seqs])


@pytest.fixture(scope="module")
def embedding(tiny_embedding_dir):
    from transformers import AutoModel

    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    hf = AutoModel.from_pretrained(str(tiny_embedding_dir), dtype=torch.float32).eval()
    return runner, Oracle(hf, causal_lm=False)


@pytest.fixture(scope="module")
def reranker(tiny_reranker_dir):
    from transformers import AutoModelForCausalLM

    runner = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_reranker_dir), dtype=torch.float32).eval()
    return runner, Oracle(hf, causal_lm=True, yes_no=(runner.yes_id, runner.no_id))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_embedding_matches_transformers(embedding, case, mode):
    runner, oracle = embedding
    seqs = CASES[case]
    assert runner.kind == "embedding" and runner.pooling == "last-token"
    for pooling in ("last-token", "mean"):
        got = _ours(runner, seqs, mode, pooling=pooling)
        want = oracle.embed(seqs, pooling)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < TOL, (case, mode, pooling)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["shared-prefix", "complex", "strict-prefix-after", "one-token",
                                  "five-copies-300"])
def test_reranker_matches_transformers(reranker, case, mode):
    runner, oracle = reranker
    assert runner.kind == "reranker"
    seqs = CASES[case]
    got = _ours(runner, seqs, mode)
    assert (got - oracle.scores(seqs)).abs().max().item() < TOL, (case, mode)


@pytest.mark.parametrize("mode", MODES)
def test_reranker_real_text_template(reranker, mode):
    """Query/document pairs through the real tokenizer and the Qwen3 reranker template."""
    runner, oracle = reranker
    query = "what is the capital of france"
    docs = ["Paris is the capital and largest city of France.",
            "The Eiffel Tower is in Paris.",
            "Berlin is the capital of Germany."]
    seqs = [runner.tokenizer.encode(
        f"{RERANK_PREFIX}<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {d}{RERANK_SUFFIX}",
        add_special_tokens=False).ids for d in docs]
    ids, cu = _pack(seqs)
    index = build_index(ids, positions_from_cu_seqlens(cu), cu)
    assert index.ratio < 0.8  # the template and the query are shared
    got = _ours(runner, seqs, mode)
    assert (got - oracle.scores(seqs)).abs().max().item() < TOL


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2_dir):
    from transformers import AutoModel

    runner = load_runner(str(tiny_qwen2_dir), device="cpu", dtype="float32")
    hf = AutoModel.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32).eval()
    return runner, Oracle(hf, causal_lm=False)


@pytest.mark.parametrize("mode", MODES)
def test_qwen2_style_fixture(qwen2, mode):
    runner, oracle = qwen2
    assert not runner.config.qk_norm and runner.config.qkv_bias
    assert not runner.config.tie_word_embeddings
    for case in ("complex", "strict-prefix-after", "mixed-lengths"):
        seqs = CASES[case]
        for pooling in ("last-token", "mean"):
            got = _ours(runner, seqs, mode, pooling=pooling)
            assert (got - oracle.embed(seqs, pooling)).abs().max().item() < TOL, (case, pooling)


def test_runner_prepare_run_contract(embedding):
    """run() returns CPU float32 [B, E]; cls pooling reads the first token; empty batch works."""
    runner, oracle = embedding
    seqs = CASES["complex"]
    ids, cu = _pack(seqs)
    index = build_index(ids, positions_from_cu_seqlens(cu), cu)
    out = runner.run(runner.prepare(ids, cu, index))
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (4, 64)
    assert (out - oracle.embed(seqs, "last-token")).abs().max().item() < TOL
    cls = _ours(runner, seqs, "compact", pooling="cls")
    assert (cls - oracle.embed(seqs, "cls")).abs().max().item() < TOL
    empty = runner.run(runner.prepare(np.zeros(0, np.int32), np.zeros(1, np.int32)))
    assert empty.shape == (0, 64)

"""Our forward (off / paper / compact) against transformers' own classes, each sequence alone.

Oracle: Qwen3Model / Qwen3ForCausalLM / Qwen2Model loaded by transformers from the same fixture
directory, fp32 on CPU, run on every distinct sequence separately. 1e-4 max abs, per docs/design.md.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.batch import build_forward_batch
from models.runner import load_runner
from models.trie import build_index, positions_from_cu_seqlens

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
    out = runner.run(dataclasses.replace(runner, radix_mlp_threshold=1.0).prepare(ids, cu))
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (4, 64)
    assert (out - oracle.embed(seqs, "last-token")).abs().max().item() < TOL
    cls = _ours(runner, seqs, "compact", pooling="cls")
    assert (cls - oracle.embed(seqs, "cls")).abs().max().item() < TOL
    empty = runner.run(runner.prepare(np.zeros(0, np.int32), np.zeros(1, np.int32)))
    assert empty.shape == (0, 64)


def _varlen_contract_attention(calls):
    """flash-attn's varlen contract, read from the device-side fields of AttnMeta only.

    The portable path uses the host boundaries; the CUDA kernels see just cu_seqlens_q/k and
    max_seqlen_q/k. This stand-in checks those fields (int32, contiguous, on q's device,
    consistent with the packed tensors, maxima exact) and computes bottom-right causal attention
    from them in float64, so a wrong device boundary fails the oracle comparison on CPU.
    """
    def attend(q, k, v, meta, *, scale):
        cu_q, cu_k = meta.cu_seqlens_q, meta.cu_seqlens_k
        for cu in (cu_q, cu_k):
            assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device
        bq, bk = cu_q.tolist(), cu_k.tolist()
        assert len(bq) == len(bk) and bq[0] == bk[0] == 0
        assert bq[-1] == q.shape[0] and bk[-1] == k.shape[0] == v.shape[0]
        lq = [b - a for a, b in zip(bq, bq[1:])]
        lk = [b - a for a, b in zip(bk, bk[1:])]
        assert all(0 < x <= y for x, y in zip(lq, lk))
        assert (meta.max_seqlen_q, meta.max_seqlen_k) == (max(lq), max(lk))
        group = q.shape[1] // k.shape[1]
        out = torch.empty(q.shape, dtype=torch.float64)
        for s in range(len(lq)):
            qs = q[bq[s]:bq[s + 1]].double()  # [lq, H, D]
            ks = k[bk[s]:bk[s + 1]].double().repeat_interleave(group, dim=1)  # [lk, H, D]
            vs = v[bk[s]:bk[s + 1]].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale  # [H, lq, lk]
            mask = torch.ones(lq[s], lk[s], dtype=torch.bool).tril(diagonal=lk[s] - lq[s])
            probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            out[bq[s]:bq[s + 1]] = torch.einsum("hqk,khd->qhd", probs, vs)
        calls.append((tuple(lq), tuple(lk)))
        return out.to(q.dtype)

    return attend


@pytest.mark.parametrize("mode", MODES)
def test_device_boundaries_drive_a_varlen_kernel_exactly(embedding, monkeypatch, mode):
    """What the GPU backends read (device cu_seqlens, max_seqlen) is right in every mode."""
    runner, oracle = embedding
    calls: list = []
    kernels_obj = runner.model.layers[0].self_attn.ops  # shared by every layer
    monkeypatch.setattr(kernels_obj, "attention", _varlen_contract_attention(calls))
    for case in ("complex", "strict-prefix-after", "one-token", "64-share-200"):
        seqs = CASES[case]
        calls.clear()
        got = _ours(runner, seqs, mode)
        assert len(calls) == runner.config.num_hidden_layers
        if mode == "compact" and case in ("complex", "64-share-200"):
            assert sum(calls[0][0]) < sum(calls[0][1])  # queries: the owners' new nodes only
        assert (got - oracle.embed(seqs, "last-token")).abs().max().item() < TOL, case


def test_the_trie_gate_weighs_saved_work():
    """0 never, 1 always; between, N'/N under the threshold *and* saved rows x hidden >= MIN_SAVED_WORK."""
    from models.options import MIN_SAVED_WORK, use_index

    rows = MIN_SAVED_WORK // 64
    assert use_index(1.0, 1.0, saved_rows=0, hidden_size=64)
    assert not use_index(0.0, 0.01, saved_rows=10**6, hidden_size=4096)
    assert not use_index(0.95, 0.5, saved_rows=rows - 1, hidden_size=64)
    assert use_index(0.95, 0.5, saved_rows=rows, hidden_size=64)
    assert use_index(0.95, 0.5, saved_rows=rows // 16, hidden_size=1024)
    assert not use_index(0.95, 0.95, saved_rows=10**6, hidden_size=4096)


def test_the_gate_changes_the_rows_run_never_the_outputs(embedding, tiny_embedding_dir):
    """A tiny model with a short shared prefix runs without the trie (it would cost more than it
    saves); a long one runs with it; either way the outputs are the transformers oracle's."""
    from models.options import MIN_SAVED_WORK

    _, oracle = embedding
    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32", prefix_cache_size="0")
    assert runner.radix_mlp_threshold == 0.95 and runner.hidden_size == 64
    rng = np.random.default_rng(3)
    for prefix_len, used in ((20, False), (MIN_SAVED_WORK // 64, True)):
        head = rng.integers(100, 5000, prefix_len).tolist()
        seqs = [head + rng.integers(100, 5000, 6).tolist() for _ in range(2)]
        ids, cu = _pack(seqs)
        prepared = runner.prepare(ids, cu)
        assert prepared.ratio < 0.95 and prepared.used_index is used, prefix_len
        assert prepared.n_compact == (len(ids) - prefix_len if used else len(ids))
        assert (runner.run(prepared) - oracle.embed(seqs, "last-token")).abs().max().item() < TOL
        forced = dataclasses.replace(runner, radix_mlp_threshold=1.0).prepare(ids, cu)
        assert forced.used_index and forced.n_compact == len(ids) - prefix_len

"""The forward's hot-path rules and the batch builder's host-side work.

- no host sync and no tensor built from host data inside the forward (DESIGN: none allowed),
  checked by recording every aten op the forward dispatches;
- per-batch work (the portable attention's equal-shape runs) happens once, at prepare;
- mean-pooling weights arrive coalesced and equal a dense [B, T] built independently;
- reranker scores keep fp32 resolution when the model runs in bf16;
- an empty batch goes through the differentiable forward too.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import models.attention.varlen as attention
from models.batch import build_forward_batch
from models.runner import load_runner
from models.trie import build_index, positions_from_cu_seqlens

SEQS = [[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 8], [9], [1, 2, 3]]
# Ops that read device data back to the host, or copy host data into a new tensor.
HOST_OPS = ("aten._local_scalar_dense", "aten.lift_fresh", "aten.nonzero", "aten.item",
            "aten.is_nonzero", "aten.equal", "aten.masked_select", "aten.unique")


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    return ids, cu


def _index(ids, cu):
    return build_index(ids, positions_from_cu_seqlens(cu), cu)


@pytest.fixture(scope="module")
def embedding(tiny_embedding_dir):
    return load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def reranker(tiny_reranker_dir):
    return load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32")


@pytest.mark.parametrize("mode", ["off", "paper", "compact"])
def test_forward_has_no_host_sync_or_host_data(embedding, reranker, mode, monkeypatch):
    ids, cu = _pack(SEQS)
    index = None if mode == "off" else _index(ids, cu)
    for runner, pooling in ((embedding, "last-token"), (embedding, "mean"), (embedding, "cls"),
                            (reranker, None)):
        batch = build_forward_batch(ids, cu, index, mode=mode, mean_pooling=pooling == "mean")
        if pooling is not None:
            monkeypatch.setattr(runner, "pooling", pooling)
        # Per-batch boundary work is done by now: the forward must not redo it per layer.
        calls = []
        real_runs = attention._runs
        monkeypatch.setattr(attention, "_runs", lambda *a: calls.append(a) or real_runs(*a))
        with torch.inference_mode(), OpLog() as log:
            runner.forward(batch)
        monkeypatch.setattr(attention, "_runs", real_runs)
        assert calls == [], (mode, pooling)
        # the recorder saw the forward's GEMMs (oneDNN-packed on this CPU, else aten.linear)
        assert log.ops["mkldnn._linear_pointwise"] + log.ops["aten.linear"] > 0
        bad = {op: n for op, n in log.ops.items() if op in HOST_OPS}
        assert not bad, (mode, pooling, bad)


def test_attn_meta_runs_group_equal_shapes():
    cu_q, cu_k = [0, 2, 4, 5, 8, 11], [0, 5, 10, 11, 14, 17]
    meta = attention.make_meta(np.asarray(cu_q), cu_k, "cpu")
    # Independent: expand the runs back to per-sequence (q0, k0, lq, lk) and compare.
    per_seq = [(cu_q[s], cu_k[s], cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s])
               for s in range(len(cu_q) - 1)]
    expanded = [(q0 + i * lq, k0 + i * lk, lq, lk)
                for q0, k0, count, lq, lk in meta.runs for i in range(count)]
    assert expanded == per_seq
    assert len(meta.runs) == 3  # (2,5) x2, (1,1), (3,3) x2: maximal runs
    assert meta.host_cu_seqlens_q == tuple(cu_q) and meta.cu_seqlens_q.dtype == torch.int32


@pytest.mark.parametrize("mode", ["off", "paper", "compact"])
def test_mean_weights_coalesced_and_equal_dense(mode):
    ids, cu = _pack(SEQS)
    index = None if mode == "off" else _index(ids, cu)
    batch = build_forward_batch(ids, cu, index, mode=mode, mean_pooling=True)
    w = batch.mean_weights
    assert w.is_coalesced()
    # Independent dense weights: every original token adds 1/len to (its sequence, its row).
    rows_of = np.arange(cu[-1]) if index is None else np.asarray(index.scatter)
    dense = torch.zeros(len(SEQS), batch.num_rows, dtype=torch.float64)
    for s in range(len(SEQS)):
        for t in range(cu[s], cu[s + 1]):
            dense[s, int(rows_of[t])] += 1.0 / (cu[s + 1] - cu[s])
    assert torch.allclose(w.to_dense().double(), dense, atol=1e-7)


def test_bf16_reranker_scores_keep_fp32_resolution(tiny_reranker_dir):
    from models.pooling import rerank_logits

    runner = load_runner(str(tiny_reranker_dir), device="cpu", dtype="bfloat16")
    rng = np.random.default_rng(3)
    seqs = [rng.integers(100, 5000, int(rng.integers(3, 12))).tolist() for _ in range(16)]
    ids, cu = _pack(seqs)
    batch = build_forward_batch(ids, cu, _index(ids, cu), mode="compact")
    with torch.no_grad():
        hidden = runner.model(batch.input_ids, batch.positions, batch)
        got = rerank_logits(runner.model, hidden, batch, yes_id=runner.yes_id, no_id=runner.no_id)
        # Independent: float64 dot products of the same bf16 normed rows and head rows.
        h = runner.model.norm(hidden[batch.last_rows]).double()  # [B, E]
        w = runner.model.head_weight().double()
        want = h @ w[runner.yes_id] - h @ w[runner.no_id]
    assert got.dtype == torch.float32
    # bf16 logits of this size are >= 1/32 apart; fp32 arithmetic is far inside that.
    assert (got.double() - want).abs().max().item() < 1e-3


def test_empty_batch_through_forward(embedding, reranker):
    batch = build_forward_batch(np.zeros(0, np.int32), np.zeros(1, np.int32), mean_pooling=True)
    with torch.no_grad():
        assert embedding.forward(batch).shape == (0, embedding.hidden_size)
        assert reranker.forward(batch).shape == (0,)

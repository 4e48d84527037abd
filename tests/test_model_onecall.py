"""The one-call-per-layer attention path (padded batched SDPA, what CUDA runs without a fused
varlen kernel) inside the whole model, against transformers' own classes, every mode; and the
runner's start-up duties: the attention report (the warm-up: tests/test_warmup.py).

Oracle: tests/test_model_forward.py's (transformers on each distinct sequence alone, fp32 CPU,
1e-4 max abs). The padded path is device-agnostic, so the CPU run checks the very code CUDA runs.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from models.attention.varlen import AttentionBackend, sdpa_padded, sdpa_varlen
from models.batch import build_forward_batch
from models.runner import load_runner
from tests.test_model_forward import (CASES, MODES, TOL, Oracle, _ours, _pack, build_index,
                                      positions_from_cu_seqlens)


@pytest.fixture(scope="module")
def padded_embedding(tiny_embedding_dir):
    from transformers import AutoModel

    runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    hf = AutoModel.from_pretrained(str(tiny_embedding_dir), dtype=torch.float32).eval()
    return runner, Oracle(hf, causal_lm=False)


@pytest.fixture
def padded_runner(padded_embedding, monkeypatch):
    runner, oracle = padded_embedding
    kernels = runner.model.layers[0].self_attn.ops  # one object shared by every layer
    calls = []

    def counted(q, k, v, meta, *, scale):
        calls.append(len(meta.padded.buckets))
        return sdpa_padded(q, k, v, meta, scale=scale)

    monkeypatch.setattr(kernels, "attention", AttentionBackend("sdpa-padded", counted))
    return runner, oracle, calls


_SHARED = list(range(100, 140))
SKEWED = [_SHARED + [200 + s] * (1 + s % 5) for s in range(12)]  # compact: one long owner, 11 short


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["complex", "strict-prefix-after", "one-token", "mixed-lengths",
                                  "skewed"])
def test_padded_attention_model_matches_transformers(padded_runner, case, mode):
    runner, oracle, calls = padded_runner
    seqs = SKEWED if case == "skewed" else CASES[case]
    for pooling in ("last-token", "mean"):
        calls.clear()
        got = _ours(runner, seqs, mode, pooling=pooling)
        assert (got - oracle.embed(seqs, pooling)).abs().max().item() < TOL, (case, mode, pooling)
        assert len(calls) == runner.config.num_hidden_layers
        assert max(calls) <= 2, calls  # one SDPA call per layer (two for a skewed compact batch)


def test_padded_attention_gradients_match_the_per_run_path(padded_runner):
    """Training-compatible: gradients through the padded path equal those of the per-run path."""
    runner, _, _ = padded_runner
    model, kernels = runner.model, runner.model.layers[0].self_attn.ops
    ids, cu = _pack(CASES["complex"])
    index = build_index(ids, positions_from_cu_seqlens(cu), cu)
    batch = build_forward_batch(ids, cu, index, mode="compact")
    grads = []
    for backend in (AttentionBackend("sdpa-padded", sdpa_padded), AttentionBackend("sdpa", sdpa_varlen)):
        kernels.attention = backend  # the fixture's monkeypatch restores the original
        model.zero_grad(set_to_none=True)
        model(batch.input_ids, batch.positions, batch)[batch.last_rows].sum().backward()
        grads.append(model.layers[0].self_attn.qkv_proj.weight.grad.clone())
    model.zero_grad(set_to_none=True)
    assert grads[1].norm() > 0
    assert ((grads[0] - grads[1]).norm() / grads[1].norm()).item() < 1e-5


def test_runner_reports_attention_choice(tiny_embedding_dir, caplog):
    with caplog.at_level(logging.INFO, logger="models"):
        runner = load_runner(str(tiny_embedding_dir), device="cpu", dtype="float32")
    report = runner.attention_report
    assert report["attention_backend"] == runner.attention_backend == "sdpa"
    assert "needs CUDA" in report["attention_backend_rejected"]["flash-attn"]
    assert "sdpa-padded" in report["attention_backend_rejected"]
    lines = [r.getMessage() for r in caplog.records if r.name == "models.runner"]
    assert any(ln.startswith("attention backend sdpa") and "flash-attn (needs CUDA" in ln
               for ln in lines)


def test_the_padded_plan_is_built_in_prepare_not_in_layer_0(padded_embedding, monkeypatch):
    """With sdpa-padded, prepare (the prep thread) builds the padded layout; run only reads it."""
    import dataclasses

    import models.attention.varlen as attention

    base, oracle = padded_embedding
    monkeypatch.setattr(base.model.layers[0].self_attn.ops, "attention", AttentionBackend("sdpa-padded", sdpa_padded))
    runner = dataclasses.replace(base, attention_backend="sdpa-padded", prefix_cache=None)
    built: list[str] = []
    real = attention.padded_plan

    def spy(cu_q, cu_k, device):
        built.append(phase)
        return real(cu_q, cu_k, device)

    monkeypatch.setattr(attention, "padded_plan", spy)
    seqs = SKEWED
    ids, cu = _pack(seqs)
    phase = "prepare"
    prepared = runner.prepare(ids, cu)
    phase = "run"
    got = runner.run(prepared)
    assert built == ["prepare"]  # once per batch, before the forward
    assert (got - oracle.embed(seqs, "last-token")).abs().max().item() < TOL


def test_a_batch_holds_at_most_65535_sequences(padded_embedding):
    runner, _ = padded_embedding
    n = 65536
    with pytest.raises(ValueError, match="at most 65535 sequences"):
        runner.prepare(np.ones(n, np.int32), np.arange(n + 1, dtype=np.int32))

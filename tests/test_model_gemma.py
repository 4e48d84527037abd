"""Gemma and Gemma2 (embedding and yes/no reranker) against transformers, in every forward mode.

Oracle: transformers' GemmaModel / Gemma2Model (last-token hidden state after the final norm) and
GemmaForCausalLM / Gemma2ForCausalLM (logit("yes") - logit("no"), Gemma2's final soft-cap
included), fp32 on CPU, each sequence alone; ours in off, paper and compact, with the prefix cache
off and on (each batch run twice), and for Gemma with tree attention on. The Gemma2 fixture's
window (8) is shorter than the shared prefix, so sliding layers and soft-caps both bite.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.runner import load_runner
from tests.test_bge_reranker_gemma import yes_loc

TOL = 1e-4


def _seqs():
    rng = np.random.default_rng(3)
    shared = rng.integers(100, 5000, 13).tolist()
    return [shared + rng.integers(100, 5000, int(n)).tolist() for n in (1, 4, 9)] + [shared[:5], [42]]


SEQS = _seqs()


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


@pytest.fixture(scope="module", params=[(p, k) for p in ("tiny-gemma", "tiny-gemma2")
                                        for k in ("embedding", "reranker")], ids=lambda x: "-".join(x))
def case(request, fixture_root):
    import transformers

    import fixtures

    preset, kind = request.param
    d = fixtures.cached(preset, kind=kind, root=fixture_root)
    probe = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
    with torch.no_grad():
        if kind == "embedding":
            hf = transformers.AutoModel.from_pretrained(str(d), dtype=torch.float32).eval()
            want = torch.stack([hf(input_ids=torch.tensor([s])).last_hidden_state[0, -1] for s in SEQS])
        else:
            hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
            logits = [hf(input_ids=torch.tensor([s]), logits_to_keep=1).logits[0, -1] for s in SEQS]
            # a Gemma yes/no reranker scores bge-reranker-v2-gemma's way: the "Yes" logit alone
            want = torch.stack([lg[yes_loc(d)] for lg in logits])
    return preset, d, want


@pytest.mark.parametrize("cache", [0, "1024tokens"])
def test_gemma_matches_transformers_in_every_mode(case, cache):
    preset, d, want = case
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=cache)
    ids, cu = _pack(SEQS)
    for mode, threshold in (("off", 0.0), ("paper", 1.0), ("compact", 1.0)):
        r = dataclasses.replace(runner, radix_attention="compact" if mode == "off" else mode,
                                radix_mlp_threshold=threshold)
        for _ in range(2):
            got = r.run(r.prepare(ids, cu))
            assert got.shape == want.shape
            assert (got - want).abs().max().item() < TOL, mode
    if cache:
        assert runner.prefix_cache.stats()["hit_tokens"] > 0


def test_paths_that_cannot_serve_gemma2_are_refused_with_the_reason(case):
    preset, d, want = case
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0, tree_attention="on")
    if preset == "tiny-gemma2":
        assert runner.attention_backend == "spec-varlen"
        assert "softcap" in runner.report.attention_rejected["sdpa"] and "window" in runner.report.attention_rejected["sdpa"]
        assert runner.tree_path is None and "softcap" in runner.tree_report
    else:  # Gemma needs nothing beyond causal softmax: the usual backend and the tree path serve it
        assert runner.attention_backend == "sdpa" and runner.tree_path is not None
        ids, cu = _pack(SEQS)
        r = dataclasses.replace(runner, radix_mlp_threshold=1.0)
        prepared = r.prepare(ids, cu)
        assert prepared.forward.tree is not None  # the batch really runs tree attention
        assert (r.run(prepared) - want).abs().max().item() < TOL


def test_gemma_config_fields():
    from models.checkpoint.config import ModelConfig

    base = {"model_type": "gemma2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 4, "sliding_window": 5,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": None}
    cfg = ModelConfig.from_dict(base)
    assert cfg.layer_windows == (5, None, 5) and cfg.hidden_act == "gelu_tanh"
    assert cfg.final_logit_softcapping is None and cfg.query_pre_attn_scalar == 256
    assert cfg.sliding_window is None  # served per layer, not by capping positions
    typed = ModelConfig.from_dict({**base, "layer_types": ["full_attention"] * 3})
    assert typed.layer_windows == (None, None, None)
    assert ModelConfig.from_dict({**base, "model_type": "gemma", "hidden_act": "gelu"}).hidden_act == "gelu_tanh"
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_dict({**base, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="activation"):
        ModelConfig.from_dict({**base, "hidden_activation": "relu"})

"""Classification heads (`*ForSequenceClassification`, 1 and 3 labels; Qwen3, Qwen2, Llama,
Gemma2) against transformers.

Oracle: transformers' Qwen3/Qwen2/LlamaForSequenceClassification loaded from the same fixture
directory, fp32 on CPU, each sequence alone (the last token's logits); ours in off, paper and
compact, with the prefix cache off and on (a batch run twice, the second reading the pool).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from models.families.registry import UnsupportedArchitecture
from models.runner import load_runner

TOL = 1e-4
PRESETS = [f"tiny-{mt}-seq-cls{sfx}" for mt in ("qwen3", "qwen2", "llama") for sfx in ("", "-3")]
PRESETS.append("tiny-gemma2-seq-cls-3")  # soft-caps and a window under a classification head
ORACLE_CLASS = {"qwen3": "Qwen3ForSequenceClassification", "qwen2": "Qwen2ForSequenceClassification",
                "llama": "LlamaForSequenceClassification", "gemma2": "Gemma2ForSequenceClassification"}


def _batch():
    rng = np.random.default_rng(1)
    shots = rng.integers(100, 5000, 48).tolist()  # a shared few-shot block
    seqs = [shots + rng.integers(100, 5000, int(n)).tolist() for n in (1, 3, 7, 12)]
    return seqs + [seqs[1], [7], [7, 8, 9]]


SEQS = _batch()


def _pack(seqs):
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    return ids, cu


@pytest.fixture(scope="module", params=PRESETS)
def loaded(request, fixture_root):
    import transformers

    import fixtures

    d = fixtures.cached(request.param, root=fixture_root)
    hf_cls = getattr(transformers, ORACLE_CLASS[request.param.split("-")[1]])
    hf = hf_cls.from_pretrained(str(d), dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([hf(input_ids=torch.tensor([s])).logits[0] for s in SEQS])  # [B, labels]
    return d, want


@pytest.mark.parametrize("cache", [0, "2048tokens"])
def test_score_heads_match_transformers_in_every_mode(loaded, cache):
    d, want = loaded
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=cache)
    labels = want.shape[1]
    # one label: a reranker where the family publishes a template and the checkpoint marks itself as
    # the reranker's conversion (the Qwen3 preset's classifier_from_token), else a reward model
    one = "reranker" if d.name.startswith("tiny-qwen3-") else "reward"
    assert runner.head == "score" and runner.kind == (one if labels == 1 else "classifier")
    assert len(runner.labels) == labels
    ids, cu = _pack(SEQS)
    for mode, threshold in (("off", 0.0), ("paper", 1.0), ("compact", 1.0)):
        r = dataclasses.replace(runner, radix_attention="compact" if mode == "off" else mode,
                                radix_mlp_threshold=threshold)
        for _ in range(2):  # with a cache, the second run reads the shared block from the pool
            got = r.run(r.prepare(ids, cu))
            expected = want if labels > 1 else want[:, 0]
            assert got.shape == expected.shape
            assert (got - expected).abs().max().item() < TOL, mode
    if cache:
        assert runner.prefix_cache is not None and runner.prefix_cache.stats()["hit_tokens"] > 0


def test_kinds_of_a_score_head(fixture_root):
    import fixtures

    one = fixtures.cached("tiny-qwen3-seq-cls", root=fixture_root)
    three = fixtures.cached("tiny-qwen3-seq-cls-3", root=fixture_root)
    reward = load_runner(str(one), device="cpu", dtype="float32", kind="reward", prefix_cache_size=0)
    assert reward.kind == "reward" and reward.output_shape(2) == (2,)
    clf = load_runner(str(three), device="cpu", dtype="float32", prefix_cache_size=0)
    assert clf.labels == ("negative", "neutral", "positive") and clf.output_shape(2) == (2, 3)
    with pytest.raises(UnsupportedArchitecture, match="3 labels"):
        load_runner(str(three), device="cpu", dtype="float32", kind="reward", prefix_cache_size=0)
    with pytest.raises(UnsupportedArchitecture, match="not 'embedding'"):
        load_runner(str(one), device="cpu", dtype="float32", kind="embedding", prefix_cache_size=0)

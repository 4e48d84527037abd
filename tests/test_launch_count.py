"""benchmarks.launch_count attributes every dispatched op to its decoder layer.

The attribution is checked against depth: a model one layer deeper dispatches exactly one more
layer's ops, the work outside the layers stays the same, and every layer range is counted.
"""
from __future__ import annotations

import fixtures
from benchmarks import launch_count


def test_counts_follow_depth(fixture_root, tiny_embedding_dir):
    one = fixtures.cached("tiny-embedding", layers=1, root=fixture_root)
    kw = dict(device="cpu", dtype="float32", modes=["off", "compact"], sequences=6, prefix=24, suffix=5)
    deep, shallow = launch_count.run(str(tiny_embedding_dir), **kw), launch_count.run(str(one), **kw)
    for mode in ("off", "compact"):
        d, s = deep["modes"][mode], shallow["modes"][mode]
        assert d["ranges"] == d["layers"] == s["layers"] + 1 and s["ranges"] == s["layers"]
        assert d["total"] == sum(d["per_layer_counts"]) + d["outside_layers"]
        assert len(set(d["per_layer_counts"])) == 1 and d["per_layer"]["median"] > 0  # identical layers
        assert d["outside_layers"] == s["outside_layers"]
        assert d["total"] - s["total"] == d["per_layer_counts"][0]
        assert d["commonest_in_layer0"] and all(n.startswith("aten::") for n, _ in d["commonest_in_layer0"])
    # the compact path's gathers and attention runs are more ops than radix off's one causal call
    assert deep["modes"]["compact"]["per_layer"]["median"] != deep["modes"]["off"]["per_layer"]["median"]


def test_qk_norm_weight_built_once_and_rebuilt_when_written(tiny_embedding_dir):
    """The q/k norms' per-head weights are concatenated once per forward pass set, not per layer
    call, and follow an in-place write (what a reload does) instead of going stale."""
    import torch

    from models.runner import load_runner

    attn = load_runner(str(tiny_embedding_dir), device="cpu", prefix_cache_size=0).model.layers[0].self_attn
    expect = lambda: torch.cat((attn.q_norm.weight.expand(attn.heads, -1),  # noqa: E731
                                attn.k_norm.weight.expand(attn.kv_heads, -1)))
    with torch.inference_mode():
        first = attn.qk_norm_weight()
        assert attn.qk_norm_weight() is first and torch.equal(first, expect())
    with torch.no_grad():
        attn.k_norm.weight.mul_(3.0)
    with torch.inference_mode():
        again = attn.qk_norm_weight()
        assert again is not first and torch.equal(again, expect())

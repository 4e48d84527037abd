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

"""int8 and bf16 CPU weights on the 0.6B shape (2 layers): embeddings and rerank scores stay
within a bound of the fp32 path computed in the same test, in modes off, paper and compact and
through the prefix cache.

Bounds: measured errors (docs/performance/cpu.md, "Linear kernels and reduced-precision weights") with a margin of
about 2-4x; the fp32 reference runs plain ``F.linear`` on the same model.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fixtures
from models.linear.quant import bf16_missing
from models.linear.select import choose_linears
from models.runner import load_runner

CPU = torch.device("cpu")
# weights -> (least cosine of an embedding to fp32, largest |difference| over the fp32 scale)
BOUND = {"int8": (0.998, 0.1), "bf16": (0.9997, 0.05)}
# (weights, kernel): both int8 kernels (they quantize the inputs differently; either may be chosen)
WEIGHTS = [("int8", "int8-dynamic"), ("int8", "int8-rowwise"),
           pytest.param("bf16", "bf16-packed", marks=pytest.mark.skipif(bf16_missing() is not None,
                                                                         reason=str(bf16_missing())))]


def bound(weights: str, kernel: str) -> tuple[float, float]:
    """BOUND for this kernel on this CPU. int8-dynamic without VNNI keeps 7 bits of its input
    (``reduce_range``, models/linear/quant.py): twice the input's quantization step, so twice
    the difference and four times 1 - cosine."""
    min_cos, max_rel = BOUND[weights]
    if kernel == "int8-dynamic" and not torch.cpu._is_vnni_supported():
        return 1 - 4 * (1 - min_cos), 2 * max_rel
    return min_cos, max_rel


def _batch(vocab: int, seed: int, texts: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """Texts sharing a 20-token instruction, a duplicate among them (what compact dedups)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, 20)
    seqs = [np.concatenate([prefix, rng.integers(0, vocab, int(rng.integers(2, 40)))]) for _ in range(texts - 1)]
    seqs.append(seqs[0])
    ids = np.concatenate(seqs).astype(np.int32)
    return ids, np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)


def _run(runner, ids, cu, mode: str, *, cache: bool = False) -> torch.Tensor:
    r = dataclasses.replace(runner, radix_attention="compact" if mode == "off" else mode,
                            radix_mlp_threshold=0.0 if mode == "off" else 1.0,
                            prefix_cache=runner.prefix_cache if cache else None)
    return torch.as_tensor(r.run(r.prepare(ids, cu))).double()


def _use(runner, weights: str, force: str | None = "first") -> None:
    choose_linears(runner.model, device=CPU, dtype=torch.float32, weights=weights, force=force)


@pytest.fixture(scope="module")
def embedder(fixture_root):
    path = fixtures.cached("qwen3-0.6b", layers=2, root=fixture_root)
    return load_runner(str(path), device="cpu", dtype="float32", prefix_cache_size="2048tokens")


@pytest.fixture(scope="module")
def reranker(fixture_root):
    path = fixtures.cached("qwen3-0.6b", layers=2, kind="reranker", root=fixture_root)
    return load_runner(str(path), device="cpu", dtype="float32", prefix_cache_size=0)


@pytest.mark.parametrize("weights, kernel", WEIGHTS)
def test_embeddings_stay_near_fp32_in_every_mode_and_through_the_cache(embedder, weights, kernel):
    min_cos, max_rel = bound(weights, kernel)
    ids, cu = _batch(embedder.config.vocab_size, seed=sum(map(ord, kernel)))  # fresh cache entries per kernel
    _use(embedder, "fp32", "F.linear")
    want = _run(embedder, ids, cu, "off")
    scale = want.abs().max().item()
    _use(embedder, weights, kernel)
    assert next(m for m in embedder.model.modules() if hasattr(m, "kernel")).kernel is not None
    try:
        outs = {mode: _run(embedder, ids, cu, mode) for mode in ("off", "paper", "compact")}
        outs["cache, first"] = _run(embedder, ids, cu, "compact", cache=True)
        outs["cache, hit"] = _run(embedder, ids, cu, "compact", cache=True)  # the prefix from the pool
    finally:
        _use(embedder, "fp32", "F.linear")
    for name, got in outs.items():
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
        rel = (got - want).abs().max().item() / scale
        assert cos >= min_cos and rel <= max_rel, (name, cos, rel)
        # the reduced precision is the only difference: modes and the cache agree among themselves
        assert (got - outs["off"]).abs().max().item() <= max_rel * scale, name


@pytest.mark.parametrize("weights, kernel", WEIGHTS)
def test_rerank_scores_stay_near_fp32(reranker, weights, kernel):
    _, max_rel = bound(weights, kernel)
    ids, cu = _batch(reranker.config.vocab_size, seed=7)
    _use(reranker, "fp32", "F.linear")
    want = _run(reranker, ids, cu, "off")
    _use(reranker, weights, kernel)
    try:
        got = {mode: _run(reranker, ids, cu, mode) for mode in ("off", "compact")}
    finally:
        _use(reranker, "fp32", "F.linear")
    scale = want.abs().max().item()
    for mode, scores in got.items():
        assert (scores - want).abs().max().item() <= max_rel * scale, mode


def test_the_server_frees_the_dense_weights_and_reports_the_choice(fixture_root):
    path = fixtures.cached("tiny-embedding", root=fixture_root)
    runner = load_runner(str(path), device="cpu", dtype="float32", prefix_cache_size=0,
                         cpu_weights="int8", keep_dense_weights=False)
    layers = [m for m in runner.model.modules() if getattr(m, "kernel", None) is not None]
    assert layers and all(m.weight.numel() == 0 for m in layers)
    assert runner.report.linear == "int8-dynamic" and runner.report.linear_choice.startswith("int8: int8-dynamic")
    ids, cu = _batch(runner.config.vocab_size, seed=3, texts=3)
    with torch.enable_grad():  # the autograd path runs F.linear on the dequantized weight
        grad_path = runner.forward(runner.prepare(ids, cu).forward)
    fast = _run(runner, ids, cu, "off")
    assert (grad_path.detach().double() - fast).abs().max().item() <= 0.1 * fast.abs().max().item()


def test_the_benchmark_compares_the_precisions(tiny_embedding_dir, capsys):
    from benchmarks import bench_linear

    assert bench_linear.main(["--model-dir", str(tiny_embedding_dir), "--weights", "int8", "--rows", "1", "5",
                              "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "fp32/int8" in out and "embed int8 vs fp32" in out and "min cos" in out


def test_the_profile_names_the_linears(tiny_embedding_dir, capsys):
    from benchmarks import bench_linear

    assert bench_linear.main(["--model-dir", str(tiny_embedding_dir), "--profile"]) == 0
    out = capsys.readouterr().out
    assert "linears: onednn-packed" in out and "_linear_pointwise" in out

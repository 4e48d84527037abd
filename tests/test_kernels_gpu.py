"""The CUDA gather kernel against index_select / index_add_ (all gpu-marked; skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import gather
from tests.test_kernels import DTYPES, _clean_state, _index  # noqa: F401 - _clean_state is autouse

# ---------------------------------------------------------------- CUDA kernel (gpu)

def _ext():
    ext = gather.load_extension()
    assert ext is not None, gather.load_error()
    return ext


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("width", [1024, 7, 6, 4, 1])  # 16-byte units, scalar, 4/8-byte units
def test_cuda_kernel_equals_index_select(dtype, index_dtype, width):
    ext = _ext()
    src = torch.randn(3001, width, device="cuda").to(dtype)
    index = _index(3001, 5003, index_dtype, device="cuda", seed=width)
    out = ext.gather_rows(src, index)
    torch.cuda.synchronize()
    assert torch.equal(out, src.index_select(0, index))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])  # 1: a slice that breaks 16-byte pointer alignment
def test_cuda_kernel_strided_kv_and_pair(dtype, offset):
    ext = _ext()
    n, h, hkv, d = 777, 4, 2, 64
    qkv = torch.randn(n, (h + 2 * hkv) * d + 1, device="cuda").to(dtype)
    q_w, kv_w = h * d + offset, hkv * d
    k = qkv[:, q_w:q_w + kv_w].view(n, hkv, d)  # [N, Hkv, D]
    v = qkv[:, q_w + kv_w:q_w + 2 * kv_w].view(n, hkv, d)
    index = _index(n, 1500, torch.int32, device="cuda", seed=offset)
    ok, ov = ext.gather_rows_pair(k, v, index)
    assert ok.is_contiguous() and ok.shape == (1500, hkv, d)
    assert torch.equal(ok, k.index_select(0, index)) and torch.equal(ov, v.index_select(0, index))
    assert torch.equal(ext.gather_rows(k, index), k[index.long()])


@pytest.mark.gpu
def test_cuda_kernel_edge_cases_and_checks():
    ext = _ext()
    src = torch.randn(10, 8, device="cuda", dtype=torch.bfloat16)
    empty = torch.empty(0, dtype=torch.int64, device="cuda")
    assert ext.gather_rows(src, empty).shape == (0, 8)
    assert [t.shape for t in ext.gather_rows_pair(src, src, empty)] == [(0, 8), (0, 8)]
    # the messages that carry numbers (formatted without an ostream: kernels/gather.cu)
    with pytest.raises(RuntimeError, match=r"contiguous \(trailing dims packed\), got strides \[1, 8\]"):
        ext.gather_rows(src.t(), torch.zeros(2, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match="index must be 1-D, got 2-D"):
        ext.gather_rows(src, torch.zeros(2, 2, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match="k and v row counts differ: 10 vs 9"):
        ext.gather_rows_pair(src, src[:9], torch.zeros(2, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match="row stride 4 is smaller than the row width 8"):
        ext.gather_rows(torch.randn(44, device="cuda").as_strided((10, 8), (4, 1)),
                        torch.zeros(2, dtype=torch.int64, device="cuda"))
    with pytest.raises(RuntimeError, match="int32 or int64"):
        ext.gather_rows(src, torch.zeros(2, dtype=torch.int16, device="cuda"))
    with pytest.raises(RuntimeError, match="must be on"):
        ext.gather_rows(src, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        ext.gather_rows(src.double(), torch.zeros(2, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
def test_cuda_selected_paths_and_backward(monkeypatch):
    monkeypatch.setenv("RADIXSERVE_GATHER_IMPL", "cuda")
    _ext()
    gather_rows = kernels.get_gather_rows("cuda")
    gather_pair = kernels.get_gather_rows_pair("cuda")
    assert gather_rows is not kernels.ref_gather_rows
    n, m = 300, 700
    index = _index(n, m, torch.int32, device="cuda", seed=7)
    qkv = torch.randn(n, 6 * 32, device="cuda", requires_grad=True)
    k, v = qkv[:, 64:128].view(n, 2, 32), qkv[:, 128:].view(n, 2, 32)
    ok, ov = gather_pair(k, v, index)
    ks = gather_rows(k, index)
    gk, gv, gs = torch.randn_like(ok), torch.randn_like(ov), torch.randn_like(ks)
    ((ok * gk).sum() + (ov * gv).sum() + (ks * gs).sum()).backward()
    expect = torch.zeros(n, 6 * 32, device="cuda")
    idx = index.long()
    expect[:, 64:128].index_add_(0, idx, (gk + gs).reshape(m, 64))
    expect[:, 128:].index_add_(0, idx, gv.reshape(m, 64))
    torch.testing.assert_close(qkv.grad, expect)

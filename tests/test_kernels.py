"""kernels/: ref twins, selection, autograd, build plumbing (CPU); the CUDA kernel (gpu-marked).

The oracle everywhere is plain advanced indexing / index_add_ on the same inputs.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import build, gather

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    monkeypatch.delenv("RADIXSERVE_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("RADIXSERVE_GATHER_IMPL", raising=False)
    monkeypatch.setattr(gather, "LOADER", gather.Loader())  # no load attempt remembered


def _index(n_src: int, m: int, dtype=torch.int64, device="cpu", seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_src, (m,), generator=g).to(dtype=dtype, device=device)


def _fused_kv(n: int, *, heads: int, kv_heads: int, head_dim: int, dtype, device="cpu"):
    """K and V as strided views of a fused QKV projection [N, (H+2Hkv)*D]."""
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q_w, kv_w = heads * head_dim, kv_heads * head_dim
    k = qkv[:, q_w:q_w + kv_w].view(n, kv_heads, head_dim)  # [N, Hkv, D], row stride > width
    v = qkv[:, q_w + kv_w:].view(n, kv_heads, head_dim)
    return k, v


# ---------------------------------------------------------------- ref twins (CPU)

@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(13,), (13, 7), (13, 3, 5)])
def test_ref_equals_indexing(dtype, index_dtype, shape):
    src = torch.randn(*shape).to(dtype)
    index = _index(shape[0], 29, index_dtype)
    out = kernels.ref_gather_rows(src, index)
    assert out.shape == (29, *shape[1:])
    assert torch.equal(out, src[index.long()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ref_pair_on_strided_kv_views(dtype):
    k, v = _fused_kv(11, heads=4, kv_heads=2, head_dim=8, dtype=dtype)
    assert not k.is_contiguous() and k.stride(0) > gather.row_width(k)
    index = _index(11, 20, torch.int32)
    ok, ov = kernels.ref_gather_rows_pair(k, v, index)
    assert torch.equal(ok, k[index.long()]) and torch.equal(ov, v[index.long()])


def test_ref_empty_index():
    src = torch.randn(5, 3)
    out = kernels.ref_gather_rows(src, torch.empty(0, dtype=torch.int32))
    assert out.shape == (0, 3)


def test_cpu_autograd_matches_indexing():
    gather_rows = kernels.get_gather_rows("cpu")
    gather_pair = kernels.get_gather_rows_pair("cpu")
    index = _index(9, 17, torch.int32)
    src = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(17, 4, dtype=torch.float64)
    (gather_rows(src, index) * w).sum().backward()
    src2 = src.detach().clone().requires_grad_()
    (src2[index.long()] * w).sum().backward()
    assert torch.allclose(src.grad, src2.grad)

    k = torch.randn(9, 2, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 2, 3, dtype=torch.float64, requires_grad=True)
    ok, ov = gather_pair(k, v, index)
    (ok.sum() + (ov * 2).sum()).backward()
    counts = torch.bincount(index.long(), minlength=9).to(torch.float64)
    assert torch.allclose(k.grad, counts[:, None, None].expand(9, 2, 3))
    assert torch.allclose(v.grad, 2 * counts[:, None, None].expand(9, 2, 3))


# ---------------------------------------------------------------- autograd Functions (CPU)

def _launch(src, index):
    return src.index_select(0, index).contiguous()


def _launch_pair(k, v, index):
    return _launch(k, index), _launch(v, index)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_function_backward_is_index_add(index_dtype):
    index = _index(10, 25, index_dtype, seed=3)
    k, v = _fused_kv(10, heads=2, kv_heads=1, head_dim=4, dtype=torch.float64)
    k = k.detach().requires_grad_()  # strided leaf, like a QKV slice
    out = gather.GatherRows.apply(k, index, _launch)
    grad = torch.randn_like(out)
    out.backward(grad)
    expect = torch.zeros(k.shape, dtype=k.dtype).index_add_(0, index.long(), grad)
    assert torch.equal(k.grad, expect)

    v = v.detach().requires_grad_()
    k2 = k.detach().clone()  # no grad: its gradient must not be computed
    ok, ov = gather.GatherRowsPair.apply(k2, v, index, _launch_pair)
    gv = torch.randn_like(ov)
    (ov * gv).sum().backward()
    assert torch.equal(ok, k2[index.long()])
    assert torch.allclose(v.grad, torch.zeros(v.shape, dtype=v.dtype).index_add_(0, index.long(), gv))


class _FakeExt:
    """Stands in for the compiled module on CPU; records which path was taken."""

    def __init__(self):
        self.calls = []

    def gather_rows(self, src, index):
        self.calls.append("single")
        return _launch(src, index)

    def gather_rows_pair(self, k, v, index):
        self.calls.append("pair")
        return list(_launch_pair(k, v, index))


def _cpu_supported(src, index):
    return (src.dtype in gather.DTYPES and index.dtype in gather.INDEX_DTYPES
            and gather.row_width(src) is not None)


def test_make_gather_rows_routing(monkeypatch):
    monkeypatch.setattr(gather, "supported", _cpu_supported)
    ext = _FakeExt()
    always = gather.make_gather_rows(ext)
    index = _index(6, 8, torch.int32)
    packed = torch.randn(6, 4)
    k, _ = _fused_kv(6, heads=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    assert torch.equal(always(packed, index), packed[index.long()]) and ext.calls == ["single"]
    assert torch.equal(always(k, index), k[index.long()]) and ext.calls == ["single"] * 2
    # float64 is not a kernel dtype: torch takes it
    n = len(ext.calls)
    always(packed.double(), index)
    assert len(ext.calls) == n
    # gradients flow through the kernel path
    leaf = packed.clone().requires_grad_()
    always(leaf, index).sum().backward()
    assert torch.equal(leaf.grad, torch.bincount(index.long(), minlength=6)[:, None].expand(6, 4).float())

    pair = gather.make_gather_rows_pair(ext)
    ok, ov = pair(k, k * 2, index)
    assert ext.calls[-1] == "pair" and torch.equal(ov, 2 * k[index.long()])


def test_layout_helpers():
    k, _ = _fused_kv(5, heads=2, kv_heads=1, head_dim=4, dtype=torch.float16)
    assert gather.row_width(k) == 4 and k.stride(0) == 16  # rows of the fused [N, (2+2)*4]
    x = torch.randn(5, 6)
    assert gather.row_width(x) == 6
    assert gather.row_width(x.t()) is None  # columns are not rows
    assert not gather.supported(x, torch.zeros(2, dtype=torch.int64))  # CPU tensors: torch


# ---------------------------------------------------------------- selection and describe

def test_cpu_selects_ref_and_describes():
    assert kernels.get_gather_rows("cpu") is kernels.ref_gather_rows
    assert kernels.get_gather_rows_pair("cpu") is kernels.ref_gather_rows_pair
    assert kernels.describe("cpu") == "torch index_select (cpu device)"


def _no_build(*a, **k):
    raise AssertionError("the extension must not be built here")


def test_disable_kernels_forces_ref(monkeypatch):
    monkeypatch.setattr(gather, "load_extension", _no_build)
    monkeypatch.setenv("RADIXSERVE_DISABLE_KERNELS", "1")
    assert kernels.get_gather_rows("cuda") is kernels.ref_gather_rows
    assert kernels.get_gather_rows_pair("cuda:0") is kernels.ref_gather_rows_pair
    assert "RADIXSERVE_DISABLE_KERNELS" in kernels.describe("cuda")
    monkeypatch.setenv("RADIXSERVE_DISABLE_KERNELS", "0")
    monkeypatch.setenv("RADIXSERVE_GATHER_IMPL", "torch")
    assert kernels.get_gather_rows("cuda") is kernels.ref_gather_rows
    assert kernels.describe("cuda") == "torch index_select (RADIXSERVE_GATHER_IMPL=torch)"


def test_impl_setting_selects_kernel(monkeypatch):
    ext = _FakeExt()
    # auto: torch's index_select, and the extension is not even loaded (unmeasured on a GPU)
    monkeypatch.setattr(gather, "load_extension", lambda: pytest.fail("auto must not build"))
    assert kernels.get_gather_rows("cuda") is kernels.ref_gather_rows
    assert kernels.get_gather_rows_pair("cuda") is kernels.ref_gather_rows_pair
    assert kernels.describe("cuda").startswith("torch index_select (RADIXSERVE_GATHER_IMPL=auto")
    monkeypatch.setattr(gather, "load_extension", lambda: ext)
    monkeypatch.setenv("RADIXSERVE_GATHER_IMPL", "cuda")
    assert kernels.get_gather_rows("cuda") is not kernels.ref_gather_rows
    assert kernels.get_gather_rows_pair("cuda") is not kernels.ref_gather_rows_pair
    assert kernels.describe("cuda") == "cuda gather kernel (RADIXSERVE_GATHER_IMPL=cuda)"
    monkeypatch.setenv("RADIXSERVE_GATHER_IMPL", "fast")
    with pytest.raises(ValueError, match="RADIXSERVE_GATHER_IMPL"):
        kernels.get_gather_rows("cuda")


def test_extension_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build.extension_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert build.extension_root() == Path.home() / ".cache" / "radixserve" / "torch_extensions"


def test_import_does_not_build():
    code = (
        "import torch.utils.cpp_extension as c\n"
        "def boom(*a, **k): raise SystemExit('cpp_extension.load called')\n"
        "c.load = boom\n"
        "import kernels, kernels.gather, torch\n"
        "kernels.get_gather_rows('cpu'); kernels.describe('cpu')\n"
        "x = torch.arange(6.).view(3, 2)\n"
        "assert torch.equal(kernels.get_gather_rows('cpu')(x, torch.tensor([2, 0])), x[[2, 0]])\n"
    )
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr


def test_cu_source_has_dispatch_and_vector_path():
    src = gather.SOURCE.read_text()
    for needle in ("AT_DISPATCH_FLOATING_TYPES_AND2", "AT_DISPATCH_INDEX_TYPES", "uint4",
                   "PYBIND11_MODULE", "gather_rows_pair", "getCurrentCUDAStream",
                   "C10_CUDA_KERNEL_LAUNCH_CHECK"):
        assert needle in src, needle


def _torch_checks(src: str) -> list[list[str]]:
    """The top-level comma-separated arguments of every TORCH_CHECK(...) call in ``src``."""
    calls, i = [], 0
    while (i := src.find("TORCH_CHECK(", i)) != -1:
        i += len("TORCH_CHECK(")
        depth, args, cur, quoted = 0, [], "", False
        while True:
            ch = src[i]
            i += 1
            if ch == '"' and src[i - 2] != "\\":
                quoted = not quoted
            elif not quoted and ch in "([{":
                depth += 1
            elif not quoted and ch in ")]}":
                if depth == 0:
                    break
                depth -= 1
            elif not quoted and ch == "," and depth == 0:
                args.append(cur.strip())
                cur = ""
                continue
            cur += ch
        calls.append(args + [cur.strip()])
    return calls


# A message part is a literal, a name the caller passed, or a string made without an ostream;
# ScalarType and Device are formatted inside libc10. Anything else (an int64, an IntArrayRef)
# would be streamed by the extension's own ostream code, which crashed the process with SIGSEGV
# on a torch 2.11 + CUDA 13 image instead of raising (kernels/gather.cu, the NOTE above dims()).
_SAFE_PART = (r'^(".*"|name|st|std::to_string\(.*\)|dims\(.*\)|[a-z]+\.scalar_type\(\)'
              r'|[a-z]+\.device\(\))$')


def test_cu_messages_format_numbers_without_an_ostream():
    import re

    calls = _torch_checks(gather.SOURCE.read_text())
    assert len(calls) >= 10  # every check of the file was found
    for args in calls:
        for part in args[1:]:
            assert re.match(_SAFE_PART, part, re.S), (part, args)
    # the parser is not blind: an integer and an array in a message are caught
    bad = _torch_checks('TORCH_CHECK(a == b, "rows ", a.size(0), " strides ", a.strides());')
    assert [p for p in bad[0][1:] if not re.match(_SAFE_PART, p)] == ["a.size(0)", "a.strides()"]

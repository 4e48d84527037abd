"""The gather wrappers' host-side checks mirror the kernel's own: what gather.cu would reject
(TORCH_CHECK raises) takes torch's index_select instead. CPU-only, with a recording fake
extension in place of the compiled one."""
from __future__ import annotations

import torch

from kernels import gather


class _RecordingExt:
    """Stands in for the compiled module: records launches, computes with indexing."""

    def __init__(self):
        self.calls: list[str] = []

    def gather_rows(self, src, index):
        self.calls.append("single")
        return src[index.long()]

    def gather_rows_pair(self, k, v, index):
        self.calls.append("pair")
        return [k[index.long()], v[index.long()]]


def test_non_contiguous_index_takes_index_select(monkeypatch):
    monkeypatch.setattr(gather, "supported", gather.layout_supported)  # CPU stands in for CUDA
    ext = _RecordingExt()
    single = gather.make_gather_rows(ext)
    pair = gather.make_gather_rows_pair(ext)
    src = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    index = torch.randint(0, 6, (16,), generator=torch.Generator().manual_seed(1))[::2]
    assert not index.is_contiguous()
    assert torch.equal(single(src, index), src[index]) and ext.calls == []
    got_k, got_v = pair(src, src * 3, index)
    assert torch.equal(got_k, src[index]) and torch.equal(got_v, 3 * src[index])
    assert ext.calls == []
    # the same index made contiguous is the kernel's
    assert torch.equal(single(src, index.contiguous()), src[index]) and ext.calls == ["single"]
    pair(src, src * 3, index.contiguous())
    assert ext.calls == ["single", "pair"]
    # a 2-D index, or a float64 source, is never the kernel's either
    assert not gather.layout_supported(src, index.contiguous().view(2, 4))
    assert not gather.layout_supported(src.double(), index.contiguous())

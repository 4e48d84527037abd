"""sentence-transformers Dense modules after pooling: act(x @ W.T + b) per pooled row.

Several embedders (stella_en_*_v5, EmbeddingGemma, ...) project the pooled vector through one or
more Dense modules before Normalize; `SentenceTransformer.encode` answers their output. The
modules are read and checked by models/checkpoint/directory.py (`read_modules`); here their
weights are loaded from the module's folder (model.safetensors, else pytorch_model.bin, keys
``linear.weight`` [out, in] and ``linear.bias`` [out]) and applied in fp32: B rows, one small
matmul each, never per token.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from models.checkpoint.directory import DenseSpec, UnsupportedModules

_ACTIVATIONS = {
    "Tanh": torch.tanh,
    "Identity": lambda x: x,
    "ReLU": torch.relu,
    "Sigmoid": torch.sigmoid,
    "GELU": nn.functional.gelu,
    "SiLU": nn.functional.silu,
}


class DenseStack(nn.Module):
    """The Dense modules in modules.json's order: [B, E] pooled -> [B, out_features of the last]."""

    def __init__(self, specs: tuple[DenseSpec, ...], tensors: list[dict[str, Tensor]]) -> None:
        super().__init__()
        self.specs = specs
        self.linears = nn.ModuleList()
        for spec, t in zip(specs, tensors):
            linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
            with torch.no_grad():
                linear.weight.copy_(t["linear.weight"].float())
                if spec.bias:
                    linear.bias.copy_(t["linear.bias"].float())
            self.linears.append(linear.float())

    @property
    def out_features(self) -> int:
        return self.specs[-1].out_features

    def forward(self, pooled: Tensor) -> Tensor:
        x = pooled.float()  # [B, E]
        for spec, linear in zip(self.specs, self.linears):
            x = _ACTIVATIONS[spec.activation](linear(x))  # [B, out]
        return x


def load_dense(model_dir: Path, specs: tuple[DenseSpec, ...], device: torch.device) -> DenseStack | None:
    """The Dense modules' weights, checked against their configs; None when there are none."""
    if not specs:
        return None
    tensors = []
    for spec in specs:
        folder = Path(model_dir) / spec.path
        if (folder / "model.safetensors").is_file():
            from safetensors.torch import load_file

            t = load_file(str(folder / "model.safetensors"))
        elif (folder / "pytorch_model.bin").is_file():
            t = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise UnsupportedModules(f"Dense module {spec.path!r}: no model.safetensors or pytorch_model.bin")
        want: dict[str, tuple[int, ...]] = {"linear.weight": (spec.out_features, spec.in_features)}
        if spec.bias:
            want["linear.bias"] = (spec.out_features,)
        for key, shape in want.items():
            if key not in t or tuple(t[key].shape) != shape:
                got = tuple(t[key].shape) if key in t else "absent"
                raise UnsupportedModules(f"Dense module {spec.path!r}: {key} should be {shape}, is {got}")
        extra = sorted(set(t) - set(want))
        if extra:
            raise UnsupportedModules(f"Dense module {spec.path!r}: tensors {extra} are not served")
        tensors.append(t)
    return DenseStack(specs, tensors).to(device).eval()

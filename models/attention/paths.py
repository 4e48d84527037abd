"""What `load_runner` chooses once, at build, and logs: the attention backend and tree path for
the family's attention spec and the CPU attention blocks' kernel (the linear layers' kernel is
chosen in models/linear/select.py).

Each choice says at start which path runs and why the others do not (the start-up log, /info).
"""
from __future__ import annotations

import logging

import torch

from models.attention.varlen import AttentionBackend
from models.attention.lse import select_cpu_kernel
from models.attention.select import select_backend
from models.attention.spec import AttentionSpec
from models.checkpoint.config import ModelConfig
from models.attention.tree_select import TreeBackend, select_tree

log = logging.getLogger("models.runner")  # the start-up lines of loading, under one logger


def select_paths(cfg: ModelConfig, spec: AttentionSpec, *, device: torch.device, dtype: torch.dtype,
                 tree_attention: str) -> tuple[AttentionBackend, TreeBackend | None, dict[str, str]]:
    """(the attention backend, the tree path or None, {tree path: why not}) for this checkpoint."""
    shape = dict(heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    backend = select_backend(device, dtype=dtype, spec=spec, **shape)
    log.info("attention backend %s on %s %s; not used: %s", backend.name, device,
             str(dtype).replace("torch.", ""),
             "; ".join(f"{k} ({v})" for k, v in backend.rejected.items()) or "none")
    tree_path, tree_rejected = select_tree(device, dtype=dtype, spec=spec, **shape)
    log.info("tree attention %s: %s", tree_attention,
             tree_path.name if tree_path else "no path (" + "; ".join(f"{k}: {v}" for k, v in tree_rejected.items()) + ")")
    return backend, tree_path, tree_rejected


def cpu_attention_kernel(cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype, wanted: bool) -> str:
    """Which kernel serves the CPU's attention blocks (measured at load; logged); "" off the CPU."""
    if device.type != "cpu" or dtype != torch.float32:
        return ""
    report = select_cpu_kernel(wanted, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                               head_dim=cfg.head_dim)
    log.info("CPU attention blocks: %s", report)
    return report

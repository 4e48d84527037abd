"""What `load_runner` chooses once, at build, and logs: the attention backend and tree path for
the family's attention spec, the linear layers' packing, the CPU attention blocks' kernel.

Each choice says at start which path runs and why the others do not (the start-up log, /info).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from models.attention import AttentionBackend
from models.attention_lse import select_cpu_kernel
from models.attention_select import select_backend
from models.attention_spec import AttentionSpec
from models.config import ModelConfig
from models.linear import pack_linears
from models.tree_select import TreeBackend, select_tree

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


def pack(model: nn.Module, *, device: torch.device, dtype: torch.dtype, wanted: bool,
          keep_dense: bool) -> str:
    """Pack the linears where it pays (CPU float32); say at start which path runs and why."""
    if not wanted:
        log.info("linear layers: F.linear (cpu_packed_weights off)")
        return "F.linear"
    reason = pack_linears(model, device=device, dtype=dtype, keep_dense=keep_dense)
    if reason is None:
        log.info("linear layers: oneDNN with weights packed at load (CPU float32%s)",
                 "" if keep_dense else "; the packed copy is the only one")
        return "onednn-packed"
    # NOTE: not packing is the normal case off the CPU; on the CPU in fp32 it is a slow path
    (log.warning if device.type == "cpu" and dtype == torch.float32 else log.info)(
        "linear layers: F.linear (%s)", reason)
    return "F.linear"


def cpu_attention_kernel(cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype, wanted: bool) -> str:
    """Which kernel serves the CPU's attention blocks (measured at load; logged); "" off the CPU."""
    if device.type != "cpu" or dtype != torch.float32:
        return ""
    report = select_cpu_kernel(wanted, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                               head_dim=cfg.head_dim)
    log.info("CPU attention blocks: %s", report)
    return report

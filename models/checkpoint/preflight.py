"""What a checkpoint says before torch loads: where its directory is, and the kind it serves.

The command line asks first, so a missing local directory, an architecture not served or a
``--model-task`` (vLLM's ``--task``) of the other kind is refused at once, not after the seconds
torch and the model code take to import. Torch-free: config.json, the directory's
sentence-transformers files and the family registry's tables, the same reads ``load_runner``
makes (models/runner.py), which decides the same way when it loads.
"""
from __future__ import annotations

from pathlib import Path

from models.checkpoint.config import ModelConfig, read_config
from models.checkpoint.directory import detect_kind
from models.checkpoint.reranker_mark import reranker_mark
from models.families.registry import (RERANK_TEMPLATES, check_kind, check_remote_code, default_kind,
                                      rerank_template_for, resolve)


def looks_like_path(model_id: str) -> bool:
    """A model id written as a path (absolute, ./, ../, ~, or more than one "/"): never a hub id."""
    return Path(model_id).is_absolute() or model_id.startswith((".", "~")) or model_id.count("/") > 1


def local_dir(model_id: str, revision: str | None = None) -> Path | None:
    """The checkpoint directory when it is on this machine (a local path, or a hub id already in
    the hub cache); None for a hub id still to download; FileNotFoundError for a path that is not."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        return path
    if looks_like_path(model_id):
        raise FileNotFoundError(f"model directory {model_id!r} does not exist")
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_id, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - a malformed id or cache: the download path reports it
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def served_kind(model_dir: Path, kind: str | None = None, rerank_template: str | None = None) -> str:
    """The kind the checkpoint serves (``kind``: the one asked for, checked against its head;
    ``rerank_template``: --rerank-template); raises ValueError (UnsupportedArchitecture) for an
    architecture, attention, remote code or kind not served."""
    raw = read_config(model_dir)
    family = resolve(str(raw.get("model_type", "")), tuple(raw.get("architectures") or ()))
    cfg = ModelConfig.from_dict(raw)
    check_remote_code(raw)
    mark = reranker_mark(model_dir, raw, RERANK_TEMPLATES.get((cfg.model_type, family.head)))
    template, _ = rerank_template_for(family, cfg.model_type, rerank_template, mark=mark, kind=kind)
    kind = kind or default_kind(family, len(cfg.labels), template=template) or detect_kind(model_dir, cfg)
    check_kind(family, kind, len(cfg.labels))
    return kind

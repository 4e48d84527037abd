"""Model engine: config, weight loading, the family registry and its families' ragged forwards
(models/families/), pooling and heads.

`load_runner(...) -> Runner` is the entry point (imported lazily, so `models.prompts` stays cheap
to import, for the repository's fixture builder among others).
"""
from __future__ import annotations

__all__ = ["Runner", "load_runner"]


def __getattr__(name: str):
    if name in __all__:
        from models import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")

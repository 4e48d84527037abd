"""Model engine: from a checkpoint directory to pooled vectors and scores, one ragged batch at a time.

The folders, one concern each:
- checkpoint/: config.json, the directory's conventions, weight loading
- families/: the family registry, the `ScoringModel` protocol, the shared layers, one module per family
- attention/: the attention backends (varlen, tree) and the choice among them
- linear/: the CPU linear kernels (packed, int8, bf16) and the measured choice
- text/: prompts, rerank templates, pair budgets: torch-free, what server/ imports
- prefix_cache/: K/V rows shared across batches

Beside them: runner.py (`Runner`, `load_runner`), batch.py (a batch's device tensors), trie.py
(the per-batch prefix trie), pooling.py, streams.py (host/device copies), warmup.py, startup.py,
prefix_setup.py, options.py, measure_cache.py, lone_choice.py (the prefix cache for a lone short
input, by measured cost).

`load_runner(...) -> Runner` is the entry point (imported lazily, so `models.text` stays cheap to
import, for the repository's fixture builder among others).
"""
from __future__ import annotations

__all__ = ["Runner", "load_runner"]


def __getattr__(name: str):
    if name in __all__:
        from models import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")

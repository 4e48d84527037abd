"""What the server reads of a model runner and drives of a scheduler, as Protocols.

``ServedRunner`` extends the scheduler's ``ModelRunner`` (prepare/run) with the fields the server
reads: the model kind and identity for checks and /info, the tokenizer and prompts for
tokenization, and the settings it reports at start-up. ``models.runner.Runner`` implements both;
the type checker holds it and any fake to them, so the server never probes a runner with getattr.
"""
from __future__ import annotations

from typing import Any, Protocol

from models.report import RunnerReport
from scheduler import SubmitResult
from scheduler.contract import ModelRunner
from scheduler.metrics import Metrics


class ServedRunner(ModelRunner, Protocol):
    kind: str  # "embedding" | "reranker" | "classifier" | "reward"
    head: str  # "pooling" | "yes-no" (two lm_head rows) | "score" (a classification head)
    labels: tuple[str, ...]  # a score head's labels in row order; () otherwise
    rerank_template: str  # a reranker's template name (/info)
    rerank_instruction: str  # a reranker's default instruction (the family's)
    head_reason: str  # why a one-label score head is a reranker (its template) or a reward model (/info)
    model_id: str
    config: Any  # the model config: ``vocab_size`` bounds valid token ids
    tokenizer: Any  # a ``tokenizers.Tokenizer``
    device: Any
    dtype: Any
    pooling: str
    radix_attention: str
    attention_backend: str
    tree_report: str  # the tree-attention policy and the path that runs, e.g. "auto (cpu-flash)"
    # what load chose and measured, and why: rejected backends, kernels, memory, the prefix cache's
    # size, the start-up stages (/info and the start-up line)
    report: RunnerReport
    max_positions: int
    hidden_size: int
    prompts: dict[str, str]
    default_prompt_name: str | None
    radix_mlp_threshold: float
    prefix_cache: Any  # None when off; else what ``Metrics.watch_prefix_cache`` reads

    def warm_up(self, *, max_tokens: int) -> dict: ...  # the serving path once, on the calling thread


class ServedScheduler(Protocol):
    """The scheduler as the app drives it: start, stop, submit, and its health for /health."""

    metrics: Metrics | None

    @property
    def alive(self) -> bool: ...

    @property
    def queue_size(self) -> int: ...

    def start(self) -> None: ...

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None: ...

    async def submit(self, items: list[list[int]], *, request_id: str | None = None,
                     all_tokens: bool = False, namespace: bytes = b"") -> SubmitResult: ...

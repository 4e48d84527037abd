"""A front end's copy of the runner's served fields: what the app reads, without the model.

``RunnerView.of(runner)`` is taken in the engine and pickled to each front end; the tokenizer
travels as its JSON (``tokenizers.Tokenizer.to_str``) and is rebuilt there. It satisfies
``ServedRunner`` so ``create_app`` builds the same routes, checks, /info and OpenAPI schema as
in one process; ``prepare``/``run``/``warm_up`` are the engine's and refuse here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from models.report import RunnerReport
from models.startup import StartupClock
from server.service.contract import ServedRunner

# The plain fields copied as they are (strings, numbers, dicts, tuples).
_COPIED = ("kind", "head", "labels", "rerank_template", "rerank_instruction", "head_reason", "model_id",
           "pooling", "radix_attention", "attention_backend", "tree_report", "max_positions", "hidden_size", "prompts",
           "default_prompt_name", "radix_mlp_threshold")


@dataclass
class RunnerView:
    kind: str
    head: str
    labels: tuple[str, ...]
    rerank_template: str
    rerank_instruction: str
    head_reason: str
    model_id: str
    pooling: str
    radix_attention: str
    attention_backend: str
    tree_report: str
    max_positions: int
    hidden_size: int
    prompts: dict[str, str]
    default_prompt_name: str | None
    radix_mlp_threshold: float
    report: RunnerReport  # the engine's, its start-up clock reading `startup_seconds`
    config: Any  # the model config (picklable): vocab_size, bos_token_id
    device: str  # str(runner.device): /info and the start-up line only
    dtype: str  # str(runner.dtype)
    tokenizer_json: str = field(repr=False)
    startup_seconds: dict = field(default_factory=dict)  # /info's `startup`, as the engine had it
    prefix_cache: Any = None  # the cache lives in the engine; its figures reach /metrics from there

    @classmethod
    def of(cls, runner: ServedRunner) -> "RunnerView":
        view = cls.__new__(cls)  # no __post_init__: the engine only pickles it (no second tokenizer)
        # the report without the engine's clock (its stage marks stay there); __post_init__ gives it one
        report = dataclasses.replace(runner.report, startup=StartupClock())
        view.__dict__.update({name: getattr(runner, name) for name in _COPIED}, report=report,
                             config=runner.config, device=str(runner.device), dtype=str(runner.dtype),
                             tokenizer_json=runner.tokenizer.to_str(),
                             startup_seconds=dict(runner.report.startup.seconds), prefix_cache=None)
        return view

    def __post_init__(self) -> None:
        from tokenizers import Tokenizer

        self.tokenizer: Any = Tokenizer.from_str(self.tokenizer_json)
        clock = StartupClock()
        clock.seconds = self.startup_seconds  # the dict /info answers, updated in place (remote.py)
        self.report = dataclasses.replace(self.report, startup=clock)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("tokenizer", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def prepare(self, input_ids, cu_seqlens, *, all_tokens=None, namespaces=None):
        raise RuntimeError("a front end runs no model: batches are prepared in the engine process")

    def run(self, prepared):
        raise RuntimeError("a front end runs no model: batches run in the engine process")

    def warm_up(self, *, max_tokens: int) -> dict:
        raise RuntimeError("a front end runs no model: the engine warms it up")

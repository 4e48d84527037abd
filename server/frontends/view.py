"""A front end's copy of the runner's served fields: what the app reads, without the model.

``RunnerView.of(runner)`` is taken in the engine and pickled to each front end; the tokenizer
travels as its JSON (``tokenizers.Tokenizer.to_str``) and is rebuilt there. It satisfies
``ServedRunner`` so ``create_app`` builds the same routes, checks, /info and OpenAPI schema as
in one process; ``prepare``/``run``/``warm_up`` are the engine's and refuse here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from server.service.contract import ServedRunner

# The plain fields copied as they are (strings, numbers, dicts, tuples).
_COPIED = ("kind", "head", "labels", "rerank_template", "rerank_instruction", "model_id", "pooling",
           "radix_attention", "attention_backend", "attention_rejected", "tree_report", "kernels", "linear",
           "linear_choice", "cpu_attention", "memory", "max_positions", "hidden_size", "prompts",
           "default_prompt_name", "radix_mlp_threshold", "prefix_cache_report")


@dataclass
class RunnerView:
    kind: str
    head: str
    labels: tuple[str, ...]
    rerank_template: str
    rerank_instruction: str
    model_id: str
    pooling: str
    radix_attention: str
    attention_backend: str
    attention_rejected: dict[str, str]
    tree_report: str
    kernels: str
    linear: str
    linear_choice: str
    cpu_attention: str
    memory: dict[str, int]
    max_positions: int
    hidden_size: int
    prompts: dict[str, str]
    default_prompt_name: str | None
    radix_mlp_threshold: float
    prefix_cache_report: dict
    config: Any  # the model config (picklable): vocab_size, bos_token_id
    device: str  # str(runner.device): /info and the start-up line only
    dtype: str  # str(runner.dtype)
    tokenizer_json: str = field(repr=False)
    startup_seconds: dict = field(default_factory=dict)  # /info's `startup`, as the engine had it
    prefix_cache: Any = None  # the cache lives in the engine; its figures reach /metrics from there

    @classmethod
    def of(cls, runner: ServedRunner) -> "RunnerView":
        startup = getattr(getattr(runner, "startup", None), "seconds", {})
        view = cls.__new__(cls)  # no __post_init__: the engine only pickles it (no second tokenizer)
        view.__dict__.update({name: getattr(runner, name) for name in _COPIED}, config=runner.config,
                             device=str(runner.device), dtype=str(runner.dtype),
                             tokenizer_json=runner.tokenizer.to_str(), startup_seconds=dict(startup),
                             prefix_cache=None)
        return view

    def __post_init__(self) -> None:
        from tokenizers import Tokenizer

        self.tokenizer: Any = Tokenizer.from_str(self.tokenizer_json)
        self.startup = SimpleNamespace(seconds=self.startup_seconds)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("tokenizer", None)
        state.pop("startup", None)
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

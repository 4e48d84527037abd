"""What each phase runs: the arms' server flags, the sizes on a GPU and in the CPU rehearsal, and
each step's time estimate (the deadline skips a step whose estimate does not fit what is left).

One table, read by the phase runner (__main__), the steps (steps.py) and the CI test, so the
flags that the docs print are the flags that run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# The two device commands of a 15-minute lease, in order: `first` brings back the headline (the
# server on the GPU, end to end at 0.6B, the latency floor, the 8B forward) in at most
# FIRST_BUDGET_S of planned steps; `second` the rest in at most SECOND_BUDGET_S. The four
# 9-minute phases after them are the same measurements at full length, for a longer lease.
PHASES = ("first", "second", "e2e06", "big8b", "e2e4b", "check")
FIRST_BUDGET_S = 420.0  # 7 minutes of the 15, wheels and fixtures included
SECOND_BUDGET_S = 300.0  # 5 minutes
BUDGET_S = {"first": FIRST_BUDGET_S, "second": SECOND_BUDGET_S}

# The arms of every end-to-end comparison, each with its cache state spelled out. `off` turns
# radix and the prefix cache off together; `paper` refuses the cache anyway (server/config.py,
# docs/api.md), the flag only says so; threshold 1 forces the trie on for every batch.
ARMS: dict[str, tuple[str, ...]] = {
    "off": ("--radix-mlp-threshold", "0", "--prefix-cache-size", "0"),
    "paper": ("--radix-mlp-threshold", "1", "--radix-attention", "paper", "--prefix-cache-size", "0"),
    "compact": ("--radix-mlp-threshold", "1", "--radix-attention", "compact", "--prefix-cache-size", "0"),
    "compact+cache": ("--radix-mlp-threshold", "1", "--radix-attention", "compact", "--prefix-cache-size", "auto"),
}
CACHE_STATE = {"off": "no trie, no cache", "paper": "trie, no cache", "compact": "trie, no cache",
               "compact+cache": "trie, cache auto"}
CONCURRENCY = 32  # the paper's
MAX_BATCH_TOKENS = 65536  # the paper's


@dataclass(frozen=True)
class Sizes:
    """The shapes one device runs: model presets, load, forward batches, time estimates (s)."""

    device: str
    dtype: str  # the forward's dtype; fixtures are stored in bfloat16 either way
    small: str  # the 0.6B role
    mid: str  # the 4B role
    big: str  # the 8B role
    layers: int | None  # None: the preset's own depth
    queries_per_s: float  # distinct queries the fastest arm may consume per second (9-10 items each)
    rounds: int  # the alternating arms' rounds (each arm in turn, `slice_s` seconds of load each)
    slice_s: float  # seconds of load per arm per round in the alternating arms
    duration: float  # seconds of load per arm at 0.6B
    mid_duration: float  # at 4B
    big_duration: float  # at 8B
    warmup: int
    floor_requests: int  # requests of each latency-floor probe
    batch: int
    prefixes: tuple[int, ...]
    suffix: int
    repeats: int
    mem_tokens: tuple[int, ...]  # tokens per batch for the peak-memory probe
    margin: float  # seconds a sub-step inside a step must still have left to start
    dims: dict[str, int] = field(default_factory=dict)  # hidden size per role (the responder's vectors)
    need: dict[str, float] = field(default_factory=dict)  # estimated seconds per step kind

    def preset(self, role: str) -> str:
        return {"small": self.small, "mid": self.mid, "big": self.big}[role]


GPU = Sizes(
    device="cuda", dtype="bfloat16", small="qwen3-0.6b", mid="qwen3-4b", big="qwen3-8b", layers=None,
    queries_per_s=400.0, rounds=4, slice_s=8.0, duration=40.0, mid_duration=30.0, big_duration=25.0, warmup=4, floor_requests=60,
    batch=32, prefixes=(0, 512, 2048), suffix=256, repeats=3, mem_tokens=(16384, 65536), margin=40.0,
    dims={"small": 1024, "mid": 2560, "big": 4096},
    need={"fixture:small": 60, "fixture:mid": 150, "fixture:big": 240, "fixture:reranker": 120,
          "arm:small": 85, "arm:mid": 95, "arm:big": 110, "ceiling": 25, "floor": 90, "host": 40,
          "forward:big": 150, "forward:dtypes": 120, "gpu_check": 300, "exactness": 90, "cache": 60,
          "launches": 60, "frontends": 70,
          # the 15-minute plan: fixtures drawn on the GPU and streamed to disk, the arms side by side
          "prelude": 15, "fixture:small:drawn": 20, "fixture:mid:drawn": 35, "fixture:big:drawn": 60,
          "arms:small": 150, "arms:mid": 100, "floor:short": 40, "ceiling:short": 20, "forward:big:drawn": 95,
          "dtypes:short": 45, "launches:short": 30, "frontends:short": 40, "gpu_check:rest": 20, "graphs:short": 20},
)
CPU = Sizes(
    device="cpu", dtype="float32", small="tiny-embedding", mid="tiny-embedding", big="tiny-embedding",
    layers=None, queries_per_s=40.0, rounds=2, slice_s=0.75, duration=1.5, mid_duration=1.5, big_duration=1.0, warmup=1, floor_requests=3,
    batch=4, prefixes=(0, 16), suffix=8, repeats=1, mem_tokens=(256, 512), margin=2.0,
    dims={"small": 64, "mid": 64, "big": 64},
    need={"fixture:small": 5, "fixture:mid": 5, "fixture:big": 5, "fixture:reranker": 5,
          "arm:small": 10, "arm:mid": 10, "arm:big": 10, "ceiling": 4, "floor": 15, "host": 4,
          "forward:big": 10, "forward:dtypes": 10, "gpu_check": 20, "exactness": 10, "cache": 10,
          "launches": 10, "frontends": 40,
          # generous: a step's limit is 2.5x its estimate, and the rehearsal runs on loaded CI boxes
          "prelude": 2, "fixture:small:drawn": 30, "fixture:mid:drawn": 30, "fixture:big:drawn": 30,
          "arms:small": 60, "arms:mid": 45, "floor:short": 30, "ceiling:short": 6, "forward:big:drawn": 30,
          "dtypes:short": 20, "launches:short": 20, "frontends:short": 40, "gpu_check:rest": 5, "graphs:short": 20},
)


def sizes(device: str) -> Sizes:
    return GPU if device.startswith("cuda") else CPU


def server_flags(arm: str, s: Sizes) -> list[str]:
    """The radixserve flags of one arm on this device (model and port are added by the step)."""
    return [*ARMS[arm], "--device", s.device, "--dtype", s.dtype, "--max-batch-tokens", str(MAX_BATCH_TOKENS),
            "--max-concurrent-requests", "4096"]


def queries_for(s: Sizes, duration: float) -> int:
    """Distinct queries enough that the fastest arm never reaches the end of the list (no repeats)."""
    return max(16, int(s.queries_per_s * duration * 1.5))


@dataclass(frozen=True)
class Step:
    name: str  # unique within a phase; names the log
    kind: str  # the function in steps.py
    need: str  # key of Sizes.need
    args: dict = field(default_factory=dict)


# The order arms run in where time may run out: radix alone (off, compact) first, then the
# cache, then paper (its forward-level figure is already measured).
RUN_ORDER = ("off", "compact", "compact+cache", "paper")


def duration(s: Sizes, role: str) -> float:
    return {"small": s.duration, "mid": s.mid_duration, "big": s.big_duration}[role]


def planned_s(phase: str, s: Sizes) -> float:
    """The phase's planned seconds: its steps' estimates plus the prelude (wheels, imports)."""
    return s.need["prelude"] + sum(s.need[step.need] for step in steps(phase, s))


def steps(phase: str, s: Sizes) -> list[Step]:
    """The steps of one phase, in order; the runner skips those that no longer fit."""
    fx = lambda role, kind="embedding": Step(f"fixture-{role}" + ("-rerank" if kind != "embedding" else ""),  # noqa: E731
                                             "fixture", f"fixture:{role}" if kind == "embedding" else "fixture:reranker",
                                             {"role": role, "kind": kind})
    arms = lambda role, names, duration: [  # noqa: E731
        Step(f"arm-{role}-{a}", "arm", f"arm:{role}", {"role": role, "arm": a, "duration": duration}) for a in names]
    drawn = lambda role: Step(f"fixture-{role}", "fixture", f"fixture:{role}:drawn",  # noqa: E731
                              {"role": role, "kind": "embedding", "drawn": True})
    if phase == "first":
        # by value: the server on the GPU end to end (radix off against compact, and the cache),
        # the latency of one short query, the client's ceiling behind those figures, the 8B forward,
        # then one short input through CUDA graphs against eager (in-process, the 0.6B fixture)
        return [drawn("small"),
                Step("arms-small", "arms", "arms:small",
                     {"role": "small", "arms": ["off", "compact", "compact+cache"], "drawn": True}),
                Step("floor-embed", "floor", "floor:short", {"role": "small", "kind": "embedding", "drawn": True}),
                Step("ceiling-small", "ceiling", "ceiling:short", {"role": "small", "duration": s.slice_s}),
                drawn("big"), Step("forward-big", "forward", "forward:big:drawn", {"role": "big", "drawn": True}),
                Step("graphs-small", "graphs", "graphs:short", {"role": "small", "drawn": True})]
    if phase == "second":
        return [drawn("mid"),
                Step("arms-mid", "arms", "arms:mid", {"role": "mid", "arms": ["off", "compact"], "drawn": True}),
                Step("dtypes", "dtypes", "dtypes:short", {"roles": ["mid"], "drawn": True}),
                Step("launches", "launches", "launches:short", {"role": "mid", "drawn": True}),
                Step("frontends", "frontends", "frontends:short"),
                Step("gpu_check", "gpu_check", "gpu_check:rest")]
    if phase == "e2e06":
        return [fx("small"), *arms("small", list(RUN_ORDER), s.duration),
                Step("ceiling-small", "ceiling", "ceiling", {"role": "small", "duration": min(10.0, s.duration)}),
                Step("floor-embed", "floor", "floor", {"role": "small", "kind": "embedding"}),
                Step("host-small", "host", "host", {"role": "small"}),
                fx("small", "reranker"),
                Step("floor-rerank", "floor", "floor", {"role": "small", "kind": "reranker"})]
    if phase == "big8b":
        return [fx("big"), Step("forward-big", "forward", "forward:big", {"role": "big"}),
                *arms("big", ["off", "compact"], s.big_duration),
                Step("ceiling-big", "ceiling", "ceiling", {"role": "big", "duration": min(10.0, s.big_duration)})]
    if phase == "e2e4b":
        return [fx("mid"), *arms("mid", list(RUN_ORDER), s.mid_duration),
                Step("ceiling-mid", "ceiling", "ceiling", {"role": "mid", "duration": min(10.0, s.mid_duration)}),
                fx("small"), Step("dtypes", "dtypes", "forward:dtypes", {"roles": ["small", "mid"]})]
    if phase == "check":
        # the new measurements first; gpu_check (run before, on the first lent GPU) takes what is left
        return [fx("small"), Step("exactness", "exactness", "exactness", {"role": "small"}),
                Step("launches", "launches", "launches", {"role": "small"}),
                Step("cache-speed", "cache", "cache", {"role": "small"}),
                Step("frontends", "frontends", "frontends"),
                Step("gpu_check", "gpu_check", "gpu_check")]
    raise ValueError(f"unknown phase {phase!r}; choose one of {', '.join(PHASES)}")

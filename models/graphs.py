"""CUDA graphs for a lone short input: the model's forward captured once per bucket length.

A one-input request of a few tokens is launch-bound on a GPU: each eager op is a launch from one
thread. A CUDA graph replays a whole forward's launches at once, but only at the shape it was
captured at. Invariant that makes it exact: under causal attention, tokens appended after a
sequence's last real token cannot change any earlier position's hidden state, so one sequence of
n tokens padded at the end to a bucket length L >= n, run through the graph captured at L, gives
the same first n rows as the eager forward of the n tokens; the head (pooling, scores) then runs
eagerly on those n rows with the real batch, so it reads exactly the real positions.

Served by a graph: a batch of one sequence, no prefix trie, no prefix cache, no per-token
answers, whose length falls in a bucket that was chosen (``GraphSet.hidden``). Bucket L serves
the lengths above the previous bucket up to L. Everything else runs eagerly.

Chosen at start-up, on the worker thread (models/warmup.py calls ``capture_all``), per bucket:
capture, then the graph's output is checked against the eager forward of the same padded input
(max abs difference within the dtype's tolerance, relative to the output's scale), then timed
(median of a few runs) against the eager forward of the bucket's shortest length, the cheapest
input it would serve. ``auto`` uses a bucket only where the graph measured faster; ``on`` every
bucket that captured and checked, whatever the timing (both are reported). Fail safe: an exception
in any capture, check or replay logs its reason and leaves every bucket eager for good.
``report`` (a dict filled in place, /info's ``cuda_graphs``) says which buckets use graphs and why
the others do not. The capture and the timer are parameters, so the choice logic runs on a CPU.
"""
from __future__ import annotations

import logging
import statistics
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from models.batch import ForwardBatch, build_forward_batch

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
BUCKETS = (16, 32, 64, 128)  # tokens; bucket L serves lengths (previous bucket, L]
# max |graph - eager| allowed, relative to max(1, max |eager|): the same kernels at the same shape
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}
FASTER = 0.97  # auto: a graph is used when it takes at most this share of the eager time
TIMED_RUNS = 7  # runs per side for the median, after one untimed run each

# capture(step) -> replay: records `step` (which returns the static output) and gives a function
# that replays it and returns that output. timer(fn, runs) -> median milliseconds of fn.
Capture = Callable[[Callable[[], Tensor]], Callable[[], Tensor]]
Timer = Callable[[Callable[[], object], int], float]


def check_mode(mode: str, device: torch.device) -> None:
    """Refuse what cannot be served as asked, before the weights load: one line, the fix in it."""
    if mode not in MODES:
        raise ValueError(f"cuda_graphs must be one of {MODES}, got {mode!r}")
    if mode == "on" and device.type != "cuda":
        raise ValueError(f"--cuda-graphs on needs a CUDA device, and the model runs on {device}: "
                         "give --cuda-graphs auto (off on a CPU, at no cost) or off")


def cuda_capture(step: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """torch.cuda.graph around `step`, after two runs on a side stream (torch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's harmless CUDA call (a copy, a pinned allocation) must not
    # invalidate this thread's capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step()

    def replay() -> Tensor:
        graph.replay()
        return out

    return replay


def cuda_timer(fn: Callable[[], object], runs: int) -> float:
    """Median milliseconds of `fn` on the current stream, by CUDA events, after one untimed run."""
    fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def choose(mode: str, *, diff: float, scale: float, tolerance: float, graph_ms: float,
           eager_ms: float) -> tuple[bool, str]:
    """Whether a captured bucket serves, and why: exact within tolerance, then faster (auto)."""
    allowed = tolerance * max(1.0, scale)
    if not diff <= allowed:  # NaN too
        return False, f"differs from eager by {diff:.3g} (allowed {allowed:.3g})"
    timing = f"graph {graph_ms:.3f} ms, eager {eager_ms:.3f} ms"
    if mode == "on":
        return True, f"on: {timing}"
    if graph_ms <= FASTER * eager_ms:
        return True, f"faster: {timing}"
    return False, f"not faster: {timing}"


def one_sequence(ids: np.ndarray, device: torch.device) -> ForwardBatch:
    """The forward batch of one sequence, no trie, no cache: what a graph bucket is captured at."""
    return build_forward_batch(ids, np.array([0, len(ids)], dtype=np.int64), None, mode="off", device=device)


class GraphSet:
    """The captured buckets of one runner and what was decided about each (see the module docstring).

    ``limit`` and ``replays`` are set once by ``capture_all`` (the worker thread, before serving)
    and cleared only by a failed replay; the prep thread reads ``limit`` through ``fits``."""

    def __init__(self, mode: str, device: torch.device, *, capture: Capture | None = None,
                 timer: Timer | None = None, buckets: tuple[int, ...] = BUCKETS,
                 report: dict | None = None) -> None:
        self.mode, self.device, self.buckets = mode, device, tuple(sorted(buckets))
        self._capture = capture or cuda_capture
        self._timer = timer or cuda_timer
        # an injected capture stands in for CUDA's (tests, on a CPU); otherwise graphs need CUDA
        self.enabled = mode != "off" and (device.type == "cuda" or capture is not None)
        # L -> (the batch captured at L, replay). NOTE: the graph reads every device tensor of that
        # batch (ids, positions, the attention's boundaries) at fixed addresses: holding the batch
        # here keeps them allocated; freed, the allocator would hand their memory to other tensors.
        self.replays: dict[int, tuple[ForwardBatch, Callable[[], Tensor]]] = {}
        self.limit = 0  # the longest input a graph serves (0: none)
        why = ("--cuda-graphs off" if mode == "off" else
               f"the model runs on {device.type}; CUDA graphs capture CUDA launches only")
        self.report = report if report is not None else {}
        self.report.update(mode=mode, buckets={},
                           state="not captured yet (the warm-up captures)" if self.enabled else f"off ({why})")

    def fits(self, num_seqs: int, num_tokens: int, per_token: bool = False) -> bool:
        """Whether a batch of this shape would be served by a graph (the prep thread asks, so such a
        batch skips the prefix cache: a graph serves only batches without one)."""
        return num_seqs == 1 and not per_token and 0 < num_tokens <= self.limit and \
            self._bucket(num_tokens) in self.replays

    def _bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def hidden(self, batch: ForwardBatch) -> Tensor | None:
        """[n, E] hidden states of a one-sequence batch from its bucket's graph; None: run eagerly.

        NOTE: the rows are a view of the graph's static output, valid until the next replay; the
        head reads them on the same stream before any later batch can replay."""
        n = batch.num_tokens
        if not (self.limit and batch.mode == "off" and batch.num_seqs == 1 and batch.cache is None
                and batch.tree is None and batch.num_rows == n and n <= self.limit):
            return None
        bucket = self._bucket(n)
        if bucket not in self.replays:
            return None
        static, replay = self.replays[bucket]
        try:
            static.input_ids[:n].copy_(batch.input_ids)  # rows past n keep earlier ids: causal, they cannot matter
            return replay()[:n]
        except Exception as exc:  # noqa: BLE001 - fail safe: eager for good, the reason logged
            self._give_up(f"a replay failed: {type(exc).__name__}: {exc}")
            return None

    def _give_up(self, why: str) -> None:
        log.warning("CUDA graphs off, every input runs eagerly: %s", why)
        self.replays, self.limit = {}, 0
        self.report["state"] = f"off ({why})"
        self.report["buckets"] = {str(b): "eager (graphs off)" for b in self.buckets}

    def capture_all(self, forward: Callable[[ForwardBatch], Tensor], *, vocab: int, dtype: torch.dtype) -> str:
        """Capture, check and time every bucket (on the serving thread, in inference mode); returns
        the summary line the warm-up logs. forward: batch -> [rows, E] hidden states."""
        if not self.enabled:
            return f"CUDA graphs {self.report['state']}"
        ids = (np.arange(self.buckets[-1], dtype=np.int64) * 7919 + 13) % max(1, vocab)  # [L] any valid ids
        chosen: dict[int, tuple[ForwardBatch, Callable[[], Tensor]]] = {}
        previous = 0
        try:
            with torch.inference_mode():
                for bucket in self.buckets:
                    used, why, replay = self._one(bucket, previous + 1, ids, forward, dtype)
                    self.report["buckets"][str(bucket)] = ("graph" if used else "eager") + f" ({why})"
                    if used:
                        chosen[bucket] = replay
                    previous = bucket
        except Exception as exc:  # noqa: BLE001 - fail safe: eager for good, the reason logged
            self._give_up(f"capture at {bucket} tokens failed: {type(exc).__name__}: {exc}")
            return f"CUDA graphs {self.report['state']}"
        self.replays = chosen
        self.limit = max(chosen, default=0)
        served = ", ".join(str(b) for b in chosen)
        self.report["state"] = (f"on for one input of up to {self.limit} tokens (buckets {served})" if chosen
                                else "off (no bucket measured faster)")
        return f"CUDA graphs {self.report['state']}: " + "; ".join(
            f"{b}: {w}" for b, w in self.report["buckets"].items())

    def _one(self, bucket: int, shortest: int, ids: np.ndarray, forward: Callable[[ForwardBatch], Tensor],
             dtype: torch.dtype) -> tuple[bool, str, Any]:
        static = one_sequence(ids[:bucket], self.device)
        reference = forward(static).float().clone()  # [bucket, E] the eager forward of the same input
        replay = self._capture(lambda: forward(static))
        diff = float((replay().float() - reference).abs().max())
        scale = float(reference.abs().max())
        short = one_sequence(ids[:shortest], self.device)  # the cheapest input this bucket serves

        def graph_run() -> Tensor:
            static.input_ids[:shortest].copy_(short.input_ids)
            return replay()

        graph_ms = self._timer(graph_run, TIMED_RUNS)
        eager_ms = self._timer(lambda: forward(short), TIMED_RUNS)
        used, why = choose(self.mode, diff=diff, scale=scale, tolerance=TOLERANCE.get(dtype, 2e-2),
                           graph_ms=graph_ms, eager_ms=eager_ms)
        return used, why, (static, replay)

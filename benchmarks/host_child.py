"""The server side of the host ceiling (benchmarks/host_ceiling.py): the child process's hook.

``python -m benchmarks.host_ceiling --serve-child ARGS`` runs the real CLI (``server.cli.main``)
with the runner's ``forward`` replaced by one that returns zeros (``zero_forward``), and answers
each "stats" line on its stdin with one line: the process's CPU seconds, each thread's CPU clock
(Python's threads by name, the others as ``native``) and the zero forward's counters. The load
side reads them before and after each measured run; ``group_of`` is how a thread's name maps to
the figure it is reported under.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time

PREFIX = "HOSTCEILING "  # the child's answers on stdout carry it (logs go to stderr)
GROUPS = ("loop", "tokenizer", "prep", "worker", "settle", "native", "other")
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def zero_forward(runner, counts: dict) -> None:
    """Replace ``runner.forward`` by one returning zeros of its output's shape ([B, E] pooled
    embeddings or [B] scores), counting its calls and their CPU time in ``counts``."""
    import torch

    counts.update(forwards=0, worker_forwards=0, worker_forward_cpu_s=0.0)
    width = () if runner.kind == "reranker" else (runner.hidden_size,)

    def forward(batch):
        # NOTE: the CPU clock is read only on the worker (two system calls): a lone batch on the
        # prep thread or the event loop (scheduler/lane.py) pays for no instrument of its own.
        on_worker = threading.current_thread().name == "rs-worker"
        t0 = time.thread_time() if on_worker else 0.0
        out = torch.zeros((batch.num_seqs, *width), dtype=torch.float32, device=runner.device)
        counts["forwards"] += 1
        if on_worker:
            counts["worker_forwards"] += 1
            counts["worker_forward_cpu_s"] += time.thread_time() - t0
        return out

    runner.forward = forward


def group_of(name: str) -> str:
    """The figure a Python thread's CPU time is reported under."""
    if name == "MainThread":
        return "loop"  # uvicorn runs the event loop on the main thread
    if name == "native":
        return "native"
    if name.startswith("radixserve-tok"):
        return "tokenizer"
    return {"rs-prep": "prep", "rs-worker": "worker", "rs-settle": "settle"}.get(name, "other")


def native_cpu_s(tid: int) -> float:
    """utime + stime of one thread of this process, from /proc (clock ticks)."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # fields 14 and 15 of proc(5)


def thread_stats(counts: dict) -> dict:
    """Process CPU seconds, each live thread's CPU seconds ("name:native id" -> s; threads Python
    did not start, such as torch's and the tokenizers' own, as "native:tid") and the zero
    forward's counters."""
    threads = {}
    known = set()
    for t in threading.enumerate():
        try:
            threads[f"{t.name}:{t.native_id}"] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            known.add(t.native_id)
        except (OSError, TypeError):  # ended since enumerate, or not started
            continue
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid not in known:
            try:
                threads[f"native:{tid}"] = native_cpu_s(tid)
            except OSError:  # ended
                continue
    return {"process_cpu_s": time.process_time(), "threads": threads, **counts}


def serve_child(argv: list[str]) -> int:
    """The real CLI with the zero forward; answers each "stats" line on stdin with one JSON line."""
    import server.app
    from server import cli

    counts: dict = {}
    real_load = server.app.load_runner

    def load_runner(config):
        runner = real_load(config)
        zero_forward(runner, counts)
        return runner

    server.app.load_runner = load_runner  # cli.main imports it from server.app at call time

    def answer() -> None:
        for line in sys.stdin:
            if line.strip() == "stats":
                print(PREFIX + json.dumps(thread_stats(counts)), flush=True)

    threading.Thread(target=answer, name="host-ceiling-stats", daemon=True).start()
    return cli.main(argv)

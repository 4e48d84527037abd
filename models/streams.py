"""Overlap on an accelerator: host-to-device copies on a copy stream, outputs back through pinned memory.

``prepare`` (the scheduler's prep thread) builds a batch's device tensors under ``copying(device)``:
on CUDA their copies go on the device's copy stream, and ``copied(device)`` records an event there.
``run`` (the worker) makes its compute stream wait for that event (``await_copies``) and marks
every tensor made on the copy stream as used by the compute stream (``record_stream``), so the
caching allocator never hands their memory to a new copy while the forward may still read it.
``to_host`` starts the copy of the outputs into pinned host memory without waiting, and returns a
``HostCopy`` whose ``result()`` waits for its event (the scheduler calls it on its settling thread;
``Runner.run`` returns one only with ``defer_copies``, else it waits itself: ``settled``).
On a CPU every step is a no-op and ``run`` returns its outputs as they are.

Invariant: the worker thread never blocks on the device: it launches, records and returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: on CUDA through pinned memory, without blocking the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@functools.lru_cache(maxsize=None)
def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The one copy stream of a CUDA device (made on first use)."""
    return torch.cuda.Stream(device=device)


def copying(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a batch's host-to-device copies run in: the copy stream on CUDA, else nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(copy_stream(device))


def copied(device: torch.device) -> torch.cuda.Event | None:
    """An event after everything queued so far on the copy stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(copy_stream(device))
    return event


def device_tensors(obj: Any, depth: int = 5) -> Iterator[torch.Tensor]:
    """The tensors a prepared batch holds: its fields', and those of the dataclasses, tuples and
    lists among them (the forward batch, its attention metadata, its cache I/O, its tree plan and
    that plan's shared calls), ``depth`` levels down."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth <= 0:
        return
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from device_tensors(getattr(obj, f.name), depth - 1)
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from device_tensors(value, depth - 1)


def await_copies(ready: torch.cuda.Event | None, tensors: Iterator[torch.Tensor], device: torch.device) -> None:
    """On ``device``'s compute stream: wait for the copies, and hold the copied tensors' memory for it."""
    if ready is None:
        return
    stream = torch.cuda.current_stream(device)
    stream.wait_event(ready)
    for t in tensors:
        if t.device.type != "cuda":
            continue
        if t.is_sparse:
            t._indices().record_stream(stream)
            t._values().record_stream(stream)
        else:
            t.record_stream(stream)


@dataclasses.dataclass
class HostCopy:
    """Outputs on their way to pinned host memory; ``result()`` waits and returns ``finish(hosts)``."""

    hosts: tuple[torch.Tensor, ...]
    event: torch.cuda.Event
    finish: Callable[..., Any]

    def result(self) -> Any:
        self.event.synchronize()
        return self.finish(*self.hosts)


def settled(out: Any) -> Any:
    """``out`` itself, or what a ``HostCopy`` holds once its copy is done."""
    return out.result() if isinstance(out, HostCopy) else out


def to_host(outputs: tuple[torch.Tensor, ...], finish: Callable[..., Any]) -> Any:
    """``finish(*host float32 copies of outputs)``: now on a CPU, later (a ``HostCopy``) on CUDA."""
    if not outputs or outputs[0].device.type != "cuda":
        return finish(*(o.float().cpu() for o in outputs))
    hosts = []
    for o in outputs:
        host = torch.empty(o.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(o.float(), non_blocking=True)  # float32 on the device, then one async copy
        hosts.append(host)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(outputs[0].device))
    return HostCopy(tuple(hosts), event, finish)

"""The loop lane: when a lone short request runs on the thread that submits it.

A retrieval query arrives alone, at a server that has been idle for a while. At an idle CPU
pipeline its batch would run on the prep thread (scheduler/pipeline.py, ``_lone``): the event
loop wakes the prep thread, which prepares and runs the batch and wakes the loop back. Each
wake-up is a thread switch and a cold cache, about a tenth of a millisecond apiece on the
socket benchmark, while the batch itself (a few tens of tokens of a small model) costs little
more. So a lone short request at an idle pipeline has its batch prepared, run and settled on
the loop itself (``Pipeline.run_here``): no hand-over either way.

What keeps that from hurting anything else:

- The loop is blocked while the batch runs, so only a batch whose expected cost is small takes
  the lane (``Lane.admits``): the moving average of what lone short batches (``LANE_TOKENS``
  tokens or fewer) cost, ``prepare`` and ``run`` in wall time, must be at most ``BUDGET_S``. A
  slow model, a cold start or a busy machine raises it above the budget and the lane closes by
  itself; the batches on the prep thread keep measuring, so it opens again when they are cheap.
- Batching is what pays under load. Only a request that finds no other pending (submitted and
  not yet answered) claims the lane, and the claim only queues a callback behind what the loop
  already has ready (``Scheduler``: ``loop.call_soon``), so requests that arrived with it (read in
  the same pass over the sockets) are submitted first; a submit that finds a claim pushes the
  claimed entries to the queue ahead of its own, and the requests are batched together as
  before, in arrival order.
- The pipeline must be idle: nothing waiting, no batch prepared or running (``Pipeline.run_here``
  checks under the lock the prep thread holds from forming a batch to handing it over or running
  it), so forwards never overlap and ``runner.prepare`` never runs on two threads at once.

A CPU runner only: on an accelerator ``run`` queues the forward and the worker and settling
threads keep the device busy while the host prepares the next batch.
"""
from __future__ import annotations

import math

LANE_TOKENS = 32  # a short query with its instruction (models/lone_choice.py's lone batches)
BUDGET_S = 0.003  # at most this expected cost blocks the event loop
WEIGHT = 0.25  # the moving average's weight of the newest lone batch


class Lane:
    """The lane's cost estimate: one float, read and written under the GIL (a stale read only sends
    one request down the other path)."""

    __slots__ = ("cost_s",)

    def __init__(self) -> None:
        self.cost_s = math.inf  # unknown until a lone short batch has run

    def admits(self, n_tokens: int) -> bool:
        """May a request of ``n_tokens`` run on the loop?"""
        return n_tokens <= LANE_TOKENS and self.cost_s <= BUDGET_S

    def observe(self, n_tokens: int, seconds: float) -> None:
        """A lone batch of ``n_tokens`` took ``seconds`` from the start of ``prepare`` to the end
        of ``run`` (on the prep thread or in the lane)."""
        if n_tokens <= LANE_TOKENS:
            # NOTE: clamped, so that one batch the scheduler held up (a preempted thread) does not
            # close the lane for the next several; costs that stay above the budget still do.
            seconds = min(seconds, 2 * BUDGET_S)
            c = self.cost_s
            self.cost_s = seconds if math.isinf(c) else c + WEIGHT * (seconds - c)

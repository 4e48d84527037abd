"""The memory budget: what requests may hold together, so that no request can exhaust the process.

The limit is the smallest of ``--memory-limit``, the cgroup's (v2 ``memory.max``, v1
``memory.limit_in_bytes``) and the address-space limit (``RLIMIT_AS``, ``ulimit -v``). What the
process already uses when serving starts (the model, the threads, the caches: ``baseline``) and
a headroom (``headroom``: a quarter of what is left, at least 64 MiB, and on a CPU, where the
forward's tensors live in this process, at least one full batch's activations from the model's
widths and ``--max-batch-tokens`` plus the allocator's slack) are kept out; the rest is the
requests' budget. Every request reserves its estimated bytes before any work on it, from its
body alone (``text_token_bound``: a byte-level BPE token covers at least one byte, so the UTF-8
bytes bound the tokens; each input at most the input limit), shrinks the reservation to the exact
estimate once tokenized, before it is queued (``estimate``: its tokens, as the tokenizer's
encodings, id lists and scheduler rows, at the route's measured bytes per token, and its answer's
floats, as arrays and JSON text), and gives them back on every path out:
- an estimate over the whole budget can never fit: 413 naming the limit and what the request
  holds;
- an estimate over what is left now (other requests hold the rest): 429, retry later.
No limit anywhere: no budget (every reservation succeeds). Work before tokenization is bounded
by the payload limit and by tokenizing only what truncation keeps (models/text/prompts.py).
"""
from __future__ import annotations

import contextlib
import os
import resource
import unicodedata

from server.http.errors import ApiError

MIB = 1 << 20
TOKEN_BYTES = 96  # an id in a Python list (object + pointer), its scheduler rows, its share of the batch
# Peak bytes per token of each route's path, from the body's JSON and the tokenizer's encodings to
# the batch's rows and the answer, beyond the headroom (which holds a batch's activations): the
# first large request of each route on a warm server peaked at 133 MB for 158k tokens (/embed),
# 129 MB for 79k (/v1/embeddings),
# 72 MB for 82k (/rerank), 54 MB for 88k (/score, distinct text_1), 76 MB for 80k (/predict
# pairs), tiny fixtures, 2-core EPYC at load ~25; tests/test_memory_costs.py checks each route's
# estimate + MIN_HEADROOM against the process's own peak. Routes: embed (/embed, /v1/embeddings,
# /similarity, ids), embed_all, rerank (one query), score (vLLM /score, any text_1), pairs
# (/predict, /classify, /pooling: texts and pairs).
TOKEN_BYTES_BY_COST = {"embed": 1024, "embed_all": 1024, "rerank": 640, "score": 640, "pairs": 768}
FLOAT_BYTES = 32  # an answer float: the array's 4 bytes and ~25 bytes of JSON text being rendered
MIN_HEADROOM = 64 * MIB
HEADROOM_SHARE = 0.25
# Each thread's malloc arena keeps its own high-water mark (the tokenizer pool's, the worker's, the
# intra-op threads'): the first large request on a thread grows the process by up to 20-36 MB
# beyond what it holds (tiny fixtures, /predict pairs, 2-core EPYC).
ALLOCATOR_SLACK = 48 * MIB
# Floats one token of a forward holds at its peak, per unit of (hidden + intermediate) width: the
# residual, the normed input, q/k/v and the rotary copies, the MLP's fused gate-up, its activation
# and output, oneDNN's reorders; the tiny fixtures' 16384-token forward grew a fresh worker
# arena by ~60 MB, 3.8 KB a token at widths 64 + 128 (5 floats per unit).
ACTIVATION_FLOATS_PER_WIDTH = 6
UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as a huge number near 2**63


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 "max": no limit


def cgroup_limit(root: str = "/sys/fs/cgroup") -> int | None:
    """This process's cgroup memory limit in bytes (v2, then v1), or None."""
    rel = ""
    with contextlib.suppress(OSError):
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            for line in f:
                if line.startswith("0::"):
                    rel = line.strip()[3:].lstrip("/")
    for path in (os.path.join(root, rel, "memory.max"), os.path.join(root, "memory.max"),
                 os.path.join(root, "memory", "memory.limit_in_bytes")):
        value = _read_int(path)
        if value is not None and value < UNLIMITED:
            return value
    return None


def address_space_limit() -> int | None:
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft in (resource.RLIM_INFINITY, -1) else int(soft)


def _status_kib(field: str) -> int:
    with contextlib.suppress(OSError):
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    return 0


def detect_limit(flag: int | None) -> tuple[int | None, str]:
    """(bytes, source): the smallest limit of the flag, the cgroup and RLIMIT_AS; (None, "none")."""
    found = [(v, name) for v, name in ((flag, "--memory-limit"), (cgroup_limit(), "the cgroup memory limit"),
                                       (address_space_limit(), "the address-space limit (ulimit -v)"))
             if v is not None]
    return min(found) if found else (None, "none")


def estimate(*, tokens: int, answer_floats: int, token_bytes: int = TOKEN_BYTES) -> int:
    """Bytes a request holds while it is served: its tokens and its answer's floats."""
    return tokens * token_bytes + answer_floats * FLOAT_BYTES


# NFC (the normalizer of the byte-level BPE tokenizers served) may grow a text: at most 3x in code
# points (Unicode's stability policy), each at most 4 bytes as 1-byte ASCII never grows.
NFC_GROWTH = 3


def text_token_bound(text: str) -> int:
    """At most how many tokens a byte-level BPE encodes ``text`` into, without tokenizing it.

    Every token of a byte-level BPE covers at least one byte of the normalized UTF-8 text (an
    added token covers several), so the bytes bound the tokens. ASCII (``str.isascii`` is O(1) on
    CPython's compact strings) and NFC-normalized text is its own normal form; any other may grow
    under NFC, by at most ``NFC_GROWTH`` times.
    """
    if text.isascii():
        return len(text)
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if unicodedata.is_normalized("NFC", text) else NFC_GROWTH * size


def activation_bytes(*, tokens: int, hidden: int, intermediate: int, dtype_bytes: int) -> int:
    """Bytes a forward of ``tokens`` tokens holds at its peak in host memory (a CPU forward)."""
    return tokens * dtype_bytes * ACTIVATION_FLOATS_PER_WIDTH * (hidden + intermediate)


def headroom(left: int, *, activations: int = 0) -> int:
    """What the budget keeps out of ``left``: a quarter of it, at least 64 MiB, and at least one
    batch's host ``activations`` with the allocator's slack when the forward runs on the host."""
    floor = max(MIN_HEADROOM, activations + ALLOCATOR_SLACK) if activations else MIN_HEADROOM
    return max(floor, int(left * HEADROOM_SHARE))


class MemoryBudget:
    """Bytes the requests in flight may hold together (event-loop confined: no lock needed)."""

    def __init__(self, limit: int | None, *, source: str = "--memory-limit", baseline: int = 0,
                 activations: int = 0) -> None:
        self.limit, self.source, self.in_use = limit, source, 0
        self.total: int | None = None
        if limit is not None:
            left = max(0, limit - baseline)
            self.total = max(0, left - headroom(left, activations=activations))

    @classmethod
    def detect(cls, flag: int | None, *, activations: int = 0) -> "MemoryBudget":
        """The budget of this process, its baseline measured now (VmSize against an address-space
        limit, which counts reservations; resident memory against the others); ``activations``:
        one batch's host activations (0 where the forward runs on a device)."""
        limit, source = detect_limit(flag)
        if limit is None:
            return cls(None, source=source)
        baseline = _status_kib("VmSize" if source.startswith("the address") else "VmRSS")
        return cls(limit, source=source, baseline=baseline, activations=activations)

    def reserved(self, nbytes: int, *, what: str) -> "Held":
        """Hold ``nbytes`` for the ``with`` block: 413 when it can never fit, 429 when it does not
        fit now. The block may ``shrink`` what it holds (an estimate made exact once the tokens are
        known). A plain context manager rather than a generator's: every request takes one."""
        total = self.total
        if total is not None:
            if nbytes > total:
                raise ApiError(
                    "too_large",
                    f"this request ({what}) needs about {nbytes / MIB:.0f} MiB while served, more than the "
                    f"{total / MIB:.0f} MiB that requests may hold under {self.source} of "
                    f"{(self.limit or 0) / MIB:.0f} MiB; send fewer or shorter inputs",
                )
            if self.in_use + nbytes > total:
                raise ApiError(
                    "overloaded",
                    f"not enough memory left for this request now ({nbytes / MIB:.0f} MiB; requests in flight "
                    f"hold {self.in_use / MIB:.0f} of {total / MIB:.0f} MiB under {self.source}); retry later",
                )
        return Held(self, nbytes)


class Held:
    """The bytes one request holds in a MemoryBudget, from entering the ``with`` block to leaving it."""

    __slots__ = ("budget", "nbytes")

    def __init__(self, budget: MemoryBudget, nbytes: int) -> None:
        self.budget, self.nbytes = budget, nbytes

    def __enter__(self) -> "Held":
        self.budget.in_use += self.nbytes
        return self

    def __exit__(self, *exc: object) -> None:
        self.budget.in_use -= self.nbytes

    def shrink(self, nbytes: int) -> None:
        """Hold ``nbytes`` instead, when that is less: the rest is free for other requests."""
        if nbytes < self.nbytes:
            self.budget.in_use -= self.nbytes - nbytes
            self.nbytes = nbytes

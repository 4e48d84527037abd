"""The optional packages a load-test command needs, checked before it starts any server or
sends any request.

Invariant: a command that would fail late for a missing package (a compare run that loads every
server, then cannot draw its PNG) fails first instead, with exit 2 and a message naming each
package, what it is for and how to install it; nothing has been started, sent or written.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from loadtest.compare import BASELINE

EXTRA = 'pip install -e ".[loadtest]"'  # the project's `loadtest` extra: matplotlib, pyarrow, transformers


@dataclass(frozen=True)
class Need:
    module: str
    purpose: str
    install: str


def needs(a) -> list[Need]:
    """What the parsed arguments `a` of one command will import beyond the core install."""
    out = []
    if a.cmd in ("run", "compare") and a.out and not a.no_plot:
        out.append(Need("matplotlib", f"the plot {a.out}/report.png (--out); --no-plot skips it", EXTRA))
    path = getattr(a, "dataset_path", None)
    if getattr(a, "source", None) in ("auto", "file") and path and str(path).lower().endswith(".parquet"):
        out.append(Need("pyarrow", f"reading {path}", EXTRA))
    if a.cmd == "compare" and (a.baseline or any(_starts_baseline(s) for s in a.server)):
        out.append(Need("transformers", "the transformers peer (@baseline)", EXTRA))
    if getattr(a, "source", None) == "hf":
        out.append(Need("datasets", "--source hf (MS MARCO from the hub)", "pip install datasets"))
    return out


def _starts_baseline(spec: str) -> bool:
    """`NAME[@PORTS]:@baseline [FLAGS]` (compare.parse_server's peer spec)."""
    return spec.partition(":")[2].split()[:1] == [BASELINE]


def missing(a) -> list[Need]:
    """The needs of `a` whose module does not import here."""
    gone = []
    for need in needs(a):
        try:
            importlib.import_module(need.module)
        except ImportError:
            gone.append(need)
    return gone


def message(gone: list[Need]) -> str:
    """One line per missing package, then the install line(s); nothing has run yet."""
    lines = [f"error: {n.module} is not installed; it is needed for {n.purpose}" for n in gone]
    lines += [f"install it with: {cmd}" for cmd in dict.fromkeys(n.install for n in gone)]
    lines.append("nothing was started or sent")
    return "\n".join(lines)

"""PNG of one or more runs: latency CDF per run (left) and items/s bars (right).

The figure title always names the data source (`datasets.describe`), also under a caller's title,
so a plot of synthetic data can never pass for one of MS MARCO.

Uses matplotlib's Agg backend (no display); imported lazily so the client works without it.
"""
from __future__ import annotations

from pathlib import Path

from loadtest.datasets import describe


def figure_title(summaries: list[dict], title: str | None = None) -> str:
    """`TITLE — SOURCE` (TITLE defaults to the workload); the source is left out only when the
    title already spells it."""
    sources = list(dict.fromkeys(str(s["source"]) for s in summaries if s.get("source")))
    src = " + ".join(describe(x) for x in sources) or "source unknown"
    head = title or " / ".join(dict.fromkeys(str(s["workload"]) for s in summaries if s.get("workload")))
    if not head:
        return src
    return head if src in head else f"{head} — {src}"


def plot(summaries: list[dict], path: str | Path, *, title: str | None = None) -> Path:
    """Draw `summaries` (report.summarize dicts) into `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_cdf, ax_bar) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in summaries:
        xs = sorted(s.get("latencies_ms") or [])
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]  # [n] empirical CDF
        ax_cdf.step(xs, ys, where="post", label=s["name"])
    ax_cdf.set_xlabel("request latency (ms)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_ylim(0, 1.02)
    ax_cdf.grid(alpha=0.3)
    ax_cdf.set_title("latency CDF")
    if any(s.get("latencies_ms") for s in summaries):
        ax_cdf.legend(fontsize=8)

    names = [s["name"] for s in summaries]
    rates = [s.get("items_per_s") or 0.0 for s in summaries]
    bars = ax_bar.bar(range(len(names)), rates, color=[f"C{i}" for i in range(len(names))])
    ax_bar.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax_bar.set_ylabel("items / s")
    ax_bar.set_title("throughput")
    ax_bar.grid(axis="y", alpha=0.3)
    ax_bar.margins(y=0.18)  # room for the labels above the bars
    for b, s in zip(bars, summaries):
        ratio = (s.get("server") or {}).get("mean_compression_ratio")
        label = f"{b.get_height():.1f}" + (f"\nN'/N {ratio:.2f}" if ratio is not None else "")
        ax_bar.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
    fig.suptitle(figure_title(summaries, title))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

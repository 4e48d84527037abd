"""A phase's three files: PHASE.md (the table, printed last), PHASE.json (everything) and
PHASE-logs.tar.gz (every step's log, server logs, gpu_check's report); nothing else lands in
--out, so four phases fit the device tool's eight returned files with room to spare.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

from benchmarks.gpu_campaign import plan

PAPER = {  # the paper's figures beside ours (end to end: MS MARCO reranking; forward: 2048/256)
    ("e2e", "small"): "1.44x", ("e2e", "mid"): "1.56x", ("e2e", "big"): "1.59x",
    ("forward", "small"): "2.74x", ("forward", "mid"): "4.14x", ("forward", "big"): "4.98x",
}
MAX_TAR_BYTES = 15 << 20  # under the tool's 16 MiB per file


def _f(v, fmt="{:.1f}", na="-") -> str:
    return na if v is None else fmt.format(v)


def arm_results(records: list[dict]) -> list[dict]:
    """Every arm's summary: one per `arm` step (one after another), or each arm of an `arms` step
    (side by side, taking turns)."""
    out = []
    for r in records:
        if r["status"] != "ok" or not r["result"]:
            continue
        if r["kind"] == "arm":
            out.append(r["result"])
        elif r["kind"] == "arms":
            out += r["result"]["arms"]
    return out


def _arms_table(records: list[dict], role: str) -> list[str]:
    arms = [{"result": x} for x in arm_results(records)]
    if not arms:
        return []
    base = next((r["result"]["items_per_s"] for r in arms if r["result"]["name"] == "off"), None)
    md = [f"| arm ({role}) | cache state | items/s | vs off | mean ms | p50 ms | N'/N | GPU busy | client CPU | "
          "sent/distinct | errors |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in arms:
        x = r["result"]
        ratio = x["items_per_s"] / base if base and x["items_per_s"] else None
        md.append(f"| {x['name']} | {x.get('cache', '-')} | {_f(x['items_per_s'])} | {_f(ratio, '{:.2f}x')} | "
                  f"{_f(x['latency_ms']['mean'])} | {_f(x['latency_ms']['p50'])} | "
                  f"{_f(x['server']['token_compression_ratio'], '{:.3f}')} | {_f(x.get('gpu_busy'), '{:.0%}', 'n/a')} | "
                  f"{_f(x.get('client_cpu_share'), '{:.2f}')} | {x['requests_sent']}/{x['distinct_requests']} | "
                  f"{x['error_count']} |")
    side = next((r["result"] for r in records if r["kind"] == "arms" and r["status"] == "ok" and r["result"]), None)
    if side:
        md.append(f"\nArms side by side: every server up at once, {side['rounds']} rounds of {side['slice_s']:g} s "
                  "of load per arm, taking turns.")
    md.append(f"\nPaper, end to end at this size: {PAPER.get(('e2e', role), '-')} (radix on vs off).")
    return md


def headroom_line(records: list[dict]) -> tuple[list[str], dict | None]:
    from loadtest.responder import CLEAN_HEADROOM, headroom

    ceil = next((r["result"] for r in records if r["kind"] == "ceiling" and r["status"] == "ok"), None)
    rates = [x["items_per_s"] for x in arm_results(records) if x["items_per_s"]]
    if ceil is None or not rates:
        return [], None
    h = headroom(max(rates), ceil["items_per_s"])
    verdict = "ok" if h["clean"] else f"CLIENT-BOUND (under {CLEAN_HEADROOM:g}x)"
    return [f"\nLoad client ceiling (zero-cost responder, same requests, concurrency {plan.CONCURRENCY}): "
            f"{_f(ceil['items_per_s'])} items/s at client CPU {_f(ceil.get('client_cpu_share'), '{:.2f}')}; "
            f"fastest arm {_f(max(rates))} items/s; headroom {_f(h['headroom'], '{:.1f}x')}: {verdict}."], h


def _other_tables(records: list[dict]) -> list[str]:
    md: list[str] = []
    for r in records:
        x, k = r["result"], r["kind"]
        if r["status"] != "ok" or not x:
            continue
        if k == "floor":
            md.append(f"- latency floor, {x['name']} (concurrency 1, {x['requests_ok']} requests): "
                      f"p50 {_f(x['latency_ms']['p50'])} ms, mean {_f(x['latency_ms']['mean'])} ms")
        elif k == "host":
            md.append(f"- host ceiling: the tokenizer on {x['threads']} threads, {_f(x['items_per_s'], '{:.0f}')} "
                      f"items/s ({_f(x['tokens_per_s'], '{:.0f}')} tokens/s)")
        elif k in ("forward", "dtypes"):
            if k == "forward":
                md.append(f"- load time {_f(x['load_s'])} s, attention {x['attention_backend']}")
            md += ["", "| model | dtype | P | mode | N | N' | ms | speedup |", "|---|---|---|---|---|---|---|---|"]
            md += [f"| {row.get('role', 'big')} | {row.get('dtype', '-')} | {row['prefix']} | {row['mode']} | "
                   f"{row['tokens']} | {row['compact_tokens']} | {_f(row['median_ms'])} | {_f(row['speedup'], '{:.2f}x')} |"
                   for row in x["rows"]]
            for m in x.get("memory", []):
                md.append(f"- peak memory at {m['tokens']} tokens per batch: " + ", ".join(
                    f"{mode} {_f(None if m[mode] is None else m[mode] / 2**30, '{:.2f} GiB', 'n/a')}"
                    for mode in ("off", "paper", "compact")))
        elif k == "graphs":
            md += ["", f"One input, CUDA graphs against eager, {x['requests']} requests each, taking turns "
                   f"(prepare + run + copy to the host; {x['cuda_graphs'].get('state', '-')}):", "",
                   "| tokens | by graph | graph p50 ms | graph p99 ms | eager p50 ms | eager p99 ms | eager / graph |",
                   "|---|---|---|---|---|---|---|"]
            md += [f"| {row['tokens']} | {row['served_by_graph']} | {row['graph_p50_ms']:.3f} | {row['graph_p99_ms']:.3f} | "
                   f"{row['eager_p50_ms']:.3f} | {row['eager_p99_ms']:.3f} | {row['eager_over_graph']:.2f}x |"
                   for row in x["rows"]]
            md += [f"- bucket {b}: {why}" for b, why in x["cuda_graphs"].get("buckets", {}).items()]
        elif k == "exactness":
            md += ["", "| dtype | mode | rel err vs transformers fp32 | transformers' own | ok |", "|---|---|---|---|---|"]
            md += [f"| {row['dtype']} | {row['mode']} | {row['rel_err']:.2e} | {row['transformers_rel_err']:.2e} | "
                   f"{row['ok']} |" for row in x["rows"]]
        elif k == "frontends":
            md += ["", f"Host path with the forward taken out, {x['cores']} cores (`benchmarks.host_ceiling`):", "",
                   "| load | processes | items/s | tokens/s | CPU-s / 1M, all processes |", "|---|---|---|---|---|"]
            md += [f"| {row['load']} | {'1' if row['api_server_count'] == 1 else 'engine + ' + str(row['api_server_count'])} | "
                   f"{_f(row['items_per_s'])} | {_f(row['tokens_per_s'], '{:.0f}')} | "
                   f"{_f(row['all_cpu_s_per_1m_tokens'], '{:.2f}')} |" for row in x["rows"]]
        elif k == "launches":
            md += ["", "| shape | mode | tokens | unit | per layer | outside layers | forward | commonest in a layer |",
                   "|---|---|---|---|---|---|---|---|"]
            md += [f"| {row['shape']} | {row['mode']} | {row['tokens']} | {row['unit']} | {row['per_layer']} | "
                   f"{row['outside']} | {row['total']} | " + ", ".join(f"{n} x{c}" for n, c in row["layer0"]) + " |"
                   for row in x["rows"]]
        elif k == "cache":
            md += ["", "| workload | config | rows/batch | p50 ms | tokens/s |", "|---|---|---|---|---|"]
            md += [f"| {row['workload']} | {row['config']} | {row['rows']:.0f} | {row['p50_ms']:.1f} | "
                   f"{row['tokens_per_s']:.0f} |" for row in x["rows"]]
        if isinstance(x, dict) and x.get("skipped"):
            md.append(f"- {r['step']} skipped inside: " + "; ".join(x["skipped"]))
        if k == "gpu_check":
            md.append(f"- gpu_check: {x['verdicts']}; tests: {x['tests']}; serving: {x['serving']}")
            md += [f"  - {f}" for f in x["failures"][:10]]
    return md


def markdown(phase: str, env: dict, records: list[dict], total_s: float, deadline_s: float) -> str:
    role = next((r["step"].split("-")[1] for r in records if r["kind"] in ("arm", "arms")), "")
    md = [f"# radixserve GPU campaign: {phase}", "",
          "env: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
    md += _arms_table(records, role)
    md += headroom_line(records)[0]
    md += [""] + _other_tables(records)
    md += ["", f"## steps ({total_s:.0f} s of a {deadline_s:.0f} s deadline)", "",
           "| step | status | seconds | note |", "|---|---|---|---|"]
    md += [f"| {r['step']} | {r['status']} | {r['seconds']} | {r.get('why', '')} |" for r in records]
    return "\n".join(md) + "\n"


def write(out: Path, phase: str, doc: dict, md: str, logs: Path) -> list[Path]:
    """PHASE.md, PHASE.json and PHASE-logs.tar.gz (logs cut to fit MAX_TAR_BYTES)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{phase}.md", out / f"{phase}.json", out / f"{phase}-logs.tar.gz"]
    paths[0].write_text(md)
    paths[1].write_text(json.dumps(doc, indent=1, default=str))
    with tarfile.open(paths[2], "w:gz") as tar:
        total = 0
        for p in sorted(logs.rglob("*")):
            if p.is_file():
                total += p.stat().st_size
                if total > MAX_TAR_BYTES * 3:  # compressed text is at least 3x smaller
                    break
                tar.add(p, arcname=str(p.relative_to(logs.parent)))
    return paths

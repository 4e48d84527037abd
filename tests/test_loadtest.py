"""Load-test tool, offline parts: data sources, workloads, percentiles/reports, metrics parsing, plots."""
from __future__ import annotations

import json
import statistics
from collections import Counter

import numpy as np
import pytest

from loadtest import cli, compare, datasets, report, scrape, workloads
from loadtest.client import RunResult

RECORDS = [
    {"query": "what is a lobster roll",
     "passages": {"is_selected": [0, 1], "passage_text": ["Lobster rolls are sandwiches.", "A roll with lobster."],
                  "url": ["a", "b"]}},
    {"query": "how long to boil eggs",
     "passages": {"is_selected": [1], "passage_text": ["Ten minutes."], "url": ["c"]}},
    {"query": "no passages here", "passages": {"is_selected": [], "passage_text": [], "url": []}},
]


# ---------------------------------------------------------------- datasets


def test_jsonl_file_in_msmarco_schema(tmp_path):
    path = tmp_path / "ms.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    ds = datasets.load("file", path=str(path))
    assert ds.source == "file:ms.jsonl" and not ds.synthetic
    # The record without passages is dropped; order and text preserved.
    assert [s.query for s in ds.samples] == [RECORDS[0]["query"], RECORDS[1]["query"]]
    assert ds.samples[0].passages == tuple(RECORDS[0]["passages"]["passage_text"])
    assert len(datasets.load_file(path, limit=1).samples) == 1
    # `auto` with a path reads the file rather than going to the hub.
    assert datasets.load("auto", path=str(path)).samples == ds.samples


def test_parquet_file_in_msmarco_schema(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "ms.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), path)
    ds = datasets.load_file(path)
    assert [s.passages for s in ds.samples] == [tuple(r["passages"]["passage_text"]) for r in RECORDS[:2]]


def test_original_json_release_and_bad_schema(tmp_path):
    rec = {"query": "q", "passages": [{"passage_text": "p1", "is_selected": 0}, {"passage_text": "p2"}]}
    assert datasets.sample_from_record(rec).passages == ("p1", "p2")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(datasets.DatasetError, match="query"):
        datasets.load_file(bad)
    with pytest.raises(datasets.DatasetError, match="not found"):
        datasets.load("file", path=str(tmp_path / "missing.jsonl"))


def test_hub_source_fails_clearly_and_auto_falls_back(monkeypatch):
    def offline(**kw):
        raise datasets.DatasetError("no network")

    monkeypatch.setattr(datasets, "load_hf", offline)
    with pytest.raises(datasets.DatasetError):
        datasets.load("hf")
    warnings = []
    ds = datasets.load("auto", limit=5, seed=3, warn=warnings.append)
    assert ds.synthetic and len(ds.samples) == 5 and warnings


def test_synthetic_deterministic_and_seeded():
    a, b, c = datasets.synthetic(30, seed=7), datasets.synthetic(30, seed=7), datasets.synthetic(30, seed=8)
    assert a == b
    assert a.samples != c.samples
    assert a.source == "synthetic(seed=7)" and a.synthetic


def test_synthetic_shape_statistics():
    ds = datasets.synthetic(300, seed=1)
    n_pass = [len(s.passages) for s in ds.samples]
    q_words = [len(s.query.split()) for s in ds.samples]
    p_words = [len(p.split()) for s in ds.samples for p in s.passages]
    assert min(n_pass) >= 8 and max(n_pass) <= 10 and 8.5 < statistics.mean(n_pass) < 9.5
    assert 3 <= statistics.mean(q_words) <= 8 and max(q_words) <= 10
    assert 30 <= min(p_words) and max(p_words) <= 80 and 45 < statistics.mean(p_words) < 65
    # Zipf-like: the most frequent word is much more frequent than the median one.
    counts = Counter(w.lower().strip(".") for s in ds.samples for p in s.passages for w in p.split())
    freqs = sorted(counts.values(), reverse=True)
    assert freqs[0] > 20 * freqs[len(freqs) // 2]
    assert len(counts) > 300  # a realistic vocabulary, not a handful of words


def test_dataset_roundtrip_through_jsonl_and_cli(tmp_path):
    out = tmp_path / "syn.jsonl"
    assert cli.main(["dataset", "--source", "synthetic", "--queries", "12", "--seed", "4", "--out", str(out)]) == 0
    back = datasets.load_file(out)
    assert back.samples == datasets.synthetic(12, seed=4).samples


# ---------------------------------------------------------------- workloads


def _tiny() -> datasets.Dataset:
    return datasets.Dataset("synthetic(seed=0)", (
        datasets.Sample("q one", ("d1", "d2", "d3")),
        datasets.Sample("q two", ("d4", "d5")),
    ))


def test_template_text_matches_reranker_layout():
    text = workloads.render_pair("what is x", "x is y", instruction="INS")
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert text == prefix + "<Instruct>: INS\n<Query>: what is x\n<Document>: x is y" + suffix


def test_template_agrees_with_models_prompts():
    prompts = pytest.importorskip("models.text.prompts")
    assert workloads.RERANK_PREFIX == prompts.RERANK_PREFIX
    assert workloads.RERANK_SUFFIX == prompts.RERANK_SUFFIX
    assert workloads.DEFAULT_INSTRUCTION == prompts.DEFAULT_INSTRUCTION
    assert workloads.render_pair("q", "d") == (
        prompts.RERANK_PREFIX + prompts.format_rerank_body(prompts.DEFAULT_INSTRUCTION, "q", "d") + prompts.RERANK_SUFFIX
    )


def test_workload_requests():
    ds = _tiny()
    rr = workloads.build_requests(ds, "rerank")
    assert [(r.route, r.body, r.items) for r in rr] == [
        ("/rerank", {"query": "q one", "texts": ["d1", "d2", "d3"]}, 3),
        ("/rerank", {"query": "q two", "texts": ["d4", "d5"]}, 2),
    ]
    et = workloads.build_requests(ds, "embed-template", batch_size=4)
    assert [r.items for r in et] == [4, 1] and all(r.route == "/v1/embeddings" for r in et)
    assert et[0].body["input"][3] == workloads.render_pair("q two", "d4")
    fl = workloads.build_requests(ds, "flipped", batch_size=64)
    assert fl[0].body["input"][0] == workloads.render_pair("d1", "q one")
    # flipped shares only the template head: the text before <Query> is identical across pairs.
    heads = {t.split("<Query>")[0] for t in fl[0].body["input"]}
    assert len(heads) == 1
    em = workloads.build_requests(ds, "embed", batch_size=2, model="m")
    assert [r.body for r in em] == [{"input": ["d1", "d2"], "model": "m"}, {"input": ["d3", "d4"], "model": "m"},
                                    {"input": ["d5"], "model": "m"}]
    with pytest.raises(ValueError):
        workloads.build_requests(ds, "nope")


# ---------------------------------------------------------------- percentiles and reports


def test_percentile_hand_computed():
    xs = [15, 20, 35, 40, 50]
    # h = 4 * p / 100: p40 -> h=1.6 -> 20 + 0.6*15 = 29; p90 -> h=3.6 -> 40 + 0.6*10 = 46
    assert report.percentile(xs, 40) == pytest.approx(29.0)
    assert report.percentile(xs, 90) == pytest.approx(46.0)
    assert report.percentile(xs, 50) == 35
    assert report.percentile(xs, 0) == 15 and report.percentile(xs, 100) == 50
    assert report.percentile([3, 1, 2, 4], 50) == pytest.approx(2.5)  # unsorted input; h = 1.5
    assert report.percentile([7.0], 99) == 7.0
    assert np.isnan(report.percentile([], 50))
    rng = np.random.default_rng(0)
    sample = rng.exponential(size=101).tolist()
    for p in (1, 37.5, 50, 90, 99):
        assert report.percentile(sample, p) == pytest.approx(float(np.percentile(sample, p)))


def _result(lat, *, items_ok, wall, errors=None, metrics=None) -> RunResult:
    r = RunResult(latencies_s=list(lat), items_ok=items_ok, wall_s=wall, sent=len(lat) + sum((errors or {}).values()))
    r.errors.update(errors or {})
    if metrics is not None:
        r.metrics = metrics
    return r


def test_summary_math():
    lat = [0.010, 0.020, 0.030, 0.040]
    m = scrape.delta(scrape.Snapshot(1.0, 2, 100, 80), scrape.Snapshot(2.2, 5, 1100, 580))
    s = report.summarize(_result(lat, items_ok=40, wall=2.0, errors={"429": 1, "connection": 2}, metrics=m),
                         name="x", meta={"workload": "rerank", "source": "synthetic(seed=0)"})
    assert s["requests_ok"] == 4 and s["requests_sent"] == 7 and s["error_count"] == 3
    assert s["errors"] == {"429": 1, "connection": 2}
    assert s["latency_ms"]["p50"] == pytest.approx(25.0)  # h = 1.5
    assert s["latency_ms"]["p90"] == pytest.approx(37.0)  # h = 2.7 -> 30 + 0.7*10
    assert s["latency_ms"]["mean"] == pytest.approx(25.0)
    assert s["requests_per_s"] == pytest.approx(2.0) and s["items_per_s"] == pytest.approx(20.0)
    assert s["tokens_per_s"] == pytest.approx(500.0)  # (1100 - 100) / 2
    assert s["server"]["mean_compression_ratio"] == pytest.approx(1.2 / 3)
    assert s["server"]["token_compression_ratio"] == pytest.approx(500 / 1000)
    md = report.markdown([s])
    assert "| x | 4 | 429: 1, connection: 2 |" in md and "synthetic" in md


def test_speedups_and_written_reports(tmp_path):
    a = report.summarize(_result([0.1, 0.2, 0.3], items_ok=30, wall=3.0), name="off")
    b = report.summarize(_result([0.05, 0.1, 0.15], items_ok=30, wall=1.5), name="compact")
    sp = report.speedups([a, b])
    assert sp[0] == {"name": "off", "throughput": 1.0, "p50": 1.0, "p99": 1.0}
    assert sp[1]["throughput"] == pytest.approx(2.0) and sp[1]["p50"] == pytest.approx(2.0)
    assert sp[1]["p99"] == pytest.approx(report.percentile([0.1, 0.2, 0.3], 99) / report.percentile([0.05, 0.1, 0.15], 99))
    paths = report.write([a, b], tmp_path, title="t")
    doc = json.loads(paths["json"].read_text())
    assert [r["name"] for r in doc["runs"]] == ["off", "compact"] and doc["speedups"][1]["throughput"] == pytest.approx(2.0)
    assert "2.00x" in paths["md"].read_text()


def test_plot_png(tmp_path):
    from loadtest import plot

    a = report.summarize(_result([0.1, 0.2, 0.3], items_ok=30, wall=3.0), name="off")
    b = report.summarize(_result([], items_ok=0, wall=1.0, errors={"500": 3}), name="broken")
    path = plot.plot([a, b], tmp_path / "r.png")
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- metrics parsing


PROM = """# HELP te_radix_mlp_compression_ratio Compact/original tokens (N'/N) per batch
# TYPE te_radix_mlp_compression_ratio histogram
te_radix_mlp_compression_ratio_bucket{le="0.05"} 0.0
te_radix_mlp_compression_ratio_bucket{le="0.5"} 2.0
te_radix_mlp_compression_ratio_bucket{le="+Inf"} 3.0
te_radix_mlp_compression_ratio_count 3.0
te_radix_mlp_compression_ratio_sum 1.25
# HELP radixserve_tokens_total Tokens per kind
# TYPE radixserve_tokens_total counter
radixserve_tokens_total{kind="original"} 4096.0
radixserve_tokens_total{kind="compact"} 1024.0
# HELP te_request_count_total Requests received
# TYPE te_request_count_total counter
te_request_count_total{method="rerank"} 12.0
"""


def test_prometheus_parse_and_delta():
    snap = scrape.parse(PROM)
    assert snap == scrape.Snapshot(ratio_sum=1.25, ratio_count=3.0, tokens_original=4096.0, tokens_compact=1024.0)
    later = scrape.parse(PROM.replace("_count 3.0", "_count 7.0").replace("_sum 1.25", "_sum 3.25")
                         .replace("4096.0", "6096.0").replace("1024.0", "1524.0"))
    d = scrape.delta(snap, later)
    assert d.batches == 4 and d.mean_ratio == pytest.approx(2.0 / 4)
    assert d.tokens_original == 2000 and d.tokens_compact == 500 and d.token_ratio == pytest.approx(0.25)
    assert scrape.parse("# nothing\n") == scrape.Snapshot()
    assert scrape.delta(None, snap).mean_ratio is None


def test_prometheus_from_scheduler_metrics_registry():
    """The series names the scheduler really registers parse the same way."""
    sm = pytest.importorskip("scheduler.metrics")
    from prometheus_client import generate_latest

    m = sm.Metrics()
    for r in (0.5, 0.25):
        m.compression_ratio.observe(r)
    m.tokens_total.labels(kind="original").inc(100)
    m.tokens_total.labels(kind="compact").inc(60)
    snap = scrape.parse(generate_latest(m.registry).decode())
    assert snap.ratio_count == 2 and snap.ratio_sum == pytest.approx(0.75)
    assert snap.tokens_original == 100 and snap.tokens_compact == 60
    assert snap.cache_hit == 0 and snap.cache_miss == 0  # the series exist, zeros without a cache


def test_prefix_cache_tokens_from_the_real_series():
    import numpy as np
    import torch
    from prometheus_client import generate_latest

    from models.prefix_cache import PrefixCache
    from scheduler.metrics import Metrics

    cache = PrefixCache(layers=1, kv_heads=1, head_dim=2, capacity=64, dtype=torch.float32, device="cpu")
    m = Metrics()
    m.watch_prefix_cache(cache)
    before = scrape.parse(generate_latest(m.registry).decode())
    assert (before.cache_hit, before.cache_miss) == (0, 0)
    for hits, misses in ((0, 20), (19, 1)):  # what the batch builder records on a lease
        lease = cache.plan(np.arange(20, dtype=np.int32), np.asarray([0, 20]))
        lease.hits, lease.misses = hits, misses
        cache.commit(lease)
    d = scrape.delta(before, scrape.parse(generate_latest(m.registry).decode()))
    assert (d.cache_hit, d.cache_miss) == (19, 21) == (cache.hits, cache.misses)


# ---------------------------------------------------------------- compare targets


def test_target_specs():
    t = compare.parse_server("compact: --radix-mlp-threshold 1 --radix-attention compact")
    assert t.name == "compact" and t.flags == ("--radix-mlp-threshold", "1", "--radix-attention", "compact")
    assert not t.baseline and t.managed
    b = compare.parse_server("peer:@baseline --batch-wait-ms 2")
    assert b.baseline and b.flags == ("--batch-wait-ms", "2")
    argv = compare.server_command(b, model_id="/m", port=1234)
    assert argv[1:3] == ["-m", "loadtest.baseline"] and argv[3:] == [
        "--model-id", "/m", "--hostname", "127.0.0.1", "--port", "1234", "--batch-wait-ms", "2"]
    u = compare.parse_target("a=http://127.0.0.1:9/")
    assert u.url == "http://127.0.0.1:9" and not u.managed
    for bad in ("nourl", "x=ftp://h"):
        with pytest.raises(ValueError):
            compare.parse_target(bad)
    with pytest.raises(ValueError, match="port"):
        compare.parse_server("x: --port 9")

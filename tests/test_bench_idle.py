"""benchmarks/bench_idle.py runs and its table is what it says: every gap of each unit measured
as often as asked, in blocks, and each p50 over the first gap's (times are never asserted)."""
from __future__ import annotations

import pytest

from benchmarks import bench_idle


def _rows(out: str) -> list[str]:
    """The table's data rows, under the machine line (loadtest/machine.py) and a blank line."""
    lines = out.splitlines()
    assert lines[0].startswith("machine: ") and lines[1] == "" and lines[2].startswith("| unit |")
    return lines[4:]


def test_each_gap_gets_its_units_and_the_first_is_the_reference(capsys, tiny_embedding_dir):
    calls: list[int] = []
    times = bench_idle.measure(lambda: calls.append(1), [0.0, 0.5], repeats=10, rounds=2)
    assert {g: len(t) for g, t in times.items()} == {0.0: 10, 0.5: 10}
    assert len(calls) == 2 * 2 * (30 + 5)  # rounds x gaps x (warm-up + block)
    assert bench_idle.main(["--gaps", "0,1", "--repeats", "4"]) == 0
    rows = [line.split("|")[1:-1] for line in _rows(capsys.readouterr().out)]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("pure-Python loop", "0"), ("pure-Python loop", "1"),
        ("one-input prepare + run", "0"), ("one-input prepare + run", "1")]
    assert rows[0][4].strip() == rows[2][4].strip() == "1.00"


def test_the_model_unit_at_each_thread_count_beside_spinning_processes(capsys, tiny_embedding_dir):
    import torch

    before = torch.get_num_threads()
    assert bench_idle.main(["--gaps", "0", "--repeats", "2", "--threads", "2,1", "--busy", "1"]) == 0
    assert torch.get_num_threads() == before
    names = [line.split("|")[1].strip() for line in _rows(capsys.readouterr().out)]
    assert names == ["pure-Python loop", "one-input prepare + run, 2 threads", "one-input prepare + run, 1 thread"]


def test_a_batch_of_random_sequences_on_a_given_checkpoint(capsys, tiny_embedding_dir):
    assert bench_idle.main(["--gaps", "0", "--repeats", "2", "--threads", "1", "--batch", "3x5",
                            "--model-dir", str(tiny_embedding_dir)]) == 0
    names = [line.split("|")[1].strip() for line in _rows(capsys.readouterr().out)]
    assert names == ["pure-Python loop", "3x5 prepare + run, 1 thread"]
    with pytest.raises(SystemExit):
        bench_idle.main(["--batch", "3x"])

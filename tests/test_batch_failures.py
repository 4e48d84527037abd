"""A batch job that cannot run, or cannot go on, fails as the server does: one line on stderr that
says why, exit 2, and no output file left behind by a job that never started.

Oracles: the exit status and stderr of the real command (a subprocess where the claim is about the
whole process: its stderr, its peak memory, a real write error under RLIMIT_FSIZE), the file
system itself (what exists afterwards), and the input's own byte counts (the memory bound).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server.batch.output import Unrunnable, scan
from tests.batch_util import line, read_out, run_cli, write_batch
from tests.serving import cached_runner

REPO = Path(__file__).resolve().parents[1]
SAFETY_S = 1800  # a hang only: a busy 2-core box loads torch in a minute or more


def run_command(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.batch.command", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=SAFETY_S, **kw)


def rows(n: int) -> list[dict]:
    return [line(f"l{i}", "/v1/embeddings", {"input": f"text number {i}"}) for i in range(n)]


def test_a_model_that_is_not_found_is_one_line_exit_2_and_no_output_file(tmp_path):
    inp, out = write_batch(tmp_path / "in.jsonl", rows(2)), tmp_path / "out.jsonl"
    proc = run_command("-i", str(inp), "-o", str(out), "--model", str(tmp_path / "no-such-model"))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no traceback, no log lines
    assert lines[0].startswith("radixserve-batch: could not start:") and "no-such-model" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("output", ["/dev/full", "/dev/null", "/dev/stdout", "/proc/self/fd/1", "DIR", "NODIR"])
def test_an_output_that_is_not_a_regular_file_is_refused_before_the_model_loads(tmp_path, capsys, output):
    from server.batch.command import main

    inp = write_batch(tmp_path / "in.jsonl", rows(1))
    target = {"DIR": str(tmp_path), "NODIR": str(tmp_path / "missing" / "out.jsonl")}.get(output, output)
    # no runner and a model that does not exist: refusing must come first, or this would fail differently
    rc = main(["-i", str(inp), "-o", target, "--model", str(tmp_path / "no-such-model"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"radixserve-batch: {target}:"), err
    assert "could not start" not in err[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the refusal as another user")
def test_an_output_directory_without_write_permission_is_refused(tmp_path):
    # a directory the job's user cannot write (as a read-only file system is): refused at start
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    inp = write_batch(tmp_path / "in.jsonl", rows(1))
    os.chmod(inp, 0o644)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import sys; from server.batch.command import main; sys.exit(main(sys.argv[1:]))",
             "-i", str(inp), "-o", str(locked / "out.jsonl"), "--model", "unused"],
            capture_output=True, text=True, cwd=REPO, timeout=SAFETY_S, user=65534)
    except PermissionError:
        pytest.skip("the interpreter is not executable by nobody")
    if proc.returncode != 2 and "Error" in proc.stderr and "radixserve-batch" not in proc.stderr:
        pytest.skip(f"the checkout is not usable by nobody: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"radixserve-batch: {locked / 'out.jsonl'}: cannot create a file in {locked} "
        "(read-only file system or no permission)"]
    assert not (locked / "out.jsonl").exists()


def test_the_resume_scan_reads_only_what_the_file_held(tmp_path):
    # a file that is not ours, with no newline at all: scanned to its size, then judged
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"x" * 5000)
    got = scan(str(out))
    assert got.torn_bytes == 5000 and out.read_bytes() == b""  # a lone torn line is cut
    out.write_bytes(b"x" * 10 + b"\n" + b"y" * 10)
    with pytest.raises(Unrunnable):
        scan(str(out))


def test_a_missing_input_file_is_one_line_exit_2(tmp_path, capsys):
    from server.batch.command import main

    rc = main(["-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--model", "x"])
    assert rc == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"radixserve-batch: no such input file: {tmp_path / 'nope.jsonl'}"]
    assert not (tmp_path / "out.jsonl").exists()


def test_no_serving_on_address_line_offline(tmp_path, tiny_embedding_dir, caplog):
    import logging

    runner = cached_runner(str(tiny_embedding_dir))
    inp, out = write_batch(tmp_path / "in.jsonl", rows(2)), tmp_path / "out.jsonl"
    with caplog.at_level(logging.INFO):
        assert run_cli(runner, tiny_embedding_dir, inp, out) == 0
    messages = [r.getMessage() for r in caplog.records]
    started = [m for m in messages if m.startswith("radixserve serving ")]
    assert len(started) == 1 and started[0].endswith("in-process (batch job: nothing listens)"), started
    assert not any(":8080" in m or "0.0.0.0" in m for m in messages)


SCRIPT = textwrap.dedent("""
    import io, json, resource, signal, sys
    from server.batch.command import main
    from tests.serving import cached_runner
    model, job = sys.argv[1], json.loads(sys.argv[2])
    runner = cached_runner(model)
    base = ["--model", model, "--no-progress", "--window", "2"]
    if job["fsize"]:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (job["fsize"], job["fsize"]))
    report = {}
    for name, inp, out in job["runs"]:
        if inp == "-":
            sys.stdin = io.TextIOWrapper(open(job["stdin"], "rb"))
        rc = main(["-i", inp, "-o", out, *base, *job["flags"]], runner=runner)
        report[name] = [rc, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]
    print("REPORT " + json.dumps(report), flush=True)
""")


def run_script(model_dir, job: dict) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), json.dumps(job)], capture_output=True,
                          text=True, cwd=REPO, timeout=SAFETY_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = [x for x in proc.stdout.splitlines() if x.startswith("REPORT ")]
    return json.loads(report[0][7:]), proc.stderr


def test_a_write_error_is_one_line_exit_2(tmp_path, tiny_embedding_dir):
    inp, out = write_batch(tmp_path / "in.jsonl", rows(40)), tmp_path / "out.jsonl"
    report, err = run_script(tiny_embedding_dir, {"fsize": 20_000, "flags": [], "runs": [["w", str(inp), str(out)]]})
    assert report["w"][0] == 2
    last = err.strip().splitlines()[-1]
    assert last == f"radixserve-batch: {out}: writing the output failed: File too large", err[-2000:]
    assert "Traceback" not in err
    scan(str(out))  # what a resumed run does first: the chunk cut short by the limit is cut off
    assert 0 < len(read_out(out)) < 40 and out.stat().st_size <= 20_000


def test_an_over_long_line_costs_bounded_memory(tmp_path, tiny_embedding_dir):
    """A 120 MiB line under a 1 MB --payload-limit: an error line for it, and a peak RSS that grows by
    far less than the line (the bound: a few times the limit plus the reader's blocks)."""
    limit = 1_000_000
    small = write_batch(tmp_path / "small.jsonl", rows(4))
    big = tmp_path / "big.jsonl"
    with open(big, "wb") as f:
        f.write(json.dumps(line("ok-1", "/v1/embeddings", {"input": "before"})).encode() + b"\n")
        f.write(b'{"custom_id": "huge", "method": "POST", "url": "/v1/embeddings", "body": {"input": "')
        for _ in range(96):
            f.write(b"word " * (1 << 18))  # 1.25 MiB
        f.write(b'"}}\n')
        f.write(json.dumps(line("ok-2", "/v1/embeddings", {"input": "after"})).encode() + b"\n")
    long_bytes = big.stat().st_size
    job = {"fsize": 0, "flags": ["--payload-limit", str(limit)], "stdin": str(big),
           "runs": [["warm", str(small), str(tmp_path / "warm.jsonl")],
                    ["file", str(big), str(tmp_path / "file.jsonl")],
                    ["stdin", "-", str(tmp_path / "stdin.jsonl")]]}
    report, err = run_script(tiny_embedding_dir, job)
    bound = 8 * limit + (48 << 20)  # readline's limit, the skip blocks, count_lines' blocks; allocator slack
    for name in ("file", "stdin"):
        rc, peak = report[name]
        assert rc == 1, err[-2000:]  # the long line is an error line; the others succeed
        grew = peak - report["warm"][1]
        assert grew < bound, f"{name}: peak grew {grew >> 20} MiB reading a {long_bytes >> 20} MiB line"
        got = read_out(tmp_path / f"{name}.jsonl")
        assert [r["custom_id"] for r in got] == ["ok-1", None, "ok-2"]
        assert got[1]["error"]["code"] == "invalid_request_line" and got[1]["error"]["line"] == 2
        assert f"longer than {limit} bytes" in got[1]["error"]["message"]
        assert got[0]["error"] is None and got[2]["error"] is None

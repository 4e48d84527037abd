"""benchmarks/bench_pycount.py counts the bytecodes of the request path it drives: a one-input
embedding executes more than /health, and the functions it names are on that path; its CPU mode
times both routes in both cache states."""
from benchmarks import bench_pycount


def test_the_count_covers_the_embedding_path(tiny_embedding_dir, capsys):
    result = bench_pycount.main(["--model-dir", str(tiny_embedding_dir), "--requests", "3", "--top", "400"])
    assert result["/v1/embeddings"] > result["/health"] > 0
    names = {name for name, _ in result["top"]}
    # the route, the scheduler's lane and the runner's prepare all run within the traced requests
    assert any(n.endswith(":openai_embeddings") for n in names)
    assert any(n.endswith(":run_here") for n in names) and any(n.endswith(":prepare") for n in names)
    assert "bytecodes per request" in capsys.readouterr().out


def test_the_cpu_mode_times_both_routes_warm_and_evicted(tiny_embedding_dir, capsys):
    times = bench_pycount.main(["--model-dir", str(tiny_embedding_dir), "--requests", "3", "--cpu", "--evict", "1"])
    assert set(times) == {(path, state) for path in ("/health", "/v1/embeddings") for state in ("warm", "evicted")}
    assert all(seconds >= 0 for seconds in times.values())
    out = capsys.readouterr().out
    assert "CPU per request, warm:" in out and "CPU per request, evicted (1 MiB written before each):" in out

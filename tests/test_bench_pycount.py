"""benchmarks/bench_pycount.py counts the bytecodes of the request path it drives: a one-input
embedding executes more than /health, and the functions it names are on that path."""
from benchmarks import bench_pycount


def test_the_count_covers_the_embedding_path(tiny_embedding_dir, capsys):
    result = bench_pycount.main(["--model-dir", str(tiny_embedding_dir), "--requests", "3", "--top", "400"])
    assert result["/v1/embeddings"] > result["/health"] > 0
    names = {name for name, _ in result["top"]}
    # the route, the scheduler's lane and the runner's prepare all run within the traced requests
    assert any(n.endswith(":openai_embeddings") for n in names)
    assert any(n.endswith(":run_here") for n in names) and any(n.endswith(":prepare") for n in names)
    assert "bytecodes per request" in capsys.readouterr().out

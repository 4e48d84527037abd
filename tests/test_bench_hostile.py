"""benchmarks.bench_hostile runs its attacks against a real server and reports the probes."""
from __future__ import annotations

from benchmarks import bench_hostile
from tests.serving import ServerThread, cached_runner


def test_bench_hostile_reports_each_attack(tiny_embedding_dir):
    from server.app import create_app
    from server.config import ServerConfig

    app = create_app(ServerConfig(model_id=str(tiny_embedding_dir)), runner=cached_runner(str(tiny_embedding_dir)))
    with ServerThread(app, stack="h11") as srv:
        # NOTE: a probe fails past its timeout, as a kubelet's does; here that is only a safety net, so a
        # busy machine's slow answer is not counted as the server's failure
        report = bench_hostile.run(srv.url, srv.url, ["none", "headers", "slow"], seconds=0.3, idle=0, slow=3,
                                   probe_timeout=120)
    assert report["headers"]["answers"][0]["reply"].startswith("HTTP/1.1 431")
    assert report["slow"]["answers"] == [{"opened": 3, "refused": 0}]
    for name in ("none", "headers", "slow"):
        assert report[name]["api"]["failed"] == 0 and report[name]["probe_port"]["probes"] >= 1

"""The checked-in HAProxy router (deploy/haproxy/) in front of three real radixserve replicas.

Runs the `haproxy` binary on loopback with the config that deploy/haproxy/render.sh makes from
the checked-in template, over three `python -m server.cli` processes on the tiny reranker. Shows:
requests that share a prefix (the rerank query, or an X-Prefix-Key header) land on one replica,
read from the replicas' own /metrics; a replica SIGKILLed under load loses no client request (every
answer is a 200, or a 503/429 with Retry-After); the dead replica's keys move and the others' stay;
a restarted replica takes its keys back once its /health is 200. All traffic stays on 127.0.0.1.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest import cli, compare, scrape
from tests.serving import free_port

ROOT = Path(__file__).resolve().parents[1]
RENDER = ROOT / "deploy" / "haproxy" / "render.sh"
HAPROXY = shutil.which("haproxy")

needs_haproxy = pytest.mark.skipif(
    HAPROXY is None, reason="haproxy is not installed (Debian: apt-get install haproxy; .ci/run tries it)")

QUERIES = [f"query {i}: which passage explains topic {i * 7 % 13}?" for i in range(12)]
DOCS = ["a passage about rivers", "a passage about mountains", "a passage about trains"]


class Replica:
    """A radixserve process on a fixed loopback port (so a restart comes back at the same address)."""

    def __init__(self, model_dir, port: int, log_path: Path) -> None:
        self.model_dir, self.port, self.log_path = model_dir, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        for key in ("API_KEY", "HOSTNAME", "PORT", "RADIXSERVE_TEST_FAULT"):
            env.pop(key, None)
        cmd = [sys.executable, "-m", "server.cli", "--model-id", str(self.model_dir), "--hostname", "127.0.0.1",
               "-p", str(self.port), "--max-batch-tokens", "512"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"replica {self.url} did not come up"
            time.sleep(0.1)

    def requests_served(self) -> float:
        """te_request_count summed over its labels, read from this replica's own /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "te_request_count"
                   for s in fam.samples if s.name.endswith("_total") or s.name == "te_request_count")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=600)


class Router:
    """haproxy -f (render.sh replicas...) on two free loopback ports: traffic and stats."""

    def __init__(self, replicas: list[Replica], tmp: Path) -> None:
        config = subprocess.run(["sh", str(RENDER), *(f"127.0.0.1:{r.port}" for r in replicas)],
                                check=True, capture_output=True, text=True).stdout
        self.config = tmp / "haproxy.cfg"
        self.config.write_text(config)
        self.port, self.stats_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, RADIXSERVE_ROUTER_BIND=f"127.0.0.1:{self.port}",
                   RADIXSERVE_ROUTER_STATS_BIND=f"127.0.0.1:{self.stats_port}")
        env.pop("RADIXSERVE_REPLICAS_DNS", None)
        check = subprocess.run([HAPROXY, "-c", "-f", str(self.config)], env=env, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(tmp / "haproxy.log", "wb")
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(self.config)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def stats(self) -> dict[str, dict]:
        """The stats page's CSV rows of backend `radixserve`, by server name (and BACKEND)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
        return {row["svname"]: row for row in rows if row["pxname"] == "radixserve"}

    def wait_status(self, want: dict[str, str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                status = {name: row["status"] for name, row in self.stats().items()}
            except httpx.TransportError:
                status = {}
            if all(status.get(name, "").startswith(s) for name, s in want.items()):
                return
            assert self.proc.poll() is None, "haproxy exited"
            assert time.monotonic() < deadline, f"router status {status}, want {want}"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=600)
        self.log.close()


@pytest.fixture(scope="module")
def cluster(tiny_reranker_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    replicas = [Replica(tiny_reranker_dir, free_port(), tmp / f"r{i + 1}.log") for i in range(3)]
    router = None
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_healthy()
        router = Router(replicas, tmp)
        router.wait_status({"r1": "UP", "r2": "UP", "r3": "UP"})
        yield router, replicas
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.kill()


def rerank(client: httpx.Client, url: str, query: str, *, doc: int = 0, headers: dict | None = None) -> httpx.Response:
    texts = [DOCS[doc % len(DOCS)], DOCS[(doc + 1) % len(DOCS)]]
    return client.post(url + "/rerank", json={"query": query, "texts": texts}, headers=headers or {}, timeout=60)


def placement(router: Router, queries: list[str]) -> dict[str, str]:
    """query -> the replica that answered it (the router's X-Radixserve-Replica header)."""
    out = {}
    with httpx.Client() as client:
        for q in queries:
            r = rerank(client, router.url, q)
            assert r.status_code == 200, r.text
            out[q] = r.headers["x-radixserve-replica"]
    return out


@needs_haproxy
def test_a_shared_prefix_lands_on_one_replica(cluster):
    router, replicas = cluster
    names = {f"r{i + 1}": r for i, r in enumerate(replicas)}
    first = placement(router, QUERIES)
    assert len(set(first.values())) >= 2, f"12 queries all hashed to one replica: {first}"
    with httpx.Client() as client:
        for q in QUERIES[:4]:
            before = {n: r.requests_served() for n, r in names.items()}
            for doc in range(5):  # five requests that share the query, each with other passages
                r = rerank(client, router.url, q, doc=doc)
                assert r.status_code == 200 and len(r.json()) == 2, r.text
            after = {n: r.requests_served() for n, r in names.items()}
            served = {n: after[n] - before[n] for n in names}
            assert served == {n: (5.0 if n == first[q] else 0.0) for n in names}, (q, served)
        # The header wins over the body: one header value, different queries, one replica.
        landed = {rerank(client, router.url, q, headers={"X-Prefix-Key": "tenant-7"}).headers["x-radixserve-replica"]
                  for q in QUERIES}
        assert len(landed) == 1
    # Key order in the JSON body does not matter.
    with httpx.Client() as client:
        for q in QUERIES[:4]:
            body = '{"texts": ["x", "y"], "query": %s}' % httpx.Request("GET", "/", json=q).content.decode()
            r = client.post(router.url + "/rerank", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200 and r.headers["x-radixserve-replica"] == first[q]


def _landing(client: httpx.Client, url: str, inputs: list[str], key: str | None = None) -> str:
    """The replica that answered POST /embed {inputs}, or, with `key`, a rerank sent with that
    X-Prefix-Key header (the header is the key as it is, so it names the replica of a key). The
    replicas run a reranker, so /embed is the replica's own 400 naming the model kind: where the
    router sent a body is what is read here."""
    if key is not None:
        r = rerank(client, url, "any query", headers={"X-Prefix-Key": key})
        assert r.status_code == 200, r.text
    else:
        r = client.post(url + "/embed", json={"inputs": inputs}, timeout=60)
        assert r.status_code == 400 and "kind 'embedding'" in r.json()["error"], r.text
    return r.headers["x-radixserve-replica"]


@needs_haproxy
def test_inputs_key_by_what_the_first_two_share(cluster):
    """A body with several inputs is keyed by the common prefix of its first two (cut after its last
    line break past byte 64), so requests of one group meet on one replica however their items
    start, while groups behind one long template spread; under 64 shared bytes, or with one input,
    the key is the first input's first 64 bytes. Each landing is checked against the replica of the
    key sent as X-Prefix-Key."""
    router, _ = cluster
    # 64 bytes the same for every group, then the group (the first-64-bytes rule would send all twelve
    # groups to one replica); no spaces: the keys travel as header values too, which cannot end in
    # one; a comma, which X-Prefix-Key keeps (req.fhdr, not req.hdr's comma-separated values)
    template = "Represent-the-passage-for-retrieval-from-the-archive-of-the-library;number-{i},topic-{t}:"
    with httpx.Client() as client:
        spread = set()
        for i in range(12):
            shared = template.format(i=i, t=i * 7 % 13)
            assert len(shared) >= 64 and "\n" not in shared and shared[:64] == template[:64]
            key = "i:" + shared
            where = _landing(client, router.url, [], key=key)
            spread.add(where)
            # the first two inputs diverge right after the shared text; the third does not matter
            assert _landing(client, router.url, [shared + "alpha rivers", shared + "beta mountains", "x"]) == where
            # they share a few more bytes ("the-tra"): the key grows by them, and is the header's again
            assert _landing(client, router.url, [shared + "the-train", shared + "the-tram"]) == _landing(
                client, router.url, [], key=key + "the-tra")
            # a line break past byte 64 cuts the key there: passages that start alike change nothing
            lined = shared + "\n<Document>: "
            cut = _landing(client, router.url, [lined + "alpha", lined + "beta"])
            assert _landing(client, router.url, [lined + "the-cat", lined + "the-dog", lined + "z"]) == cut
            # one input, or two that share under 64 bytes: the first 64 bytes of the first input
            first64 = _landing(client, router.url, [], key="i:" + shared[:64])
            assert _landing(client, router.url, [shared + "alone"]) == first64
            assert _landing(client, router.url, [shared + "one", shared[:40] + "two"]) == first64
        assert len(spread) >= 2, f"12 groups behind one template all hashed to one replica: {spread}"


def _tokens(replica: Replica) -> float:
    text = httpx.get(replica.url + "/metrics", timeout=5).text
    return scrape.parse(text).tokens_original or 0.0


@needs_haproxy
def test_load_tester_through_the_router_adds_up_the_replicas(cluster, tmp_path):
    router, replicas = cluster
    before = [_tokens(r) for r in replicas]
    spec = f"affinity={router.url}@" + ",".join(r.url for r in replicas)
    rc = cli.main(["compare", "--target", spec, "--workload", "rerank-pointwise", "--source", "synthetic",
                   "--queries", "6", "--requests", "24", "--concurrency", "3", "--warmup", "0", "--quiet",
                   "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    run = report["runs"][0]
    served = [_tokens(r) - b for r, b in zip(replicas, before)]
    assert run["requests_ok"] == 24
    assert run["server"]["tokens_original"] == sum(served) > 0
    assert sum(1 for x in served if x > 0) >= 2  # six queries: more than one replica took work


def _answer(q: str, r: httpx.Response) -> tuple:
    """(query, status, Retry-After, ranks in a 200's body)."""
    return q, r.status_code, r.headers.get("retry-after"), len(r.json()) if r.status_code == 200 else None


def _load(url: str, queries: list[str], stop: threading.Event, answers: list, errors: list) -> None:
    with httpx.Client() as client:
        i = 0
        while not stop.is_set():
            q = queries[i % len(queries)]
            try:
                answers.append(_answer(q, rerank(client, url, q, doc=i)))
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(repr(exc))
            i += 1


@needs_haproxy
def test_bcd_sigkill_loses_nothing_keys_move_and_come_back(cluster):
    router, replicas = cluster
    before = placement(router, QUERIES)
    by_replica = {name: [q for q, n in before.items() if n == name] for name in ("r1", "r2", "r3")}
    victim_name = max(by_replica, key=lambda n: len(by_replica[n]))
    victim = replicas[int(victim_name[1:]) - 1]
    assert by_replica[victim_name], before

    stop, answers, errors = threading.Event(), [], []
    workers = [threading.Thread(target=_load, args=(router.url, QUERIES[k::4], stop, answers, errors)) for k in range(4)]
    retries_before = int(router.stats()["BACKEND"]["wretr"] or 0) + int(router.stats()["BACKEND"]["wredis"] or 0)
    for w in workers:
        w.start()
    try:
        time.sleep(1.5)
        sent_before_kill = len(answers)
        victim.kill()  # SIGKILL: no drain, in-flight connections are reset
        with httpx.Client() as client:  # the victim's keys at once, before any health check notices
            for q in by_replica[victim_name]:
                answers.append(_answer(q, rerank(client, router.url, q)))
        router.wait_status({victim_name: "DOWN"})
        time.sleep(1.0)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
    # (b) nothing lost: every request got an answer, and every answer is a 200 or a refusal to retry.
    assert not errors, errors[:5]
    assert len(answers) > sent_before_kill > 0
    for q, status, retry_after, n in answers:
        assert status == 200 and n == 2 or status in (429, 503) and retry_after, (q, status)
    retries = int(router.stats()["BACKEND"]["wretr"] or 0) + int(router.stats()["BACKEND"]["wredis"] or 0)
    assert retries > retries_before, "the kill never hit a request: the retry path was not exercised"

    # (c) the dead replica's keys move to the others; every other key stays where it was.
    during = placement(router, QUERIES)
    for q in QUERIES:
        if before[q] == victim_name:
            assert during[q] != victim_name
        else:
            assert during[q] == before[q], (q, before[q], during[q])

    # (d) restarted at the same address: no traffic until its /health is 200, then its keys return.
    victim.start()
    while not victim.healthy():
        assert router.stats()[victim_name]["status"].startswith("DOWN")
        assert victim_name not in placement(router, by_replica[victim_name][:1]).values()
        assert victim.proc.poll() is None, victim.log_path.read_text()[-3000:]
        time.sleep(0.2)
    router.wait_status({victim_name: "UP"})
    assert placement(router, QUERIES) == before


@needs_haproxy
@pytest.mark.parametrize("where", ["docker-compose.yml", "deploy/kubernetes/router-haproxy.yaml"])
def test_dns_variant_of_the_config_is_valid(where, tmp_path):
    """Compose and Kubernetes run the same file with replicas from DNS: `haproxy -c` accepts it with
    the environment they set, and every variable they set is one the config reads."""
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all((ROOT / where).read_text()))
    if where == "docker-compose.yml":
        env = {k: str(v) for k, v in docs[0]["services"]["router"]["environment"].items()}
    else:
        deployment = next(d for d in docs if d and d["kind"] == "Deployment")
        env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    assert all("${" + name in config for name in env), env
    env["RADIXSERVE_ROUTER_BIND"] = f"127.0.0.1:{free_port()}"  # -c binds nothing, but keep it loopback
    env["RADIXSERVE_ROUTER_STATS_BIND"] = f"127.0.0.1:{free_port()}"
    # Both mount deploy/haproxy/ where the config's default Lua path points; here it is the checkout.
    lua_default = "${RADIXSERVE_ROUTER_LUA-/usr/local/etc/haproxy/prefix_key.lua}"
    assert lua_default in config and (ROOT / "deploy" / "haproxy" / "prefix_key.lua").is_file()
    if where == "docker-compose.yml":
        assert "./deploy/haproxy:/usr/local/etc/haproxy:ro" in docs[0]["services"]["router"]["volumes"]
    else:
        assert "--from-file=deploy/haproxy/prefix_key.lua" in (ROOT / where).read_text()
    env["RADIXSERVE_ROUTER_LUA"] = str(ROOT / "deploy" / "haproxy" / "prefix_key.lua")
    check = subprocess.run([HAPROXY, "-c", "-f", str(ROOT / "deploy" / "haproxy" / "haproxy.cfg")],
                           env=dict(os.environ, **env), capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_parse_target_with_replicas():
    t = compare.parse_target("aff=http://127.0.0.1:9000@http://127.0.0.1:9001, http://127.0.0.1:9002/")
    assert (t.name, t.url, t.metrics_urls) == ("aff", "http://127.0.0.1:9000", ("http://127.0.0.1:9001", "http://127.0.0.1:9002"))
    assert compare.parse_target("one=http://127.0.0.1:9000").metrics_urls == ()
    with pytest.raises(ValueError):
        compare.parse_target("aff=http://127.0.0.1:9000@http://")


def _snapshot(ratio_sum, count, orig, comp, hit, miss, created=1.0) -> scrape.Snapshot:
    return scrape.Snapshot(ratio_sum=ratio_sum, ratio_count=count, tokens_original=orig, tokens_compact=comp,
                           ratio_created=created, cache_hit=hit, cache_miss=miss)


def test_combine_equals_the_delta_of_the_summed_counters():
    """Adding the replicas' deltas gives what one server with all their counters would show."""
    pairs = [(_snapshot(1.0, 2, 100, 60, 5, 1), _snapshot(4.2, 6, 900, 400, 55, 9)),
             (_snapshot(0.0, 0, 0, 0, 0, 0), _snapshot(0.5, 1, 30, 30, 0, 30)),
             (_snapshot(2.0, 3, 50, 50, 0, 0), _snapshot(2.0, 3, 50, 50, 0, 0))]  # took no request
    combined = scrape.combine([scrape.delta(b, a) for b, a in pairs])
    summed = [scrape.Snapshot(*(sum(getattr(p[i], f) for p in pairs) for f in (
        "ratio_sum", "ratio_count", "tokens_original", "tokens_compact", "ratio_created", "cache_hit", "cache_miss")))
        for i in (0, 1)]
    expect = scrape.delta(summed[0], summed[1])
    assert combined.batches == expect.batches == 5
    assert combined.mean_ratio == pytest.approx(expect.mean_ratio) and combined.mean_ratio == pytest.approx((4.2 - 1.0 + 0.5) / 5)
    for f in ("tokens_original", "tokens_compact", "cache_hit", "cache_miss"):
        assert getattr(combined, f) == getattr(expect, f), f
    # One replica restarted (or unreadable): the cluster figure is unknown, not a partial sum.
    restarted = (_snapshot(1.0, 2, 100, 60, 5, 1), _snapshot(0.1, 1, 10, 10, 0, 0, created=2.0))
    assert scrape.combine([scrape.delta(*pairs[0]), scrape.delta(*restarted)]).tokens_original is None
    assert scrape.combine([scrape.delta(*pairs[0]), scrape.delta(None, None)]).batches is None
    # A replica that never took a request has no labelled token series yet: it adds 0, not unknown.
    idle = (_snapshot(0.0, 0, None, None, 0, 0), _snapshot(0.0, 0, None, None, 0, 0))
    with_idle = scrape.combine([scrape.delta(*pairs[0]), scrape.delta(*idle)])
    assert with_idle.tokens_original == scrape.delta(*pairs[0]).tokens_original == 800

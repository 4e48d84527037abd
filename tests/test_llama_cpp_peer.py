"""benchmarks.llama_cpp_peer: arguments, the three loads, the token/cosine checks and a whole run.

Without llama.cpp the llama arms are a stand-in that takes llama-server's command line and speaks
its routes (/health, /tokenize {content, add_special}, /v1/embeddings), tokenizing with the
checkpoint's own tokenizer.json and answering vectors drawn from each text's hash; the radixserve
arm is the real server on the tiny embedding fixture. The last test runs the real llama-server on
the tiny fixture converted by llama.cpp's own converter, and skips unless LLAMA_SERVER,
LLAMA_CPP_DIR (the llama.cpp source with convert_hf_to_gguf.py) and LLAMA_CPP_PYTHON (a Python
with the converter's requirements) are set: docs/performance/cpu.md, "Against llama.cpp".
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import llama_cpp_check as check
from benchmarks import llama_cpp_peer as peer
from loadtest import datasets, machine, workloads

STUB = r'''
"""llama-server's command line and routes; embeddings drawn from each text's hash."""
import hashlib, json, random, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def vector(text, dims):
    rng = random.Random(hashlib.sha256(text.encode()).digest())
    return [rng.gauss(0.0, 1.0) for _ in range(dims)]


def main(argv):
    opts = dict(zip(argv, argv[1:]))
    conf = json.loads(open(opts["-m"]).read())
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(conf["tokenizer"])

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, code, doc):
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply(200, {"status": "ok"}) if self.path == "/health" else self.reply(404, {})

        def do_POST(self):
            doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                ids = tok.encode(doc["content"], add_special_tokens=doc.get("add_special", False)).ids
                self.reply(200, {"tokens": ids[:-1] if conf.get("drop_eos") else ids})
            elif self.path == "/v1/embeddings":
                data = [{"object": "embedding", "index": i, "embedding": vector(t, conf["dims"])}
                        for i, t in enumerate(doc["input"])]
                self.reply(200, {"object": "list", "data": data})
            else:
                self.reply(404, {})

    ThreadingHTTPServer((opts["--host"], int(opts["--port"])), H).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
'''


@pytest.fixture(scope="module")
def stub(tmp_path_factory, tiny_embedding_dir):
    """(llama-server command, gguf paths: good, drop_eos, module with `vector`)."""
    d = tmp_path_factory.mktemp("llama-stub")
    (d / "llama_server_stub.py").write_text(STUB)
    tok = str(Path(tiny_embedding_dir) / "tokenizer.json")
    dims = json.loads((Path(tiny_embedding_dir) / "config.json").read_text())["hidden_size"]
    ggufs = {}
    for name, drop in (("good", False), ("drop_eos", True)):
        ggufs[name] = d / f"{name}.gguf"
        ggufs[name].write_text(json.dumps({"tokenizer": tok, "dims": dims, "drop_eos": drop}))
    spec = importlib.util.spec_from_file_location("llama_server_stub", d / "llama_server_stub.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return f"{sys.executable} {d / 'llama_server_stub.py'}", ggufs, mod


def _args(stub, model_dir, *extra):
    cmd, ggufs, _ = stub
    return peer.parse_args(["--model-dir", str(model_dir), "--llama-server", cmd, "--gguf", f"f32={ggufs['good']}",
                            "--gguf", f"q8_0={ggufs['good']}", *extra])


def test_arguments_build_the_arms_and_refuse_what_cannot_run(stub, tiny_embedding_dir, monkeypatch, tmp_path):
    args = _args(stub, tiny_embedding_dir, "--parallel", "4", "--ctx-per-slot", "256", "--threads", "2")
    arms = peer.arms_from(args)
    assert [a.name for a in arms] == ["compact", "bf16", "int8", "llama-f32", "llama-q8_0"]
    assert [a.llama for a in arms] == [False, False, False, True, True]
    assert arms[1].argv == ("--cpu-weights", "bf16") and arms[0].argv == ()
    llama = list(arms[3].argv)
    for flag, value in (("-np", "4"), ("-c", str(4 * 256)), ("-t", "2"), ("-b", "4096"), ("-ub", "4096"),
                        ("--pooling", "last"), ("-m", str(stub[1]["good"]))):
        assert llama[llama.index(flag) + 1] == value
    assert "--embedding" in llama and "-kvu" in llama and "--port" not in llama  # the port is chosen at start
    bad = [["--gguf", "f32"], ["--gguf", f"x={tmp_path / 'missing.gguf'}"], ["--items", "0"],
           ["--ours", "compact=", "--ours", "compact=--cpu-weights int8"], ["--template-requests", "0"]]
    for extra in bad:
        with pytest.raises(SystemExit):
            _args(stub, tiny_embedding_dir, *extra)
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit):
        peer.parse_args(["--model-dir", str(tiny_embedding_dir), "--gguf", f"f32={stub[1]['good']}"])


def test_the_three_loads():
    ds = datasets.synthetic(60, seed=1)
    template = peer.load_requests("template", ds, items=8, count=3)
    documents = peer.load_requests("documents", ds, items=8, count=3)
    query = peer.load_requests("query", ds, items=8, count=5)
    for reqs, items in ((template, 8), (documents, 8), (query, 1)):
        assert all(r.route == "/v1/embeddings" and r.items == items == len(r.body["input"]) for r in reqs)
    passages = [p for s in ds.samples for p in s.passages]
    assert [t for r in documents for t in r.body["input"]] == passages[:24]
    first = template[0].body["input"]
    assert first[0] == workloads.render_pair(ds.samples[0].query, ds.samples[0].passages[0])
    assert all(t.startswith(workloads.RERANK_PREFIX) for t in first)
    assert [r.body["input"][0] for r in query] == [workloads.query_prompt() + s.query for s in ds.samples[:5]]
    with pytest.raises(ValueError, match="wanted"):
        peer.load_requests("documents", ds, items=8, count=10_000)
    texts = peer.check_texts(ds)
    measured = {t for r in template + documents + query for t in r.body["input"]}
    assert len(texts) == 3 * peer.CHECK_TEXTS_PER_LOAD and not measured & set(texts)


def test_token_comparison_and_cosines():
    assert check.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert check.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert check.first_difference([1, 2, 3], [1, 2]) == 2
    got = check.compare_tokens([[1, 2], [3, 4, 5]], [[1, 2], [3, 4]])
    assert got == {"texts": 2, "equal": 1, "first_mismatch": {"text": 1, "position": 2, "ours": [5], "theirs": []}}
    a, b = [1.0, 2.0, 2.0], [2.0, 0.0, 1.0]
    want = sum(x * y for x, y in zip(a, b)) / (3.0 * math.sqrt(5.0))
    assert check.cosine(a, b) == pytest.approx(want)
    assert check.cosines([a, a], [a, b])["min"] == pytest.approx(want)
    with pytest.raises(ValueError):
        check.cosine([0.0, 0.0], [1.0, 0.0])


@pytest.fixture(scope="module")
def servers(stub, tiny_embedding_dir, tmp_path_factory):
    """radixserve on the tiny fixture (`compact`), two stub llama-servers (`llama-f32`, `llama-q8_0`)
    and one that drops the EOS (`llama-drop`), started as a run starts its arms."""
    cmd, ggufs, _ = stub
    arms = [peer.Arm("compact", (), llama=False)] + [
        peer.Arm(name, tuple(peer.llama_argv(cmd, str(ggufs[g]), threads=1, parallel=2, ctx_per_slot=64)), llama=True)
        for name, g in (("llama-f32", "good"), ("llama-q8_0", "good"), ("llama-drop", "drop_eos"))]
    with contextlib.ExitStack() as stack:
        yield peer.start(stack, arms, model_dir=str(tiny_embedding_dir), log_dir=tmp_path_factory.mktemp("logs"),
                         startup_timeout=120)


def test_checks_compare_ids_and_vectors_with_ours(servers, stub):
    arms = [peer.Arm("compact", (), llama=False), peer.Arm("llama-f32", (), llama=True),
            peer.Arm("llama-drop", (), llama=True)]
    texts = peer.check_texts(datasets.synthetic(10, seed=2))
    got = peer.run_checks(servers, arms, texts)
    assert got["reference"] == "compact" and got["texts"] == len(texts)
    assert got["tokens"]["llama-f32"] == {"texts": len(texts), "equal": len(texts), "first_mismatch": None}
    ours_ids = check.our_token_ids(servers["compact"], texts)
    drop = got["tokens"]["llama-drop"]
    assert drop["equal"] == 0 and drop["first_mismatch"]["position"] == len(ours_ids[0]) - 1
    ours = check.embeddings(servers["compact"], texts)
    dims = len(ours[0])
    for i, t in enumerate(texts):  # the stub's vectors, computed here, against ours
        v = stub[2].vector(t, dims)
        dot = sum(x * y for x, y in zip(ours[i], v))
        want = dot / math.sqrt(sum(x * x for x in ours[i]) * sum(y * y for y in v))
        assert got["cosine"]["llama-f32"]["per_text"][i] == pytest.approx(want, rel=1e-6)


def test_a_whole_run_prints_every_arm_and_its_ratios(servers, stub, tiny_embedding_dir, tmp_path, capsys):
    out = tmp_path / "peer.json"
    args = _args(stub, tiny_embedding_dir, "--ours", "compact=", "--items", "3", "--template-requests", "2",
                 "--documents-requests", "2", "--query-requests", "3", "--queries", "30", "--threads", "1",
                 "--log-dir", str(tmp_path / "logs"), "--json", str(out))
    doc = peer.run(args, urls=servers)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["checks"]["tokens"]["llama-f32"]["equal"] == doc["checks"]["texts"]
    printed = capsys.readouterr().out
    for load, count, items in (("template", 2, 3), ("documents", 2, 3), ("query", 3, 1)):
        got = doc["loads"][load]
        assert (got["requests"], got["items_per_request"]) == (count, items)
        rows = {r["name"]: r for r in got["rows"]}
        assert set(rows) == {"compact", "llama-f32", "llama-q8_0"}
        assert all(r["errors"] == 0 for r in rows.values())
        for r in rows.values():
            for ln in ("llama-f32", "llama-q8_0"):
                assert r[f"items_vs_{ln}"] == pytest.approx(r["items_per_s"] / rows[ln]["items_per_s"])
                assert r[f"p50_vs_{ln}"] == pytest.approx(r["p50_ms"] / rows[ln]["p50_ms"])
        assert f"### {load}: {count} requests of {items} items" in printed
    assert doc["uptime_before"] and doc["uptime_after"]
    assert doc["machine"]["load_start"] and doc["machine"]["load_end"]  # loadtest/machine.py
    assert f"machine: {machine.line(doc['machine'])}" in printed


LLAMA_ENV = ("LLAMA_SERVER", "LLAMA_CPP_DIR", "LLAMA_CPP_PYTHON")


@pytest.mark.skipif(not all(os.environ.get(k) for k in LLAMA_ENV),
                    reason="llama.cpp not built here: set LLAMA_SERVER, LLAMA_CPP_DIR and LLAMA_CPP_PYTHON "
                           "(docs/performance/cpu.md, 'Against llama.cpp')")
def test_real_llama_server_reads_the_fixture_as_we_do(tiny_embedding_dir, tmp_path):
    gguf = tmp_path / "tiny-f32.gguf"
    subprocess.run([os.environ["LLAMA_CPP_PYTHON"], str(Path(os.environ["LLAMA_CPP_DIR"]) / "convert_hf_to_gguf.py"),
                    str(tiny_embedding_dir), "--outtype", "f32", "--outfile", str(gguf)],
                   check=True, capture_output=True, timeout=300)
    arms = [peer.Arm("ours", (), llama=False),
            peer.Arm("llama-f32", tuple(peer.llama_argv(os.environ["LLAMA_SERVER"], str(gguf), threads=1, parallel=2,
                                                        ctx_per_slot=512)), llama=True)]
    with contextlib.ExitStack() as stack:
        urls = peer.start(stack, arms, model_dir=str(tiny_embedding_dir), log_dir=tmp_path, startup_timeout=120)
        got = peer.run_checks(urls, arms, peer.check_texts(datasets.synthetic(10, seed=2)))
    assert got["tokens"]["llama-f32"]["equal"] == got["texts"], got["tokens"]
    # float32 on both sides: the same model up to summation order
    assert got["cosine"]["llama-f32"]["min"] > 0.9999, got["cosine"]


def test_the_documented_command_parses():
    text = (Path(__file__).resolve().parents[1] / "docs" / "performance" / "cpu.md").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.S)).replace("\\\n", " ")
    lines = [ln for ln in blocks.splitlines() if "python -m benchmarks.llama_cpp_peer" in ln]
    assert lines, "docs/performance/cpu.md shows no benchmarks.llama_cpp_peer command"
    for line in lines:
        words = shlex.split(line.split("python -m benchmarks.llama_cpp_peer", 1)[1].split("#")[0])
        args = peer.parser().parse_args(words)  # parses; the GGUF files are the reader's own
        assert args.gguf and args.model_dir

"""The checkpoint zoo (fixtures/zoo.py) against each checkpoint's own library, over HTTP.

- Every entry loads served on exactly the routes docs/zoo.md lists, or is refused with its reason.
- Embedders: `SentenceTransformer.encode` (its prompts, default prompt, pooling, Dense and
  Normalize modules), one text at a time, fp32, against /embed, /v1/embeddings and /v2/embed.
- Classifiers and reward models: transformers' AutoModelForSequenceClassification (its
  last-non-pad-token rule, its id2label) against /predict, /classify, /pooling and /score.
Radix modes off, paper and compact (with the prefix cache), each request sent twice so the
second reads the cache where it is on. 1e-4.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from fixtures import zoo
from models.runner import load_runner
from server.app import create_app
from server.config import ServerConfig
from server.service import heads
from tests.serving import ServerThread

TOL = 1e-4
TEXTS = ["the quick brown fox jumps over the lazy dog near the river bank", "a short one",
         "the quick brown fox naps"]
MODES = ("compact+cache", "paper", "off")
EMBEDDERS = [e.name for e in zoo.ENTRIES if e.served == zoo.EMBED]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "zoo.md"


def _servers(d, **load):
    """One server per radix mode: compact with the prefix cache, paper and off without it."""
    cached = load_runner(str(d), device="cpu", dtype="float32", **load)
    plain = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0, **load)

    def start(runner, threshold):
        config = ServerConfig(model_id=str(d), radix_mlp_threshold=threshold)
        return ServerThread(create_app(config, runner=runner)).start()

    return cached, {"compact+cache": start(cached, 1.0),
                    "paper": start(dataclasses.replace(plain, radix_attention="paper"), 1.0),
                    "off": start(plain, 0.0)}


def test_docs_table_is_the_zoo():
    assert zoo.table() in DOCS.read_text(), "docs/zoo.md's table differs from fixtures.zoo.table()"


@pytest.mark.parametrize("name", [e.name for e in zoo.ENTRIES])
def test_each_entry_is_served_or_refused_as_the_table_says(fixture_root, name):
    entry = zoo.get(name)
    d = zoo.cached(name, root=fixture_root)
    if not entry.served:
        with pytest.raises(ValueError, match=entry.refused):
            load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
        return
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
    assert set(heads.routes(runner.kind, runner.head)) == set(entry.served)


@pytest.fixture(scope="module", params=EMBEDDERS)
def embedder(request, fixture_root):
    from sentence_transformers import SentenceTransformer

    d = zoo.cached(request.param, root=fixture_root)
    st = SentenceTransformer(str(d), device="cpu")
    st.float()
    runner, servers = _servers(d)
    yield zoo.get(request.param), st, runner, servers
    for s in servers.values():
        s.stop()


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _encode(st, texts, **kw) -> np.ndarray:
    """SentenceTransformer.encode one text at a time (no padding in the oracle)."""
    return np.stack([st.encode([t], batch_size=1, convert_to_numpy=True, **kw)[0] for t in texts])


@pytest.mark.parametrize("mode", MODES)
def test_embedders_equal_sentence_transformers(embedder, mode):
    entry, st, runner, servers = embedder
    url = servers[mode].url
    raw = _encode(st, TEXTS)  # the checkpoint's default prompt, if it names one
    # /embed normalizes unless normalize=false (TEI's default), /v1/embeddings and /v2/embed always:
    # where modules.json has no Normalize module, encode's vectors are compared normalized there
    unit = _unit if "Normalize" not in entry.modules else (lambda x: x)
    want = unit(raw)
    assert runner.hidden_size == want.shape[1]  # the last Dense module's width where there is one
    for _ in range(2):  # the second request reads the prefix cache where it is on
        got = np.asarray(httpx.post(url + "/embed", json={"inputs": TEXTS}, timeout=120).json())
        assert got.shape == want.shape and np.abs(got - want).max() < TOL
        if "Normalize" not in entry.modules:  # encode's own vectors, as they are
            as_is = httpx.post(url + "/embed", json={"inputs": TEXTS, "normalize": False}, timeout=120).json()
            assert np.abs(np.asarray(as_is) - raw).max() < TOL * max(1.0, float(np.abs(raw).max()))
    oai = httpx.post(url + "/v1/embeddings", json={"input": TEXTS, "model": runner.model_id}, timeout=120).json()
    assert np.abs(np.asarray([x["embedding"] for x in oai["data"]]) - want).max() < TOL
    cohere = httpx.post(url + "/v2/embed", json={"texts": TEXTS, "input_type": "search_document",
                                                 "embedding_types": ["float"]}, timeout=120)
    assert cohere.status_code == 200, cohere.text
    # search_document: the checkpoint's "document" prompt, else none (server/service/cohere_embed.py)
    want_doc = unit(_encode(st, TEXTS, prompt=(entry.prompts or {}).get("document", "")))
    assert np.abs(np.asarray(cohere.json()["embeddings"]["float"]) - want_doc).max() < TOL
    for name in entry.prompts or {}:
        want_p = unit(_encode(st, TEXTS, prompt_name=name))
        got_p = np.asarray(httpx.post(url + "/embed", json={"inputs": TEXTS, "prompt_name": name},
                                      timeout=120).json())
        assert np.abs(got_p - want_p).max() < TOL, name


def test_dense_answers_token_states_at_the_model_width(embedder):
    """/embed_all: every token's final state, as sentence-transformers' token_embeddings (before
    Pooling and Dense), so the model's width even where Dense modules narrow the pooled vector."""
    entry, st, runner, servers = embedder
    if not entry.dense:
        pytest.skip("no Dense module")
    got = httpx.post(servers["compact+cache"].url + "/embed_all", json={"inputs": TEXTS[1]}, timeout=120).json()
    want = st.encode([TEXTS[1]], output_value="token_embeddings", prompt_name=entry.default_prompt_name)[0]
    assert np.asarray(got[0]).shape == tuple(want.shape) and np.abs(np.asarray(got[0]) - want.numpy()).max() < TOL


def _hf_seq_cls(d):
    import transformers

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(d), dtype=torch.float32).eval()

    def logits(ids):
        with torch.inference_mode():
            return hf(input_ids=torch.tensor([ids])).logits[0].numpy()  # [labels]

    return hf, logits


@pytest.fixture(scope="module")
def classifier(fixture_root):
    d = zoo.cached("qwen3-embedding-classifier", root=fixture_root)
    hf, oracle = _hf_seq_cls(d)
    runner, servers = _servers(d)
    yield hf, oracle, runner, servers
    for s in servers.values():
        s.stop()


@pytest.mark.parametrize("mode", MODES)
def test_classifier_reads_the_last_token_that_is_not_pad(classifier, mode):
    hf, oracle, runner, servers = classifier
    url = servers[mode].url
    tok = runner.tokenizer
    assert all(tok.encode(t).ids[-1] == hf.config.pad_token_id for t in TEXTS)  # appended <|endoftext|>
    labels = [hf.config.id2label[i] for i in range(hf.config.num_labels)]
    raw = [oracle(tok.encode(t).ids) for t in TEXTS]
    for _ in range(2):
        got = httpx.post(url + "/predict", json={"inputs": [[t] for t in TEXTS], "raw_scores": True}, timeout=120)
        assert got.status_code == 200, got.text
        for answer, want in zip(got.json(), raw):
            assert {g["label"]: g["score"] for g in answer} == pytest.approx(dict(zip(labels, want)), abs=TOL)
    cls = httpx.post(url + "/classify", json={"input": TEXTS}, timeout=120).json()
    for item, want in zip(cls["data"], raw):
        probs = np.exp(want - want.max()) / np.exp(want - want.max()).sum()
        assert item["probs"] == pytest.approx(list(probs), abs=TOL) and item["label"] == labels[int(np.argmax(want))]


def test_pad_rule_edges(fixture_root):
    """Pad tokens inside and at the end of a sequence, and a sequence of pad tokens alone: the
    rightmost token that is not pad (index 0 when there is none), as transformers reads it."""
    d = zoo.cached("qwen3-embedding-classifier", root=fixture_root)
    _, oracle = _hf_seq_cls(d)
    pad = zoo.ENDOFTEXT_ID
    seqs = [[9707, pad, 1879, pad, pad], [pad, pad], [pad], [9707, 1879], [9707, 1879, pad] * 4]
    ids = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    cu[1:] = np.cumsum([len(s) for s in seqs])
    want = np.stack([oracle(s) for s in seqs])
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
    for mode, threshold in (("compact", 0.0), ("paper", 1.0), ("compact", 1.0)):
        r = dataclasses.replace(runner, radix_attention=mode, radix_mlp_threshold=threshold)
        assert np.abs(r.run(r.prepare(ids, cu)).numpy() - want).max() < TOL, mode


@pytest.fixture(scope="module", params=["llama-reward", "qwen3-reward"])
def reward(request, fixture_root):
    d = zoo.cached(request.param, root=fixture_root)
    hf, oracle = _hf_seq_cls(d)
    runner, servers = _servers(d)
    yield oracle, runner, servers
    for s in servers.values():
        s.stop()


@pytest.mark.parametrize("mode", MODES)
def test_reward_model_on_every_single_score_route(reward, mode):
    oracle, runner, servers = reward
    url = servers[mode].url
    tok = runner.tokenizer
    assert runner.kind == "reward" and runner.rerank_template == ""
    raw = [float(oracle(tok.encode(t).ids)[0]) for t in TEXTS]
    pooled = httpx.post(url + "/pooling", json={"input": TEXTS}, timeout=120).json()
    assert [d["data"][0] for d in pooled["data"]] == pytest.approx(raw, abs=TOL)
    pred = httpx.post(url + "/predict", json={"inputs": [[t] for t in TEXTS], "raw_scores": True}, timeout=120)
    assert pred.status_code == 200, pred.text
    assert [a[0]["score"] for a in pred.json()] == pytest.approx(raw, abs=TOL)
    cls = httpx.post(url + "/classify", json={"input": TEXTS}, timeout=120).json()
    assert [d["probs"][0] for d in cls["data"]] == pytest.approx([1 / (1 + np.exp(-x)) for x in raw], abs=TOL)
    pairs = [oracle(tok.encode(TEXTS[0], t).ids)[0] for t in TEXTS[1:]]  # the tokenizer's own pair
    score = httpx.post(url + "/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:], "use_activation": False},
                       timeout=120)
    assert score.status_code == 200, score.text
    assert [d["score"] for d in score.json()["data"]] == pytest.approx(pairs, abs=TOL)
    refused = httpx.post(url + "/rerank", json={"query": "q", "texts": ["a"]}, timeout=120)
    assert refused.status_code == 400 and "/pooling" in refused.text
    info = httpx.get(url + "/info", timeout=60).json()
    assert info["model_type"]["reward"]["score"] == "score head, raw"
    assert info["model_type"]["reward"]["template"] is None
    assert "no marker of a reranker conversion" in info["model_type"]["reward"]["why"]
    assert set(info["routes"]) == set(zoo.SINGLE_SCORE)


def test_rerank_template_is_the_operators_choice(fixture_root):
    """A family without a reranker template is served as one only through the template named."""
    d = zoo.cached("mxbai-rerank-v2", root=fixture_root)
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0,
                         rerank_template="qwen3-reranker")
    assert runner.kind == "reranker" and runner.rerank_template == "qwen3-reranker"
    reward_dir = zoo.cached("llama-reward", root=fixture_root)
    named = load_runner(str(reward_dir), device="cpu", dtype="float32", prefix_cache_size=0,
                        rerank_template="qwen3-reranker")
    assert named.kind == "reranker" and named.head == "score"
    with pytest.raises(ValueError, match="unknown reranker template"):
        load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0, rerank_template="nope")
    emb = zoo.cached("qwen3-embedding", root=fixture_root)
    with pytest.raises(ValueError, match="applies to a reranker"):
        load_runner(str(emb), device="cpu", dtype="float32", prefix_cache_size=0, rerank_template="qwen3-reranker")


def test_one_label_qwen3_head_is_a_reranker_only_where_it_says_so(fixture_root):
    """A one-label Qwen3ForSequenceClassification is Qwen3-Reranker's conversion (its template on
    the rerank routes) only where its files mark it: config.json's classifier_from_token (vLLM's
    key) or a card printing the template; unmarked (Skywork-Reward-V2-Qwen3's files) a reward
    model. The flags override either way, and /info says which and why; the torch-free preflight
    decides the same."""
    import fixtures
    from models.checkpoint.preflight import served_kind

    load = dict(device="cpu", dtype="float32", prefix_cache_size=0)
    card = zoo.cached("qwen3-reranker-seq-cls", root=fixture_root)
    marked = fixtures.cached("tiny-qwen3-seq-cls", root=fixture_root)
    plain = zoo.cached("qwen3-reward", root=fixture_root)
    for d, why in ((card, "README.md: the qwen3-reranker template"),
                   (marked, "config.json: classifier_from_token ['no', 'yes']")):
        r = load_runner(str(d), **load)
        assert (r.kind, r.rerank_template, r.head_reason) == ("reranker", "qwen3-reranker", why)
        assert served_kind(d) == "reranker"
        as_reward = load_runner(str(d), kind="reward", **load)
        assert (as_reward.kind, as_reward.head_reason) == ("reward", "--model-task reward")
    r = load_runner(str(plain), **load)
    assert (r.kind, r.rerank_template) == ("reward", "") and "no marker" in r.head_reason
    assert served_kind(plain) == "reward"
    named = load_runner(str(plain), rerank_template="qwen3-reranker", **load)
    assert (named.kind, named.rerank_template, named.head_reason) == ("reranker", "qwen3-reranker", "--rerank-template")
    assert served_kind(plain, rerank_template="qwen3-reranker") == "reranker"
    asked = load_runner(str(plain), kind="reranker", **load)
    assert (asked.kind, asked.rerank_template) == ("reranker", "qwen3-reranker")
    srv = ServerThread(create_app(ServerConfig(model_id=str(card)), runner=load_runner(str(card), **load))).start()
    try:
        info = httpx.get(srv.url + "/info", timeout=60).json()
    finally:
        srv.stop()
    assert info["model_type"] == {"reranker": {"score": "sigmoid(score head)", "template": "qwen3-reranker",
                                               "why": "README.md: the qwen3-reranker template"}}


def test_card_marked_reranker_equals_transformers_over_the_template(fixture_root):
    """The card-marked conversion on /rerank: transformers' AutoModelForSequenceClassification over
    Qwen3-Reranker's template as its card prints it (the prefix, the body, the suffix)."""
    from tests.test_model_forward import INSTRUCTION, RERANK_PREFIX, RERANK_SUFFIX

    d = zoo.cached("qwen3-reranker-seq-cls", root=fixture_root)
    assert RERANK_PREFIX.split("\n")[1].startswith(zoo.QWEN3_RERANKER_CARD.split("system\\n")[1][:60])
    _, oracle = _hf_seq_cls(d)
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
    tok = runner.tokenizer
    query, docs = TEXTS[0], TEXTS[1:]

    def ids(doc):
        body = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {doc}"
        return [i for part in (RERANK_PREFIX, body, RERANK_SUFFIX) for i in tok.encode(part, add_special_tokens=False).ids]

    want = {i: float(oracle(ids(doc))[0]) for i, doc in enumerate(docs)}
    srv = ServerThread(create_app(ServerConfig(model_id=str(d)), runner=runner)).start()
    try:
        r = httpx.post(srv.url + "/rerank", json={"query": query, "texts": docs, "raw_scores": True}, timeout=120)
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    assert {x["index"]: x["score"] for x in r.json()} == pytest.approx(want, abs=TOL)


@pytest.mark.parametrize("name,reason", [("gte-qwen2-instruct", "modeling_qwen.Qwen2Model.*bidirectional"),
                                         ("stella-en-1.5b-v5", "modeling_qwen.Qwen2Model.*bidirectional")])
def test_bidirectional_remote_code_is_refused_before_torch_with_its_reason(fixture_root, name, reason):
    """The preflight (torch-free, at the command line) and the loader give the same one-line reason."""
    from models.checkpoint.preflight import served_kind

    d = zoo.cached(name, root=fixture_root)
    with pytest.raises(ValueError, match=reason):
        served_kind(d)
    with pytest.raises(ValueError, match=reason):
        load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)


def test_reranker_marks(tmp_path):
    """What counts as the mark of Qwen3-Reranker's conversion: vLLM's config keys or a card that
    prints the template; other words, another family or a card without the line do not."""
    from models.checkpoint.reranker_mark import reranker_mark

    t = "qwen3-reranker"
    assert reranker_mark(tmp_path, {"is_original_qwen3_reranker": True}, t) == "config.json: is_original_qwen3_reranker"
    assert reranker_mark(tmp_path, {"classifier_from_token": ["no", "yes"]}, t).startswith("config.json")
    assert reranker_mark(tmp_path, {"classifier_from_token": ["yes", "no"]}, t) is None
    assert reranker_mark(tmp_path, {"classifier_from_token": ["no", "yes"]}, None) is None
    assert reranker_mark(tmp_path, {}, t) is None
    (tmp_path / "README.md").write_text("# Skywork-Reward-V2\nA reward model over chats.\n")
    assert reranker_mark(tmp_path, {}, t) is None
    (tmp_path / "README.md").write_text(zoo.QWEN3_RERANKER_CARD)
    assert reranker_mark(tmp_path, {}, t) == "README.md: the qwen3-reranker template"

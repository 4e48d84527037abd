"""Prefix-cache namespaces (a request's ``cache_salt``): what one client sent cannot be read back by
another through ``x-compute-tokens``.

The attack is the real one: a victim's request holds a secret; an attacker guesses it digit by
digit, and the guess whose ``x-compute-tokens`` is smallest (most of it was cached) is the digit.
It must succeed within one namespace (so the test can fail) and find no signal across namespaces.
The in-batch trie must not merge items of different namespaces either.
"""
from __future__ import annotations

import dataclasses

import httpx
import numpy as np
import pytest

from server.http import cache_salt
from tests.serving import cached_runner, serve

SECRET = "483920"


@pytest.fixture(scope="module")
def srv(tiny_embedding_dir):
    s = serve(tiny_embedding_dir)
    yield s
    s.stop()


def _post(url: str, text: str, salt: str | None) -> httpx.Response:
    body = {"inputs": text} if salt is None else {"inputs": text, "cache_salt": salt}
    r = httpx.post(url + "/embed", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def _attack(url: str, prefix: str, salt: str | None) -> tuple[str, list[list[int]]]:
    """(the digits recovered, the x-compute-tokens of every guess, position by position)."""
    known, seen = "", []
    _post(url, prefix, salt)  # the attacker's own copy of the public prefix: its guesses differ only after it
    for _ in SECRET:
        costs = [int(_post(url, prefix + known + d, salt).headers["x-compute-tokens"]) for d in "0123456789"]
        seen.append(costs)
        known += str(int(np.argmin(costs)))
    return known, seen


@pytest.mark.parametrize("victim, attacker, leaks", [
    (None, None, True),  # one shared namespace: the attack works (the test can fail)
    ("tenant-a", "tenant-a", True),  # the same salt is one namespace
    ("tenant-a", None, False),
    (None, "tenant-b", False),
    ("tenant-a", "tenant-b", False),
])
def test_secret_recovery_works_only_within_a_namespace(srv, victim, attacker, leaks):
    prefix = f"Customer {victim}-{attacker} PIN: "  # a prefix of its own per case: no earlier entries
    _post(srv.url, prefix + SECRET, victim)
    recovered, seen = _attack(srv.url, prefix, attacker)
    if leaks:
        assert recovered == SECRET, seen
    else:
        assert all(len(set(costs)) == 1 for costs in seen), seen  # not one guess stands out
        assert recovered != SECRET


def test_compute_tokens_header_can_be_left_out(tiny_embedding_dir):
    s = serve(tiny_embedding_dir, compute_tokens_header=False)
    try:
        r = httpx.post(s.url + "/embed", json={"inputs": "hello"})
        assert r.status_code == 200 and "x-compute-tokens" not in r.headers
        assert "x-inference-time" in r.headers  # the other headers stay
        r = httpx.post(s.url + "/v1/embeddings", json={"input": "hello", "cache_salt": "x"})
        assert r.status_code == 200 and "x-compute-tokens" not in r.headers
    finally:
        s.stop()


def test_cache_salt_is_validated_on_every_inference_dialect(srv):
    for path, body in (("/embed", {"inputs": "x"}), ("/v1/embeddings", {"input": "x"}),
                       ("/v2/embed", {"texts": ["x"], "input_type": "search_query"})):
        assert httpx.post(srv.url + path, json={**body, "cache_salt": "ok"}).status_code == 200, path
        assert httpx.post(srv.url + path, json={**body, "cache_salt": ""}).status_code == 422, path
        assert httpx.post(srv.url + path, json={**body, "cache_salt": 7}).status_code == 422, path


def test_one_batch_shares_trie_nodes_only_within_a_namespace(tiny_embedding_dir):
    # threshold 1: the trie always runs, whatever the cost-aware gate would say of a tiny model
    runner = dataclasses.replace(cached_runner(str(tiny_embedding_dir)), radix_mlp_threshold=1.0)
    tok = runner.tokenizer
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(1000, 20000, size=40)]  # no earlier cache entry starts so
    items = [shared + [5], shared + [6], shared + [7]]
    ids = np.asarray([t for it in items for t in it], dtype=np.int32)
    cu = np.asarray([0, 41, 82, 123], dtype=np.int32)
    a, b = cache_salt.namespace(_Req("a")), cache_salt.namespace(_Req("b"))
    assert tok is not None and a != b and cache_salt.namespace(_Req(None)) == b""
    # items 0 and 2 share a namespace, item 1 has its own: only item 2 may reuse item 0's rows
    p = runner.prepare(ids, cu, namespaces=[a, b, a])
    assert p.used_index and p.n_compact == 41 + 41 + 1, p.n_compact
    _settle(p)
    p = runner.prepare(ids, cu)  # one namespace: the trie shares the 40 tokens three ways
    assert p.used_index and p.n_compact == 41 + 1 + 1, p.n_compact
    _settle(p)


def _settle(prepared) -> None:
    """Give back the batch's cache lease (it never runs)."""
    io = getattr(prepared.forward, "cache", None)
    if io is not None:
        io.abort()


class _Req:
    """What ``cache_salt.namespace`` reads of a request: its ASGI scope."""

    def __init__(self, salt: str | None) -> None:
        self.scope: dict = {}
        cache_salt.remember(self, salt)


def test_cache_plan_finds_a_prefix_only_in_its_own_namespace():
    import torch

    from models.prefix_cache import PrefixCache

    cache = PrefixCache(layers=1, kv_heads=1, head_dim=2, capacity=16 * 16, dtype=torch.float32, device="cpu")
    seq = np.arange(100, 140, dtype=np.int32)  # 2 full blocks and a tail of 8
    cu = np.asarray([0, 40], dtype=np.int64)
    cache.commit(cache.plan(seq, cu, [b"tenant-a"]))
    for spaces, found in (([b"tenant-a"], 39), ([b"tenant-b"], 0), (None, 0), ([b""], 0)):
        lease = cache.plan(seq, cu, spaces)
        assert int(lease.matched[0]) == found, (spaces, lease.matched)
        cache.abort(lease)
    cache.commit(cache.plan(seq, cu))  # the shared namespace gets its own copy
    lease = cache.plan(seq, cu)
    assert int(lease.matched[0]) == 39
    cache.abort(lease)


def test_trie_groups_equal_separate_tries():
    from models.trie import build_index, positions_from_cu_seqlens

    rng = np.random.default_rng(1)
    base = rng.integers(0, 50, size=12)
    seqs = [np.concatenate([base, rng.integers(0, 50, size=k)]) for k in (3, 0, 5, 3, 1)]
    groups = np.asarray([0, 7, 7, 0, 3])
    ids = np.concatenate(seqs).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int32)
    together = build_index(ids, positions_from_cu_seqlens(cu), cu, groups=groups)
    separate = 0
    for g in np.unique(groups):
        part = [s for s, gg in zip(seqs, groups) if gg == g]
        pids = np.concatenate(part).astype(np.int32)
        pcu = np.concatenate([[0], np.cumsum([len(s) for s in part])]).astype(np.int32)
        separate += len(build_index(pids, positions_from_cu_seqlens(pcu), pcu).gather)
    assert len(together.gather) == separate
    assert np.array_equal(ids[together.gather], together.compact_ids)  # real tokens, not the keys
    shared = build_index(ids, positions_from_cu_seqlens(cu), cu)
    assert len(shared.gather) < separate

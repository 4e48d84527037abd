"""Shared test setup: the gpu marker and random-weight checkpoints built once per session."""
from __future__ import annotations

import os

import pytest
import torch

# Keep CPU tests deterministic and light on a 2-core machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# The CPU linear kernel: the first candidate that passes its self-test, not a timing that may go
# either way on a busy machine (tests/test_linear_select.py measures with an injected clock).
os.environ.setdefault("RADIXSERVE_CPU_LINEAR", "first")
# Measure at every load: a test never reads or writes the user's measurement cache
# (tests/test_cold_start.py points it at a temporary file).
os.environ.setdefault("RADIXSERVE_MEASURE_CACHE", "off")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # NOTE: not `"gpu" in item.keywords`: keywords hold parent names, so a checkout in a
        # directory named gpu would skip every test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fixture_root(tmp_path_factory):
    """Where this session's checkpoints live (RADIXSERVE_FIXTURE_DIR to reuse across runs)."""
    root = os.environ.get("RADIXSERVE_FIXTURE_DIR")
    return root if root else str(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture(scope="session")
def tiny_embedding_dir(fixture_root):
    import fixtures

    return fixtures.cached("tiny-embedding", root=fixture_root)


@pytest.fixture(scope="session")
def tiny_reranker_dir(fixture_root):
    import fixtures

    return fixtures.cached("tiny-reranker", root=fixture_root)


@pytest.fixture(scope="module")
def reranker_oracle(tiny_reranker_dir):
    """transformers' own Qwen3 causal LM on the tiny reranker: scores to compare forwards with."""
    from transformers import AutoModelForCausalLM

    from models.runner import load_runner
    from tests.test_model_forward import Oracle

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_reranker_dir), dtype=torch.float32).eval()
    probe = load_runner(str(tiny_reranker_dir), device="cpu", dtype="float32", prefix_cache_size=0)
    return Oracle(hf, causal_lm=True, yes_no=(probe.yes_id, probe.no_id))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(fixture_root):
    import fixtures

    return fixtures.cached("tiny-qwen2", root=fixture_root)

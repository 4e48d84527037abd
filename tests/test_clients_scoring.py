"""A real client of the classification route: huggingface_hub's InferenceClient.text_classification
pointed at the server (`base_url`), which posts TEI's body to POST / (dispatched to /predict).

Oracle: transformers' Qwen3ForSequenceClassification on the same ids, fp32, softmax over labels.
NOTE: the client keeps the first element of TEI's answer (the most probable label), which is what
it is compared on.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fixtures
from models.runner import load_runner
from server.app import create_app
from server.config import ServerConfig
from tests.serving import ServerThread

TEXTS = ["the film was wonderful", "a dull, plodding story"]


@pytest.fixture(scope="module")
def classifier(fixture_root):
    d = fixtures.cached("tiny-qwen3-seq-cls-3", root=fixture_root)
    runner = load_runner(str(d), device="cpu", dtype="float32", prefix_cache_size=0)
    srv = ServerThread(create_app(ServerConfig(model_id=str(d)), runner=runner)).start()
    yield srv, runner.tokenizer, d
    srv.stop()


def test_huggingface_hub_text_classification(classifier):
    hub = pytest.importorskip("huggingface_hub")
    import transformers

    srv, tok, d = classifier
    hf = transformers.Qwen3ForSequenceClassification.from_pretrained(str(d), dtype=torch.float32).eval()
    labels = ["negative", "neutral", "positive"]
    client = hub.InferenceClient(base_url=srv.url)
    for text in TEXTS:
        got = client.text_classification(text)
        top = got[0] if isinstance(got, list) else got
        with torch.inference_mode():
            probs = hf(input_ids=torch.tensor([tok.encode(text).ids])).logits[0].softmax(-1).numpy()
        assert top.label == labels[int(np.argmax(probs))]
        assert abs(top.score - float(probs.max())) < 1e-4

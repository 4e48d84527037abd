"""The fixture CLI is idempotent, and the tiny reranker's scores mean something.

Scores come from transformers' Qwen3ForCausalLM on the same checkpoint (sigmoid(logit yes - no) at
the last token of the Qwen3-Reranker template), on keyword pairs the shaping never saw.
"""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

import fixtures
from models.text import prompts
from fixtures import rerank_head
from fixtures.__main__ import main as fixtures_cli


def test_cli_is_idempotent_for_the_same_fixture(tmp_path, capsys):
    out = tmp_path / "demo"
    args = [str(out), "--preset", "tiny-embedding", "--layers", "1"]
    assert fixtures_cli(args) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert fixtures_cli(args) == 0  # the README's command, run a second time
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == first
    with pytest.raises(SystemExit):  # another fixture is never written over this one
        fixtures_cli(args + ["--seed", "1"])
    assert "does not hold this fixture" in capsys.readouterr().err
    other = tmp_path / "user-data"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        fixtures.build(other, "tiny-embedding", layers=1)


@pytest.fixture(scope="module")
def hf_scores(tiny_reranker_dir):
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(tiny_reranker_dir / "tokenizer.json"))
    template = prompts.RerankTemplate(tok)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_reranker_dir), dtype=torch.float32).eval()
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")

    def score(query: str, doc: str) -> float:
        ids = template.encode(query, [doc], max_length=1024, truncate=True)[0]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        return torch.sigmoid(logits[yes] - logits[no]).item()

    return score


def test_reranker_scores_spread_and_order_related_first(hf_scores):
    pairs = rerank_head.calibration_pairs(seed=1234, n=12)  # held out: the fixture used seed 0
    scores = [hf_scores(q, d) for q, d, _ in pairs]
    related, unrelated = scores[0::2], scores[1::2]
    assert all(0.01 < s < 0.99 for s in scores), scores  # not saturated (was ~0.99999 for all)
    assert min(scores) < 0.3 and max(scores) > 0.7, scores  # spread over (0, 1)
    wins = sum(r > u for r, u in zip(related, unrelated))
    assert wins >= 9, (wins, related, unrelated)  # each query: its related document first
    assert sum(related) / len(related) > sum(unrelated) / len(unrelated) + 0.15

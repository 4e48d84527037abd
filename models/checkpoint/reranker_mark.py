"""Whether a one-label score head marks itself as a yes/no reranker's conversion (torch-free).

A one-label ``*ForSequenceClassification`` is two different things with the same weights' shape:
a reranker converted from a yes/no causal LM (tomaarsen/Qwen3-Reranker-0.6B-seq-cls: the score row
is lm_head["yes"] - lm_head["no"], meaningful only over Qwen3-Reranker's template) and a reward
model (Skywork/Skywork-Reward-V2-Qwen3-0.6B: a raw score over the chat the client sends). Only
the checkpoint's own files tell them apart, so the family's reranker template is the default
only where one of them says so:

- config.json ``classifier_from_token`` naming the family's two words (["no", "yes"]) or
  ``is_original_qwen3_reranker`` true: the keys vLLM reads to serve Qwen3-Reranker as a
  sequence classifier (its ``--hf-overrides`` for Qwen/Qwen3-Reranker-*), which a conversion that
  keeps them carries;
- README.md (the model card) quoting the template's system line, as Qwen3-Reranker's card and
  the cards of its seq-cls conversions do: the card defines the template the score was made for.

A reward model's files carry neither; it is served as a reward model unless the operator names a
template (--rerank-template). models/families/registry.py's ``rerank_template_for`` reads the
mark this returns.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

# Qwen3-Reranker's system line (models/text/prompts.py's template), as its card prints it
QWEN3_SYSTEM_LINE = "Judge whether the Document meets the requirements based on the Query and the Instruct provided"
CARD_BYTES = 1 << 20  # a model card is read up to this many bytes (a card is a few kB)
# family template -> (its words as config.json's classifier_from_token, the card's line)
MARKS: dict[str, tuple[list[str], str]] = {"qwen3-reranker": (["no", "yes"], QWEN3_SYSTEM_LINE)}


def reranker_mark(model_dir: str | Path, raw: dict[str, Any], template: str | None) -> str | None:
    """Why this checkpoint is ``template``'s reranker conversion (a phrase for /info), or None."""
    if template not in MARKS:
        return None
    words, line = MARKS[template]
    if raw.get("is_original_qwen3_reranker") is True and template == "qwen3-reranker":
        return "config.json: is_original_qwen3_reranker"
    if raw.get("classifier_from_token") == words:
        return f"config.json: classifier_from_token {words}"
    card = Path(model_dir) / "README.md"
    try:
        with card.open("rb") as f:
            text = f.read(CARD_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return None
    return f"README.md: the {template} template" if line in text else None

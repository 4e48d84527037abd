"""The yes/no reranker templates a family's RerankSpec names, and how each one scores.

- "qwen3-reranker" (models/text/prompts.py's RerankTemplate): Qwen3-Reranker's chat template, the body
  ``<Instruct>: ...\\n<Query>: ...\\n<Document>: ...``; score logit("yes") - logit("no").
- "bge-reranker-gemma": BAAI's bge-reranker-v2-gemma as FlagEmbedding's ``FlagLLMReranker`` builds
  it: ids = [bos] + ids("A: {query}") + ids("\\n") + ids("B: {passage}") + ids("\\n") + ids(prompt),
  every part encoded on its own without special tokens, bos the checkpoint's ``bos_token_id``;
  the prompt is the instruction (default BGE_GEMMA_PROMPT); score logit("Yes") alone.
Both cut only the body (the query and the document), never the template around it; the relevance
is sigmoid(score) for both.
"""
from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

from models.text.pair_budget import check_pair_budget, pair_tokens
from models.text.prompts import (
    Cut, InputTooLong, QueryTooLong, RerankTemplate, _check_direction, _encode_ids_only, cut_body, encode_bounded,
)

QWEN3 = "qwen3-reranker"
BGE_GEMMA = "bge-reranker-gemma"
BGE_GEMMA_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to the query by "
    "providing a prediction of either 'Yes' or 'No'."
)
# /info's model_type.reranker.score, per template
SCORES = {
    QWEN3: "sigmoid(logit('yes') - logit('no'))",
    BGE_GEMMA: "sigmoid(logit('Yes'))",
}


class BgeGemmaTemplate:
    """bge-reranker-v2-gemma's input layout (FlagEmbedding ``get_inputs``), the body cut to fit.

    The body is ``ids("A: {query}") + ids("\\n") + ids("B: {passage}")``; [bos] before it and
    ``ids("\\n") + ids(prompt)`` after it are never cut, so every pair still ends with the
    question the "Yes" logit answers. The query is encoded once per request, each passage once;
    long texts cost what can be kept (``encode_bounded``).
    """

    def __init__(self, tokenizer: Tokenizer, *, bos_id: int | None) -> None:
        if bos_id is None:
            raise ValueError("the bge-reranker-gemma template starts with <bos>, but config.json has no bos_token_id")
        self.tokenizer = tokenizer
        self.bos_ids = [int(bos_id)]
        self.sep_ids = self._ids(["\n"])[0]

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(e.ids) for e in _encode_ids_only(self.tokenizer, list(texts))] if texts else []

    def _kept(self, texts: Sequence[str], budget: int, direction: str) -> list[list[int]]:
        """Each text's ids, or (longer than ``budget``) its ``budget`` tokens on the ``direction`` side."""
        out: list[list[int]] = []
        for enc, whole in encode_bounded(self.tokenizer, texts, keep=budget, direction=direction):
            ids = list(enc.ids)
            out.append(ids if whole else Cut(ids[:budget] if direction == "right" else ids[len(ids) - budget:]))
        return out

    def encode(
        self,
        query: str,
        documents: Sequence[str],
        *,
        instruction: str = BGE_GEMMA_PROMPT,
        max_length: int,
        truncate: bool,
        direction: str = "right",
        max_pair_tokens: int = 0,
        counted: tuple[int, int] = (0, 0),
    ) -> list[list[int]]:
        """[bos] + body + sep + prompt per document; only the body is cut to fit ``max_length``.

        Raises as RerankTemplate.encode does: ValueError when the prompt leaves no room,
        QueryTooLong, PairBudgetExceeded, InputTooLong.
        """
        direction = _check_direction(direction)
        (prompt_enc, prompt_whole), = encode_bounded(self.tokenizer, [instruction], keep=max_length, direction="right")
        suffix = self.sep_ids + list(prompt_enc.ids)
        overhead = len(self.bos_ids) + len(suffix)
        budget = max_length - overhead
        if not prompt_whole or budget < 1:
            raise ValueError(f"max_length {max_length} leaves no room for the reranker template and its "
                             f"instruction (at least {overhead} tokens)")
        (query_ids,) = self._kept(["A: " + query], budget, direction)
        head = query_ids + self.sep_ids if not isinstance(query_ids, Cut) else Cut(query_ids + self.sep_ids)
        # A passage is >= 1 token ("B:"); cutting from the right would leave none in any pair.
        if (not truncate or direction == "right") and len(head) + 1 > budget:
            raise QueryTooLong(len(head) + 1 + overhead, max_length, truncating=truncate)
        tails = self._kept(["B: " + d for d in documents], budget, direction)
        check_pair_budget(pair_tokens(overhead=overhead, bodies=[len(head) + len(t) for t in tails],
                                      max_length=max_length), documents=len(documents), limit=max_pair_tokens, counted=counted)
        out = []
        for i, tail in enumerate(tails):
            if not truncate and len(head) + len(tail) > budget:
                raise InputTooLong(i, len(head) + len(tail) + overhead, max_length,
                                   at_least=isinstance(head, Cut) or isinstance(tail, Cut))
            out.append(self.bos_ids + cut_body(head, tail, budget, direction) + suffix)
        return out


def build_template(name: str, tokenizer: Tokenizer, *, bos_id: int | None) -> RerankTemplate | BgeGemmaTemplate:
    """The template a RerankSpec names, bound to the checkpoint's tokenizer."""
    if name == QWEN3:
        return RerankTemplate(tokenizer)
    if name == BGE_GEMMA:
        return BgeGemmaTemplate(tokenizer, bos_id=bos_id)
    raise ValueError(f"unknown reranker template {name!r}; known: {', '.join(SCORES)}")

"""Service calls of the score heads: classification (TEI /predict, vLLM /classify) and raw
single scores (vLLM /pooling of a reward model).

Inputs are texts, or text pairs (TEI's /predict): a pair is encoded the way the tokenizer's own
pair template joins two texts, then cut to the input limit as a whole (or refused when truncation
is off), each side encoded on a window bounded by that limit, in one batch (models/text/pairs.py). Everything runs through the service's admission, tokenization pool and
scheduler (`Service._infer`), so permits, limits and timing are exactly the other routes'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union, cast

import numpy as np
from starlette.requests import Request

from models.text.pairs import encode_pairs
from models.text.prompts import InputTooLong, encode_embedding_inputs
from server.service.core import Call, Items, Service
from server.service.results import Scores, Usage

Text = Union[str, tuple[str, str]]


@dataclass(frozen=True)
class Logits:
    values: np.ndarray  # [B, labels] float32 raw logits of the score head (a [B] head: [B, 1])
    labels: tuple[str, ...]  # row order of the head (id2label)
    usage: Usage

    def probabilities(self) -> np.ndarray:
        """[B, labels]: sigmoid for a one-label head, else softmax over the labels (TEI and vLLM)."""
        x = self.values.astype(np.float64)
        if x.shape[1] == 1:
            return 1.0 / (1.0 + np.exp(-x))
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)


def encode_texts(tokenizer, items: Sequence[Text], *, max_length: int, truncate: bool,
                 direction: str) -> Items:
    """Token ids of texts and (text, text) pairs, special tokens as the tokenizer adds them: the
    texts as one batch and the pairs as another, each on windows bounded by ``max_length``
    (models/text/prompts.py, models/text/pairs.py), never one whole-text ``Tokenizer.encode``."""
    singles = [i for i, t in enumerate(items) if not isinstance(t, tuple)]
    doubles = [i for i, t in enumerate(items) if isinstance(t, tuple)]
    out: list = [None] * len(items)
    try:
        ids = encode_embedding_inputs(tokenizer, [str(items[i]) for i in singles], prompt="",
                                      max_length=max_length, truncate=truncate, direction=direction)
    except InputTooLong as exc:  # named by its place in the request, not among the texts
        raise InputTooLong(singles[exc.index], exc.length, max_length, at_least=exc.at_least) from None
    for i, one in zip(singles, ids):
        out[i] = one
    try:
        ids = encode_pairs(tokenizer, [cast("tuple[str, str]", items[i]) for i in doubles], max_length=max_length,
                           truncate=truncate, direction=direction)
    except InputTooLong as exc:
        raise InputTooLong(doubles[exc.index], exc.length, max_length, at_least=exc.at_least) from None
    for i, one in zip(doubles, ids):
        out[i] = one
    return out


async def logits(service: Service, request: Request, call: Call, items: Sequence[Text], *, truncate: bool,
                 direction: str, cap: int | None = None) -> Logits:
    """The score head's logits for each text or pair, in input order. cap: a tighter token limit
    per input than the server's (vLLM's truncate_prompt_tokens)."""
    tok = service.tok
    limit = tok.max_input_length if cap is None else min(cap, tok.max_input_length)

    async def encode() -> Items:
        return await tok._off_loop(lambda: encode_texts(tok.tokenizer, items, max_length=limit,
                                                        truncate=truncate, direction=direction))

    outputs, usage = await service._infer(request, call, len(items), encode, cost="pairs",
                                          bound=tok.bound(items, max_length=limit))
    rows = np.asarray([np.atleast_1d(np.asarray(o, dtype=np.float32)) for o in outputs], dtype=np.float32)
    labels = tuple(service.runner.labels) or ("LABEL_0",)
    return Logits(rows.reshape(len(items), -1), labels, usage)



async def pair_scores(service: Service, request: Request, call: Call, pairs: Sequence[tuple[str, str]], *,
                      instruction: str, truncate: bool, direction: str) -> Scores:
    """Raw reranker scores of (query, document) pairs, in input order; each distinct query's
    template part is encoded once, and the whole request is one admission, one pool call, one
    pair-token budget and one submission."""
    tok = service.tok

    async def encode() -> Items:
        return await tok.score_inputs(pairs, instruction=instruction, truncate=truncate, direction=direction)

    outputs, usage = await service._infer(request, call, len(pairs), encode, cost="score",
                                          bound=tok.score_bound(pairs, instruction=instruction))
    return Scores([float(s) for s in outputs], usage)

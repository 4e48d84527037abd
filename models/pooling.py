"""Pooling and heads over the rows the model ran on (compact rows in radix modes).

Invariant: N rows of hidden states are never materialised. Last-token and cls read B rows
through the batch's row indices; mean pooling applies the final RMSNorm per row (it is not
linear, and sentence-transformers averages the *normed* last hidden state) and then takes a
sparse [B, T] weighted sum whose weights are multiplicity / original length. The final norm
and the head touch pooled rows only; the reranker computes just the "yes" and "no" logits.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from models.batch import ForwardBatch
from models.options import POOLINGS
from models.families.protocol import ScoringModel


def pool(model: ScoringModel, hidden: Tensor, batch: ForwardBatch, pooling: str) -> Tensor:
    """hidden [T, E] before the final norm -> [B, E] pooled, after the final norm."""
    if pooling == "last-token":
        return model.final_norm(hidden.index_select(0, batch.last_rows))  # [B, E]
    if pooling == "cls":
        return model.final_norm(hidden.index_select(0, batch.first_rows))  # [B, E]
    if pooling == "mean":
        if batch.mean_weights is None:
            raise ValueError("mean pooling needs a batch built with mean_pooling=True")
        normed = model.final_norm(hidden).float()  # [T, E], T = N' in radix modes
        return torch.sparse.mm(batch.mean_weights, normed)  # [B, E]
    raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")


def token_states(model: ScoringModel, hidden: Tensor, rows: Tensor) -> Tensor:
    """hidden [T, E] before the final norm, rows [M] model rows -> [M, E] after the final norm.

    Per-token output (/embed_all): each original token reads its compact row (rows = the
    index's scatter for those tokens), so shared prefixes are computed once and copied out.
    """
    return model.final_norm(hidden.index_select(0, rows))  # [M, E]


def rerank_logits(model: ScoringModel, hidden: Tensor, batch: ForwardBatch, *,
                  yes_id: int, no_id: int | None) -> Tensor:
    """[B] raw scores logit("yes") - logit("no") at each sequence's last token; logit("yes")
    alone when ``no_id`` is None (bge-reranker-v2-gemma)."""
    h = model.final_norm(hidden.index_select(0, batch.last_rows))  # [B, E]
    w = model.head_weight()
    # NOTE: row views by Python int: no index tensor built from host data (a blocking copy on
    # CUDA) inside the forward. Never the full vocabulary.
    ids = (yes_id,) if no_id is None else (yes_id, no_id)
    rows = torch.stack([w[model.head_row(i)] for i in ids])  # [1 or 2, E]
    # NOTE: fp32 from here: bf16 logits near 10 are 1/16 apart, and their difference (the score)
    # would be quantised as coarsely, tying documents that differ.
    logits = model.final_logits(h.float() @ rows.float().t())  # [B, 1 or 2] (Gemma2: soft-capped)
    return logits[:, 0] if no_id is None else logits[:, 0] - logits[:, 1]


def cut_trailing_pad(input_ids, cu_seqlens, pad_id: int | None):
    """(input_ids, cu_seqlens) with each sequence cut after its last token that is not ``pad_id``.

    A `*ForSequenceClassification` head reads, in transformers, the rightmost token that is not
    the config's pad token (index 0 when every token is one; the last token when the config has
    no pad token). Tokenizers such as Qwen3-Embedding's append ``<|endoftext|>``, which Qwen3
    configs also name as pad, so the score is read one token before the end. Attention is causal:
    that token's state does not depend on the tokens after it, so cutting them gives exactly
    transformers' logits, in every radix mode and with the prefix cache (host-only, numpy).
    """
    if pad_id is None:
        return input_ids, cu_seqlens
    ids = np.asarray(input_ids)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)  # [B]
    ends = cu[1:][lens > 0] - 1
    if not (ids[ends] == pad_id).any():  # the common case: nothing to cut
        return input_ids, cu_seqlens
    seq = np.repeat(np.arange(len(lens)), lens)  # [N] sequence of each token
    pos = np.arange(len(ids)) - cu[:-1][seq]  # [N] position in its sequence
    last = np.zeros(len(lens), dtype=np.int64)  # [B] rightmost non-pad position (0 when none)
    np.maximum.at(last, seq, np.where(ids != pad_id, pos, 0))
    keep = np.minimum(last + 1, lens)  # [B] tokens kept
    new_cu = np.zeros_like(cu)
    new_cu[1:] = np.cumsum(keep)
    return (np.ascontiguousarray(ids[pos < keep[seq]]),
            new_cu.astype(np.asarray(cu_seqlens).dtype))


def classify_logits(model: ScoringModel, hidden: Tensor, batch: ForwardBatch) -> Tensor:
    """[B, labels] fp32 logits of the `score` head at each sequence's last token.

    NOTE: a ForSequenceClassification checkpoint reads the last non-pad token; our sequences are
    unpadded and cut after it (`cut_trailing_pad`, in the runner's prepare), so that is each
    sequence's last row.
    """
    head = model.score_head()
    assert head is not None  # load_runner builds it for every score-head kind
    h = model.final_norm(hidden.index_select(0, batch.last_rows))  # [B, E]
    return h.float() @ head.weight.float().t()  # [B, labels]


def normalize(emb, dimensions: int | None = None):
    """Matryoshka: truncate [B, E] to `dimensions` first, then L2-normalise (torch or numpy)."""
    if dimensions is not None:
        if dimensions <= 0 or dimensions > emb.shape[-1]:
            raise ValueError(f"dimensions must be in 1..{emb.shape[-1]}, got {dimensions}")
        emb = emb[..., :dimensions]
    if isinstance(emb, torch.Tensor):
        return torch.nn.functional.normalize(emb.float(), p=2.0, dim=-1)
    emb = np.asarray(emb, dtype=np.float32)
    norm = np.linalg.norm(emb, axis=-1, keepdims=True)
    return emb / np.maximum(norm, 1e-12)

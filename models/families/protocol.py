"""What the runner and pooling need of a model, whatever its family.

Invariant: runner.py, pooling.py, warmup and the prefix cache talk to a model only through
`ScoringModel`: the forward over the batch's rows (hidden states *before* the final norm), the
final norm applied to pooled rows only, and the heads (the lm_head's rows a yes/no reranker reads,
a classification `score` head). A family subclasses it and defines `forward` and `final_norm`;
the head bookkeeping here is shared (parameter names are the checkpoint's: `lm_head`, `score`).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from models.batch import ForwardBatch
from models.checkpoint.config import ModelConfig


@dataclass(frozen=True)
class RerankSpec:
    """What a family's yes/no reranker reads: the template (by name: models/text/rerank_templates.py
    builds its token ids), the answer words whose lm_head rows score, and the default instruction.
    ``no`` None: the score is the "yes" logit alone (bge-reranker-v2-gemma), else the difference."""

    template: str
    yes: str
    no: str | None
    instruction: str


class ScoringModel(nn.Module):
    """A decoder over one ragged token list, and its heads."""

    config: ModelConfig
    embed_tokens: nn.Embedding
    # NOTE: the heads are submodules, set only when the checkpoint has them (a class-level None
    # would shadow nn.Module's submodule lookup): read them with `lm_head_or_none()` / `score_head()`.
    head_ids: dict[int, int] | None = None  # token id -> its row of a cut lm_head; None: every row

    def forward(self, input_ids: Tensor, positions: Tensor, batch: ForwardBatch) -> Tensor:
        """input_ids [T], positions [T] -> [T, E] hidden states before the final norm."""
        raise NotImplementedError

    def final_norm(self, x: Tensor) -> Tensor:
        """[..., E] pooled rows -> the same after the final norm."""
        raise NotImplementedError

    def final_logits(self, logits: Tensor) -> Tensor:
        """Head logits as the checkpoint's own head leaves them (Gemma2 soft-caps); identity here."""
        return logits

    def keep_head_rows(self, token_ids: tuple[int, ...]) -> None:
        """Declare an untied lm_head of these tokens' rows only (before loading: the loader reads
        `head_rows()`). A reranker reads two rows of a [V, E] head; a tied head is the input
        embedding, which the model needs whole, so it is left as it is."""
        head = self.lm_head_or_none()
        if head is None:
            return
        w = head.weight
        self.lm_head = nn.Linear(self.config.hidden_size, len(token_ids), bias=False, device=w.device,
                                 dtype=w.dtype)
        self.head_ids = {int(t): i for i, t in enumerate(token_ids)}

    def head_rows(self) -> dict[str, tuple[int, ...]]:
        """{parameter: checkpoint rows it keeps} for the loader: the cut lm_head, if any."""
        return {} if self.head_ids is None else {"lm_head.weight": tuple(self.head_ids)}

    def head_weight(self) -> Tensor:
        """[V, E] output embedding (lm_head, or the tied input embedding); [K, E] once cut."""
        head = self.lm_head_or_none()
        return head.weight if head is not None else self.embed_tokens.weight

    def head_row(self, token_id: int) -> int:
        """The row of `head_weight()` that scores `token_id`."""
        return token_id if self.head_ids is None else self.head_ids[token_id]

    def lm_head_or_none(self) -> nn.Linear | None:
        """The untied lm_head, if the model declares one."""
        head = self._modules.get("lm_head")
        return head if isinstance(head, nn.Linear) else None

    def score_head(self) -> nn.Linear | None:
        """The classification head [labels, E], if the model declares one."""
        head = self._modules.get("score")
        return head if isinstance(head, nn.Linear) else None

"""The peer baseline's model: a checkpoint served the plain way, transformers + padded batches.

Embedding checkpoints load with AutoModel (last-token pooling, L2 normalize); reranker checkpoints
with AutoModelForCausalLM (raw score = logit("yes") - logit("no") at the last real token).
Invariant: a padded row gives the same output as the same sequence alone, for left and right
padding: the attention mask hides pads, position ids count real tokens only, and pooling reads
the last real token (not column -1).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from models.text import prompts
KINDS = ("embedding", "reranker")


def detect_kind(model_dir: Path) -> str:
    """sentence-transformers files mark an embedding checkpoint; otherwise a reranker (the hub's
    Qwen3-Embedding configs also name *ForCausalLM, so `architectures` cannot decide)."""
    if (model_dir / "config_sentence_transformers.json").exists() or (model_dir / "modules.json").exists():
        return "embedding"
    return "reranker"


def pad_batch(seqs: list[list[int]], *, pad_id: int, side: str = "left"):
    """-> input_ids, attention_mask, position_ids, each [B, T] int64 (T = longest sequence)."""
    if side not in ("left", "right"):
        raise ValueError("padding side must be left or right")
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)  # [B, T]
    mask = torch.zeros((len(seqs), t), dtype=torch.long)  # [B, T]
    for i, s in enumerate(seqs):
        sl = slice(t - len(s), t) if side == "left" else slice(0, len(s))
        ids[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = 1
    # NOTE: transformers numbers positions 0..T-1 regardless of padding unless told otherwise;
    # counting real tokens keeps left-padded rows at the positions they would have alone.
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
    return ids, mask, pos


def last_token(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """hidden [B, T, E], mask [B, T] -> [B, E] at each row's last real token (either padding)."""
    t = mask.shape[1]
    last = (mask * torch.arange(t, device=mask.device)).argmax(-1)  # [B]
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


class BaselineModel:
    def __init__(self, model_id: str, *, kind: str | None = None, device: str | None = None,
                 dtype: str | None = None, max_length: int | None = None) -> None:
        import transformers

        self.model_dir = Path(model_id)
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"the baseline needs a local checkpoint directory, got {model_id!r}")
        self.kind = kind or detect_kind(self.model_dir)
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
            dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        ]
        cls = transformers.AutoModel if self.kind == "embedding" else transformers.AutoModelForCausalLM
        self.model = cls.from_pretrained(str(self.model_dir), dtype=self.dtype).to(self.device).eval()
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self.max_length = int(max_length or cfg.get("max_position_embeddings", 32768))
        eos = cfg.get("eos_token_id")
        self.pad_id = int(eos[0] if isinstance(eos, list) else (eos if eos is not None else 0))
        if self.kind == "reranker":
            self.template = prompts.RerankTemplate(self.tokenizer)
            yes, no = self.tokenizer.token_to_id("yes"), self.tokenizer.token_to_id("no")
            if yes is None or no is None:
                raise ValueError("reranker tokenizer lacks the 'yes'/'no' tokens")
            self.yes_no = (yes, no)

    # ------------------------------------------------------------ tokenization (request side)

    def encode_texts(self, texts: list[str], *, truncate: bool = True) -> list[list[int]]:
        return prompts.encode_embedding_inputs(self.tokenizer, texts, max_length=self.max_length, truncate=truncate)

    def encode_pairs(self, query: str, docs: list[str], *, instruction: str | None = None,
                     truncate: bool = True) -> list[list[int]]:
        return self.template.encode(query, docs, instruction=instruction or prompts.DEFAULT_INSTRUCTION,
                                    max_length=self.max_length, truncate=truncate)

    # ------------------------------------------------------------ forward (worker side)

    @torch.inference_mode()
    def forward(self, seqs: list[list[int]], *, side: str = "left") -> torch.Tensor:
        """Embeddings [B, E] (L2-normalized, float32) or raw reranker scores [B]."""
        ids, mask, pos = (x.to(self.device) for x in pad_batch(seqs, pad_id=self.pad_id, side=side))
        if self.kind == "embedding":
            hidden = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state  # [B, T, E]
            pooled = last_token(hidden, mask).float()  # [B, E]
            return torch.nn.functional.normalize(pooled, dim=-1).cpu()
        # Reranker: run the decoder, then the lm_head on the B pooled rows only (two columns).
        hidden = self.model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        pooled = last_token(hidden, mask)  # [B, E]
        w = self.model.lm_head.weight[list(self.yes_no)]  # [2, E]
        logits = (pooled @ w.T).float()  # [B, 2]
        return (logits[:, 0] - logits[:, 1]).cpu()

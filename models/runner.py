"""Runner: a loaded model plus its pooling/head, with the prepare (host) / run (device) split.

Invariant: `prepare` is host-only (numpy, pinned copies) so the scheduler's CPU thread can build
batch N+1 while `run` executes batch N; `run` returns CPU float32 with one device-to-host copy.
Backend and kernels are chosen once here, at build time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

import kernels
from models.attention import select_backend, to_device
from models.batch import ForwardBatch, build_forward_batch
from models.config import ModelConfig
from models.loader import default_device, load_weights, parse_dtype, resolve_model_dir
from models.pooling import POOLINGS, pool, rerank_logits, token_states
from models.qwen3 import Kernels, Qwen3Model

KINDS = ("embedding", "reranker")
RADIX_ATTENTION = ("compact", "paper")
_POOLING_KEYS = (("pooling_mode_lasttoken", "last-token"), ("pooling_mode_mean_tokens", "mean"),
                 ("pooling_mode_cls_token", "cls"))


@dataclass(frozen=True)
class TokenBatch:
    """A ForwardBatch whose flagged items answer every token's final state, not a pooled one."""

    forward: ForwardBatch
    items: tuple[int, ...]  # the flagged items, in batch order
    rows: torch.Tensor  # [sum of their lengths] int64 model row of each of their tokens


@dataclass
class Runner:
    kind: str
    model_id: str
    config: ModelConfig
    tokenizer: Tokenizer
    model: Qwen3Model
    device: torch.device
    dtype: torch.dtype
    pooling: str
    radix_attention: str
    attention_backend: str
    kernels: str
    max_positions: int
    hidden_size: int
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    yes_id: int | None = None
    no_id: int | None = None

    def prepare(self, input_ids, cu_seqlens, index=None, all_tokens=None) -> ForwardBatch | TokenBatch:
        """Host side: everything the forward needs, pinned and queued to the device.

        all_tokens: [B] bool, the items that want every token's state; any True gives a TokenBatch.
        """
        batch = build_forward_batch(
            input_ids, cu_seqlens, index, mode=self.radix_attention, device=self.device,
            mean_pooling=self.kind == "embedding" and self.pooling == "mean",
        )
        mask = np.zeros(0, dtype=bool) if all_tokens is None else np.asarray(all_tokens, dtype=bool)
        if not mask.any():
            return batch
        if mask.shape != (batch.num_seqs,):
            raise ValueError(f"all_tokens has shape {mask.shape}, the batch {batch.num_seqs} sequences")
        lens = np.asarray(batch.seq_lens, dtype=np.int64)  # [B]
        # The model row of every original token: the index's scatter in radix modes.
        rows_of = (np.arange(batch.num_tokens, dtype=np.int64) if batch.mode == "off"
                   else np.asarray(index.scatter).astype(np.int64))  # [N]
        rows = rows_of[np.repeat(mask, lens)]  # [sum of the flagged lengths]
        return TokenBatch(batch, tuple(int(i) for i in np.flatnonzero(mask)),
                          to_device(torch.from_numpy(np.ascontiguousarray(rows)), self.device))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Differentiable pooled output on the device: [B, E] embeddings or [B] raw scores."""
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, E]
        return self._head(hidden, batch)

    def _head(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.kind == "reranker":
            return rerank_logits(self.model, hidden, batch, yes_id=self.yes_id, no_id=self.no_id)
        return pool(self.model, hidden, batch, self.pooling)

    def run(self, batch: ForwardBatch | TokenBatch) -> torch.Tensor | list:
        """CPU float32: [B, E] pooled embeddings (not normalised) or [B] raw reranker scores;
        for a TokenBatch a list with one output per item, [L, E] for the flagged items."""
        with torch.inference_mode():
            if isinstance(batch, TokenBatch):
                return self._run_tokens(batch)
            if batch.num_seqs == 0:
                shape = (0,) if self.kind == "reranker" else (0, self.hidden_size)
                return torch.zeros(shape, dtype=torch.float32)
            return self.forward(batch).float().cpu()

    def _run_tokens(self, tb: TokenBatch) -> list:
        batch = tb.forward
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, E]
        pooled = self._head(hidden, batch).float()  # [B, E] or [B]
        states = token_states(self.model, hidden, tb.rows).float()  # [M, E]
        pooled, states = pooled.cpu().numpy(), states.cpu().numpy()
        out: list = [float(p) if pooled.ndim == 1 else p.copy() for p in pooled]
        lens = [batch.seq_lens[i] for i in tb.items]
        for i, part in zip(tb.items, np.split(states, np.cumsum(lens)[:-1])):
            out[i] = part  # [L, E]
        return out


def detect_kind(model_dir: Path, cfg: ModelConfig) -> str:
    if (model_dir / "modules.json").is_file() or (model_dir / "config_sentence_transformers.json").is_file():
        return "embedding"
    if cfg.is_causal_lm:
        return "reranker"
    return "embedding"


def detect_pooling(model_dir: Path) -> str:
    path = model_dir / "1_Pooling" / "config.json"
    if path.is_file():
        conf = json.loads(path.read_text())
        for key, name in _POOLING_KEYS:
            if conf.get(key):
                return name
    return "last-token"


def _prompts(model_dir: Path) -> tuple[dict[str, str], str | None]:
    path = model_dir / "config_sentence_transformers.json"
    if not path.is_file():
        return {}, None
    conf = json.loads(path.read_text())
    return dict(conf.get("prompts") or {}), conf.get("default_prompt_name")


def _token_id(tok: Tokenizer, word: str) -> int:
    tid = tok.token_to_id(word)
    if tid is None:
        ids = tok.encode(word, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"reranker needs {word!r} to be one token, got ids {ids}")
        tid = ids[0]
    return int(tid)


def load_runner(model_id: str, *, revision: str | None = None, device=None, dtype=None,
                radix_attention: str = "compact", pooling: str | None = None,
                kind: str | None = None) -> Runner:
    """Resolve, load and wire up a model for serving (see docs/architecture.md)."""
    if radix_attention not in RADIX_ATTENTION:
        raise ValueError(f"radix_attention must be one of {RADIX_ATTENTION}, got {radix_attention!r}")
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    model_dir = resolve_model_dir(model_id, revision)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype, device)
    kind = kind or detect_kind(model_dir, cfg)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    backend = select_backend(device, dtype=dtype)
    ker = Kernels(backend, kernels.get_gather_rows(device), kernels.get_gather_rows_pair(device))
    with torch.device("meta"):
        model = Qwen3Model(cfg, ker, rope_device=device, lm_head=kind == "reranker")
    load_weights(model, model_dir, device=device, dtype=dtype)
    model.eval()

    prompts, default_prompt_name = _prompts(model_dir)
    yes_id = no_id = None
    if kind == "reranker":
        yes_id, no_id = _token_id(tokenizer, "yes"), _token_id(tokenizer, "no")
    max_positions = cfg.max_position_embeddings
    if cfg.sliding_window is not None:  # beyond the window our full causal attention is wrong
        max_positions = min(max_positions, cfg.sliding_window)
    return Runner(
        kind=kind, model_id=str(model_id), config=cfg, tokenizer=tokenizer, model=model,
        device=device, dtype=dtype, pooling=pooling or detect_pooling(model_dir),
        radix_attention=radix_attention, attention_backend=backend.name,
        kernels=kernels.describe(device), max_positions=max_positions,
        hidden_size=cfg.hidden_size, prompts=prompts, default_prompt_name=default_prompt_name,
        yes_id=yes_id, no_id=no_id,
    )


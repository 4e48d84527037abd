"""Runner: a loaded model plus its pooling/head, with the prepare (host) / run (device) split.

Invariant: `prepare` is host-only (numpy, pinned copies) so the scheduler's CPU thread can build
batch N+1 while `run` executes batch N; it builds the prefix trie and applies the threshold gate
itself, so callers see batches, never tries. `run` returns CPU float32 with one device-to-host
copy. Backend and kernels are chosen once here, at build time. With a prefix cache, every
prepared batch holds a lease on it: `run` commits it when the forward succeeded and aborts it
otherwise. Items flagged `all_tokens` answer every token's final state, read from the model rows
through the trie's scatter (never an uncompacted forward); their batch skips the prefix cache.
"""
from __future__ import annotations

import dataclasses

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

import kernels
from models.attention import to_device
from models.attention_select import select_backend
from models.batch import ForwardBatch, build_forward_batch
from models.config import ModelConfig
from models.linear import pack_linears
from models.loader import default_device, load_weights, parse_dtype, resolve_model_dir
from models.pooling import POOLINGS, pool, rerank_logits, token_states
from models.prefix_cache import BLOCK_TOKENS, DEFAULT_SIZE, PrefixCache, bytes_per_token, capacity_tokens
from models.qwen3 import Kernels, Qwen3Model
from models.radix import build_index, positions_from_cu_seqlens
from models.tree_attention import POLICIES as TREE_POLICIES, attach_tree
from models.tree_select import TreeBackend, select_tree

KINDS = ("embedding", "reranker")
RADIX_ATTENTION = ("compact", "paper")
log = logging.getLogger(__name__)
_POOLING_KEYS = (("pooling_mode_lasttoken", "last-token"), ("pooling_mode_mean_tokens", "mean"),
                 ("pooling_mode_cls_token", "cls"))


def use_index(threshold: float, ratio: float) -> bool:
    """The trie gate: 0 never (not even built), >= 1 always, else iff N'/N < threshold."""
    return threshold >= 1.0 or (threshold > 0.0 and ratio < threshold)


@dataclass(frozen=True)
class PreparedBatch:
    """One batch ready for `run`, and the figures the scheduler reports about it."""

    forward: ForwardBatch
    n_tokens: int  # N, original tokens
    n_compact: int  # rows the model runs on: N' with the trie, N without
    ratio: float  # N'/N of the trie (1.0 when it was not built)
    used_index: bool  # did the gate let the trie through
    computed_tokens: tuple[int, ...] = ()  # [B] tokens of each sequence not read from the prefix cache
    token_items: tuple[int, ...] = ()  # the all_tokens items, ascending: they answer [L, E] states
    token_rows: torch.Tensor | None = None  # [sum of their lengths] int64 model row of each of their tokens


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
    radix_threshold: float = 0.95  # the trie gate (see use_index)
    prefix_cache: PrefixCache | None = None  # None: off (size 0, or a mode it cannot serve)
    # {backend: why it is not the one running} (start-up log, /info attention_backend_rejected)
    attention_rejected: dict[str, str] = field(default_factory=dict)
    warmup_ms: float | None = None
    # tree attention for compact batches: "auto" (per batch, by estimated cost), "on", "off";
    # tree_path is the kernel path chosen at build (None: unavailable, tree_rejected says why)
    tree_attention: str = "auto"
    tree_path: TreeBackend | None = None
    tree_rejected: dict[str, str] = field(default_factory=dict)
    linear: str = "F.linear"  # "onednn-packed" when models.linear packed the weights

    @property
    def attention_report(self) -> dict:
        """Which attention backend runs and why the others do not (for /info and logs)."""
        return {"attention_backend": self.attention_backend,
                "attention_backend_rejected": dict(self.attention_rejected),
                "tree_attention": self.tree_report}

    @property
    def tree_report(self) -> str:
        """E.g. "auto (cpu-flash)", or "off (...)" with why no path is available."""
        if self.tree_path is None or self.tree_attention == "off":
            why = "; ".join(f"{k}: {v}" for k, v in self.tree_rejected.items()) or "off"
            return f"off ({why})" if self.tree_attention != "off" else "off"
        return f"{self.tree_attention} ({self.tree_path.name})"

    def prepare(self, input_ids, cu_seqlens, *, all_tokens=None) -> PreparedBatch:
        """Host side: input_ids int [N], cu_seqlens int [B+1] -> everything the forward needs.

        Builds the trie unless the threshold is 0, keeps it iff the gate says so, and pins and
        queues the tensors to the device. all_tokens: None, or [B] bool, the items that answer
        every token's final state instead of the pooled output.
        """
        n = int(cu_seqlens[-1])
        mask = np.zeros(0, dtype=bool) if all_tokens is None else np.asarray(all_tokens, dtype=bool)
        if mask.any() and mask.shape != (len(cu_seqlens) - 1,):
            raise ValueError(f"all_tokens has shape {mask.shape}, the batch {len(cu_seqlens) - 1} sequences")
        per_token = bool(mask.any())
        index, ratio = None, 1.0
        if self.radix_threshold > 0.0:
            built = build_index(input_ids, positions_from_cu_seqlens(cu_seqlens), cu_seqlens)
            ratio = float(built.ratio)
            if use_index(self.radix_threshold, ratio):
                index = built
        # NOTE: tokens read from the prefix cache have no hidden-state row (only pooled K/V), so a
        # batch with per-token items runs without it. Leaving out only those items' sequences is
        # not enough: a cached node they share with another sequence would still lose its row, and
        # uncaching it would break the cache's prefix-closed layout. Such batches are rare.
        use_cache = self.cache_usable and not per_token
        forward = build_forward_batch(
            input_ids, cu_seqlens, index, mode=self.radix_attention, device=self.device,
            mean_pooling=self.kind == "embedding" and self.pooling == "mean",
            cache=self.prefix_cache if use_cache else None,
        )
        forward = attach_tree(forward, self.tree_attention, self.tree_path.fn if self.tree_path else None,
                              heads=self.config.num_attention_heads,
                              kv_heads=self.config.num_key_value_heads, head_dim=self.config.head_dim)
        items, rows = (), None
        if per_token:
            lens = np.diff(np.asarray(cu_seqlens, dtype=np.int64))  # [B]
            # The model row of every original token: itself without the trie, else its compact row.
            rows_of = (np.arange(n, dtype=np.int64) if forward.mode == "off"
                       else np.asarray(index.scatter).astype(np.int64))  # [N]
            picked = rows_of[np.repeat(mask, lens)]  # [sum of the flagged lengths]
            items = tuple(int(i) for i in np.flatnonzero(mask))
            rows = to_device(torch.from_numpy(np.ascontiguousarray(picked)), self.device)
        # NOTE: rows actually computed: N' (or N) less the prefix cache's hits.
        return PreparedBatch(forward, n_tokens=n, n_compact=forward.num_rows, ratio=ratio,
                             used_index=index is not None, computed_tokens=forward.computed_tokens,
                             token_items=items, token_rows=rows)

    @property
    def cache_usable(self) -> bool:
        """The prefix cache serves compact attention with last-token outputs only (a copy of the
        runner with another mode or pooling, `dataclasses.replace`, keeps the pool but not its use)."""
        return self.radix_attention == "compact" and (self.kind == "reranker" or self.pooling == "last-token")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Differentiable pooled output on the device: [B, E] embeddings or [B] raw scores."""
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, E]
        return self._head(hidden, batch)

    def _head(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.kind == "reranker":
            return rerank_logits(self.model, hidden, batch, yes_id=self.yes_id, no_id=self.no_id)
        return pool(self.model, hidden, batch, self.pooling)

    def run(self, prepared: PreparedBatch) -> torch.Tensor | list:
        """CPU float32: [B, E] pooled embeddings (not normalised) or [B] raw reranker scores; with
        all_tokens items a list of B outputs, [L, E] final states for those items."""
        batch = prepared.forward
        try:
            with torch.inference_mode():
                if batch.num_seqs == 0:
                    shape = (0,) if self.kind == "reranker" else (0, self.hidden_size)
                    out = torch.zeros(shape, dtype=torch.float32)
                elif prepared.token_items:
                    out = self._run_tokens(prepared)
                else:
                    out = self.forward(batch).float().cpu()  # synchronises: pool writes are done
        except BaseException:
            if batch.cache is not None:
                batch.cache.abort()
            raise
        if batch.cache is not None:
            batch.cache.commit()
        return out

    def _run_tokens(self, prepared: PreparedBatch) -> list:
        batch = prepared.forward
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, E]
        pooled = self._head(hidden, batch).float().cpu().numpy()  # [B, E] or [B]
        states = token_states(self.model, hidden, prepared.token_rows).float().cpu().numpy()  # [M, E]
        out: list = list(pooled)
        lens = [batch.seq_lens[i] for i in prepared.token_items]
        for i, part in zip(prepared.token_items, np.split(states, np.cumsum(lens)[:-1])):
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
                kind: str | None = None, radix_threshold: float = 0.95,
                prefix_cache_size: str | int = DEFAULT_SIZE, cpu_packed_weights: bool = True,
                keep_dense_weights: bool = True, tree_attention: str = "auto") -> Runner:
    """Resolve, load and wire up a model for serving (see docs/architecture.md).

    prefix_cache_size: "512MiB", "2GB", "8192tokens", a byte count, "auto" or 0 (off); see
    docs/operations.md, "Prefix cache". cpu_packed_weights: reorder the linear weights for oneDNN
    on a CPU in float32 (models/linear.py); keep_dense_weights=False then frees the dense copies
    (serving: one copy in memory; gradients no longer reach the linear weights).
    """
    if not radix_threshold >= 0.0:  # NOTE: also refuses NaN
        raise ValueError(f"radix_threshold must be >= 0, got {radix_threshold!r}")
    if radix_attention not in RADIX_ATTENTION:
        raise ValueError(f"radix_attention must be one of {RADIX_ATTENTION}, got {radix_attention!r}")
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if tree_attention not in TREE_POLICIES:
        raise ValueError(f"tree_attention must be one of {TREE_POLICIES}, got {tree_attention!r}")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    capacity_tokens(prefix_cache_size, 1)  # a malformed size fails before the weights load
    model_dir = resolve_model_dir(model_id, revision)
    cfg = ModelConfig.from_pretrained_dir(model_dir)
    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype, device)
    kind = kind or detect_kind(model_dir, cfg)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    backend = select_backend(device, dtype=dtype, heads=cfg.num_attention_heads,
                             kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    log.info("attention backend %s on %s %s; not used: %s", backend.name, device,
             str(dtype).replace("torch.", ""),
             "; ".join(f"{k} ({v})" for k, v in backend.rejected.items()) or "none")
    tree_path, tree_rejected = select_tree(device, dtype=dtype, heads=cfg.num_attention_heads,
                                           kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
    log.info("tree attention %s: %s", tree_attention,
             tree_path.name if tree_path else "no path (" + "; ".join(f"{k}: {v}" for k, v in tree_rejected.items()) + ")")
    ker = Kernels(backend, kernels.get_gather_rows(device), kernels.get_gather_rows_pair(device))
    with torch.device("meta"):
        model = Qwen3Model(cfg, ker, rope_device=device, lm_head=kind == "reranker")
    load_weights(model, model_dir, device=device, dtype=dtype)
    model.eval()
    linear = _pack(model, device=device, dtype=dtype, wanted=cpu_packed_weights, keep_dense=keep_dense_weights)

    prompts, default_prompt_name = _prompts(model_dir)
    yes_id = no_id = None
    if kind == "reranker":
        yes_id, no_id = _token_id(tokenizer, "yes"), _token_id(tokenizer, "no")
    pooling = pooling or detect_pooling(model_dir)
    prefix_cache = _prefix_cache(cfg, prefix_cache_size, kind=kind, pooling=pooling,
                                 radix_attention=radix_attention, device=device, dtype=dtype)
    max_positions = cfg.max_position_embeddings
    if cfg.sliding_window is not None:  # beyond the window our full causal attention is wrong
        max_positions = min(max_positions, cfg.sliding_window)
    runner = Runner(
        kind=kind, model_id=str(model_id), config=cfg, tokenizer=tokenizer, model=model,
        device=device, dtype=dtype, pooling=pooling,
        radix_attention=radix_attention, attention_backend=backend.name,
        kernels=kernels.describe(device), max_positions=max_positions,
        hidden_size=cfg.hidden_size, prompts=prompts, default_prompt_name=default_prompt_name,
        yes_id=yes_id, no_id=no_id, radix_threshold=float(radix_threshold), prefix_cache=prefix_cache,
        attention_rejected=dict(backend.rejected), linear=linear,
        tree_attention=tree_attention, tree_path=tree_path, tree_rejected=tree_rejected,
    )
    warm_up(runner)
    return runner


def _pack(model: Qwen3Model, *, device: torch.device, dtype: torch.dtype, wanted: bool,
          keep_dense: bool) -> str:
    """Pack the linears where it pays (CPU float32); say at start which path runs and why."""
    if not wanted:
        log.info("linear layers: F.linear (cpu_packed_weights off)")
        return "F.linear"
    reason = pack_linears(model, device=device, dtype=dtype, keep_dense=keep_dense)
    if reason is None:
        log.info("linear layers: oneDNN with weights packed at load (CPU float32%s)",
                 "" if keep_dense else "; the packed copy is the only one")
        return "onednn-packed"
    # NOTE: not packing is the normal case off the CPU; on the CPU in fp32 it is a slow path
    (log.warning if device.type == "cpu" and dtype == torch.float32 else log.info)(
        "linear layers: F.linear (%s)", reason)
    return "F.linear"


WARMUP_LENGTHS = (16, 16, 5)  # a few short sequences: every GEMM shape class, no real cost


def warm_up(runner: Runner) -> float:
    """One forward on a tiny batch before serving, so the first request does not pay cuBLAS
    handles, allocator growth and lazy module set-up. Runs here, before any scheduler or
    metrics exist, so it is never counted. Logs "warm-up" with its time; returns ms."""
    lens = np.asarray(WARMUP_LENGTHS, np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    ids = np.arange(int(cu[-1]), dtype=np.int32) % max(1, runner.config.vocab_size)
    t0 = time.perf_counter()
    # NOTE: a copy without the prefix cache, so the warm-up's made-up tokens never enter the pool.
    cold = dataclasses.replace(runner, prefix_cache=None)
    cold.run(cold.prepare(ids, cu))  # .cpu() at the end waits for the device
    runner.warmup_ms = (time.perf_counter() - t0) * 1e3
    log.info("warm-up forward: %.1f ms (%d tokens, %s %s, attention %s)", runner.warmup_ms,
             int(cu[-1]), runner.device, str(runner.dtype).replace("torch.", ""),
             runner.attention_backend)
    return runner.warmup_ms


def _prefix_cache(cfg: ModelConfig, size, *, kind: str, pooling: str, radix_attention: str,
                  device: torch.device, dtype: torch.dtype) -> PrefixCache | None:
    """The preallocated pool, or None with a start-up line saying why it is off."""
    per_token = bytes_per_token(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                                head_dim=cfg.head_dim, dtype=dtype)
    tokens = capacity_tokens(size, per_token)
    reason = None
    if tokens <= 0:
        reason = "size 0"
    elif radix_attention != "compact":
        reason = f"radix_attention={radix_attention} (it needs compact attention)"
    elif kind == "embedding" and pooling != "last-token":
        reason = f"pooling={pooling} (it reads rows of every token, or the first; cached rows have no hidden state)"
    elif tokens < BLOCK_TOKENS:
        reason = f"size {size!r} is under one {BLOCK_TOKENS}-token block ({per_token} bytes per token)"
    if reason is not None:
        (log.info if tokens <= 0 else log.warning)("prefix cache off: %s", reason)
        return None
    cache = PrefixCache(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                        head_dim=cfg.head_dim, capacity=tokens, dtype=dtype, device=device)
    log.info("prefix cache on: %d tokens, %.1f MiB (%d bytes per token)", cache.n_slots * cache.block,
             cache.capacity_bytes / 2**20, per_token)
    return cache


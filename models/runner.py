"""Runner: a loaded model plus its pooling/head, with the prepare (host) / run (device) split.

Invariant: `prepare` is host-only (numpy, pinned copies) so the scheduler's CPU thread can build
batch N+1 while `run` executes batch N; it builds the prefix trie and applies the threshold gate
itself, so callers see batches, never tries. `run` returns CPU float32 with one device-to-host
copy. Backend and kernels are chosen once here, at build time. With a prefix cache, every
prepared batch holds a lease on it: `run` commits it when the forward succeeded and aborts it
otherwise (the commit is queued; the prep thread publishes it). Items flagged `all_tokens` answer every token's final state, read from the model rows
through the trie's scatter (never an uncompacted forward); their batch skips the prefix cache.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tokenizers import Tokenizer

import kernels
from models.batch import ForwardBatch, PreparedBatch, build_forward_batch
from models.checkpoint.directory import detect_kind, detect_pooling, read_modules, read_prompts, token_id
from models.dense import DenseStack, load_dense
from models.graphs import GraphSet, check_mode as check_cuda_graphs
from models.checkpoint.config import ModelConfig, read_config
from models.linear.select import choose_linears
from models.lone_choice import LoneChoice, Path as LonePath, paths as lone_paths
from models.checkpoint.loader import (default_device, describe_memory, load_weights, memory_report, parse_dtype,
                           resolve_model_dir)
from models.options import KINDS, POOLINGS, RADIX_ATTENTION, check_radix_mlp_threshold, use_index
from models.pooling import classify_logits, cut_trailing_pad, pool, rerank_logits, token_states
from models.report import RunnerReport
from models.prefix_cache import DEFAULT_SIZE, PrefixCache, cache_refusal, capacity_tokens
from models.prefix_setup import head_pooling, start_prefix_cache
from models.attention.paths import cpu_attention_kernel, select_paths
from models.startup import clock_for_load
from models.families.layers import AttentionOps
from models.families.protocol import ScoringModel
from models import streams
from models.streams import to_device
from models.checkpoint.reranker_mark import reranker_mark
from models.families.registry import (RERANK_TEMPLATES, SCORE_HEAD, build_model, check_kind, check_remote_code,
                                     check_template, default_kind, family_spec, rerank_spec, rerank_template_for,
                                     resolve as resolve_family)
from models.trie import RadixIndex, build_index, namespace_groups, positions_from_cu_seqlens
from models.attention.tree import POLICIES as TREE_POLICIES, attach_tree
from models.attention.tree_select import TreeBackend, describe_tree
from models.warmup import warm_up

log = logging.getLogger(__name__)
MAX_SEQS = 65535  # sequences per batch: CUDA attention kernels launch one grid row per sequence


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class Runner:
    # "embedding" [B, E] | "reranker" [B] | "classifier" [B, labels] | "reward" [B] (docs/architecture.md)
    kind: str
    model_id: str
    config: ModelConfig
    tokenizer: Tokenizer
    model: ScoringModel
    device: torch.device
    dtype: torch.dtype
    pooling: str
    radix_attention: str
    attention_backend: str
    max_positions: int
    hidden_size: int  # the answer's width: the last Dense module's out_features, else the model's
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    yes_id: int | None = None
    head: str = "pooling"  # what produces the output: "pooling", "yes-no" (lm_head rows), "score"
    # a reranker's template name and default instruction (its RerankSpec; "" when not a reranker)
    rerank_template: str = "qwen3-reranker"
    rerank_instruction: str = ""
    head_reason: str = ""  # why a score head is a reranker (its template) or a reward model (/info)
    labels: tuple[str, ...] = ()  # a score head's labels, row order (id2label)
    no_id: int | None = None
    radix_mlp_threshold: float = 0.95  # the trie gate (models.options.use_index)
    prefix_cache: PrefixCache | None = None  # None: off (size 0, or a mode it cannot serve)
    # tree attention for compact batches: "auto" (per batch, by estimated cost), "on", "off";
    # tree_path is the kernel path chosen at build (None: unavailable, report.tree_rejected says why)
    tree_attention: str = "auto"
    tree_path: TreeBackend | None = None
    # what load and warm-up chose and measured, for /info and logs (models/report.py)
    report: RunnerReport = field(default_factory=RunnerReport)
    # run() may return a HostCopy on CUDA (the scheduler settles it on its own thread); off: run waits
    defer_copies: bool = False
    dense: DenseStack | None = None  # sentence-transformers Dense modules after pooling (models/dense.py)
    graphs: GraphSet | None = None  # CUDA graphs for a lone short input (models/graphs.py); None: eager
    # a lone short batch on a CPU takes the prefix cache and torch's threads only when they measure
    # cheaper (models/lone_choice.py); None: always (the server sets one, server/app.py)
    lone_choice: LoneChoice | None = None

    @property
    def attention_report(self) -> dict:
        """Which attention backend runs and why the others do not (for /info and logs)."""
        return {"attention_backend": self.attention_backend,
                "attention_backend_rejected": dict(self.report.attention_rejected),
                "tree_attention": self.tree_report}

    @property
    def tree_report(self) -> str:
        """E.g. "auto (cpu-flash)", or "off (...)" with why no path is available."""
        return describe_tree(self.tree_attention, self.tree_path, self.report.tree_rejected, self.device)

    def prepare(self, input_ids, cu_seqlens, *, all_tokens=None, namespaces=None) -> PreparedBatch:
        """Host side: input_ids int [N], cu_seqlens int [B+1] -> everything the forward needs.

        Builds the trie unless the threshold is 0, keeps it iff the gate says so, and pins and
        queues the tensors to the device. all_tokens: None, or [B] bool, the items that answer
        every token's final state instead of the pooled output. namespaces: None, or [B] bytes,
        each item's prefix-cache namespace (b"": the shared one); items of different namespaces
        share neither cache entries nor trie nodes.
        """
        t0 = time.perf_counter()
        if self.head == "score":  # the score token: the last non-pad one (transformers' rule)
            input_ids, cu_seqlens = cut_trailing_pad(input_ids, cu_seqlens, self.config.pad_token_id)
        n = int(cu_seqlens[-1])
        if len(cu_seqlens) - 1 > MAX_SEQS:
            raise ValueError(f"a batch holds at most {MAX_SEQS} sequences (a CUDA grid dimension), "
                             f"got {len(cu_seqlens) - 1}")
        mask = None if all_tokens is None else np.asarray(all_tokens, dtype=bool)
        mask = mask if mask is not None and mask.any() else None  # None: no item answers per-token states
        if mask is not None and mask.shape != (len(cu_seqlens) - 1,):
            raise ValueError(f"all_tokens has shape {mask.shape}, the batch {len(cu_seqlens) - 1} sequences")
        per_token = mask is not None
        index: RadixIndex | None = None
        ratio = 1.0
        # NOTE: one sequence has no shared prefix (N'/N = 1): below threshold 1 the gate would drop it.
        if self.radix_mlp_threshold > 0.0 and (len(cu_seqlens) > 2 or self.radix_mlp_threshold >= 1.0):
            built = build_index(input_ids, positions_from_cu_seqlens(cu_seqlens), cu_seqlens,
                                groups=namespace_groups(namespaces))
            ratio = float(built.ratio)
            saved = n - len(built.compact_ids)
            if use_index(self.radix_mlp_threshold, ratio, saved_rows=saved, hidden_size=self.config.hidden_size):
                index = built
        use_cache = self.cache_usable(all_tokens=per_token) and not (
            self.graphs is not None and self.graphs.fits(len(cu_seqlens) - 1, n, per_token))
        lone: LonePath | None = None
        if (self.lone_choice is not None and self.device.type == "cpu"
                and self.lone_choice.applies(len(cu_seqlens) - 1, n)):
            lone = self.lone_choice.choose(lone_paths(use_cache, torch.get_num_threads()))
            use_cache = lone.cached
        # NOTE: tokens read from the prefix cache have no hidden-state row (only pooled K/V), so a
        # batch with per-token items runs without it. Leaving out only those items' sequences is
        # not enough: a cached node they share with another sequence would still lose its row, and
        # uncaching it would break the cache's prefix-closed layout. Such batches are rare.
        with streams.copying(self.device):  # CUDA: the copies go on the copy stream (models/streams.py)
            forward = build_forward_batch(
                input_ids, cu_seqlens, index, mode=self.radix_attention, device=self.device,
                mean_pooling=self.kind == "embedding" and self.pooling == "mean",
                cache=self.prefix_cache if use_cache else None,
                namespaces=namespaces,
            )
            forward = attach_tree(forward, self.tree_attention, self.tree_path.fn if self.tree_path else None,
                                  heads=self.config.num_attention_heads,
                                  kv_heads=self.config.num_key_value_heads, head_dim=self.config.head_dim)
            if self.attention_backend == "sdpa-padded":
                # NOTE: the padded layout (host work, then its copies) is built here on the prep
                # thread; left to its first use it would run in layer 0 on the worker.
                forward.attn.padded  # noqa: B018 - a cached_property: computed once, now
            items, rows = self._token_rows(n, cu_seqlens, mask, index) if mask is not None else ((), None)
        # NOTE: rows actually computed: N' (or N) less the prefix cache's hits.
        return PreparedBatch(forward, n_tokens=n, n_compact=forward.num_rows, ratio=ratio,
                             used_index=index is not None, computed_tokens=forward.computed_tokens,
                             token_items=items, token_rows=rows, ready=streams.copied(self.device),
                             lone=lone, lone_prepare_s=time.perf_counter() - t0)

    def _token_rows(self, n: int, cu_seqlens, mask: np.ndarray,
                    index: RadixIndex | None) -> tuple[tuple[int, ...], torch.Tensor]:
        """The all_tokens items (ascending) and the model row of each of their tokens, on the device."""
        lens: np.ndarray = np.diff(np.asarray(cu_seqlens, dtype=np.int64))  # [B]
        # The model row of every original token: itself without the trie, else its compact row.
        rows_of = (np.asarray(index.scatter).astype(np.int64) if index is not None
                   else np.arange(n, dtype=np.int64))  # [N]
        picked = rows_of[np.repeat(mask, lens)]  # [sum of the flagged lengths]
        items = tuple(int(i) for i in np.flatnonzero(mask))
        rows = to_device(torch.from_numpy(np.ascontiguousarray(picked)), self.device)
        return items, rows

    def cache_usable(self, *, all_tokens: bool = False) -> bool:
        """Whether a batch of this runner uses its prefix cache (`cache_refusal`; a copy of the
        runner with another mode or pooling, `dataclasses.replace`, keeps the pool but not its use)."""
        refused = cache_refusal(radix_attention=self.radix_attention,
                                pooling=head_pooling(self.kind, self.pooling), all_tokens=all_tokens)
        return self.prefix_cache is not None and refused is None

    def warm_up(self, *, max_tokens: int) -> dict:
        """The serving path once on the calling thread (the worker's): models/warmup.py."""
        figures = warm_up(self, max_tokens=max_tokens)
        self.report.startup.add("warm-up", figures["ms"] / 1e3)
        self.report.startup.finish()
        return figures

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Differentiable pooled output on the device: [B, E] embeddings or [B] raw scores."""
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, E]
        return self._head(hidden, batch)

    def _served(self, batch: ForwardBatch) -> torch.Tensor:
        """`forward` as serving runs it: a lone short input through its CUDA graph bucket when one
        was chosen (the first rows of the padded forward, models/graphs.py), else `forward` itself
        (the seam a benchmark's zero-cost forward replaces: benchmarks/host_ceiling.py)."""
        hidden = self.graphs.hidden(batch) if self.graphs is not None else None
        if hidden is None:
            return self.forward(batch)
        return self._head(hidden, batch)

    def _head(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if self.head == "score":
            logits = classify_logits(self.model, hidden, batch)  # [B, labels]
            return logits if self.kind == "classifier" else logits[:, 0]  # one score: [B]
        if self.kind == "reranker":
            assert self.yes_id is not None  # load_runner sets it (no_id: None when "yes" scores alone)
            return rerank_logits(self.model, hidden, batch, yes_id=self.yes_id, no_id=self.no_id)
        pooled = pool(self.model, hidden, batch, self.pooling)  # [B, E]
        return pooled if self.dense is None else self.dense(pooled)  # [B, out_features]

    def run(self, prepared: PreparedBatch) -> torch.Tensor | list | streams.HostCopy:
        """CPU float32: [B, E] pooled embeddings (not normalised) or [B] raw reranker scores; with
        all_tokens items a list of B outputs, [L, E] final states for those items. With
        ``defer_copies`` on CUDA the same comes as a ``HostCopy`` (models/streams.py): the copy
        into pinned memory is under way, ``result()`` waits for it, the caller is not blocked.

        NOTE: on CUDA the cache lease is committed once the forward is queued: later batches read
        the pool on the same stream, after it; a device fault there is fatal to the process. The
        commit here only queues the lease; the prep thread publishes it before its next look-up."""
        batch = prepared.forward
        t0 = time.perf_counter()
        out: torch.Tensor | list | streams.HostCopy
        lone = prepared.lone
        restore = 0  # the thread count to give back after this forward (0: left as it is)
        if lone is not None and lone.threads != (current := torch.get_num_threads()):
            torch.set_num_threads(lone.threads)  # forwards never overlap (models/lone_choice.py)
            restore = current
        try:
            with torch.inference_mode():
                streams.await_copies(prepared.ready, streams.device_tensors(prepared), self.device)
                if batch.num_seqs == 0:
                    shape = self.output_shape(0)
                    out = torch.zeros(shape, dtype=torch.float32)
                elif prepared.token_items:
                    out = self._run_tokens(prepared)
                else:
                    out = streams.to_host((self._served(batch),), _same)  # on a CPU: done, pool writes too
        except BaseException:
            if batch.cache is not None:
                batch.cache.abort()
            raise
        finally:
            if restore:
                torch.set_num_threads(restore)
        if batch.cache is not None:
            batch.cache.commit()
        if lone is not None and self.lone_choice is not None:
            self.lone_choice.record(lone, prepared.lone_prepare_s + time.perf_counter() - t0)
        return out if self.defer_copies else streams.settled(out)

    def output_shape(self, n: int) -> tuple[int, ...]:
        """The shape of `run`'s pooled answer for n sequences."""
        if self.kind == "classifier":
            return (n, len(self.labels))
        return (n, self.hidden_size) if self.kind == "embedding" else (n,)

    def _run_tokens(self, prepared: PreparedBatch) -> list | streams.HostCopy:
        batch = prepared.forward
        assert prepared.token_rows is not None  # prepare sets it with token_items
        hidden = self.model(batch.input_ids, batch.positions, batch)  # [T, E]
        pooled = self._head(hidden, batch)  # [B, E] or [B]
        states = token_states(self.model, hidden, prepared.token_rows)  # [M, E]
        lens = [batch.seq_lens[i] for i in prepared.token_items]

        def finish(pooled_host: torch.Tensor, states_host: torch.Tensor) -> list:
            out: list = list(pooled_host.numpy())
            for i, part in zip(prepared.token_items, np.split(states_host.numpy(), np.cumsum(lens)[:-1])):
                out[i] = part  # [L, E]
            return out

        return streams.to_host((pooled, states), finish)


def load_runner(model_id: str, *, revision: str | None = None, device=None, dtype=None,
                radix_attention: str = "compact", pooling: str | None = None,
                kind: str | None = None, radix_mlp_threshold: float = 0.95,
                prefix_cache_size: str | int = DEFAULT_SIZE, cpu_packed_weights: bool = True, cpu_weights: str = "fp32",
                keep_dense_weights: bool = True, max_batch_tokens: int = 16384,
                tree_attention: str = "auto", dense_path: str | None = None,
                rerank_template: str | None = None, cuda_graphs: str = "auto") -> Runner:
    """Resolve, load and wire up a model for serving (see docs/architecture.md).

    prefix_cache_size: "512MiB", "2GB", "8192tokens", a byte count, "auto" or 0 (off); see
    docs/operations.md, "Prefix cache". cpu_packed_weights: reorder the linear weights for oneDNN
    on a CPU in float32 (models/linear/packed.py); keep_dense_weights=False then frees the dense copies
    (serving: one copy in memory; gradients no longer reach the linear weights). cpu_weights:
    fp32, int8 or bf16 linear weights on a CPU in float32 (models/linear/select.py).
    max_batch_tokens: the largest batch served; a CUDA `auto` cache is sized after a forward of it.
    Nothing is warmed up here: the scheduler's worker thread calls `warm_up` before serving.
    dense_path: TEI's --dense-path (models/checkpoint/directory.py, `read_modules`).
    rerank_template: serve a score or yes/no head through this reranker template
    (models/families/registry.py, `rerank_template_for`).
    cuda_graphs: auto, on or off: a lone short input through CUDA graphs captured at warm-up where
    they measure faster (models/graphs.py); `on` on a device other than CUDA is refused.
    """
    radix_mlp_threshold = check_radix_mlp_threshold(radix_mlp_threshold)
    if radix_attention not in RADIX_ATTENTION:
        raise ValueError(f"radix_attention must be one of {RADIX_ATTENTION}, got {radix_attention!r}")
    if pooling is not None and pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if tree_attention not in TREE_POLICIES:
        raise ValueError(f"tree_attention must be one of {TREE_POLICIES}, got {tree_attention!r}")
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    capacity_tokens(prefix_cache_size, 1)  # a malformed size fails before the weights load
    clock = clock_for_load()
    model_dir = resolve_model_dir(model_id, revision)
    raw = read_config(model_dir)
    # refuses what we would serve wrong, before the numbers are parsed
    family = resolve_family(str(raw.get("model_type", "")), tuple(raw.get("architectures") or ()))
    cfg = ModelConfig.from_dict(raw)
    check_remote_code(raw)
    device = torch.device(device) if device is not None else default_device()
    dtype = parse_dtype(dtype, device)
    template, head_reason = rerank_template_for(
        family, cfg.model_type, rerank_template, kind=kind,
        mark=reranker_mark(model_dir, raw, RERANK_TEMPLATES.get((cfg.model_type, family.head))))
    kind = kind or default_kind(family, len(cfg.labels), template=template) or detect_kind(model_dir, cfg)
    check_kind(family, kind, len(cfg.labels))
    check_template(family, kind, template, given=rerank_template is not None)
    if kind == "reward" and template is not None:  # a marked conversion the operator serves as a reward model
        head_reason = "--model-task reward"
    head = "score" if family.head == SCORE_HEAD else "yes-no" if kind == "reranker" else "pooling"
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    backend, tree_path, tree_rejected = select_paths(cfg, family_spec(family, cfg), device=device, dtype=dtype,
                                                     tree_attention=tree_attention)
    ops = AttentionOps(backend, kernels.get_gather_rows(device), kernels.get_gather_rows_pair(device))
    check_cuda_graphs(cuda_graphs, device)  # before the weights load
    yes_id = no_id = None
    rerank = rerank_spec(template, family, log_choice=kind == "reranker") if kind == "reranker" and template else None
    if head == "yes-no" and rerank is not None:
        yes_id = token_id(tokenizer, rerank.yes)
        no_id = token_id(tokenizer, rerank.no) if rerank.no is not None else None
    labels = cfg.labels if head == "score" else ()
    clock.mark("config")
    with torch.device("meta"):
        model = build_model(family, cfg, ops, rope_device=device, lm_head=head == "yes-no",
                            num_labels=len(labels))
        if yes_id is not None:  # the score reads these rows only
            model.keep_head_rows((yes_id,) if no_id is None else (yes_id, no_id))
    load_weights(model, model_dir, device=device, dtype=dtype, take_rows=model.head_rows())
    model.eval()
    clock.mark("weights")
    linear = choose_linears(model, device=device, dtype=dtype, weights=cpu_weights,
                            packed_wanted=cpu_packed_weights, keep_dense=keep_dense_weights)
    (log.warning if linear.failed else log.info)("linear layers: %s weights, %s", linear.weights, linear.report)
    memory = memory_report(model, device)  # the weights as served: int8 or bf16 at their own size
    log.info("weights loaded: %s", describe_memory(memory))
    cpu_attention = cpu_attention_kernel(cfg, device=device, dtype=dtype, wanted=cpu_packed_weights)
    if cpu_attention and backend.name == "spec-varlen":  # the blocks' kernels do not run at all
        cpu_attention = "spec-varlen (the checkpoint's soft-cap or window; no CPU block kernel)"
    clock.mark("kernel choices")

    prompts, default_prompt_name = read_prompts(model_dir)
    modules = read_modules(model_dir, hidden_size=cfg.hidden_size, dense_path=dense_path) if kind == "embedding" else None
    if dense_path is not None and modules is None:
        raise ValueError(f"--dense-path applies to an embedding model, not a {kind}")
    pooling = pooling or (modules.pooling if modules is not None else None) or detect_pooling(model_dir)
    dense = load_dense(model_dir, modules.dense, device) if modules is not None else None
    max_positions = cfg.max_position_embeddings
    if cfg.sliding_window is not None:  # beyond the window our full causal attention is wrong
        max_positions = min(max_positions, cfg.sliding_window)
    graphs_report: dict = {}  # filled in place by the GraphSet (live: /info reads it before the warm-up)
    runner = Runner(
        kind=kind, model_id=str(model_id), config=cfg, tokenizer=tokenizer, model=model,
        device=device, dtype=dtype, pooling=pooling,
        radix_attention=radix_attention, attention_backend=backend.name, max_positions=max_positions,
        hidden_size=dense.out_features if dense is not None else cfg.hidden_size, prompts=prompts,
        default_prompt_name=default_prompt_name, yes_id=yes_id, no_id=no_id, head=head, labels=labels,
        rerank_template=rerank.template if rerank else "",
        head_reason=head_reason if head == "score" and kind != "classifier" else "",
        rerank_instruction=rerank.instruction if rerank else "", radix_mlp_threshold=radix_mlp_threshold,
        tree_attention=tree_attention, tree_path=tree_path, dense=dense,
        graphs=GraphSet(cuda_graphs, device, report=graphs_report),
        report=RunnerReport(attention_rejected=dict(backend.rejected), tree_rejected=tree_rejected,
                            kernels=kernels.describe(device), linear=linear.kernel,
                            linear_choice=f"{linear.weights}: {linear.report}", cpu_attention=cpu_attention,
                            memory=memory, startup=clock, cuda_graphs=graphs_report),
    )
    runner.prefix_cache, cache_report = start_prefix_cache(runner, prefix_cache_size, max_batch_tokens=max_batch_tokens)
    runner.report = dataclasses.replace(runner.report, prefix_cache=cache_report)
    clock.mark("cache allocation")
    return runner


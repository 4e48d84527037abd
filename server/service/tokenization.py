"""Tokenization off the event loop: batch encodes in a small thread pool, timed into metrics.

Every encode of a request runs as one ``encode_batch`` call in the executor, so the event loop
never blocks on the tokenizer (HF tokenizers releases the GIL inside its Rust batch encode),
except a short request (``short``: a few inputs, ~2k characters), encoded on the loop: that costs
tens of microseconds, less than the hop to a thread and back.
Prompt and truncation failures, and a rerank request over the pair-token budget
(``max_pair_tokens``, models/text/pair_budget.py: one budget per request, however many distinct
queries it holds), surface as ApiError (422) in the route's dialect. /tokenize's
answer is bounded: at most ``max_display_tokens`` tokens per request, counted on prefixes of the
inputs (work in proportion to the cap, ``count_capped``) before the full encode and any token
object, and rendered to JSON bytes in the executor too.
"""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

from models.text import prompts
from models.text import rerank_templates
from scheduler.metrics import Metrics
from server.http.errors import ApiError
from server.memory import text_token_bound
from server.service.contract import ServedRunner

T = TypeVar("T")
INLINE_TEXTS = 4  # requests with at most this many inputs ...
INLINE_CHARS = 2048  # ... of at most this many characters together (prompt included) tokenize inline
TEMPLATE_TEXT = 64  # bytes of format text a template writes around a rerank body ("<Query>: ", "A: ", ...)


class Tokenization:
    """The tokenizer-facing half of a request, bound to one runner's tokenizer and limits."""

    def __init__(
        self, runner: ServedRunner, *, max_input_length: int, metrics: Metrics, max_display_tokens: int = 16384,
        workers: int = 2, max_pair_tokens: int = 0,
    ) -> None:
        self.tokenizer = runner.tokenizer
        self.max_input_length = max_input_length
        self.max_pair_tokens = max_pair_tokens  # tokens of one rerank request's pairs together (0: no limit)
        self.max_display_tokens = max_display_tokens
        self.metrics = metrics
        # NOTE: the embedding table's rows bound valid ids (an id past it would crash the batch).
        self.vocab_size = int(runner.config.vocab_size)
        # a reranker's template, by the name the family's RerankSpec gives (models/text/rerank_templates.py)
        self.rerank = (rerank_templates.build_template(runner.rerank_template, runner.tokenizer,
                                                       bos_id=runner.config.bos_token_id)
                       if runner.kind == "reranker" else None)
        self.special_ids = frozenset(
            i for i, tok in runner.tokenizer.get_added_tokens_decoder().items() if tok.special
        )
        # Tokens an input may hold beyond its own text's bound: the special tokens (a pair's), the
        # rerank template around the body and the body's own format text (< TEMPLATE_TEXT bytes).
        template = self.rerank
        around = len(template.prefix_ids) + len(template.suffix_ids) if isinstance(template, prompts.RerankTemplate) else 0
        around += len(getattr(template, "bos_ids", ())) + 2 * len(getattr(template, "sep_ids", ()))
        self.overhead = runner.tokenizer.num_special_tokens_to_add(True) + around + TEMPLATE_TEXT
        self.workers = workers
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="radixserve-tok")

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[[], T], *, inline: bool = False) -> T:
        """``fn()`` in the pool; ``inline``: on the loop (a short input costs less than the hop)."""
        t0 = time.perf_counter()
        try:
            if inline:
                return fn()
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        except MemoryError as exc:  # this request's, not the process's: the server keeps serving
            raise ApiError("unhealthy", "not enough memory to tokenize this request; retry later or send "
                                        "fewer or shorter inputs") from exc
        except ValueError as exc:  # InputTooLong, UnknownPrompt, PairBudgetExceeded, a template that cannot fit
            raise ApiError("validation", str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - a tokenizer failure is the input's fault
            raise ApiError("tokenizer", f"tokenization failed: {exc}") from exc
        finally:
            self.metrics.tokenization_duration.observe(time.perf_counter() - t0)

    async def embedding_inputs(
        self, texts: Sequence[str], *, prompt: str, truncate: bool, direction: str
    ) -> list[list[int]]:
        return await self._off_loop(
            lambda: prompts.encode_embedding_inputs(
                self.tokenizer, texts, prompt=prompt, max_length=self.max_input_length,
                truncate=truncate, direction=direction,
            ),
            inline=short(texts, prompt),
        )

    async def rerank_inputs(
        self, query: str, documents: Sequence[str], *, instruction: str, truncate: bool, direction: str
    ) -> list[list[int]]:
        template = self.rerank
        assert template is not None, "rerank inputs need a reranker"
        return await self._off_loop(
            lambda: template.encode(
                query, documents, instruction=instruction, max_length=self.max_input_length,
                truncate=truncate, direction=direction, max_pair_tokens=self.max_pair_tokens,
            ),
            inline=short(documents, query + instruction),
        )

    async def score_inputs(
        self, pairs: Sequence[tuple[str, str]], *, instruction: str, truncate: bool, direction: str
    ) -> list[list[int]]:
        """Rerank inputs of (query, document) pairs with any number of distinct queries (vLLM's
        /score with a list of text_1), in input order: each distinct query's template part once,
        all of them in one pool call, under one ``max_pair_tokens`` budget for the whole request."""
        template = self.rerank
        assert template is not None, "rerank inputs need a reranker"
        limit = self.max_pair_tokens

        def encode() -> list[list[int]]:
            order: dict[str, list[int]] = {}
            for i, (query, _) in enumerate(pairs):
                order.setdefault(query, []).append(i)
            items: list = [None] * len(pairs)
            tokens = documents = 0
            for query, idx in order.items():
                try:
                    ids = template.encode(query, [pairs[i][1] for i in idx], instruction=instruction,
                                          max_length=self.max_input_length, truncate=truncate, direction=direction,
                                          max_pair_tokens=limit, counted=(tokens, documents))
                except prompts.InputTooLong as exc:  # named by its place in the request
                    raise prompts.InputTooLong(idx[exc.index], exc.length, exc.max_length,
                                               at_least=exc.at_least) from None
                tokens, documents = tokens + sum(map(len, ids)), documents + len(idx)
                for i, one in zip(idx, ids):
                    items[i] = one
            return items

        return await self._off_loop(encode, inline=len(pairs) <= INLINE_TEXTS and short(
            [d for _, d in pairs], "".join({q for q, _ in pairs}) + instruction))

    def bound(self, texts: Sequence[str | tuple[str, str]], *, shared: str = "", pairs: bool = False,
              max_length: int | None = None) -> int:
        """At most how many tokens ``texts`` become, from their sizes alone (no tokenizer): per
        input, ``shared`` (a prompt, or a rerank query and instruction) + its text + the overhead,
        at most the input limit (what truncation keeps, or the most a refused input could); for
        rerank ``pairs`` at most the request's pair budget. O(1) per ASCII text (server/memory.py)."""
        limit = self.max_input_length if max_length is None else max_length
        extra = self.overhead + text_token_bound(shared)
        total = 0
        for t in texts:
            size = sum(map(text_token_bound, t)) if isinstance(t, tuple) else text_token_bound(t)
            total += min(limit, extra + size)
        return min(total, self.max_pair_tokens) if pairs and self.max_pair_tokens > 0 else total

    def score_bound(self, pairs: Sequence[tuple[str, str]], *, instruction: str) -> int:
        """``bound`` of (query, document) pairs with any number of distinct queries."""
        queries: dict[str, int] = {}
        extra = self.overhead + text_token_bound(instruction)
        total = 0
        for query, doc in pairs:
            q = queries.get(query)
            if q is None:
                q = queries[query] = text_token_bound(query)
            total += min(self.max_input_length, extra + q + text_token_bound(doc))
        return min(total, self.max_pair_tokens) if self.max_pair_tokens > 0 else total

    def check_token_ids(self, items: Sequence[Sequence[int]], *, truncate: bool) -> list[list[int]]:
        """Pre-tokenized inputs: every id in the vocabulary; cut (right) or refuse when too long."""
        out = []
        for i, ids in enumerate(items):
            # NOTE: min/max run in C; a per-id Python loop blocked the event loop on big inputs.
            bad = [t for t in (min(ids), max(ids)) if not 0 <= t < self.vocab_size] if ids else []
            if bad:
                raise ApiError("validation", f"input {i}: token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
            if len(ids) > self.max_input_length:
                if not truncate:
                    raise ApiError("validation", str(prompts.InputTooLong(i, len(ids), self.max_input_length)))
                ids = ids[: self.max_input_length]
            out.append(list(ids))
        return out

    async def display(self, texts: Sequence[str], *, prompt: str, add_special_tokens: bool) -> bytes:
        """/tokenize: JSON bytes of the tokens with their text and char offsets into (prompt + input).

        422 when the request's inputs hold more than ``max_display_tokens`` tokens together.
        """

        def render() -> bytes:
            full = [prompt + t for t in texts]
            total, exact = count_capped(self.tokenizer, full, self.max_display_tokens,
                                        add_special_tokens=add_special_tokens)
            if total > self.max_display_tokens:
                held = f"{total} tokens" if exact else f"at least {total} tokens"
                raise TooManyTokens(
                    f"the inputs hold {held} together, more than /tokenize returns per request "
                    f"({self.max_display_tokens}); send fewer or shorter inputs"
                )
            encs = self.tokenizer.encode_batch(full, add_special_tokens=add_special_tokens)
            out = []
            for text, enc in zip(full, encs):
                tokens = []
                for tid, (start, stop), added, tok in zip(enc.ids, enc.offsets, enc.special_tokens_mask, enc.tokens):
                    special = bool(added) or tid in self.special_ids
                    piece = tok if special else text[start:stop]
                    tokens.append({"id": tid, "text": piece, "special": special, "start": start, "stop": stop})
                out.append(tokens)
            return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

        return await self._off_loop(render)


# Tokens by which a prefix of a text may out-count the whole text (BPE merges across the cut).
PREFIX_SLACK = 16


def count_capped(tokenizer, texts: Sequence[str], cap: int, *, add_special_tokens: bool) -> tuple[int, bool]:
    """(count, exact): the texts' total token count when it is at most ``cap`` (exact); else a
    count above ``cap``, exact or a lower bound.

    The work is bounded by the cap, not by the input: each text is encoded on prefixes that double
    from 2 x (cap + slack) characters until the text ends or a prefix alone settles that the
    request is over the cap (a prefix's count, less ``PREFIX_SLACK``, bounds the whole text's from
    below). So a 2 MB text of digits costs one encode of ~33k characters, not 2M tokens.
    """
    total = 0
    for text in texts:
        size = 2 * (cap + PREFIX_SLACK)
        while True:
            piece = text[:size]
            n = len(tokenizer.encode(piece, add_special_tokens=add_special_tokens).ids)
            if len(piece) == len(text):
                total += n
                break
            if total + n - PREFIX_SLACK > cap:
                return total + n - PREFIX_SLACK, False
            size *= 2
        if total > cap:
            return total, True
    return total, True
def short(texts: Sequence[str], shared: str = "") -> bool:
    """Few and short enough to tokenize on the loop: well under the cost of a thread hop (~0.1 ms)."""
    return len(texts) <= INLINE_TEXTS and len(shared) + sum(map(len, texts)) <= INLINE_CHARS


class TooManyTokens(ValueError):
    """A /tokenize request whose answer would exceed the per-request token cap."""

"""Qwen3 prompt templates and truncation that never cuts the special tokens or the template.

Embedding inputs: the prompt text (e.g. "Instruct: {task}\\nQuery:") is prepended to the input
text, the text is encoded without special tokens, cut to fit, and only then does the tokenizer's
post-processor append its special tokens (<|endoftext|> for Qwen3-Embedding), so a truncated
input still ends with them. Reranker inputs follow the reference Qwen3-Reranker code: prefix and
suffix are encoded once, separately; the body
``<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}`` is encoded on its own
(no special tokens) and is the only part truncation cuts; ids = prefix + body + suffix. The body's
ids equal one encode of the whole body string, but are built from its shared part (encoded once
per request) and each document (encoded once), so a long query costs once, not once per document.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from tokenizers import Encoding, Tokenizer

from models.pair_budget import check_pair_budget, pair_tokens

RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
DIRECTIONS = ("right", "left")


class InputTooLong(ValueError):
    """An input over ``max_length`` tokens while truncation is off."""

    def __init__(self, index: int, length: int, max_length: int) -> None:
        super().__init__(
            f"input {index} has {length} tokens, more than the maximum of {max_length}; "
            "shorten it or set truncate=true"
        )
        self.index, self.length, self.max_length = index, length, max_length


class UnknownPrompt(ValueError):
    """A prompt_name the model does not define."""


def embedding_query_prompt(task: str) -> str:
    """The Qwen3-Embedding query prompt for a task description (documents take no prompt)."""
    return f"Instruct: {task}\nQuery:"


def format_rerank_body(instruction: str, query: str, document: str) -> str:
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def resolve_prompt(
    prompts: Mapping[str, str],
    *,
    prompt_name: str | None,
    default_prompt_name: str | None = None,
    default_prompt: str | None = None,
) -> str:
    """The prompt text to prepend: the named one, else the server default, else none ("")."""
    name = prompt_name
    if name is None:
        if default_prompt is not None:
            return default_prompt
        name = default_prompt_name
    if name is None:
        return ""
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise UnknownPrompt(f"unknown prompt_name {name!r}; this model defines: {known}")
    return prompts[name]


def _encode_ids_only(tokenizer: Tokenizer, texts: list[str]) -> list[Encoding]:
    """Batch encode without char offsets (about half the CPU and far less memory on long texts);
    ids, truncation and post-processing are unchanged. Older tokenizers lack it: plain batch encode."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    encode = fast if fast is not None else tokenizer.encode_batch
    return encode(texts, add_special_tokens=False)


def _check_direction(direction: str) -> str:
    direction = direction.lower()
    if direction not in DIRECTIONS:
        raise ValueError(f"truncation direction must be right or left, not {direction!r}")
    return direction


def encode_texts(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    max_length: int,
    truncate: bool,
    direction: str = "right",
    add_special_tokens: bool = True,
) -> list[Encoding]:
    """Batch-encode ``texts``; cut the text tokens to fit, then add the special tokens.

    Raises InputTooLong (naming the first offending input) when ``truncate`` is false.
    """
    direction = _check_direction(direction)
    n_special = tokenizer.num_special_tokens_to_add(False) if add_special_tokens else 0
    budget = max_length - n_special
    if budget < 1:
        raise ValueError(f"max_length {max_length} leaves no room next to {n_special} special tokens")
    encodings = _encode_ids_only(tokenizer, list(texts))
    out = []
    for i, enc in enumerate(encodings):
        if len(enc.ids) > budget:
            if not truncate:
                raise InputTooLong(i, len(enc.ids) + n_special, max_length)
            enc.truncate(budget, direction=direction)
        out.append(tokenizer.post_process(enc, add_special_tokens=add_special_tokens))
    return out


def encode_embedding_inputs(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    prompt: str = "",
    max_length: int,
    truncate: bool,
    direction: str = "right",
) -> list[list[int]]:
    """Token ids of embedding inputs: prompt text prepended, special tokens kept on truncation."""
    encodings = encode_texts(
        tokenizer, [prompt + t for t in texts], max_length=max_length, truncate=truncate, direction=direction
    )
    return [list(e.ids) for e in encodings]


class QueryTooLong(ValueError):
    """The shared part of a rerank input (instruction + query) leaves no room for a document."""

    def __init__(self, length: int, max_length: int) -> None:
        super().__init__(
            f"the query and instruction alone take {length} tokens with the reranker template, more "
            f"than the maximum of {max_length}; shorten the query or set truncate=true"
        )
        self.length, self.max_length = length, max_length


def cut_body(head: list[int], tail: list[int], budget: int, direction: str) -> list[int]:
    """The body ``head + tail`` cut to ``budget`` tokens (right keeps the start, left the end),
    built without materializing the uncut concatenation (``head`` may be a huge shared query)."""
    if len(head) + len(tail) <= budget:
        return head + tail
    if direction == "right":
        return head[:budget] if len(head) >= budget else head + tail[: budget - len(head)]
    if len(tail) >= budget:
        return tail[len(tail) - budget :]
    return head[len(head) - (budget - len(tail)) :] + tail


class RerankTemplate:
    """The Qwen3-Reranker chat template with prefix/suffix encoded once.

    Per request, the shared part of every body (``<Instruct>: ...\n<Query>: ...\n<Document>:``)
    is encoded once and each document once (as `` {document}``), so the work is proportional to
    the request, not to query x documents. The split sits between the colon and the space, where
    Qwen's pre-tokenizer always cuts, so shared + piece ids equal the ids of the whole body. Each
    document's boundary is still checked on a small window (``window`` characters each side,
    encoded joined and apart); a document whose boundary would tokenize differently (another
    tokenizer family) is encoded as its whole body instead, which is exact but costs the shared
    part again.
    """

    def __init__(self, tokenizer: Tokenizer, *, window: int = 32) -> None:
        self.tokenizer = tokenizer
        self.window = window
        self.prefix_ids = list(tokenizer.encode(RERANK_PREFIX, add_special_tokens=False).ids)
        self.suffix_ids = list(tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False).ids)

    @property
    def overhead(self) -> int:
        """Tokens the template adds around the body."""
        return len(self.prefix_ids) + len(self.suffix_ids)

    def _ids(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(e.ids) for e in _encode_ids_only(self.tokenizer, list(texts))]

    def _splits_cleanly(self, shared: str, pieces: Sequence[str]) -> list[bool]:
        """Per piece: does ``shared | piece`` tokenize as the two sides apart (on a window)?"""
        left = shared[-self.window :]
        (left_ids,) = self._ids([left])
        heads = [p[: self.window] for p in pieces]
        joined = self._ids([left + h for h in heads])
        apart = self._ids(heads)
        return [j == left_ids + a for j, a in zip(joined, apart)]

    def encode(
        self,
        query: str,
        documents: Sequence[str],
        *,
        instruction: str = DEFAULT_INSTRUCTION,
        max_length: int,
        truncate: bool,
        direction: str = "right",
        max_pair_tokens: int = 0,
    ) -> list[list[int]]:
        """prefix + body + suffix per document; only the body is cut to fit ``max_length``.

        Raises QueryTooLong before any document is encoded when ``truncate`` is false and the
        shared part alone cannot fit; PairBudgetExceeded when the pairs would hold more than
        ``max_pair_tokens`` tokens together (0: no limit), counted before any pair is built;
        InputTooLong naming the first document that does not fit.
        """
        direction = _check_direction(direction)
        budget = max_length - self.overhead
        if budget < 1:
            raise ValueError(
                f"max_length {max_length} leaves no room for the reranker template ({self.overhead} tokens)"
            )
        whole = format_rerank_body(instruction, query, "")
        assert whole.endswith(": "), "the split below relies on the body ending with ': {document}'"
        shared_text = whole[:-1]
        pieces = [" " + d for d in documents]
        clean = self._splits_cleanly(shared_text, pieces)
        (shared,) = self._ids([shared_text])
        if not truncate and all(clean) and len(shared) + 1 > budget:  # a piece is >= 1 token (its space)
            raise QueryTooLong(len(shared) + 1 + self.overhead, max_length)
        piece_ids = iter(self._ids([p for p, ok in zip(pieces, clean) if ok]))
        body_ids = iter(self._ids([shared_text + p for p, ok in zip(pieces, clean) if not ok]))
        parts = [(shared, next(piece_ids)) if ok else (next(body_ids), []) for ok in clean]
        bodies = [len(head) + len(tail) for head, tail in parts]
        check_pair_budget(pair_tokens(overhead=self.overhead, bodies=bodies, max_length=max_length),
                          documents=len(documents), limit=max_pair_tokens)
        out = []
        for i, (head, tail) in enumerate(parts):
            if not truncate and len(head) + len(tail) > budget:
                raise InputTooLong(i, len(head) + len(tail) + self.overhead, max_length)
            out.append(self.prefix_ids + cut_body(head, tail, budget, direction) + self.suffix_ids)
        return out

"""Qwen3 prompt templates and truncation that never cuts the special tokens or the template.

Embedding inputs: the prompt text (e.g. "Instruct: {task}\\nQuery:") is prepended to the input
text, the text is encoded without special tokens, cut to fit, and only then does the tokenizer's
post-processor append its special tokens (<|endoftext|> for Qwen3-Embedding), so a truncated
input still ends with them. Reranker inputs follow the reference Qwen3-Reranker code: prefix and
suffix are encoded once, separately; the body
``<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}`` is encoded on its own
(no special tokens) and is the only part truncation cuts; ids = prefix + body + suffix.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from tokenizers import Encoding, Tokenizer

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
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
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


class RerankTemplate:
    """The Qwen3-Reranker chat template with prefix/suffix encoded once."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prefix_ids = list(tokenizer.encode(RERANK_PREFIX, add_special_tokens=False).ids)
        self.suffix_ids = list(tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False).ids)

    @property
    def overhead(self) -> int:
        """Tokens the template adds around the body."""
        return len(self.prefix_ids) + len(self.suffix_ids)

    def encode(
        self,
        query: str,
        documents: Sequence[str],
        *,
        instruction: str = DEFAULT_INSTRUCTION,
        max_length: int,
        truncate: bool,
        direction: str = "right",
    ) -> list[list[int]]:
        """prefix + body + suffix per document; only the body is cut to fit ``max_length``."""
        direction = _check_direction(direction)
        budget = max_length - self.overhead
        if budget < 1:
            raise ValueError(f"max_length {max_length} leaves no room for the reranker template ({self.overhead} tokens)")
        bodies = [format_rerank_body(instruction, query, d) for d in documents]
        encodings = self.tokenizer.encode_batch(bodies, add_special_tokens=False)
        out = []
        for i, enc in enumerate(encodings):
            ids = list(enc.ids)
            if len(ids) > budget:
                if not truncate:
                    raise InputTooLong(i, len(ids) + self.overhead, max_length)
                ids = ids[:budget] if direction == "right" else ids[len(ids) - budget :]
            out.append(self.prefix_ids + ids + self.suffix_ids)
        return out

"""A tokenizer proxy that counts the characters it is asked to encode, for tests that bound how
much of a request the server tokenizes."""
from __future__ import annotations


class CountingTokenizer:
    """Wraps a `tokenizers.Tokenizer`; ``chars`` is the total length of every text it encoded."""

    def __init__(self, inner) -> None:
        self.inner, self.chars = inner, 0

    def encode(self, text, **kw):
        self.chars += len(text)
        return self.inner.encode(text, **kw)

    def encode_batch(self, texts, **kw):
        self.chars += sum(len(t) for t in texts)
        return self.inner.encode_batch(texts, **kw)

    def encode_batch_fast(self, texts, **kw):
        self.chars += sum(len(t) for t in texts)
        return self.inner.encode_batch_fast(texts, **kw)

    def __getattr__(self, name):  # everything else (post_process, num_special_tokens_to_add, ...) as is
        return getattr(self.inner, name)

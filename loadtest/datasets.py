"""Query/passage sets for load tests: MS MARCO (hub or local file) or a seeded synthetic twin.

Every source yields the same shape, a `Dataset` of `Sample(query, passages)`, and a `source`
label that travels into every report ("msmarco-hf:...", "file:...", or "synthetic(...)") so a figure
measured on generated text is never mistaken for one measured on MS MARCO. A synthetic label names
the seed and every generator shape that differs from the default, e.g.
`synthetic(seed=0,query_words=80-160)`, so two runs on differently shaped data never look alike.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadtest.wordlist import QUERY_OPENERS, WORDS

SOURCES = ("auto", "hf", "file", "synthetic")


@dataclass(frozen=True)
class Sample:
    query: str
    passages: tuple[str, ...]


@dataclass(frozen=True)
class Dataset:
    source: str  # label for reports: "msmarco-hf:v1.1/validation", "file:NAME", "synthetic(seed=S[,...])"
    samples: tuple[Sample, ...]

    @property
    def synthetic(self) -> bool:
        return self.source.startswith("synthetic")


class DatasetError(RuntimeError):
    """A source the user asked for could not be read (message says why and what to do)."""


# ---------------------------------------------------------------- MS MARCO schema


def sample_from_record(rec: dict) -> Sample:
    """One MS MARCO row -> Sample. `passages` is {passage_text: [...], ...} (HF) or a list of
    {passage_text: str} dicts (the original JSON release); both are accepted."""
    if "query" not in rec or "passages" not in rec:
        raise DatasetError(f"record lacks 'query'/'passages' (MS MARCO schema): keys {sorted(rec)}")
    p = rec["passages"]
    if isinstance(p, dict):
        texts = p.get("passage_text")
    elif isinstance(p, list):
        texts = [x["passage_text"] if isinstance(x, dict) else x for x in p]
    else:
        texts = None
    if texts is None:
        raise DatasetError("'passages' must hold 'passage_text' (list of str)")
    return Sample(query=str(rec["query"]), passages=tuple(str(t) for t in texts))


def _take(records, limit: int | None) -> tuple[Sample, ...]:
    out = []
    for rec in records:
        s = sample_from_record(rec)
        if s.passages:
            out.append(s)
        if limit is not None and len(out) >= limit:
            break
    return tuple(out)


def load_file(path: str | Path, *, limit: int | None = None) -> Dataset:
    """A local .jsonl / .json / .parquet file in the MS MARCO v1.1 schema."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DatasetError('reading parquet needs pyarrow (pip install -e ".[loadtest]")') from e
        records = pq.read_table(path).to_pylist()
    elif suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            text = f.read()
        if suffix == ".json" and text.lstrip().startswith("["):
            records = json.loads(text)
        else:
            records = (json.loads(line) for line in text.splitlines() if line.strip())
    else:
        raise DatasetError(f"unknown dataset file type {suffix!r} (want .jsonl, .json or .parquet)")
    samples = _take(records, limit)
    if not samples:
        raise DatasetError(f"no samples with passages in {path}")
    return Dataset(source=f"file:{path.name}", samples=samples)


def load_hf(*, split: str = "validation", limit: int | None = None) -> Dataset:
    """MS MARCO v1.1 through the `datasets` library (imported lazily; needs the hub)."""
    try:
        import datasets as hf_datasets
    except ImportError as e:
        raise DatasetError("the 'datasets' package is not installed (pip install datasets)") from e
    try:
        ds = hf_datasets.load_dataset("microsoft/ms_marco", "v1.1", split=split, streaming=True)
        samples = _take(iter(ds), limit)
    except Exception as e:  # network, hub, auth: all mean "not available here"
        raise DatasetError(f"could not load microsoft/ms_marco v1.1 ({split}): {type(e).__name__}: {e}") from e
    return Dataset(source=f"msmarco-hf:v1.1/{split}", samples=samples)


# ---------------------------------------------------------------- synthetic twin


def _zipf_weights(n: int, s: float = 1.07) -> list[float]:
    return [1.0 / (rank + 1) ** s for rank in range(n)]


# Generator shape defaults (MS MARCO-like); the label mentions any other value.
PASSAGES_PER_QUERY = (8, 10)
QUERY_WORDS = (2, 6)  # topic words after the opener ("what is", "how to", ...)
PASSAGE_WORDS = (30, 80)


def _check_range(name: str, r: tuple[int, int]) -> tuple[int, int]:
    lo, hi = r
    if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
        raise ValueError(f"{name} must be (MIN, MAX) integers with 1 <= MIN <= MAX, got {r!r}")
    return (lo, hi)


def synthetic_label(
    seed: int,
    *,
    passages_per_query: tuple[int, int] = PASSAGES_PER_QUERY,
    query_words: tuple[int, int] = QUERY_WORDS,
    passage_words: tuple[int, int] = PASSAGE_WORDS,
) -> str:
    """`synthetic(seed=S)` plus `,NAME=MIN-MAX` for each non-default shape."""
    parts = [f"seed={seed}"]
    for name, value, default in (("passages_per_query", passages_per_query, PASSAGES_PER_QUERY),
                                 ("query_words", query_words, QUERY_WORDS),
                                 ("passage_words", passage_words, PASSAGE_WORDS)):
        if tuple(value) != default:
            parts.append(f"{name}={value[0]}-{value[1]}")
    return f"synthetic({','.join(parts)})"


def synthetic(
    n_queries: int = 200,
    *,
    seed: int = 0,
    passages_per_query: tuple[int, int] = PASSAGES_PER_QUERY,
    query_words: tuple[int, int] = QUERY_WORDS,
    passage_words: tuple[int, int] = PASSAGE_WORDS,
) -> Dataset:
    """MS MARCO-shaped text: short lowercase queries (an opener + `query_words` topic words),
    `passages_per_query` passages of exactly `passage_words` words each (inclusive ranges).

    Words are drawn Zipf-like from `WORDS`; a passage reuses some of its query's content words so
    the text looks retrieved. Deterministic in `seed` (its own `random.Random`)."""
    passages_per_query = _check_range("passages_per_query", passages_per_query)
    query_words = _check_range("query_words", query_words)
    passage_words = _check_range("passage_words", passage_words)
    rng = random.Random(seed)
    weights = _zipf_weights(len(WORDS))
    # Query topics skip the ~150 most frequent (mostly function) words.
    content = WORDS[150:]
    content_w = _zipf_weights(len(content), s=0.8)
    samples = []
    for _ in range(n_queries):
        opener = rng.choice(QUERY_OPENERS)
        topic = rng.choices(content, weights=content_w, k=rng.randint(*query_words))
        query = " ".join([opener, *topic])
        passages = []
        for _ in range(rng.randint(*passages_per_query)):
            n = rng.randint(*passage_words)
            words = rng.choices(WORDS, weights=weights, k=n)
            for t in topic:  # sprinkle the query's topic words in
                if rng.random() < 0.7:
                    words[rng.randrange(n)] = t
            sentences, i = [], 0
            while i < n:  # cut into sentences of 8-20 words
                j = min(n, i + rng.randint(8, 20))
                chunk = words[i:j]
                sentences.append(chunk[0].capitalize() + " " + " ".join(chunk[1:]) + ".")
                i = j
            passages.append(" ".join(sentences).replace(" .", "."))
        samples.append(Sample(query=query, passages=tuple(passages)))
    label = synthetic_label(seed, passages_per_query=passages_per_query, query_words=query_words,
                            passage_words=passage_words)
    return Dataset(source=label, samples=tuple(samples))


def write_jsonl(ds: Dataset, path: str | Path) -> Path:
    """Write in the HF MS MARCO schema (readable back by `load_file`)."""
    path = Path(path)
    with path.open("w", encoding="utf-8") as f:
        for s in ds.samples:
            rec = {
                "query": s.query,
                "passages": {
                    "is_selected": [0] * len(s.passages),
                    "passage_text": list(s.passages),
                    "url": [""] * len(s.passages),
                },
            }
            f.write(json.dumps(rec) + "\n")
    return path


def describe(label: str) -> str:
    """A source label in words for titles: `synthetic (seed 0, query_words 80-160)`,
    `MS MARCO v1.1 (hub, validation)`, `file d.jsonl (MS MARCO schema)`; unknown labels as given.
    Synthetic data always says "synthetic"."""
    if label.startswith("synthetic(") and label.endswith(")"):
        return "synthetic (" + ", ".join(p.replace("=", " ", 1) for p in label[10:-1].split(",")) + ")"
    if label.startswith("msmarco-hf:"):
        version, _, split = label[len("msmarco-hf:"):].partition("/")
        return f"MS MARCO {version} (hub, {split})"
    if label.startswith("file:"):
        return f"file {label[5:]} (MS MARCO schema)"
    return label


# ---------------------------------------------------------------- entry point


def load(
    source: str = "auto",
    *,
    path: str | None = None,
    split: str = "validation",
    limit: int | None = None,
    seed: int = 0,
    query_words: tuple[int, int] = QUERY_WORDS,
    passage_words: tuple[int, int] = PASSAGE_WORDS,
    warn=None,
) -> Dataset:
    """Pick a source. `auto`: the file if given, else the hub, else synthetic (with a warning);
    an explicit `hf` or `file` that fails raises DatasetError instead of falling back.
    `seed`, `query_words` and `passage_words` shape the synthetic generator only."""
    if source not in SOURCES:
        raise DatasetError(f"unknown source {source!r}; choose one of {', '.join(SOURCES)}")
    if source == "file" or (source == "auto" and path):
        if not path:
            raise DatasetError("--source file needs --dataset-path")
        return load_file(path, limit=limit)
    if source == "hf":
        return load_hf(split=split, limit=limit)
    if source == "auto":
        try:
            return load_hf(split=split, limit=limit)
        except DatasetError as e:
            if warn is not None:
                warn(f"MS MARCO unavailable ({e}); using the synthetic generator")
    return synthetic(limit if limit is not None else 200, seed=seed, query_words=query_words,
                     passage_words=passage_words)

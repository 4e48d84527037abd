"""Turn a Dataset into the HTTP requests of one workload, in one of three orders.

- `rerank`: POST /rerank {query, texts}: one request per query with all of its passages, or with
  `batch_size` set, the query's passages split into requests of at most `batch_size` (in order).
- `embed-template` (the paper's setup): each (query, passage) pair rendered with the Qwen3-Reranker
  template as plain text, sent to /v1/embeddings in requests of `batch_size` (64) items. Pairs of
  one query are adjacent, so a request shares system prompt + instruction + query across them.
- `flipped`: the same template with query and passage swapped: only the system prompt and the
  instruction are shared, the worst case for prefix deduplication.
- `embed`: the bare passages to /v1/embeddings.

Prefix-cache workloads, one item per request (light load is where a cross-batch cache pays):
- `rerank-pointwise`: POST /rerank {query, texts: [passage]}, one pair per request; the server
  applies the reranker template, so consecutive requests of a query share template + query.
- `embed-query`: POST /embed {inputs: [query prompt + query]}, one query per request, with
  Qwen3-Embedding's query prompt `Instruct: {instruction}\nQuery:` prepended by the client. The
  server's `prompt_name: "query"` prepends the same text (prompt + input, no separator), so the
  tokens are identical, and peers without named prompts (the transformers baseline) do the same work.
- `embed-chunks`: long documents cut into chunks (`loadtest.documents`; word ranges in `Chunking`),
  one chunk per /v1/embeddings request as `document + CHUNK_SEPARATOR + chunk`. Documents are the
  dataset's passages packed in order; requests go document by document, so consecutive requests
  share the whole document as their prefix.

Score-head workloads (RadixMLP's best case: one long prefix shared by every item of a request):
- `reward-best-of-n`: POST /pooling {input: [prompt + response, ...]} (vLLM's reward route): one
  request per query, the query rendered as a prompt (`reward_prompt`) and each of its passages a
  response (`REWARD_SEPARATOR` between them), N = `batch_size` responses per request (default:
  all of the query's passages), as best-of-N sampling and RL pipelines score them.
- `classify-few-shot`: POST /classify {input: [few-shot block + item, ...]}: a long few-shot block
  (`few_shot_block`: the dataset's first FEW_SHOT_EXAMPLES passages, each labelled, built once
  per dataset) shared by every item, one short input per item (each passage, as
  `Text: {passage}\nLabel:`), `batch_size` items per request (default EMBED_BATCH_SIZE).

Orders (`Order`, parsed from `grouped | shuffled | interleave:K`):
- `grouped` (default): dataset order; /v1/embeddings requests are cut from the flat stream of all
  items, so one request may span two queries.
- `shuffled`: the grouped request list under a seeded shuffle (`random.Random(seed)`).
- `interleave:K`: K users; user u works through queries u, u+K, u+2K, ... one at a time, sending
  that query's requests in order (cut per query: a request never mixes queries); the K streams are
  merged round-robin (step t: user 0's t-th request, user 1's, ..., skipping exhausted users).
  For `embed-chunks` a "query" is a document: its chunk requests stay in order within each user.
Every order is deterministic and carries every item exactly once; the client cycles through it.

Warm-up requests (`warmup_dataset`, `marked`) carry text no measured request starts with: every
query and passage of the warm-up's data begins with `WARMUP_MARK`, so the warm-up shares only
what measured requests share with each other (a template, an instruction, a prompt) and a prefix
cache can never answer a measured request, whole or in part, from what the warm-up sent.

`encoding="base64"` asks /v1/embeddings for base64 vectors (`encoding_format`, the OpenAI field):
a quarter of the float JSON's bytes and one string per item to parse, so a fast server's answers do
not make the client the bottleneck. Other routes have no such field and keep their float answers.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import TypeVar

from loadtest.datasets import Dataset
from loadtest.documents import Chunking, documents

WORKLOADS = ("rerank", "rerank-pointwise", "embed-template", "flipped", "embed", "embed-query", "embed-chunks",
             "reward-best-of-n", "classify-few-shot")
ONE_ITEM = ("rerank-pointwise", "embed-query", "embed-chunks")  # one item per request by definition
ORDERS = ("grouped", "shuffled", "interleave:K")
EMBED_BATCH_SIZE = 64  # /v1/embeddings default items per request
ENCODINGS = ("float", "base64")  # /v1/embeddings encoding_format

# Qwen3-Reranker template (docs/design.md, "Qwen3 prompts"). A client-side copy on purpose:
# loadtest/ speaks HTTP only and must not import the server's packages.
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# Qwen3-Embedding's query prompt (config_sentence_transformers.json "query"), instruction filled in.
QUERY_PROMPT = "Instruct: {instruction}\nQuery:"
CHUNK_SEPARATOR = "\n\n"
# Score-head workloads: the reward prompt around a query, and the few-shot classification block.
REWARD_PROMPT = ("You are a helpful assistant. Answer the user's question accurately and concisely, "
                 "citing what the passage says.\nQuestion: {query}\nAnswer:")
REWARD_SEPARATOR = " "
FEW_SHOT_INSTRUCTION = "Classify the sentiment of each text as negative, neutral or positive.\n\n"
FEW_SHOT_LABELS = ("negative", "neutral", "positive")
FEW_SHOT_EXAMPLES = 16
SCORE_ROUTES = {"reward-best-of-n": "/pooling", "classify-few-shot": "/classify"}


@dataclass(frozen=True)
class Request:
    route: str  # "/rerank" or "/v1/embeddings"
    body: dict
    items: int  # input items carried (passages or texts)


def render_pair(query: str, document: str, *, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """prefix + `<Instruct>: {instruction}\\n<Query>: {q}\\n<Document>: {d}` + suffix."""
    return f"{RERANK_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{RERANK_SUFFIX}"


@dataclass(frozen=True)
class Order:
    mode: str = "grouped"  # "grouped" | "shuffled" | "interleave"
    users: int = 0  # K, for "interleave" only

    def __str__(self) -> str:
        return f"interleave:{self.users}" if self.mode == "interleave" else self.mode


def parse_order(spec: str) -> Order:
    """`grouped`, `shuffled` or `interleave:K` (K >= 1) -> Order; ValueError otherwise."""
    spec = spec.strip()
    if spec in ("grouped", "shuffled"):
        return Order(spec)
    head, sep, k = spec.partition(":")
    if head == "interleave" and sep and k.strip().isdigit() and int(k) >= 1:
        return Order("interleave", int(k))
    raise ValueError(f"order must be grouped, shuffled or interleave:K with K >= 1, got {spec!r}")


T = TypeVar("T")


def _chunks(items: list[T], size: int) -> list[list[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def interleave(groups: list[list[T]], users: int) -> list[T]:
    """User u takes groups u, u+K, ... (K = users) and sends their elements in order; the K
    streams are merged round-robin, an exhausted user dropping out."""
    if users < 1:
        raise ValueError("users must be >= 1")
    streams = [[x for g in groups[u::users] for x in g] for u in range(users)]
    out: list[T] = []
    for step in range(max((len(st) for st in streams), default=0)):
        out.extend(st[step] for st in streams if step < len(st))
    return out


def query_prompt(instruction: str = DEFAULT_INSTRUCTION) -> str:
    """Qwen3-Embedding's query prompt with `instruction`; the input follows it directly."""
    return QUERY_PROMPT.format(instruction=instruction)


def _texts(sample, workload: str, instruction: str) -> list[str]:
    """The /v1/embeddings inputs one sample contributes, in passage order."""
    if workload == "embed":
        return list(sample.passages)
    if workload == "embed-template":
        return [render_pair(sample.query, p, instruction=instruction) for p in sample.passages]
    # flipped: the passage sits where the query was and vice versa
    return [render_pair(p, sample.query, instruction=instruction) for p in sample.passages]


def _embeddings_request(chunk: list[str], model: str | None, encoding: str = "float") -> Request:
    body: dict = {"input": chunk}
    if model:
        body["model"] = model
    if encoding != "float":  # only when asked: the default answer stays the OpenAI default
        body["encoding_format"] = encoding
    return Request("/v1/embeddings", body, len(chunk))


def reward_prompt(query: str) -> str:
    """The shared prompt of one best-of-N request (every response follows it)."""
    return REWARD_PROMPT.format(query=query)


def few_shot_block(dataset: Dataset, examples: int = FEW_SHOT_EXAMPLES) -> str:
    """The shared few-shot block: the dataset's first ``examples`` passages, labelled in turn."""
    passages = [p for s in dataset.samples for p in s.passages][:examples]
    shots = "".join(f"Text: {p}\nLabel: {FEW_SHOT_LABELS[i % len(FEW_SHOT_LABELS)]}\n\n"
                    for i, p in enumerate(passages))
    return FEW_SHOT_INSTRUCTION + shots


def few_shot_item(block: str, text: str) -> str:
    return f"{block}Text: {text}\nLabel:"


def _score_request(route: str, texts: list[str], model: str | None) -> Request:
    body: dict = {"input": texts}
    if model:
        body["model"] = model
    return Request(route, body, len(texts))


def _rerank_request(query: str, texts: list[str], instruction: str) -> Request:
    body: dict = {"query": query, "texts": texts}
    if instruction != DEFAULT_INSTRUCTION:  # only when asked: not every rerank server takes it
        body["instruction"] = instruction
    return Request("/rerank", body, len(texts))


def query_requests(
    dataset: Dataset,
    workload: str,
    *,
    batch_size: int | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    model: str | None = None,
    chunking: Chunking = Chunking(),
    seed: int = 0,
    encoding: str = "float",
) -> list[list[Request]]:
    """Per sample (dataset order), its own requests in order; no request mixes two queries.
    For `embed-chunks` the groups are documents (a chunk's requests never leave its document).
    batch_size None: all passages of a query for rerank, EMBED_BATCH_SIZE for /v1/embeddings."""
    if workload == "embed-chunks":
        return [[_embeddings_request([doc + CHUNK_SEPARATOR + c], model, encoding) for c in chunks]
                for doc, chunks in documents(dataset, chunking=chunking, seed=seed)]
    block = few_shot_block(dataset) if workload == "classify-few-shot" else ""
    out = []
    for s in dataset.samples:
        if workload == "reward-best-of-n":
            prompt = reward_prompt(s.query) + REWARD_SEPARATOR
            size = batch_size or max(1, len(s.passages))
            out.append([_score_request("/pooling", [prompt + p for p in c], model)
                        for c in _chunks(list(s.passages), size)])
        elif workload == "classify-few-shot":
            items = [few_shot_item(block, p) for p in s.passages]
            out.append([_score_request("/classify", c, model) for c in _chunks(items, batch_size or EMBED_BATCH_SIZE)])
        elif workload in ("rerank", "rerank-pointwise"):
            size = 1 if workload == "rerank-pointwise" else batch_size or max(1, len(s.passages))
            out.append([_rerank_request(s.query, c, instruction) for c in _chunks(list(s.passages), size)])
        elif workload == "embed-query":
            out.append([Request("/embed", {"inputs": [query_prompt(instruction) + s.query]}, 1)])
        else:
            texts = _texts(s, workload, instruction)
            out.append([_embeddings_request(c, model, encoding)
                        for c in _chunks(texts, batch_size or EMBED_BATCH_SIZE)])
    return out


def build_requests(
    dataset: Dataset,
    workload: str,
    *,
    batch_size: int | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
    model: str | None = None,
    order: Order | str = "grouped",
    seed: int = 0,
    chunking: Chunking = Chunking(),
    encoding: str = "float",
) -> list[Request]:
    """All requests of one pass over the dataset for `workload`, in `order` (module docstring).
    batch_size None means the workload's default (see `query_requests`); the ONE_ITEM workloads
    take none. `seed` drives `shuffled` and the document/chunk lengths of `embed-chunks`.
    `encoding`: "float" or "base64" vectors from /v1/embeddings (other routes ignore it)."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if batch_size is not None and batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    if batch_size is not None and workload in ONE_ITEM:
        raise ValueError(f"--batch-size does not apply to {workload}: it sends one item per request")
    order = parse_order(order) if isinstance(order, str) else order
    per_query = lambda: query_requests(dataset, workload, batch_size=batch_size,  # noqa: E731
                                       instruction=instruction, model=model, chunking=chunking, seed=seed,
                                       encoding=encoding)
    if order.mode == "interleave":
        return interleave(per_query(), order.users)
    if workload in ("embed-template", "flipped", "embed"):
        # grouped multi-item /v1/embeddings requests are cut from the flat item stream (may span queries)
        texts = [t for s in dataset.samples for t in _texts(s, workload, instruction)]
        reqs = [_embeddings_request(c, model, encoding) for c in _chunks(texts, batch_size or EMBED_BATCH_SIZE)]
    else:
        reqs = [r for group in per_query() for r in group]
    if order.mode == "shuffled":
        random.Random(seed).shuffle(reqs)
    return reqs


WARMUP_MARK = "warm-up:"  # the first word of every warm-up query and passage


def warmup_dataset(dataset: Dataset) -> Dataset:
    """The dataset with every query and passage marked: the same workload built from it gives
    warm-up requests of the measured ones' shape that share none of their own text."""
    samples = tuple(replace(s, query=f"{WARMUP_MARK} {s.query}", passages=tuple(f"{WARMUP_MARK} {p}" for p in s.passages))
                    for s in dataset.samples)
    return Dataset(source=dataset.source, samples=samples)


def marked(req: Request) -> Request:
    """`req` with `WARMUP_MARK` in front of each of its texts (for a request list without its dataset)."""
    body = dict(req.body)
    for key in ("query", "texts", "input", "inputs", "documents"):
        value = body.get(key)
        if isinstance(value, str):
            body[key] = f"{WARMUP_MARK} {value}"
        elif isinstance(value, list):
            body[key] = [f"{WARMUP_MARK} {v}" if isinstance(v, str) else v for v in value]
    return Request(req.route, body, req.items)


def expected_count(body: dict) -> int:
    """How many results a correct answer to `body` holds (the client checks it)."""
    for key in ("texts", "input", "inputs"):
        if key in body:
            return len(body[key])
    raise ValueError(f"no input items in request body (keys {sorted(body)})")

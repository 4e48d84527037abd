"""Peer baseline server: the same checkpoint served without radixserve (transformers, padded
batches) behind the same routes, so `compare` can put a number on "what people do otherwise".

`python -m loadtest.baseline --model-id DIR --port P`. Routes: /v1/embeddings (+ /embeddings),
/embed, /rerank, /health, /metrics (request count and real/padded token counters only).
Dynamic batching keeps it a fair peer: the first waiting request opens a batch, which collects
more requests for up to --batch-wait-ms while the padded size (rows x longest) stays within
--max-batch-tokens and rows within --max-batch-items; one request's items never split. A single
worker thread runs the forwards in order.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from contextlib import asynccontextmanager

# NOTE: Request must be a module-level name: with postponed annotations FastAPI resolves the
# handler annotations in module globals, and an unresolved one silently becomes a query param.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from loadtest.baseline_model import BaselineModel


@dataclass(frozen=True)
class BaselineConfig:
    model_id: str
    hostname: str = "127.0.0.1"
    port: int = 8090
    kind: str | None = None
    device: str | None = None
    dtype: str | None = None
    max_batch_tokens: int = 16384  # padded tokens per forward
    max_batch_items: int = 64
    batch_wait_ms: float = 5.0
    padding_side: str = "left"


class Batcher:
    """Collects submitted sequence lists into padded forwards on one worker thread."""

    def __init__(self, model: BaselineModel, cfg: BaselineConfig) -> None:
        self.model, self.cfg = model, cfg
        self.queue: asyncio.Queue | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baseline-worker")
        self.task: asyncio.Task | None = None
        self.tokens_real = 0
        self.tokens_padded = 0
        self.requests = 0

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def submit(self, seqs: list[list[int]]):
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((seqs, fut))
        return await fut

    def _fits(self, rows: int, longest: int) -> bool:
        return rows <= self.cfg.max_batch_items and rows * longest <= self.cfg.max_batch_tokens

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        carry = None
        while True:
            first = carry if carry is not None else await self.queue.get()
            carry = None
            batch = [first]
            rows, longest = len(first[0]), max(len(s) for s in first[0])
            deadline = time.monotonic() + self.cfg.batch_wait_ms / 1000.0
            while True:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    entry = await asyncio.wait_for(self.queue.get(), timeout)
                except asyncio.TimeoutError:
                    break
                r, lg = rows + len(entry[0]), max(longest, max(len(s) for s in entry[0]))
                if not self._fits(r, lg):
                    carry = entry  # opens the next batch
                    break
                batch.append(entry)
                rows, longest = r, lg
            seqs = [s for entry in batch for s in entry[0]]
            try:
                out = await loop.run_in_executor(
                    self.pool, lambda: self.model.forward(seqs, side=self.cfg.padding_side)
                )
            except Exception as e:  # noqa: BLE001 - every waiter of this batch gets the error
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            self.tokens_real += sum(len(s) for s in seqs)
            self.tokens_padded += len(seqs) * longest
            i = 0
            for entry_seqs, fut in batch:
                n = len(entry_seqs)
                if not fut.done():
                    fut.set_result(out[i : i + n])
                i += n


def create_app(cfg: BaselineConfig, model: BaselineModel | None = None):
    model = model or BaselineModel(cfg.model_id, kind=cfg.kind, device=cfg.device, dtype=cfg.dtype)
    batcher = Batcher(model, cfg)

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="radixserve-loadtest baseline", lifespan=lifespan)
    app.state.batcher = batcher

    def err(status: int, msg: str, kind: str = "validation"):
        return JSONResponse({"error": msg, "error_type": kind}, status_code=status)

    def texts_of(value) -> list[str] | None:
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
            return value
        return None

    async def embed_texts(texts: list[str]):
        if model.kind != "embedding":
            raise ValueError("this baseline serves a reranker; embedding routes need an embedding model")
        batcher.requests += 1
        seqs = model.encode_texts(texts)
        return await batcher.submit(seqs), sum(len(s) for s in seqs)

    @app.get("/health")
    async def health():
        alive = batcher.task is not None and not batcher.task.done()
        return JSONResponse({"status": "ok" if alive else "down"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        lines = [
            "# TYPE te_request_count counter", f"te_request_count {batcher.requests}",
            "# TYPE radixserve_tokens counter", f'radixserve_tokens_total{{kind="original"}} {batcher.tokens_real}',
            "# TYPE baseline_padded_tokens counter", f"baseline_padded_tokens_total {batcher.tokens_padded}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def v1_embeddings(request: Request):
        body = await request.json()
        texts = texts_of(body.get("input")) if isinstance(body, dict) else None
        if texts is None:
            return JSONResponse({"error": {"message": "input must be a string or a non-empty list of strings",
                                           "type": "invalid_request_error", "code": 422}}, status_code=422)
        try:
            vecs, n_tok = await embed_texts(texts)
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "code": 400}},
                                status_code=400)
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vecs)],
            "model": body.get("model") or cfg.model_id,
            "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
        }

    @app.post("/embed")
    async def embed(request: Request):
        body = await request.json()
        texts = texts_of(body.get("inputs")) if isinstance(body, dict) else None
        if texts is None:
            return err(422, "inputs must be a string or a non-empty list of strings")
        try:
            vecs, _ = await embed_texts(texts)
        except ValueError as e:
            return err(400, str(e))
        return [v.tolist() for v in vecs]

    @app.post("/rerank")
    async def rerank(request: Request):
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("query"), str):
            return err(422, "query must be a string")
        texts = texts_of(body.get("texts"))
        if texts is None:
            return err(422, "texts must be a non-empty list of strings")
        if model.kind != "reranker":
            return err(400, "this baseline serves an embedding model; /rerank needs a reranker")
        batcher.requests += 1
        raw = await batcher.submit(model.encode_pairs(body["query"], texts, instruction=body.get("instruction")))
        scores = [float(x) for x in raw]
        if not body.get("raw_scores", False):
            scores = [1.0 / (1.0 + math.exp(-s)) for s in scores]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        return [{"index": i, "score": scores[i]} for i in order]

    return app


def main(argv=None) -> None:
    p = argparse.ArgumentParser("python -m loadtest.baseline", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-id", required=True, help="local checkpoint directory")
    p.add_argument("--hostname", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--kind", choices=("embedding", "reranker"), default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None)
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--max-batch-items", type=int, default=64)
    p.add_argument("--batch-wait-ms", type=float, default=5.0)
    p.add_argument("--padding-side", choices=("left", "right"), default="left")
    a = p.parse_args(argv)
    cfg = BaselineConfig(**{k: v for k, v in vars(a).items()})
    import uvicorn

    uvicorn.run(create_app(cfg), host=cfg.hostname, port=cfg.port, log_level="warning")


if __name__ == "__main__":
    main()

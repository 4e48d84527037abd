"""The load tester's requests as an OpenAI batch file, so ``radixserve-batch`` and a server under
``radixserve-loadtest run`` answer the same requests in the same order.

  python -m benchmarks.batch_file --workload rerank-pointwise --order interleave:16 --source synthetic \
      --queries 48 --query-words 40,80 --seed 0 --out /tmp/pairs.jsonl

Takes the load tester's data and load flags of the same names (loadtest/cli.py) and writes one line
per request: ``{"custom_id": "req-<n>", "method": "POST", "url": <route>, "body": <body>}``.
"""
from __future__ import annotations

import argparse
import json

from loadtest import datasets, workloads


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    return int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.batch_file", description=__doc__.split("\n\n")[0])
    p.add_argument("--source", choices=datasets.SOURCES, default="synthetic")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--query-words", type=_range, default=datasets.QUERY_WORDS, metavar="MIN,MAX")
    p.add_argument("--passage-words", type=_range, default=datasets.PASSAGE_WORDS, metavar="MIN,MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=workloads.WORKLOADS, default="rerank")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--order", default="grouped", help="grouped, shuffled or interleave:K")
    p.add_argument("--out", required=True, help="output .jsonl")
    a = p.parse_args(argv)
    ds = datasets.load(a.source, path=a.dataset_path, limit=a.queries, seed=a.seed, query_words=a.query_words,
                       passage_words=a.passage_words)
    reqs = workloads.build_requests(ds, a.workload, batch_size=a.batch_size, order=a.order, seed=a.seed)
    with open(a.out, "w") as f:
        for n, r in enumerate(reqs):
            f.write(json.dumps({"custom_id": f"req-{n}", "method": "POST", "url": r.route, "body": r.body}) + "\n")
    print(f"{a.out}: {len(reqs)} {a.workload} requests ({a.order}), {sum(r.items for r in reqs)} items, "
          f"data {ds.source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

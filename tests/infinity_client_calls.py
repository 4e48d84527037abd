"""Run by tests/test_clients_infinity.py inside infinity_client's own virtualenv (it pins httpx < 0.28,
which this project's environment does not hold): Infinity's real client calls one base URL and
prints what it parsed as JSON on stdout. Imports nothing of this repository.

    python infinity_client_calls.py BASE_URL embed|rerank QUERY_OR_- TEXT...
"""
from __future__ import annotations

import json
import sys

from infinity_client import Client
from infinity_client.api.default import embeddings, models, rerank
from infinity_client.models import OpenAIEmbeddingInputText, RerankInput


def main() -> None:
    base_url, kind, query, texts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    client = Client(base_url=base_url, raise_on_unexpected_status=True, timeout=300)
    listed = models.sync(client=client)
    out: dict = {"models": [{"id": m.id, "owned_by": m.owned_by.value, "capabilities": m.capabilities,
                             "stats": m.stats.to_dict(), "backend": m.backend} for m in listed.data]}
    if kind == "embed":
        result = embeddings.sync(client=client, body=OpenAIEmbeddingInputText.from_dict({"input": texts}))
        out["embeddings"] = [d.embedding for d in result.data]
        out["usage"] = result.usage.to_dict()
    else:
        for name, extra in (("plain", {}), ("documents", {"return_documents": True, "top_n": 2}),
                            ("raw", {"raw_scores": True})):
            result = rerank.sync(client=client, body=RerankInput.from_dict({"query": query, "documents": texts, **extra}))
            out[name] = {"results": [{"index": r.index, "relevance_score": r.relevance_score,
                                      "document": None if not isinstance(r.document, (str, dict)) else r.document}
                                     for r in result.results],
                         "usage": result.usage.to_dict(), "model": result.model}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

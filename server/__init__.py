"""HTTP serving: the FastAPI app (TEI, OpenAI and Cohere/Jina dialects), admission control,
tokenization off the event loop, and the ``radixserve`` CLI. Imports scheduler/ and models/,
never the reverse."""

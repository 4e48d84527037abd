"""The route dialects: one module per API family (TEI, OpenAI, Cohere/Jina, Infinity, vLLM,
operations), each translating its bodies to and from the service layer's domain results. No route
module imports another; the body models live in server/schemas/ (one module per dialect), and a
piece two dialects share lives in the service layer (server/service/cohere_embed.py: Cohere's
embed body, also taken at TEI's POST /)."""

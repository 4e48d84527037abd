"""The route dialects: one module per API family (TEI, OpenAI, Cohere/Jina, operations), each
translating its bodies to and from the service layer's domain results. No route module imports
another; the body models live in schemas.py and schemas_compat.py."""

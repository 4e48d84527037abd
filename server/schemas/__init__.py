"""Request and response bodies, one module per dialect as the route modules are (tei, openai,
cohere, infinity, vllm) and the pieces they share (common). Imported by the routes, the service
layer and the HTTP body parser alike; imports nothing of theirs."""

"""The HTTP edge: ASGI middlewares (front door, drain), body parsing, error bodies, request ids,
the uvicorn listener, /docs, logging and tracing. Nothing here knows a model or a route dialect."""

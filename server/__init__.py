"""HTTP serving: the FastAPI app (app.py), the ``radixserve`` CLI (cli.py) and its config
(config.py) over three packages: routes/ (one module per API dialect), service/ (checks,
permits, tokenization, the scheduler call, domain results) and http/ (middlewares, bodies,
errors, the uvicorn listener). Imports scheduler/ and models/, never the reverse."""

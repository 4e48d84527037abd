"""HTTP serving: the FastAPI app (app.py), the ``radixserve`` CLI (cli.py), its config
(config.py) and the settings every serving process applies (process.py), over three packages:
routes/ (one module per API dialect, their bodies in schemas/, one module per dialect too),
service/ (checks, permits, tokenization, the scheduler call, domain results) and http/
(middlewares, bodies, errors, the uvicorn listener). frontends/ runs several front-end processes
before one engine (--api-server-count); batch/ runs the same app offline over a file
(``radixserve-batch``: command.py, inprocess.py). Imports scheduler/ and models/, never the
reverse."""

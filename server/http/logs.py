"""Log set-up for the server: plain text lines, or one JSON object per line (--json-output).

The same format applies to uvicorn's own loggers, so a log shipper sees one format per process.
"""
from __future__ import annotations

import json
import logging
import time

_UVICORN = ("uvicorn", "uvicorn.error", "uvicorn.access")


class JsonFormatter(logging.Formatter):
    """{"timestamp", "level", "target", "message"} (+ "exception") per line, like TEI's JSON logs."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(*, json_output: bool, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler()
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in _UVICORN:
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True

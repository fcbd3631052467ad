"""The command line's logging: one handler on stderr, text or JSON lines, a level for trio-mlx.

`configure(level, fmt)` sets trio-mlx's loggers (`trio_mlx.*`) to `level`; hypercorn's error log
and other libraries log at WARNING and above (DEBUG as well under `level="debug"`).
`fmt="json"` writes one JSON object a line: `time` (ISO 8601, UTC), `level`, `logger`,
`message`, and `exception` (the traceback) where there is one.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JSONFormatter(logging.Formatter):
    """A log record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, fmt: str = "text") -> None:
    """Log to stderr at `level` (one of `LEVELS`) in `fmt` (one of `FORMATS`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    numeric = getattr(logging, level.upper())
    root.setLevel(min(numeric, logging.WARNING) if numeric == logging.DEBUG else logging.WARNING)
    logging.getLogger("trio_mlx").setLevel(numeric)
    # hypercorn's INFO line ("Running on ...") repeats trio-mlx's own "loading ... on URL".
    logging.getLogger("hypercorn.error").setLevel(max(numeric, logging.WARNING))

"""braid's log: every record to stderr, as text or as one JSON object a line (--log-format).

A record may carry structured fields (`extra={FIELDS: {...}}`, as the per-request line does): in
text they are already in its message, in JSON each becomes a key of its own, numbers as numbers.
Prompts and generated text are never logged.
"""

from __future__ import annotations

import json
import logging
import sys
import time

FIELDS = "fields"  # the record attribute that holds a record's structured fields
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the record's
    fields, and the traceback where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, FIELDS, None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup(level: str, log_format: str) -> None:
    """Sends every record at `level` or above to stderr, in `log_format` (text or json). Python
    warnings become records too, so a JSON log holds nothing but JSON."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)


def key_values(fields: dict[str, object]) -> str:
    """`request_id=ab12 status=OK queue_ms=0.4`: a record's fields as its text message."""
    return " ".join(f"{key}={_plain(value)}" for key, value in fields.items())


def _plain(value: object) -> object:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else value

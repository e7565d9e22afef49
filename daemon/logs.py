"""Structured logs: one line per event, as ``key=value`` text or one JSON object per line.

Call sites log an event name plus fields::

    log_event(log, logging.INFO, "update_end", slot="[0,8)", update_id=3, seconds=2.1)

Text: ``2026-11-29T08:00:00.123Z INFO update_end slot=[0,8) update_id=3 seconds=2.1``.
JSON: ``{"ts": "...", "level": "INFO", "logger": "...", "event": "update_end", "slot": ...}``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_FIELDS = "slotsync_fields"


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """Log ``event`` with structured ``fields`` (values must be JSON-able)."""
    logger.log(level, event, extra={_FIELDS: fields})


def _ts(record: logging.LogRecord) -> str:
    t = time.gmtime(record.created)
    return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}Z"


def _text_value(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v)
    return json.dumps(s) if (" " in s or "=" in s or '"' in s or not s) else s


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <event> key=value ...`` (values with spaces are JSON-quoted)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, _FIELDS, {})
        parts = [_ts(record), record.levelname, record.getMessage()]
        parts += [f"{k}={_text_value(v)}" for k, v in fields.items()]
        line = " ".join(parts)
        if record.exc_info:
            line += " exc=" + json.dumps(self.formatException(record.exc_info))
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, then the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _ts(record), "level": record.levelname,
                               "logger": record.name, "event": record.getMessage()}
        out.update(getattr(record, _FIELDS, {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, fmt: str) -> None:
    """Send the daemon's logs to stderr (journald picks them up under systemd)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

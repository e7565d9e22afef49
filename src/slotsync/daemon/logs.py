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


class RateLimiter:
    """Per-key rate limit for a warning that a peer can trigger at will (a rejected message):
    the first ``burst`` events of a key in each ``interval_s`` are logged, the rest counted;
    ``due`` then hands out one summary (key, count) per key and interval. I/O-free: times are
    monotonic seconds passed in.

    Args:
        burst: events logged per key and interval (>= 1).
        interval_s: length of an interval, seconds (> 0).
        max_keys: keys tracked at once; beyond it the oldest interval is summarised early
            (a peer that changes identity per message cannot grow this without bound).
    """

    def __init__(self, burst: int = 5, interval_s: float = 60.0, max_keys: int = 1024) -> None:
        if burst < 1 or not interval_s > 0 or max_keys < 1:
            raise ValueError(f"burst must be >= 1, interval_s > 0 and max_keys >= 1, got "
                             f"{burst}, {interval_s}, {max_keys}")
        self.burst, self.interval_s, self.max_keys = burst, interval_s, max_keys
        self._windows: dict[str, list[float | int]] = {}  # key -> [start, logged, suppressed]
        self._carry: list[tuple[str, int]] = []  # summaries of intervals ended early

    def allow(self, key: str, now: float) -> bool:
        """Count one event of ``key``; True if it should be logged."""
        w = self._windows.get(key)
        if w is None or now >= w[0] + self.interval_s:
            if w is not None and w[2]:
                self._carry.append((key, int(w[2])))  # summary of the ended interval
            if w is None and len(self._windows) >= self.max_keys:
                oldest = min(self._windows, key=lambda k: self._windows[k][0])
                old = self._windows.pop(oldest)
                if old[2]:
                    self._carry.append((oldest, int(old[2])))
            w = self._windows[key] = [now, 0, 0]
        if w[1] < self.burst:
            w[1] += 1
            return True
        w[2] += 1
        return False

    def due(self, now: float) -> list[tuple[str, int]]:
        """``(key, suppressed count)`` for each interval that ended with events not logged;
        intervals that ended are forgotten."""
        out, self._carry = self._carry, []
        for key, w in list(self._windows.items()):
            if now >= w[0] + self.interval_s:
                if w[2]:
                    out.append((key, int(w[2])))
                del self._windows[key]
        return out

    def next_due(self) -> float | None:
        """When ``due`` next has something to report, or None."""
        if self._carry:
            return 0.0
        ts = [w[0] + self.interval_s for w in self._windows.values() if w[2]]
        return min(ts) if ts else None

"""A small durable record of engines that may be mid-update, so a daemon killed with SIGKILL
learns on restart which engines it left paused with half-loaded weights.

The record is ``<state_dir>/inflight.json``, rewritten atomically (temp file, rename) whenever
the set of such engines changes. Not fsync'd: it guards against the daemon *process* dying
while its engines live on, and the page cache outlives a process; a kernel crash or power
loss takes the engines' processes down too, so nothing is left mid-update then (an fsync
would cost every round two disk flushes; BENCHMARKS.md). The daemon writes it off its event
loop, in order, and a slot's ``/start_weight_update`` is sent only once the record naming that
slot is written. It lists every slot whose update has begun and not ended (``in_flight``), or whose
update failed and was not yet recovered (``failed``)::

    {"format": 1, "slots": [{"slot": [0, 8], "engine_url": "http://...", "update_id": 7,
      "weight_version": "step-7", "since": 1764403200.0, "state": "in_flight" | "failed"}]}
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

FORMAT = 1


@dataclass(frozen=True)
class MidUpdateEngine:
    """An engine that may hold half-loaded weights (design.md I4): one entry of the record
    file. The same fact is ``EngineSession.mid_update`` in the core and
    ``"engine_may_be_mid_update"`` in ``/status``."""

    slot: tuple[int, int]
    engine_url: str
    update_id: int
    weight_version: str
    state: str  # "in_flight" or "failed"
    since: float = 0.0  # wall-clock seconds since the epoch

    def key(self) -> tuple:
        return (self.slot, self.engine_url, self.update_id, self.state)


class MidUpdateRecord:
    """Reads and writes the record file. ``path`` None disables it (tests, no state dir)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._last: tuple | None = None

    def load(self) -> list[MidUpdateEngine]:
        """The engines a previous daemon left mid-update; [] if none or no file.

        Raises:
            ValueError: the file exists but is not a record this version understands.
        """
        if self.path is None or not self.path.exists():
            return []
        try:
            data = json.loads(self.path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"unknown format {data.get('format')!r}")
            return [
                MidUpdateEngine((int(d["slot"][0]), int(d["slot"][1])), str(d["engine_url"]),
                            int(d["update_id"]), str(d["weight_version"]), str(d["state"]),
                            float(d.get("since", 0.0)))
                for d in data["slots"]
            ]
        except (OSError, KeyError, TypeError, IndexError, json.JSONDecodeError) as e:
            raise ValueError(f"in-flight record {self.path} is unreadable: {e}") from None

    @staticmethod
    def key_of(engines: list[MidUpdateEngine]) -> tuple:
        """What a write of ``engines`` depends on (equal keys: nothing to rewrite)."""
        return tuple(sorted(e.key() for e in engines))

    def save(self, engines: list[MidUpdateEngine]) -> bool:
        """Write the record if it changed (temp file, then rename: another process sees the
        old or the new record, never a part); returns whether it wrote. Blocking: the daemon
        calls it from its record thread.

        Raises:
            OSError: the folder or file cannot be written.
        """
        if self.path is None:
            return False
        key = self.key_of(engines)
        if key == self._last:
            return False
        body = {"format": FORMAT, "slots": [
            {"slot": list(e.slot), "engine_url": e.engine_url, "update_id": e.update_id,
             "weight_version": e.weight_version, "state": e.state, "since": e.since or time.time()}
            for e in sorted(engines, key=lambda e: e.slot)
        ]}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.path)
        self._last = key
        return True

"""The fault suite's results table: one :class:`Row` per scenario, mode and engine, collected
by a :class:`Recorder` and written as JSON for ``tests/gen_reliability.py``, which renders
``docs/reliability.md`` (moved from ``tests/faults_lib.py``, issue 16).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from rank_pool import RankRun

RELIABILITY_ENV = "SLOTSYNC_RELIABILITY_OUT"  # the JSON file rows are appended to


def _engine_impl() -> str:
    from engines import impl

    return impl()


@dataclass
class Row:
    """One scenario x mode x engine for docs/reliability.md."""

    scenario: str
    mode: str
    fault: str
    engine: str = field(default_factory=_engine_impl)  # "reference" or "vllm" (tests/engines.py)
    happened: str = ""
    engine_after_fault: str = ""
    engine_final: str = ""
    rank_errors: list[str] = field(default_factory=list)
    detect_s: float | None = None
    other_slot: str = ""
    outcome: str = "fail"  # set to "pass" at the end of a scenario; "xfail (bug)"


class Recorder:
    """Collects rows; :meth:`dump` writes them as JSON to ``$SLOTSYNC_RELIABILITY_OUT``."""

    def __init__(self) -> None:
        self.rows: list[Row] = []

    def row(self, scenario: str, mode: str, fault: str) -> Row:
        r = Row(scenario, mode, fault)
        self.rows.append(r)
        return r

    def dump(self) -> None:
        path = os.environ.get(RELIABILITY_ENV)
        if not path:
            return
        old: list[dict] = []
        if os.path.exists(path):
            try:
                old = json.loads(Path(path).read_text())
            except (OSError, json.JSONDecodeError):
                old = []
        Path(path).write_text(json.dumps(old + [r.__dict__ for r in self.rows], indent=1))


def describe_errors(run: RankRun, k: int, ranks: list[int]) -> list[str]:
    """``rank r: phase: first 80 chars`` for each rank's round-k result."""
    out = []
    for r in ranks:
        if r in run.killed and not run.rounds(r):
            out.append(f"rank {r}: (killed)")
            continue
        res = [e for e in run.rounds(r) if e["round"] == k]
        if not res:
            out.append(f"rank {r}: no result")
        elif res[0]["status"] == "ok":
            out.append(f"rank {r}: ok")
        else:
            e = res[0]
            kind = f" [{e['error_type']}]" if e["error_type"] != "SlotsyncError" else ""
            out.append(f"rank {r}: {e['phase']}{kind}: {e['message'][:80]}")
    return out

"""``slotsync status``'s part for LoRA adapters (issue 36 E): every adapter version each slot's
engine serves, loads or has lost. Pure functions of the slots' ``"adapters"`` entries in the
``/status`` document (``daemon/core/slot_status.py``): ``{"lora_name", "version",
"served_name", "state", "nbytes", "loaded_at" (unix s), "error"}``, ``state`` one of
``served``, ``loading``, ``reloading``, ``unloading``, ``lost``."""

from __future__ import annotations

import time


def _slot(s: dict) -> str:
    return f"[{s['slot'][0]},{s['slot'][1]})"


def _size(n: int | None) -> str:
    """Bytes in decimal units, as ``12.5 MB``."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _ago(loaded_at: float | None, now: float) -> str:
    if not loaded_at:
        return "-"
    s = max(0.0, now - loaded_at)
    return f"{s:.0f}s ago" if s < 3600 else f"{s / 3600:.1f}h ago"


def _state(a: dict) -> str:
    """``lost`` in capitals (the one state that needs someone), the others as they are."""
    return "LOST" if a.get("state") == "lost" else str(a.get("state", "?"))


def render_adapters(status: dict, now: float | None = None) -> str:
    """One row per adapter version of each slot's engine: slot, engine, served name
    (``math@v3``), state, size, when it was loaded, its error; then one line per engine
    naming what it serves (``[0,2) serves math@v3 (12.5 MB), code@v1 (3.1 MB)``). "" when
    no slot has adapters (a daemon without them, or an older one). ``now``: unix seconds
    (default the clock)."""
    now = time.time() if now is None else now
    rows, serves = [], []
    for s in status.get("slots", []):
        entries = s.get("adapters") or []
        for a in sorted(entries, key=lambda a: (a.get("lora_name", ""), a.get("version", 0))):
            err = a.get("error") or "-"
            rows.append([_slot(s), s.get("engine_url") or "-",
                         a.get("served_name") or f"{a.get('lora_name')}@v{a.get('version')}",
                         _state(a), _size(a.get("nbytes")), _ago(a.get("loaded_at"), now),
                         err if len(err) <= 80 else err[:77] + "..."])
        if entries:
            served = [f"{a.get('served_name')} ({_size(a.get('nbytes'))})"
                      for a in entries if a.get("state") == "served"]
            serves.append(f"{_slot(s)} serves " + (", ".join(served) or "no adapter"))
    if not rows:
        return ""
    head = ["SLOT", "ENGINE", "ADAPTER", "STATE", "SIZE", "LOADED", "ERROR"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                      for r in [head, *rows]] + serves)


def lost_adapters(status: dict) -> list[str]:
    """``"[0,2) math@v3: <error>"`` for every adapter version a slot's engine should serve
    and has lost (``state == "lost"``): requests naming it fail until the daemon loads it
    again or a newer version is published."""
    return [f"{_slot(s)} {a.get('served_name')}" + (f": {a['error']}" if a.get("error") else "")
            for s in status.get("slots", []) for a in s.get("adapters") or []
            if a.get("state") == "lost"]

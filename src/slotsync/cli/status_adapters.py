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
    """Bytes in decimal units, as ``12.5 MB``; "-" for 0 or None (not known: an adapter
    found on the engine, loaded before this daemon started)."""
    if not n:
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
    naming what it serves (``[0,2) serves math@v3 (12.5 MB), code@v1 (3.1 MB)``), its
    adapter round in flight and its rounds so far (``_engine_line``). "" when no slot has
    adapters (a daemon without them, or an older one). ``now``: unix seconds (default the
    clock; ``loaded_at`` is unix seconds in the document)."""
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
        line = _engine_line(s, entries)
        if line:
            serves.append(line)
    if not rows and not serves:
        return ""
    head = ["SLOT", "ENGINE", "ADAPTER", "STATE", "SIZE", "LOADED", "ERROR"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    table = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in [head, *rows]] if rows else []
    return "\n".join(table + serves)


def _engine_line(s: dict, entries: list[dict]) -> str:
    """``[0,2) serves math@v3 (12.5 MB); adapter round in flight: math@v4, phase load; 3
    adapter round(s) succeeded, 1 failed, the last: <error>``: what the slot's engine serves,
    its adapter round in flight and its rounds so far (``adapter_round``,
    ``adapter_rounds_succeeded`` / ``_failed``, ``adapter_last_error``); '' for a slot that
    never had an adapter."""
    cur = s.get("adapter_round")
    ok, failed = s.get("adapter_rounds_succeeded") or 0, s.get("adapter_rounds_failed") or 0
    if not (entries or cur or ok or failed):
        return ""
    served = [f"{a.get('served_name')} ({_size(a.get('nbytes'))})" for a in entries
              if a.get("state") == "served"]
    parts = [f"{_slot(s)} serves " + (", ".join(served) or "no adapter")]
    if cur:
        parts.append(f"adapter round in flight: {cur.get('adapter')}, phase {cur.get('phase')}"
                     + (" (failing)" if cur.get("failing") else ""))
    if ok or failed:
        last = s.get("adapter_last_error") or ""
        parts.append(f"{ok} adapter round(s) succeeded, {failed} failed" + (
            f", the last: {last if len(last) <= 120 else last[:117] + '...'}"
            if failed and last else ""))
    return "; ".join(parts)


def lost_adapters(status: dict) -> list[str]:
    """``"[0,2) math@v3: <error>"`` for every adapter version a slot's engine should serve
    and has lost (``state == "lost"``): requests naming it fail until the trainer publishes
    that version again (the entry's ``error`` says so)."""
    return [f"{_slot(s)} {a.get('served_name')}" + (f": {a['error']}" if a.get("error") else "")
            for s in status.get("slots", []) for a in s.get("adapters") or []
            if a.get("state") == "lost"]

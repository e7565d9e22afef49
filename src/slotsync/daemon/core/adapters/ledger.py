"""What one engine holds and should hold of LoRA adapters, kept by the daemon (I/O-free;
issue 36 D): ``AdapterLedger``, one per engine (``EngineSession.adapters``: it moves with
what the daemon knows of the engine, ``EngineSession.take_over``).

Each adapter version the engine serves, or is being given, is an ``AdapterEntry`` under its
served name (``wire.served_name``: ``"math@v3"``), in one of the states ``/status`` shows:

    state       meaning
    loading     its load call is out (a round's new version)
    served      the engine serves it
    reloading   the engine restarted; the daemon loads it again from its kept folder (vLLM)
    lost        the engine restarted and the daemon holds no copy (SGLang: the engine read the
                ranks' memory, which they freed): publish that version again
    unloading   a newer version is served; its unload call is out

Besides them: ``stray``, served names the engine may hold but must not (a load that failed
or timed out may still have registered the name; an unload that failed), unloaded at the
next round before anything else; and ``retired``, the folders of versions unloaded whose
files are kept until the next version of that adapter is unloaded (vLLM: a request that was
running on the old version re-reads its folder after a base-weight finish, whose
``reset_lora_state`` dropped it from the workers: ``vllm/v1/worker/gpu_model_runner.py``
``reset_lora_state`` via ``Worker.finish_weight_update``; its ``LoRARequest`` keeps the path).
A folder is in use (``folders_in_use``: never removed, at the daemon's stop neither) while an
entry, a stray name or ``retired`` has it (docs/lora-vllm-notes.md: a folder vLLM re-reads
that is gone kills its engine core).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from slotsync.daemon.core.adapters.plan import AdapterPlan

LOADING, SERVED, RELOADING, LOST, UNLOADING = "loading", "served", "reloading", "lost", "unloading"
STATES = (LOADING, SERVED, RELOADING, LOST, UNLOADING)
"""An entry's states (the table above)."""

_SERVED_NAME_RE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_.\-]{0,63})@v(?P<version>\d+)$")


def parse_served_name(name: str) -> tuple[str, int] | None:
    """``(lora_name, version)`` of a served name ``"math@v3"`` (``wire.served_name``), or
    None for a name not of that form (another's adapter)."""
    m = _SERVED_NAME_RE.match(name)
    return (m["name"], int(m["version"])) if m else None


@dataclass
class AdapterEntry:
    """Version ``version`` of adapter ``lora_name``, served as ``served_name``: its
    ``state`` (``STATES``), ``nbytes`` (bytes of its tensors, 0: not known), ``loaded_at``
    (monotonic seconds of its last load, None: not loaded by this daemon), ``error`` (what
    went wrong with it last, '' none), ``folder`` (the files the engine reads it from, ''
    none: SGLang, or found on the engine) and ``plan`` (None: found on the engine)."""

    lora_name: str
    version: int
    served_name: str
    state: str
    nbytes: int = 0
    loaded_at: float | None = None
    error: str = ""
    folder: str = ""
    plan: AdapterPlan | None = None

    def status(self) -> dict[str, Any]:
        """The ``/status`` entry (``"loaded_at"``: monotonic here; the service writes it as
        unix seconds, ``service/status_documents.py``)."""
        return {"lora_name": self.lora_name, "version": self.version,
                "served_name": self.served_name, "state": self.state, "nbytes": self.nbytes,
                "loaded_at": self.loaded_at, "error": self.error or None}


@dataclass
class Reconciled:
    """What the engine's list of adapters says against the ledger (``AdapterLedger.reconcile``):
    entries to load again from their folders (``reload``, now ``reloading``), entries lost
    (``lost``), adapters found on the engine that this daemon did not load (``adopted``:
    served names of the form ``name@vN``, e.g. loaded by a daemon before this one), and the
    folders of stray names the engine no longer holds (``gone``: to remove)."""

    reload: list[AdapterEntry] = field(default_factory=list)
    lost: list[AdapterEntry] = field(default_factory=list)
    adopted: list[AdapterEntry] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)


@dataclass
class AdapterLedger:
    """The adapters of one engine (the module docstring): ``entries`` by served name,
    ``stray`` served name -> its folder ('' none), ``retired`` (lora name, folder) pairs."""

    entries: dict[str, AdapterEntry] = field(default_factory=dict)
    stray: dict[str, str] = field(default_factory=dict)
    retired: list[tuple[str, str]] = field(default_factory=list)

    def current(self, lora_name: str) -> AdapterEntry | None:
        """The version of ``lora_name`` the engine serves or should serve (not the one being
        unloaded, not one still loading): the highest such, or None."""
        have = [e for e in self.entries.values() if e.lora_name == lora_name
                and e.state in (SERVED, RELOADING, LOST)]
        return max(have, key=lambda e: e.version) if have else None

    def held(self) -> set[str]:
        """Served names the engine holds or may hold (entries not lost, and strays)."""
        return {n for n, e in self.entries.items() if e.state != LOST} | set(self.stray)

    def folders_in_use(self) -> set[str]:
        """Folders an engine may read: every entry's (lost ones included: the version may be
        published again, and the folder is named by its served name), every stray's, and the
        retired ones (a request admitted before their unload may still run)."""
        return {e.folder for e in self.entries.values() if e.folder} | {
            f for f in self.stray.values() if f} | {f for _, f in self.retired}

    def reconcile(self, listed: set[str], reloadable: bool, engine_url: str | None
                  ) -> Reconciled:
        """The engine lists ``listed`` (served names, from its list of models): an entry it
        should serve that it does not list was lost with a restart of the engine (or someone
        unloaded it); ``reloadable``: the family can load it again from its folder."""
        out = Reconciled()
        for e in self.entries.values():
            if e.state == SERVED and e.served_name not in listed:
                (out.reload if reloadable and e.folder else out.lost).append(e)
        for e in out.reload:
            e.state, e.error = RELOADING, ""
        for e in out.lost:
            e.state = LOST
            e.error = (f"engine {engine_url} no longer lists {e.served_name} (restarted, or "
                       "unloaded by someone else) and the daemon holds no copy of it: publish "
                       f"version {e.version} of {e.lora_name!r} again")
        for name in sorted(set(self.stray) - listed):
            folder = self.stray.pop(name)
            if folder:
                out.gone.append(folder)
        for name in sorted(listed - set(self.entries) - set(self.stray)):
            parsed = parse_served_name(name)
            if parsed is None:
                continue
            e = AdapterEntry(parsed[0], parsed[1], name, SERVED,
                             error="found on the engine: loaded before this daemon started")
            self.entries[name] = e
            out.adopted.append(e)
        return out

    def restarted(self, reloadable: bool, engine_url: str | None) -> Reconciled:
        """The engine is a new process (the base round's probe found a new session): it holds
        nothing; the names it may have held are gone (``reconcile`` with an empty list)."""
        return self.reconcile(set(), reloadable, engine_url)

    def retire(self, served: str) -> list[str]:
        """``served`` was unloaded: forget its entry, keep its folder (``retired``); returns
        the folders of versions of the same adapter retired before it, now to remove."""
        e = self.entries.pop(served, None)
        if e is None:
            return []
        old = [f for name, f in self.retired if name == e.lora_name]
        self.retired = [(n, f) for n, f in self.retired if n != e.lora_name]
        if e.folder:
            self.retired.append((e.lora_name, e.folder))
        return old

    def status(self) -> list[dict[str, Any]]:
        """``/status``'s ``"adapters"``: each entry, by adapter name then version."""
        return [e.status() for e in sorted(self.entries.values(),
                                           key=lambda e: (e.lora_name, e.version))]

"""What the I/O-free core asks its adapter to do: one frozen dataclass per action.

The coordinators (``coordinator.py``) and the slot table (``slot_table.py``) return lists of
these; the adapter (``executor.py``) runs them in order and feeds engine call outcomes back
through ``SlotCoordinator.on_engine_result``. The adapter never looks at a route or a message
to decide what to do: what an action requires is one of its fields (``EngineCall.needs_record``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotsync.protocol.wire import FromDaemon


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``msg`` to the rank whose socket identity is ``identity``."""

    identity: bytes
    msg: FromDaemon


@dataclass(frozen=True, slots=True)
class EngineCall:
    """Call vLLM route ``route`` (a name from ``daemon/vllm/client.py``'s ``ROUTES``) with
    JSON ``body``.

    ``needs_record``: the durable record naming the slot (``mid_update_record.py``) must be on
    disk before the call is sent, because the call may leave the engine mid-update
    (``/start_weight_update``, design.md I4); when it cannot be written the call is not sent
    and fails. ``index`` is the chunk of an ``update_weights`` call, else -1. ``timeout_s``:
    a deadline of its own, seconds (an adapter load: ``Timeouts.adapter_load_s``; 0: the
    client's ``engine_timeout_s`` only), after which it fails as timed out.
    """

    call_id: int
    update_id: int
    route: str
    body: Any = None
    slot: tuple[int, int] = (0, 0)
    index: int = -1
    needs_record: bool = False
    timeout_s: float = 0.0


@dataclass(frozen=True, slots=True)
class UpdateEnded:
    """An update ended. ``outcome`` is ``"success"`` or ``"failed"``; ``seconds`` from the first
    Begin; ``nbytes`` is tensor bytes per rank consumed by the engine; ``omitted_names`` the
    names the slot's last successful update loaded and this one left out."""

    slot: tuple[int, int]
    engine_url: str
    update_id: int
    weight_version: str
    outcome: str
    seconds: float
    chunks: int
    nbytes: int
    error: str = ""
    omitted_names: int = 0


@dataclass(frozen=True, slots=True)
class SlotEvent:
    """A line for the log: ``event`` (a snake_case name) about ``slot``, with ``fields``;
    ``warning`` for what an operator should act on."""

    slot: tuple[int, int]
    event: str
    fields: dict[str, Any]
    warning: bool = True


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    """Write the folder the engine loads adapter ``plan`` from (issue 36; a ``"host"``
    family, ``AdapterSupport.write_files``), reading each rank's part from ``handles`` (rank
    -> its ``wire.ShmHandle``, None for an empty part), within ``timeout_s`` seconds; the
    outcome comes back through ``SlotTable.on_adapter_files(slot, call_id, ...)``: the
    folder, or why it could not be written."""

    call_id: int
    slot: tuple[int, int]
    update_id: int
    plan: Any  # adapters.plan.AdapterPlan (not imported: the plan imports nothing of this)
    handles: dict[int, Any]
    timeout_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RemoveAdapterFiles:
    """Remove an adapter version's folder (issue 36): ``folder``, no engine of the slot
    reads it any more."""

    slot: tuple[int, int]
    folder: str


@dataclass(frozen=True, slots=True)
class SweepAdapterFolders:
    """Remove the adapter folders of ``slot`` that a daemon before this one left (found at
    start) and that are not in ``keep`` (the folders its engine may read:
    ``AdapterLedger.folders_in_use``, after the engine's list of adapters answered; issue
    36). The outcome comes back through ``SlotTable.on_adapter_swept(slot, call_id)``: an
    adapter round waits for it, so that no folder it writes is ever swept."""

    call_id: int
    slot: tuple[int, int]
    keep: frozenset[str]


Action = (Reply | EngineCall | UpdateEnded | SlotEvent | AdapterFiles | RemoveAdapterFiles
          | SweepAdapterFolders)

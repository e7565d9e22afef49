"""One adapter round of one slot (I/O-free; issue 36): its phases, what it gathered, the
checks of a rank's ``AdapterData``, and what the round still waits for.

Phases (each moves forward only; ``rounds.py`` moves them)::

    begin ──(every AdapterBegin, gathered and checked)──► info ──(version, server_info and the
    list of adapters answered; limits, version and room checked; Ack(adapter_begin) sent,
    strays unloaded, lost versions loaded again)──► data ──(every AdapterData checked)──►
    files ("host": the daemon writes the folder) ──► load ──(load returned: the new version
    served, Ack(adapter_data))──► ended (the previous version's unload goes out after it)

    a failure anywhere: the errors wait for every call out of the round; a load that was sent
    (returned or not) is undone first (``drop``: unload the new name), so that no engine
    keeps a half-loaded or unannounced version; the previous version stays served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from slotsync.daemon.core.adapters.ledger import AdapterEntry
from slotsync.daemon.core.adapters.plan import AdapterPlan
from slotsync.protocol.wire import AdapterBegin, CudaIpcHandle, Handle, ShmHandle


class AdapterPhase(StrEnum):
    """Where an adapter round stands (the table at the top)."""

    BEGIN = "begin"  # waiting for every rank's AdapterBegin
    INFO = "info"  # asking the engine what it is, can hold and holds
    DATA = "data"  # Ack(adapter_begin) sent: waiting for every rank's AdapterData
    FILES = "files"  # the daemon writes the folder ("host")
    LOAD = "load"  # the load call is out (its answer ends the round)


@dataclass
class AdapterRound:
    """The adapter round ``update_id`` of one slot. Times are monotonic seconds."""

    update_id: int
    started_at: float
    begins: dict[int, AdapterBegin] = field(default_factory=dict)
    phase: AdapterPhase = AdapterPhase.BEGIN
    plan: AdapterPlan | None = None
    transport: str = ""  # "host" | "device", told in Ack(adapter_begin)
    info_sent: bool = False
    answers: dict[str, Any] = field(default_factory=dict)  # info step -> its answer
    info_errors: dict[str, str] = field(default_factory=dict)  # info step -> its error
    acked_at: float = 0.0  # Ack(adapter_begin) sent then
    data: dict[int, Handle | None] = field(default_factory=dict)
    folder: str = ""  # written ("host")
    load_sent_at: float = 0.0
    ranks_needed: bool = True  # their memory is still read (false once files or load done)
    acked: bool = False  # Ack(adapter_data) sent: the new version is served
    stub: Any = None  # the update.Update the families read the version stage's answers into
    previous: AdapterEntry | None = None  # the version the new one replaces
    # a failure waiting for the calls of the round to return: (phase, message, missing)
    failure: tuple[str, str, list[int]] | None = None
    failure_code: str = ""  # its Error.code (protocol/errors.py ADAPTER_CODES)
    dropping: bool = False  # the failed load's unload is out (or done)

    @property
    def lora(self) -> str:
        """``"math@v3"`` once gathered, else the first begin's name and version."""
        if self.plan is not None:
            return self.plan.served_name
        b = next(iter(self.begins.values()), None)
        return f"{b.lora_name}@v{b.version}" if b is not None else "an adapter"

    def part_nbytes(self, rank: int) -> int:
        """Bytes of ``rank``'s part behind its handle (``wire.part_offsets``)."""
        return self.begins[rank].nbytes

    def missing(self, ranks: range) -> list[int]:
        """The ranks of ``ranks`` the round waits for in its phase (begin or data)."""
        have = self.begins if self.phase is AdapterPhase.BEGIN else self.data
        return [r for r in ranks if r not in have]


def handle_refusal(rank: int, handle: Handle | None, nbytes: int, transport: str,
                   registered: str | None) -> str:
    """Why rank ``rank``'s ``AdapterData.handle`` cannot carry its part of ``nbytes`` bytes
    under the round's ``transport`` (``"host"``: a ``ShmHandle`` the daemon reads;
    ``"device"``: the rank's ``registered`` transport's handle, ``"cuda"`` or ``"shm"``), or
    ''."""
    if handle is None:
        return "" if nbytes == 0 else (f"rank {rank} sent no handle for its part of {nbytes} "
                                       "bytes")
    want: type = ShmHandle
    how = ("a shared-memory handle (transport \"host\": the rank copies its part into a POSIX "
           "shared-memory segment the daemon reads)")
    if transport == "device" and registered == "cuda":
        want, how = CudaIpcHandle, "a CUDA IPC handle (transport \"device\", registered cuda)"
    elif transport == "device":
        how = "a shared-memory handle (transport \"device\", registered shm)"
    if not isinstance(handle, want):
        return f"rank {rank} sent a {type(handle).__name__} for its adapter part; it must be {how}"
    if handle.nbytes < nbytes:
        return (f"rank {rank}'s adapter handle covers {handle.nbytes} bytes, but its part "
                f"(AdapterBegin.tensors at wire.part_offsets) has {nbytes}")
    return ""

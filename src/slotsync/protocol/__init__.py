"""What a trainer rank imports: the wire schema, engine-slot topology and the publisher.

The public API is this package's names (``from slotsync.protocol import Publisher,
SlotTopology, SlotsyncError, ...``). Two layers live here:

* the schema, in ``protocol/`` itself, pure Python (msgspec, no torch): ``wire/`` (the messages
  between a rank and its daemon, their checks and codec), ``topology.py`` (engine slots),
  ``errors.py`` (``SlotsyncError`` and its codes), ``chunking.py`` (the one chunking rule and
  a chunk message's size bound), ``manifest.py`` (an update's tensor manifest digest),
  ``liveness.py`` (heartbeat options) and ``endpoint.py`` (the daemon's default runtime folder
  and socket). Of ``protocol``, the daemon imports only these (it never imports torch,
  design.md I6); they import nothing of ``protocol.rank``, torch or numpy.
* the trainer-side client, in ``rank/``: ``Publisher`` and the parts it is built of (see
  ``slotsync.protocol.rank``). It imports the schema and torch, never the daemon, an engine or
  a benchmark.

The torch-dependent names (``Publisher``, ``PublishStats``, ``AdapterStats``,
``new_slot_groups``, the export helpers) are loaded lazily on first access, so
``import slotsync.protocol`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slotsync.protocol.errors import SlotsyncError, SlotsyncTimeout
from slotsync.protocol.topology import EngineSlot, SlotTopology, TopologyError
from slotsync.protocol.wire import PROTOCOL_VERSION, logical_gpu_uuid, normalize_gpu_uuid

if TYPE_CHECKING:
    from slotsync.protocol.rank.export import ShmSegment, cuda_ipc_handle, gpu_uuid_of
    from slotsync.protocol.rank.groups import new_slot_groups
    from slotsync.protocol.rank.publisher import AdapterStats, Publisher, PublishStats
    from slotsync.protocol.rank.staging import StagingBuffer

_LAZY = {
    "AdapterStats": "slotsync.protocol.rank.publisher",
    "Publisher": "slotsync.protocol.rank.publisher",
    "PublishStats": "slotsync.protocol.rank.publisher",
    "new_slot_groups": "slotsync.protocol.rank.groups",
    "cuda_ipc_handle": "slotsync.protocol.rank.export",
    "gpu_uuid_of": "slotsync.protocol.rank.export",
    "ShmSegment": "slotsync.protocol.rank.export",
    "StagingBuffer": "slotsync.protocol.rank.staging",
}

__all__ = [
    "PROTOCOL_VERSION",
    "AdapterStats",
    "EngineSlot",
    "PublishStats",
    "Publisher",
    "ShmSegment",
    "SlotTopology",
    "SlotsyncError",
    "SlotsyncTimeout",
    "StagingBuffer",
    "TopologyError",
    "cuda_ipc_handle",
    "gpu_uuid_of",
    "logical_gpu_uuid",
    "new_slot_groups",
    "normalize_gpu_uuid",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""What ``Publisher`` accepts: its arguments and transport, ``publish``'s tensors and weight
version, an update's manifest (and a rank-local begin's tensor list made from it), and each
chunk's message size against the daemon's cap.

The rules come from the wire (``wire.MAX_NAME_CHARS``, ``wire.MAX_VERSION_CHARS``,
``wire.DTYPE_SIZES``: what the daemon decodes). A tensor may have any size: one larger than
``staging_bytes`` goes as a chunk of its own (packed: exporting its own memory,
``ChunkExporter.oversize``; issue 17). No I/O here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch

from slotsync.protocol import wire
from slotsync.protocol.chunking import MessageBound
from slotsync.protocol.rank.export import DTYPE_NAME_MEMO, dtype_name
from slotsync.protocol.topology import EngineSlot

__all__ = ["MAX_STAGING_BUFFERS", "Manifest", "check_item", "check_message_sizes",
           "check_publisher_args", "check_version", "checked", "manifest_entries",
           "rank_local_args", "rank_local_begin", "resolve_transport"]

MAX_STAGING_BUFFERS = 8
"""Packed: the most staging regions per rank."""

Manifest = Sequence[tuple[str, "torch.dtype | str", Sequence[int]]]
"""An update's tensors, ``(name, dtype, shape)`` in send order (``Publisher.publish``)."""


def check_publisher_args(endpoint: str, engine_url: str, rank: int, slot: EngineSlot,
                         gpu_uuid: str | None, packed: bool, staging_bytes: int,
                         staging_buffers: int, timeout_s: float, liveness_s: float) -> None:
    """``Publisher``'s arguments, checked in one place (see its Args).

    ``endpoint`` must be ``ipc:///absolute/path``: slotsyncd binds nothing else (its
    ``socket`` option, ``daemon/service/config.py``), so any other endpoint would only time out.
    ``engine_url`` is checked as the daemon checks ``Register.engine_url``
    (``wire.check_engine_url``), here rather than at ``register()``.

    Raises:
        TypeError: an argument of the wrong type (names it and what was given).
        ValueError: ``rank`` not in ``slot``, an endpoint or engine URL slotsync cannot use,
            or a value out of range.
    """
    for arg, text in (("endpoint", endpoint), ("engine_url", engine_url)):
        if not isinstance(text, str):
            raise TypeError(f"{arg} must be a str, got {type(text).__name__} {text!r}")
    if not endpoint.startswith("ipc:///"):
        raise ValueError(
            f"endpoint {endpoint!r} must be ipc:///absolute/path/to/slotsyncd.sock (the "
            "'ready endpoint=' slotsyncd prints): the daemon serves only node-local ipc:// "
            "sockets, since CUDA IPC handles mean nothing on another host"
        )
    try:
        wire.check_engine_url(engine_url)
    except ValueError as e:
        raise ValueError(f"engine_url {e}") from None
    for arg, value in (("rank", rank), ("staging_bytes", staging_bytes),
                       ("staging_buffers", staging_buffers)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{arg} must be an int, got {type(value).__name__} {value!r}")
    if rank not in slot:
        raise ValueError(f"rank {rank} is not in its engine slot {slot}")
    if gpu_uuid is not None and not isinstance(gpu_uuid, str):
        raise TypeError(f"gpu_uuid must be a str, got {type(gpu_uuid).__name__} "
                        f"{gpu_uuid!r}")
    if not isinstance(packed, bool):
        raise TypeError(f"packed must be True or False, got {type(packed).__name__} "
                        f"{packed!r}")
    if not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool):
        raise TypeError(f"timeout_s must be a number of seconds, got "
                        f"{type(timeout_s).__name__} {timeout_s!r}")
    if staging_bytes <= 0:
        raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
    if not 1 <= staging_buffers <= MAX_STAGING_BUFFERS:
        raise ValueError(f"staging_buffers must be 1..{MAX_STAGING_BUFFERS}, got "
                         f"{staging_buffers}")
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
    if (not isinstance(liveness_s, int | float) or isinstance(liveness_s, bool)
            or not 0.1 <= liveness_s <= 3600):
        raise ValueError(f"liveness_s must be 0.1..3600 seconds, got {liveness_s!r}")


def check_version(weight_version: object) -> None:
    """A weight version the wire carries (``Begin``): a str of 1 to ``MAX_VERSION_CHARS``.

    Raises:
        TypeError: not a str. ValueError: empty or too long.
    """
    if not isinstance(weight_version, str):
        raise TypeError(f"weight_version must be a str, got {type(weight_version).__name__} "
                        f"{weight_version!r}"[:200])
    if not 0 < len(weight_version) <= wire.MAX_VERSION_CHARS:
        raise ValueError(f"weight_version must have 1 to {wire.MAX_VERSION_CHARS} characters "
                         f"(it has {len(weight_version)})")


def checked(items: Iterable[object]) -> Iterator[tuple[str, torch.Tensor, int]]:
    """``(name, tensor, bytes)`` per item, lazily, after the checks ``publish`` documents:
    a (str, Tensor) pair, a name not seen before, of 1 to ``wire.MAX_NAME_CHARS``
    characters, a dtype of ``wire.DTYPE_SIZES``, not on the meta device. No size limit: a
    tensor larger than ``staging_bytes`` is a chunk of its own (``chunking.cut``).

    One test per check on the way through (this runs once per tensor and round); what
    fails is told by ``_refuse``.

    Raises:
        TypeError: an item is not a ``(str, torch.Tensor)`` pair.
        ValueError: a check fails (names the tensor).
    """
    seen: set[str] = set()
    max_chars, known = wire.MAX_NAME_CHARS, DTYPE_NAME_MEMO
    strided = torch.strided
    for item in items:
        if type(item) is tuple and len(item) == 2:
            name, t = item
            if type(name) is not str or not isinstance(t, torch.Tensor):
                name, t = check_item(item)  # raises the TypeError
        else:
            name, t = check_item(item)
        n = t.nbytes if t.layout is strided else -1  # (sparse: _refuse says so)
        if (n < 0 or name in seen or not 0 < len(name) <= max_chars
                or t.dtype not in known or t.is_meta):
            _refuse(name, t, seen)  # raises, or remembers a new dtype
        seen.add(name)
        yield name, t, n


def _refuse(name: str, t: torch.Tensor, seen: set[str]) -> None:
    """Raise the ValueError saying which of ``checked``'s checks ``(name, t)`` fails;
    returns when none does (a dtype seen for the first time)."""
    if t.layout is not torch.strided:
        raise ValueError(f"tensor {name!r} has layout {t.layout}: only dense (strided) "
                         "tensors can be published")
    if name in seen:
        raise ValueError(f"tensor {name!r} appears twice in one update")
    if not 0 < len(name) <= wire.MAX_NAME_CHARS:
        raise ValueError(
            f"tensor name {name[:80]!r} must have 1 to {wire.MAX_NAME_CHARS} "
            f"characters (it has {len(name)})"
        )
    try:
        dtype_name(t.dtype)  # memoized; its ValueError names the allowed dtypes
    except ValueError as e:
        raise ValueError(f"tensor {name!r}: {e}") from None
    if t.is_meta:
        raise ValueError(f"tensor {name!r} is on the meta device: it has no data")


def check_item(item: object) -> tuple[str, torch.Tensor]:
    """One ``(name, tensor)`` pair, or a TypeError saying what was given instead."""
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise TypeError(
            f"publish takes (name, tensor) pairs (e.g. model.state_dict().items()), got "
            f"{type(item).__name__} {str(item)[:80]!r}"
        )
    name, t = item
    if not isinstance(name, str) or not isinstance(t, torch.Tensor):
        raise TypeError(
            f"publish takes (name: str, tensor: torch.Tensor) pairs, got "
            f"({type(name).__name__}, {type(t).__name__}) for {str(name)[:80]!r}"
        )
    return name, t


def resolve_transport(
    transport: str, device: torch.device | int | str | None
) -> tuple[str, torch.device]:
    """Pick the transport and the rank's device (see ``Publisher``'s ``transport``)."""
    if transport not in ("auto", "cuda", "shm"):
        raise ValueError(f"transport must be 'auto', 'cuda' or 'shm', got {transport!r}")
    dev: torch.device | None = None
    if device is not None:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if transport == "auto":
        if dev is not None:
            transport = "cuda" if dev.type == "cuda" else "shm"
        else:
            transport = "cuda" if torch.cuda.is_available() else "shm"
    if transport == "cuda":
        if dev is not None and dev.type != "cuda":
            raise ValueError(f"transport 'cuda' needs a CUDA device, got {dev}")
        if not torch.cuda.is_available():
            raise ValueError("transport 'cuda' needs a CUDA build of torch and a visible GPU "
                             "(torch.cuda.is_available() is False); use transport='shm'")
        if dev is None or dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return "cuda", dev
    return "shm", dev if dev is not None else torch.device("cpu")


def manifest_entries(manifest: Manifest) -> list[tuple[str, str, tuple[int, ...]]]:
    """``manifest`` with vLLM's dtype names and int shapes (``manifest.manifest_of``'s input).

    Raises:
        ValueError: an unsupported dtype.
    """
    return [(name, dt if isinstance(dt, str) else dtype_name(dt), tuple(int(d) for d in shape))
            for name, dt, shape in manifest]


def rank_local_args(rank: int, slot: EngineSlot, rank_local: bool,
                    worker_rank: int | None) -> tuple[bool, int]:
    """``(rank_local, worker_rank)`` checked; ``worker_rank`` defaults to ``rank - slot.start``
    in rank-local mode and is -1 outside it (``wire.Begin``).

    Raises:
        ValueError: ``worker_rank`` without ``rank_local``, or outside ``[0, slot.count)``.
    """
    if not rank_local:
        if worker_rank is not None:
            raise ValueError(f"worker_rank={worker_rank} needs rank_local=True")
        return False, -1
    w = rank - slot.start if worker_rank is None else worker_rank
    if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < slot.count:
        raise ValueError(f"rank {rank}: worker_rank must be an int in [0, {slot.count}) (the "
                         f"engine's workers), got {worker_rank!r}")
    return True, w


def rank_local_begin(rank: int, worker_rank: int,
                     manifest: Manifest | None) -> dict[str, object]:
    """A rank-local ``Begin``'s own fields (``wire.Begin``): ``worker_rank`` and the update's
    tensors in clear, from its manifest.

    Raises:
        ValueError: no manifest, or an empty one (rank-local mode declares the update's
            tensors in its begin).
    """
    entries = manifest_entries(manifest) if manifest is not None else None
    if not entries:
        raise ValueError(
            f"rank {rank}: rank-local mode declares the update's tensors in its "
            "begin: publish a list or mapping, or pass manifest= (name, dtype, shape) "
            "for an iterator")
    return {"rank_local": True, "worker_rank": worker_rank,
            "names": [e[0] for e in entries], "dtype_names": [e[1] for e in entries],
            "shapes": [list(e[2]) for e in entries]}


def check_message_sizes(items: list[tuple[str, torch.Tensor, int]], cap: int, transport: str,
                        packed: bool, staging_bytes: int) -> None:
    """Refuse, before the begin, a chunk whose message would exceed the daemon's
    ``max_message_bytes`` ``cap`` (learnt at registration; 0: unknown, not checked), cut at
    ``staging_bytes`` from ``items`` (``checked``'s output): ``chunking.MessageBound``.

    Raises:
        ValueError: names the chunk, its tensor count and both sizes.
    """
    if not cap:
        return
    bound = MessageBound(transport, packed)
    if bound.worst(len(items)) <= cap:
        return  # even the whole update in one message would fit (the usual case: free)
    bound.check(((name, t.dim(), n) for name, t, n in items), staging_bytes, cap)

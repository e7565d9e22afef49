"""The ``update_info`` / ``init_info`` payloads of vLLM's IPC weight-transfer backend, parsed
and validated in one place, as vLLM does it (vLLM 0.32 ``distributed/weight_transfer/
ipc_engine.py``: ``IPCWeightTransferInitInfo``, ``IPCWeightTransferUpdateInfo.__post_init__``,
``IPCWeightTransferEngine.parse_init_info`` / ``parse_update_info`` / ``receive_weights``).

I/O-free: text or decoded JSON in, :class:`ParsedUpdate` (or vLLM's exception, with vLLM's
text) out. The reference engine's worker (``slotsync.engine.reference.worker_state``) loads what
this
module parses; ``ipc_handles_pickled`` is always unpickled here (the reference engine stands in
for a vLLM server launched with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
"""

from __future__ import annotations

import base64
import pickle
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

# Keys of vLLM's IPCWeightTransferUpdateInfo (0.27-0.33); anything else is a TypeError there.
UPDATE_INFO_KEYS = frozenset(
    {"names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes"}
)
# Keys of vLLM's IPC init info (0.27-0.33).
INIT_INFO_KEYS = frozenset({"packed"})


@dataclass
class ParsedUpdate:
    """One ``update_info`` after vLLM-style validation (see :func:`parse_update_info`).

    ``handles`` is a list of ``{gpu_uuid: args}`` (one per name) when unpacked, or one
    ``{gpu_uuid: args}`` dict for the chunk's uint8 buffer when packed; ``tensor_sizes`` is
    each tensor's bytes in the packed buffer (``None`` when unpacked).
    """

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[list[int]]
    handles: Any
    tensor_sizes: list[int] | None


def _dtype(name: Any) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r} in `dtype_names`")
    return dt


def check_dataclass_kwargs(d: Any, allowed: frozenset, what: str, cls: str) -> None:
    """Refuse a non-object or an unknown key the way vLLM 0.32's
    ``WeightTransferEngine.parse_init_info`` / ``parse_update_info`` do: the dataclass
    constructor's ``TypeError`` wrapped as ``ValueError("Invalid <what> for
    IPCWeightTransferEngine: <cls>.__init__() got an unexpected keyword argument '<key>'")``."""
    if not isinstance(d, dict):
        raise TypeError(f"{what} must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ValueError(
            f"Invalid {what} for IPCWeightTransferEngine: {cls}.__init__() got an unexpected "
            f"keyword argument '{unknown[0]}'"
        )


def nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    """Bytes of a contiguous tensor of ``dtype`` and ``shape`` (a list of ints)."""
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize  # (itemsize: no tensor made per name)


JSON = msgspec.json.Decoder()  # JSON text -> dict / list / str / int / float / bool / None


def decode_json(text: bytes) -> Any:
    """``update_info`` sent as JSON text (the server forwards the request's text so that each
    worker decodes it in parallel), decoded.

    Raises:
        ValueError: ``update_info is not valid JSON: <msgspec's reason>``.
    """
    try:
        return JSON.decode(text)
    except msgspec.DecodeError as e:
        raise ValueError(f"update_info is not valid JSON: {e}") from None


def parse_init_info(init_info: Any) -> bool:
    """vLLM ``init_weight_transfer_engine``'s ``init_info = {"packed": bool}``: whether the
    session's chunks are packed.

    Raises:
        TypeError, ValueError: not an object, or an unknown key (vLLM 0.32
            ``parse_init_info``: ``Invalid init_info for IPCWeightTransferEngine: ...``).
    """
    check_dataclass_kwargs(init_info, INIT_INFO_KEYS, "init_info", "IPCWeightTransferInitInfo")
    return bool(init_info.get("packed", False))


class RawPackedUpdateInfo(msgspec.Struct, forbid_unknown_fields=True):
    """A packed ``update_info`` as JSON text, its lists left undecoded (``msgspec.Raw`` only
    finds where each ends). Byte-identical lists decode to identical values, so the four
    texts key a ``slotsync.engine.reference.weight_loader.PackedPlan`` without decoding thousands of
    names and shapes per chunk."""

    names: msgspec.Raw
    dtype_names: msgspec.Raw
    shapes: msgspec.Raw
    tensor_sizes: msgspec.Raw
    ipc_handles_pickled: str

    def key(self) -> tuple[bytes, bytes, bytes, bytes]:
        """The four lists' JSON texts (``names``, ``dtype_names``, ``shapes``,
        ``tensor_sizes``), as sent."""
        return (bytes(self.names), bytes(self.dtype_names), bytes(self.shapes),
                bytes(self.tensor_sizes))


RAW_PACKED = msgspec.json.Decoder(RawPackedUpdateInfo)


def check_args(args: Any) -> None:
    """Discard mode: the handle value must look like one a load would map (the 15-tuple
    of ``reduce_tensor``'s args).

    Raises:
        ValueError: another value.
    """
    if isinstance(args, (tuple, list)) and len(args) == 15:
        return
    raise ValueError(f"unrecognized IPC handle args of type {type(args).__name__}")


def handles_of(update_info: dict) -> Any:
    """The unpickled ``ipc_handles_pickled`` (vLLM 0.33: exactly one of ``ipc_handles`` /
    ``ipc_handles_pickled``; only the pickled form travels over HTTP).

    Raises:
        ValueError: both or neither given, or ``ipc_handles`` given.
    """
    handles = update_info.get("ipc_handles")
    pickled = update_info.get("ipc_handles_pickled")
    if pickled is not None:
        if handles is not None:
            raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
        return pickle.loads(base64.b64decode(pickled))
    if handles is not None:
        raise ValueError(
            "`ipc_handles` holds live objects and only travels over Ray; over HTTP send "
            "`ipc_handles_pickled`"
        )
    raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")


def parse_update_info(update_info: Any, packed: bool) -> ParsedUpdate:
    """Validate one ``update_info`` as vLLM's IPC backend does, in its order.

    Rules, from vLLM 0.32 ``ipc_engine.py`` (``IPCWeightTransferUpdateInfo.__post_init__``,
    then ``IPCWeightTransferEngine.receive_weights``): unknown or missing keys fail
    ``parse_update_info`` (``Invalid update_info for IPCWeightTransferEngine: ...``); exactly
    one of ``ipc_handles`` / ``ipc_handles_pickled`` (standard base64 of a pickle);
    ``dtype_names`` and ``shapes`` as long as ``names``, and a handle list too. Then, packed:
    ``tensor_sizes`` is required (``ValueError("`tensor_sizes` is required when
    packed=True")``) and the handles must be one dict -- else vLLM's bare ``assert
    isinstance(update_info.ipc_handles, dict)`` fails with an empty message; unpacked: the
    handles must be a list (bare ``assert isinstance(..., list)``). Beyond vLLM, packed
    ``tensor_sizes`` must be as long as ``names`` (vLLM's ``zip`` would drop the rest).

    Raises:
        ValueError, TypeError, AssertionError: with vLLM's texts; the caller turns them into
            a 500.
    """
    check_dataclass_kwargs(update_info, UPDATE_INFO_KEYS, "update_info",
                            "IPCWeightTransferUpdateInfo")
    absent = [f"'{k}'" for k in ("names", "dtype_names", "shapes") if k not in update_info]
    if absent:  # Python's text for a call missing these positional arguments, all of them
        listed = (absent[0] if len(absent) == 1 else f"{absent[0]} and {absent[1]}"
                  if len(absent) == 2 else f"{', '.join(absent[:-1])}, and {absent[-1]}")
        plural = "argument" if len(absent) == 1 else "arguments"
        raise ValueError(
            "Invalid update_info for IPCWeightTransferEngine: IPCWeightTransferUpdateInfo"
            f".__init__() missing {len(absent)} required positional {plural}: {listed}"
        )
    names = update_info["names"]
    dtype_names = update_info["dtype_names"]
    shapes = update_info["shapes"]
    handles = handles_of(update_info)
    n = len(names)
    if len(dtype_names) != n:
        raise ValueError(
            f"`dtype_names` should be of the same size as `names`: got {len(dtype_names)} and {n}"
        )
    if len(shapes) != n:
        raise ValueError(
            f"`shapes` should be of the same size as `names`: got {len(shapes)} and {n}"
        )
    if isinstance(handles, list) and len(handles) != n:
        raise ValueError(
            f"`ipc_handles` should be of the same size as `names`: got {len(handles)} and {n}"
        )
    tensor_sizes = update_info.get("tensor_sizes")
    if packed:
        if tensor_sizes is None:
            raise ValueError("`tensor_sizes` is required when packed=True")
        if not isinstance(handles, dict):
            raise AssertionError  # vLLM: assert isinstance(update_info.ipc_handles, dict)
        if len(tensor_sizes) != n:
            raise ValueError(
                f"`tensor_sizes` should be of the same size as `names`: "
                f"got {len(tensor_sizes)} and {n}"
            )
        tensor_sizes = [int(s) for s in tensor_sizes]
    else:
        if not isinstance(handles, list):
            raise AssertionError  # vLLM: assert isinstance(update_info.ipc_handles, list)
        tensor_sizes = None
    dtypes = [_dtype(d) for d in dtype_names]
    shapes = [[int(d) for d in s] for s in shapes]
    return ParsedUpdate(list(names), dtypes, shapes, handles, tensor_sizes)


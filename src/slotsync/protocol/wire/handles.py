"""Handle records: what a ``Chunk`` carries to point at a rank's tensor memory, a CUDA IPC
handle (``CudaIpcHandle``) or a POSIX shared-memory range (``ShmHandle``). On the wire each is a
msgpack array, its tag first (``array_like``, protocol version 2).

Pure Python, no torch (the daemon imports it, design.md I6); imports ``fields`` only.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from slotsync.protocol.wire.fields import (
    DTYPE_SIZES,
    DtypeName,
    FieldError,
    HandleBytes,
    NonNeg,
    TupleDims,
)

_SHM_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,200}$")


class CudaIpcHandle(
    msgspec.Struct, tag="cuda", frozen=True, forbid_unknown_fields=True, array_like=True,
    gc=False,
):
    """The 15 fields of ``torch.multiprocessing.reductions.reduce_tensor(t)[1]`` for a CUDA
    tensor, as typed data (no pickle). The daemon re-creates vLLM's argument tuple from them.

    Field order and meaning follow ``rebuild_cuda_tensor`` (torch 2.x); vLLM overwrites
    ``device`` with the receiving worker's own device index (vllm-contract.md).

    On the wire: a 16-element msgpack array, ``["cuda", tensor_class, size, ...,
    event_sync_required]`` (``array_like``). Classes and ``dtype`` are checked against the
    allow-lists by msgspec while decoding; ``__post_init__`` checks that ``size`` and
    ``stride`` have as many dims. ``gc=False``: the fields are atoms and tuples of ints, so a
    record can never be part of a reference cycle, and the garbage collector need not track
    the thousands an unpacked round decodes.
    """

    tensor_class: Literal["torch.Tensor", "torch.nn.parameter.Parameter"]
    size: TupleDims
    stride: TupleDims
    storage_offset: NonNeg  # in elements
    storage_class: Literal["torch.storage.TypedStorage", "torch.storage.UntypedStorage"]
    dtype: DtypeName
    device: NonNeg
    ipc_handle: HandleBytes  # cudaIpcMemHandle (+ torch's framing)
    storage_size_bytes: NonNeg
    storage_offset_bytes: NonNeg
    requires_grad: bool
    ref_counter_handle: HandleBytes
    ref_counter_offset: NonNeg
    event_handle: HandleBytes | None
    event_sync_required: bool

    def __post_init__(self) -> None:
        if len(self.size) != len(self.stride):
            raise FieldError(
                "stride", f"size has {len(self.size)} dims but stride has {len(self.stride)}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's own elements (contiguous view)."""
        n = 1
        for d in self.size:
            n *= d
        return n * DTYPE_SIZES[self.dtype]


class ShmHandle(
    msgspec.Struct, tag="shm", frozen=True, forbid_unknown_fields=True, array_like=True,
    gc=False,
):
    """A CPU stand-in for a CUDA IPC handle: bytes ``[offset, offset + nbytes)`` of the POSIX
    shared-memory segment ``/dev/shm/<segment>``. Lets the whole path run without a GPU; only
    the reference engine understands it (vLLM does not).

    On the wire: ``["shm", segment, offset, nbytes]`` (``array_like``, as ``CudaIpcHandle``).
    """

    segment: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    offset: NonNeg  # bytes
    nbytes: NonNeg  # bytes

    def __post_init__(self) -> None:
        if not _SHM_NAME_RE.match(self.segment):
            raise FieldError("segment", f"bad shared-memory segment name {self.segment!r}")


Handle = CudaIpcHandle | ShmHandle

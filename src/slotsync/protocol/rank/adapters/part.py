"""This rank's part of an adapter in memory: the bytes an ``AdapterData`` handle covers, laid out
as ``wire.part_offsets`` says (tensors back to back in ``AdapterBegin.tensors`` order, each
at a multiple of ``wire.ADAPTER_ALIGN`` bytes), and their sha256 digests.

One host copy, always (a non-empty part): a POSIX shared-memory segment this rank creates
(``shm_segment.ShmSegment``), where the digests are taken (sha256 runs on the CPU) and which
the ``"host"`` transport hands over as it is -- so the one device-to-host copy serves both.
On the cuda transport the tensors are first packed into one uint8 device buffer (a copy on
the GPU), then copied to the host in one transfer; the ``"device"`` transport exports that
buffer (one CUDA IPC handle, ``export.cuda_ipc_handle``). Whichever copy the daemon's
transport does not use is freed as soon as it is known (``handle``).

A part of whole tensors whose layout allows it (``wire.adapter.file_header``: the part of a
rank that holds the adapter alone, e.g. under DDP, and any part of whole tensors) is laid out
in its segment as a complete ``adapter_model.safetensors``: the header first, the handle
covering the tensors after it (at the same ``part_offsets`` from the handle's start). On the
``"host"`` transport the segment is then sealed before it is handed over
(``ShmSegment.seal``: mode 0444, this process's mapping and descriptor closed), so that a
daemon can hard-link it as the file vLLM loads instead of copying it: it checks the seal
with a read lease, which the kernel refuses while any process holds the file open for
writing. The rank writes nothing into the segment after its digests are taken.

Lifetime (design.md I3): the copy handed over lives until the daemon's
``Ack(adapter_data)`` (the engine has read or copied it) or its ``Error``; ``free`` then
unlinks the segment, drops the device buffer and, on CUDA, runs ``torch.cuda.ipc_collect()``.
An export the engine was never known to consume (no ack: an error, a timeout, an interrupt)
is given back first (``export.release_unconsumed``), as the base-weight ledger does for
chunks never acknowledged (``export_ledger.py``). Should the engine have mapped and released
it after all, the counter goes below zero, which torch's IPC limbo frees as it frees zero
(``CudaIPCSentDataLimbo::collect`` keeps only blocks whose counter is above zero); an engine
still reading it then reads freed memory, which the digests it checks catch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from slotsync.protocol import wire
from slotsync.protocol.rank.adapters.inputs import PartTensor
from slotsync.protocol.rank.export import cuda_ipc_handle, raw_bytes, release_unconsumed
from slotsync.protocol.rank.shm_segment import ShmSegment
from slotsync.protocol.wire.adapter import file_header, part_offsets

__all__ = ["AdapterPart"]

log = logging.getLogger("slotsync.protocol.rank.publisher")  # (the log lines stay the publisher's)

PARALLEL_DIGEST_BYTES = 32 << 20
"""Parts of at least this many bytes are hashed by up to 4 threads (``hashlib`` releases the
GIL while it hashes), on shm while the next tensors are copied."""


def _sha256(view: torch.Tensor) -> str:
    return hashlib.sha256(view.numpy()).hexdigest()


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the uint8 tensor ``src`` into the segment's view ``dst``: a plain single-threaded
    ``memcpy`` (numpy's) from host memory. torch's ``copy_`` splits each copy over its
    intra-op threads (OpenMP), and a part is hundreds of small tensors: every one is a
    parallel region whose threads wait for each other, while the digest threads hold the
    cores; on a loaded 2-core machine that made a Qwen3-8B rank-32 part's copy (504 tensors,
    174.6 MB) take 1.9-3.9 s instead of 0.25-0.43 s (BENCHMARKS.md, ``slotsync bench
    lora``)."""
    if src.device.type == "cpu":
        dst.numpy()[:] = src.numpy()
    else:
        dst.copy_(src)


class AdapterPart:
    """This rank's part of one adapter round in memory (see the module's docstring).

    Args:
        tensors: the part (``inputs.part_tensors``), in the order the begin lists them.
        rank: the publisher's rank (names its segment).
        transport: the publisher's, ``"cuda"`` (a device buffer too) or ``"shm"``.
        device: the publisher's device (cuda: where the device buffer lives).
        owned: the publisher's list of segments it owns (its finalizer unlinks what is left
            there at ``close``, garbage collection or exit); the segment is added and removed.
    """

    def __init__(self, tensors: list[PartTensor], *, rank: int, transport: str,
                 device: torch.device, owned: list[ShmSegment]) -> None:
        self.tensors = tensors
        offsets, self.nbytes = part_offsets(tensors)  # type: ignore[arg-type]
        self.offsets: list[int] = offsets
        self.rank = rank
        self.transport = transport
        self.device = device
        self._owned = owned
        self.segment: ShmSegment | None = None
        self.device_buffer: torch.Tensor | None = None
        self.export: wire.CudaIpcHandle | None = None
        self.consumed = False  # the daemon acknowledged the data: the engine has its bytes
        self.copy_s = self.digest_s = 0.0
        whole = all(t.row_start == 0 and t.row_stop == t.shape[0] for t in tensors)
        self.header = (file_header([(t.name, t.dtype, t.shape) for t in tensors]) if whole
                       else None) or b""
        """The safetensors header the segment starts with (b'': the part is not laid out
        as a file); the handle starts after it."""

    def fill(self) -> list[str]:
        """Allocate the copies, copy the tensors in and return the sha256 hex digest of each
        tensor's bytes (its rows, C order), taken from the host copy. On CUDA the tensors are
        packed on the device, then copied to the host in one transfer; on shm each tensor's
        digest is taken (by up to 4 threads: ``hashlib`` releases the GIL) while the next
        ones are copied, for a part of ``PARALLEL_DIGEST_BYTES`` or more.

        Raises:
            MemoryError: the segment (``/dev/shm``) or the device buffer cannot be allocated
                (names the size and where).
        """
        if not self.tensors:
            return []
        t0 = time.perf_counter()
        try:
            self.segment = ShmSegment(len(self.header) + self.nbytes, rank=self.rank)
        except OSError as e:
            raise MemoryError(f"cannot create a shared-memory segment of {self.nbytes} bytes "
                              f"for this rank's adapter part: {e} (free space in /dev/shm, or "
                              "a larger --shm-size for a container)") from None
        self._owned.append(self.segment)
        seg = self.segment.tensor
        assert seg is not None
        if self.header:
            _host_copy(seg[: len(self.header)],
                       torch.frombuffer(bytearray(self.header), dtype=torch.uint8))
        host = seg[len(self.header):]
        views = [host[off : off + t.nbytes] for t, off in zip(self.tensors, self.offsets,
                                                               strict=True)]
        workers = min(4, os.cpu_count() or 1) if self.nbytes >= PARALLEL_DIGEST_BYTES else 0
        pool = ThreadPoolExecutor(workers) if workers > 1 and len(views) > 1 else None
        try:
            with torch.no_grad():
                if self.transport == "cuda":
                    try:
                        buf = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
                    except RuntimeError as e:  # torch.OutOfMemoryError is one
                        raise MemoryError(f"cannot allocate {self.nbytes} bytes on "
                                          f"{self.device} for this rank's adapter part: "
                                          f"{e}") from None
                    self.device_buffer = buf
                    self._copy_into(buf)
                    host.copy_(buf)  # (to pageable memory: returns once the copy is done)
                    hashed = [pool.submit(_sha256, v) for v in views] if pool else []
                else:
                    hashed = []
                    for t, view in zip(self.tensors, views, strict=True):
                        if t.nbytes:
                            _host_copy(view, raw_bytes(t.local))
                        if pool:
                            hashed.append(pool.submit(_sha256, view))
            t1 = time.perf_counter()
            digests = ([f.result() for f in hashed] if pool
                       else [_sha256(v) for v in views])
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
        del views, host, seg  # (no view of the segment may outlive it: ShmSegment.close_and_unlink)
        self.copy_s, self.digest_s = t1 - t0, time.perf_counter() - t1
        return digests

    def _copy_into(self, buf: torch.Tensor) -> None:
        for t, off in zip(self.tensors, self.offsets, strict=True):
            n = t.nbytes
            if n:
                buf[off : off + n].copy_(raw_bytes(t.local))

    def handle(self, transport: str) -> wire.Handle | None:
        """The handle of the part for the daemon's ``transport`` (None: an empty part), and
        the copy it does not use freed: ``"host"``: the segment (the device buffer is
        dropped; the segment sealed, ``ShmSegment.seal``, when it is laid out as a file);
        ``"device"``: on the cuda transport a CUDA IPC handle of the device buffer (the
        segment is unlinked), on shm the segment (the CPU stand-in). A segment's handle
        starts after its ``header``.

        Raises:
            ValueError: a transport other than ``"host"`` or ``"device"``.
        """
        if transport not in ("host", "device"):
            raise ValueError(f"transport {transport!r} is not 'host' or 'device'")
        if not self.tensors:
            return None
        assert self.segment is not None
        if transport == "device" and self.device_buffer is not None:
            self.export = cuda_ipc_handle(self.device_buffer)
            self._unlink()
            return self.export
        self.device_buffer = None  # (never exported: plain memory of the caching allocator)
        if transport == "host" and self.header:
            try:
                self.segment.seal()
            except BufferError:  # (a view left: the daemon sees it unsealed and copies)
                log.warning("rank %d: the adapter part's segment %s still has a view; handed "
                            "over unsealed", self.rank, self.segment.name)
        return self.segment.handle(len(self.header), self.nbytes)

    def _unlink(self) -> None:
        seg, self.segment = self.segment, None
        if seg is not None:
            seg.close_and_unlink()
            if seg in self._owned:
                self._owned.remove(seg)

    def free(self) -> None:
        """Unlink the segment, drop the device buffer (giving back an export the daemon did
        not acknowledge: ``consumed`` False) and, on CUDA, ``torch.cuda.ipc_collect()``.
        Idempotent; never raises for a give-back that fails (logged)."""
        export, self.export = self.export, None
        if export is not None and not self.consumed:
            try:
                release_unconsumed(export)
            except Exception as e:  # noqa: BLE001 - freeing must go on
                log.warning("rank %d: could not give back the adapter part's CUDA export: %s",
                            self.rank, e)
        had_device = self.device_buffer is not None or export is not None
        self.device_buffer = None
        self._unlink()
        if had_device:
            torch.cuda.ipc_collect()

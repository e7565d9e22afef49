"""POSIX shared-memory segments (the CPU transport's stand-in for CUDA IPC memory): created
and unlinked by the publisher, opened by name by the reference engine's workers.

Every segment this module creates is ``/dev/shm/slotsync-<pid>-r<rank>-<n>``
(``SHM_PREFIX``), so leftovers of a dead process can be found by name.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
from multiprocessing import shared_memory

import torch

from slotsync.protocol.wire import ShmHandle

__all__ = ["SHM_PREFIX", "ShmSegment"]

log = logging.getLogger("slotsync.protocol.rank.export")  # (the log lines stay export's)

SHM_PREFIX = "slotsync-"
"""Every segment this module creates is ``/dev/shm/slotsync-<pid>-r<rank>-<n>``."""

_segment_counter = itertools.count()


class ShmSegment:
    """A POSIX shared-memory segment owned (created and unlinked) by the publisher.

    Named ``slotsync-<pid>-r<rank>-<n>`` (a file under ``/dev/shm``), with a uint8 torch view
    ``tensor`` of shape ``(size,)`` over it. The reader opens it by name; the segment must stay
    until the reader acknowledged (design.md I3).

    Args:
        size: bytes, >= 0 (a 0-byte request still creates a 1-byte segment; POSIX needs one).
        rank: the owner's global rank, used in the name.

    Raises:
        OSError: the segment cannot be created (e.g. ``/dev/shm`` missing), or is larger than
            the free space of ``/dev/shm`` (tmpfs creates it sparse; the first write beyond
            that space would kill the process with SIGBUS).
    """

    def __init__(self, size: int, *, rank: int = 0) -> None:
        if size < 0:
            raise ValueError(f"shared-memory segment size must be >= 0, got {size}")
        self.size = size
        real = max(size, 1)
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            st = None  # no /dev/shm to ask: SharedMemory says what is wrong
        if st is not None and real > st.f_bavail * st.f_frsize:
            raise OSError(errno.ENOSPC, f"/dev/shm has {st.f_bavail * st.f_frsize} bytes free, "
                          f"a segment of {real} bytes does not fit")
        while True:
            name = f"{SHM_PREFIX}{os.getpid()}-r{rank}-{next(_segment_counter)}"
            try:
                self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
                    name=name, create=True, size=real
                )
                break
            except FileExistsError:  # left over by a dead process with our pid
                continue
        self.name: str = self._shm.name.lstrip("/")
        self.sealed = False
        self.tensor: torch.Tensor | None = torch.frombuffer(
            self._shm.buf, dtype=torch.uint8, count=real
        )[:size]
        log.debug("created shared-memory segment %s (%d bytes)", self.name, size)

    def handle(self, offset: int = 0, nbytes: int | None = None) -> ShmHandle:
        """A handle for bytes ``[offset, offset + nbytes)`` of this segment (default: to the end).

        Raises:
            ValueError: the range is outside the segment, or the segment is closed.
        """
        if self._shm is None:
            raise ValueError(f"shared-memory segment {self.name} is closed")
        if nbytes is None:
            nbytes = self.size - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) is outside segment {self.name} "
                f"of {self.size} bytes"
            )
        return ShmHandle(segment=self.name, offset=offset, nbytes=nbytes)

    def seal(self) -> None:
        """Give up this process's write access to the segment before a reader takes it as it
        is (an adapter part laid out as a file, which the daemon may hard-link into its
        adapter folder, ``daemon/service/adapter_io.py``): its mode becomes 0444 (no one
        opens it for writing again without a ``chmod`` by its owner), the torch view is
        dropped and the mapping and file descriptor closed. The name stays, for readers
        and for ``close_and_unlink``; ``handle`` still works; ``tensor`` is None.

        A reader can check it: the kernel grants a read lease (``fcntl(F_SETLEASE,
        F_RDLCK)``) on a file only while no process holds it open for writing, a writable
        mapping included. Idempotent.

        Raises:
            ValueError: the segment is closed.
            BufferError: another torch view of ``tensor`` is still alive (the mapping
                cannot be closed; the mode is 0444 already).
        """
        shm = self._shm
        if shm is None:
            raise ValueError(f"shared-memory segment {self.name} is closed")
        if self.sealed:
            return
        fd = os.open(os.path.join("/dev/shm", self.name),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, 0o444)
        finally:
            os.close(fd)
        self.tensor = None  # release the buffer export before closing the mapping
        shm.close()
        self.sealed = True

    @property
    def closed(self) -> bool:
        """Whether ``close_and_unlink`` ran."""
        return self._shm is None

    def close_and_unlink(self) -> None:
        """Drop the torch view, unmap and remove the segment. Idempotent.

        Any other torch view of ``tensor`` the caller kept must be gone first, or the unmap
        fails with ``BufferError`` (the name is still unlinked).
        """
        shm, self._shm = self._shm, None
        if shm is None:
            return
        self.tensor = None  # release the buffer export before closing the mapping
        try:
            shm.close()
        except BufferError:
            log.warning("segment %s still has a view; unlinking without unmapping", self.name)
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
        log.debug("unlinked shared-memory segment %s", self.name)

    def __del__(self) -> None:  # last resort; the publisher closes explicitly
        try:
            self.close_and_unlink()
        except Exception:  # noqa: BLE001 - never raise from __del__
            pass

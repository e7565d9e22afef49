"""The I/O of adapter rounds (issue 36): the ranks' shared-memory parts read, the folders an
engine loads adapters from written and removed, each off the event loop (``AdapterIO``; the
executor runs the core's ``AdapterFiles`` and ``RemoveAdapterFiles`` through it).

The folders live in ``adapter_dir`` (``Config.adapter_root``: by default
``/dev/shm/slotsyncd-<uid>/adapters-<key>``, made safely in the world-writable ``/dev/shm``
by ``adapter_root.make_private``, ``adapter_root.py`` says why there), made mode 0700 when
the daemon makes it, one folder per slot (``slot-<start>-<end>``), and in it one folder per
served version (``math@v3``, written by the engine's family: ``AdapterSupport.write_files``,
into a temp folder renamed at the end). A folder goes once no engine holds its version (the core's
``RemoveAdapterFiles``); at the daemon's stop the folders it wrote that no engine can still
need are removed (``close``: an engine may read a served version's folder again, after vLLM's
``reset_lora_state`` at every base-weight finish, so those stay while it runs), and the
default ``adapter_dir`` with its private folder when they are left empty. Folders found
at start (a previous daemon's) are left alone: an engine may still read them.

A rank's part is read from ``/dev/shm/<segment>`` (the name is the wire's, checked there: no
``/``), opened read-only without following a link, a regular file, mapped read-only, each
read bounds-checked against the handle's range and the segment's size.

Or taken whole (``PartReader.take``): when one rank holds the adapter laid out as a complete
safetensors file (``wire.adapter.file_header``), its segment is hard-linked into the version's
folder instead of copied, when the adapter folder is on the segment's filesystem
(``adapter_dir`` on ``/dev/shm``'s tmpfs) and the segment is **sealed**: mode without write
bits, exactly the header the round's plan gives then the part, one link only, and a read
lease granted, which Linux grants only while no process holds the file open for writing
(``fcntl(2)`` ``F_SETLEASE``: a writable mapping counts, ``fs/locks.c``
``check_conflicting_open``). The rank wrote it, hashed it and sealed it before its
``AdapterData`` (``protocol/rank/adapters/part.py``): with no writer left and none able to
open it (0444, and the folder is the daemon's), the linked bytes are the bytes the rank's
digests describe, which is what the daemon's sha256 check proves on the copied path; so the
link is not hashed again. A segment that fails any check is copied and hashed as before
(the reason is logged, ``adapter_file``). After the rank unlinks its name the daemon's link
holds the bytes, and the folder's removal frees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from slotsync.daemon.logs import log_event
from slotsync.daemon.service.adapter_root import AdapterRoot, make_private, remove_if_empty
from slotsync.protocol.wire import ShmHandle

log = logging.getLogger("slotsync.daemon.service.adapter_io")

SHM_DIR = "/dev/shm"
TEMP_PREFIX = ".writing-"  # (the families' temp folders: removed at start and stop)


def _owner(st: os.stat_result) -> str:
    """Why a segment of another uid than the daemon's is not linked ('' for its own): Linux
    grants a lease only on a file of the caller's uid (``fcntl(2)`` ``F_SETLEASE``, or
    ``CAP_LEASE``) and, with ``fs.protected_hardlinks`` (most distributions' default), links
    a file the caller cannot write only for its owner (or ``CAP_FOWNER``)."""
    if st.st_uid == os.geteuid():
        return ""
    return (f" (the segment is uid {st.st_uid}'s and the daemon runs as uid {os.geteuid()}: "
            "Linux lets only a file's owner take its lease and hard-link it once it is "
            "read-only; run the daemon as the trainer ranks' user to link)")


class PartReader:
    """Reads ranks' parts from their shared-memory handles (``handles``: rank -> its
    ``ShmHandle``, None for an empty part); a context manager that unmaps them at its end.

    ``read(rank, offset, nbytes)``: ``nbytes`` bytes at ``offset`` of that rank's part, a
    ``memoryview`` over the mapping (valid until the reader closes).

    Raises (from ``read``):
        ValueError: no handle for the rank, a range outside its handle or its segment, or a
            segment that is not a regular file of ``/dev/shm`` (the text names rank and
            segment).
    """

    def __init__(self, handles: Mapping[int, Any], shm_dir: str = SHM_DIR) -> None:
        self._handles = dict(handles)
        self._dir = shm_dir
        self._maps: dict[int, mmap.mmap] = {}
        self.taken: dict[int, str] = {}  # rank -> '' (linked) or why not (``take``)

    def __enter__(self) -> PartReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # (a view still held: freed with it)
                m.close()
        self._maps.clear()

    def _map(self, rank: int, h: ShmHandle) -> mmap.mmap:
        m = self._maps.get(rank)
        if m is not None:
            return m
        path = os.path.join(self._dir, h.segment)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise ValueError(f"rank {rank}'s shared-memory segment {h.segment!r} cannot be "
                             f"opened: {e.strerror} (did the rank free it before the daemon's "
                             "Ack(adapter_data)?)") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"rank {rank}'s segment {h.segment!r} is not a regular file "
                                 f"of {self._dir}")
            if h.offset + h.nbytes > st.st_size:
                raise ValueError(f"rank {rank}'s handle covers bytes [{h.offset}, "
                                 f"{h.offset + h.nbytes}) of segment {h.segment!r}, which has "
                                 f"{st.st_size}")
            m = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) if st.st_size else None
        finally:
            os.close(fd)
        if m is None:
            raise ValueError(f"rank {rank}'s segment {h.segment!r} is empty")
        self._maps[rank] = m
        return m

    def take(self, rank: int, dest: Path, header: bytes) -> str:
        """Hard-link rank ``rank``'s segment as the file ``dest`` when it is exactly
        ``header`` followed by the rank's part and sealed (the module docstring); returns ''
        once linked, else why not (nothing was made at ``dest``; the caller copies). Every
        outcome is kept in ``taken`` (rank -> '' or the reason), for the log.

        Checked, on the segment opened read-only without following a link: a regular file;
        the handle starts ``len(header)`` bytes in and ends at the file's end; no write bit
        in its mode (``ShmSegment.seal``); one link; a read lease granted (no process has
        it open for writing; held until the link is made, so none opens it meanwhile);
        its first bytes ``header``; ``dest`` on the same filesystem; the file linked the
        one checked (same inode; a name replaced meanwhile is unlinked again).
        """
        why = self._take(rank, dest, header)
        self.taken[rank] = why
        return why

    def _take(self, rank: int, dest: Path, header: bytes) -> str:
        h = self._handles.get(rank)
        if not isinstance(h, ShmHandle):
            return "no shared-memory handle"
        if h.offset != len(header):
            return (f"its handle starts {h.offset} bytes into segment {h.segment!r}, not after "
                    "a safetensors header (a publisher that lays its part out at offset 0)")
        path = os.path.join(self._dir, h.segment)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            return f"segment {h.segment!r} cannot be opened: {e.strerror}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != h.offset + h.nbytes:
                return (f"segment {h.segment!r} is not a regular file of {h.offset + h.nbytes} "
                        "bytes")
            if st.st_mode & 0o222:
                return (f"segment {h.segment!r} is writable (mode {stat.S_IMODE(st.st_mode):o}): "
                        "the rank did not seal it")
            if st.st_nlink != 1:
                return f"segment {h.segment!r} has {st.st_nlink} links"
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            except OSError as e:
                if e.errno == errno.EAGAIN:
                    return (f"a process holds segment {h.segment!r} open for writing (no read "
                            "lease)")
                return f"no read lease on segment {h.segment!r}: {e.strerror}" + _owner(st)
            try:
                if os.pread(fd, len(header), 0) != header:
                    return (f"segment {h.segment!r} does not start with the safetensors header "
                            "of the round's plan")
                try:
                    os.link(path, dest, follow_symlinks=False)
                except OSError as e:
                    if e.errno == errno.EXDEV:
                        return (f"the adapter folder is not on {self._dir}'s filesystem (set "
                                f"adapter_dir to a folder on it to link instead of copying)")
                    return (f"segment {h.segment!r} cannot be linked: {e.strerror}"
                            + _owner(st))
                linked = os.lstat(dest)
                if (linked.st_dev, linked.st_ino) != (st.st_dev, st.st_ino):
                    os.unlink(dest)  # (the name was replaced meanwhile: not the file checked)
                    return f"segment {h.segment!r} was replaced while it was linked"
            finally:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        finally:
            os.close(fd)
        return ""

    def read(self, rank: int, offset: int, nbytes: int) -> memoryview:
        h = self._handles.get(rank)
        if not isinstance(h, ShmHandle):
            raise ValueError(f"rank {rank} handed over no shared-memory handle for its part")
        if offset < 0 or nbytes < 0 or offset + nbytes > h.nbytes:
            raise ValueError(f"rank {rank}: bytes [{offset}, {offset + nbytes}) of its part "
                             f"are outside its handle's {h.nbytes}")
        start = h.offset + offset
        return memoryview(self._map(rank, h))[start:start + nbytes]


class AdapterIO:
    """The adapter folders of one daemon (the module docstring).

    Args:
        root: ``adapter_dir`` (made at ``prepare``, mode 0700).
        shm_dir: where the ranks' segments are (``/dev/shm``; tests may point elsewhere).
        private: the default ``adapter_dir``'s private folder above ``root``
            (``adapter_root.AdapterRoot.private``: made and checked at ``prepare``, removed
            with ``root`` at ``close`` when both are empty); '' for an ``adapter_dir`` set in
            the configuration.
    """

    def __init__(self, root: str | Path, shm_dir: str = SHM_DIR, private: str = "") -> None:
        self.root = Path(root)
        self.shm_dir = shm_dir
        self.private = private
        self.written: set[str] = set()  # folders this daemon wrote and has not removed
        self.found: list[str] = []  # folders a previous daemon left (kept)
        self._io = ThreadPoolExecutor(2, thread_name_prefix="slotsync-adapters")

    def prepare(self) -> None:
        """Make ``root`` (mode 0700 when made here; an existing one keeps its mode, e.g. one
        an operator made readable by an engine of another user), remove the temp folders a
        killed daemon left, and note the folders found.

        Raises:
            OSError: the folder cannot be made.
            AdapterDirError: the default's private folder is not safe to use (its text says
                what to do; ``adapter_root.make_private``).
        """
        make_private(AdapterRoot(str(self.root), self.private))
        if not self.root.is_dir():
            self.root.mkdir(parents=True, mode=0o700, exist_ok=True)
        for slot in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for f in sorted(slot.iterdir()):
                if f.name.startswith(TEMP_PREFIX):
                    shutil.rmtree(f, ignore_errors=True)
                elif f.is_dir():
                    self.found.append(str(f))

    def links(self) -> bool:
        """Whether ``root`` is on the ranks' segments' filesystem (``shm_dir``), so that a
        round one rank holds whole can be linked instead of copied (``PartReader.take``).
        False when either cannot be looked at."""
        try:
            return os.stat(self.root).st_dev == os.stat(self.shm_dir).st_dev
        except OSError:
            return False

    def slot_root(self, slot: tuple[int, int]) -> Path:
        """The folder of ``slot``'s adapter versions."""
        return self.root / f"slot-{slot[0]}-{slot[1]}"

    async def write(self, slot: tuple[int, int], plan: Any, handles: Mapping[int, Any],
                    write_files: Callable[..., Path], timeout_s: float) -> tuple[bool, str, str]:
        """Write ``plan``'s folder for ``slot`` with the family's ``write_files``, reading
        the ranks' parts from ``handles``, in a thread, within ``timeout_s`` seconds (0:
        none). Returns ``(ok, folder, error)``; a write that outlives its deadline removes
        its folder when it ends."""
        root = self.slot_root(slot)

        def run() -> str:
            t0 = time.perf_counter()
            # 0755 (umask aside), as the version folders in it: ``adapter_dir``'s own mode
            # decides who may enter (0700 when the daemon made it); an operator who made it
            # readable for an engine of another user needs the slot folder readable too
            root.mkdir(parents=True, exist_ok=True, mode=0o755)
            with PartReader(handles, self.shm_dir) as reader:
                folder = str(write_files(root, plan, reader.read, reader.take))
            for rank, why in reader.taken.items():
                log_event(log, logging.INFO, "adapter_file",
                          folder=folder, rank=rank, how="linked" if not why else "copied",
                          seconds=round(time.perf_counter() - t0, 6),
                          **({"why": why} if why else {}))
            return folder

        fut = asyncio.get_running_loop().run_in_executor(self._io, run)
        try:
            async with asyncio.timeout(timeout_s or None):
                folder = await asyncio.shield(fut)
        except TimeoutError:
            fut.add_done_callback(self._drop_late)
            return False, "", (f"the adapter's folder was not written within {timeout_s:g} s "
                               "(adapter_load_timeout_s)")
        except (ValueError, OSError) as e:
            return False, "", str(e)
        self.written.add(folder)
        return True, folder, ""

    def _drop_late(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            with contextlib.suppress(RuntimeError):  # (stopped meanwhile: close removes it)
                self._io.submit(shutil.rmtree, fut.result(), True)

    async def remove(self, folder: str) -> None:
        """Remove ``folder`` (one under ``root`` only), off the event loop."""
        path = Path(folder)
        if self.root not in path.parents:
            return
        self.written.discard(folder)
        await asyncio.get_running_loop().run_in_executor(self._io, shutil.rmtree, path, True)

    def close(self, in_use: set[str]) -> list[str]:
        """The daemon stops: remove the folders it wrote that no engine can still need (not
        in ``in_use``: ``SlotTable.adapter_folders_in_use``) and any temp folder, and stop
        the thread. Returns the folders removed."""
        self._io.shutdown(wait=True)
        gone = sorted(self.written - in_use)
        for f in gone:
            shutil.rmtree(f, ignore_errors=True)
        self.written &= in_use
        for slot in (p for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else ():
            for f in slot.iterdir():
                if f.name.startswith(TEMP_PREFIX):
                    shutil.rmtree(f, ignore_errors=True)
            with contextlib.suppress(OSError):
                slot.rmdir()  # (only when empty)
        remove_if_empty(AdapterRoot(str(self.root), self.private))
        return gone

"""Temporary folders owned by one process (the demo's, a benchmark's), and the removal of those
whose owner is gone.

A run that is stopped by Ctrl-C or SIGTERM removes its folder itself; one that is SIGKILLed
cannot. So the owner writes its pid, with the process's start time (so that a reused pid is
not taken for it), into the folder's ``pid`` file, and the next run's start removes each
folder of its prefix whose owner no longer runs (:func:`remove_stale_folders`). A folder
without a ``pid`` file (a run still starting), with a live owner, or owned by another user is
left alone. (Moved from ``slotsync.demo.leftovers``, issue 35, so that the benchmarks use
it too.)

:func:`owned_folder` is the whole cycle for a benchmark: stale folders removed, a fresh one
made and owned (multiprocessing's ``pymp-*`` folder inside it), and removed at the end.

Standard library only.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

OWNER_FILE = "pid"
"""In an owned folder: ``"<pid> <start time>"`` of the owner (start time: field 22 of
``/proc/<pid>/stat``, clock ticks since boot; ``-`` where there is no ``/proc``)."""


def process_start_time(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks after boot, ``/proc/<pid>/stat`` field 22),
    or None where it cannot be read (no such process, no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[19])  # fields after the name start at 3
    except (OSError, ValueError, IndexError):
        return None


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether process ``pid`` runs (a zombie does not), and, where ``start_time`` is given and
    ``/proc`` can tell, is the same process (not a later one that reused the pid)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    if _zombie(pid):
        return False
    if start_time is not None:
        now = process_start_time(pid)
        if now is not None and now != start_time:
            return False
    return True


def write_owner(folder: str, pid: int | None = None) -> None:
    """Record ``pid`` (default: this process) and its start time as ``folder``'s owner, in one
    rename, so that a reader never sees half a file."""
    pid = os.getpid() if pid is None else pid
    start = process_start_time(pid)
    tmp = os.path.join(folder, f".{OWNER_FILE}.tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.write(f"{pid} {'-' if start is None else start}\n")
    os.replace(tmp, os.path.join(folder, OWNER_FILE))


def read_owner(folder: str) -> tuple[int, int | None] | None:
    """``(pid, start time or None)`` from ``folder``'s ``pid`` file; None without a readable
    one."""
    try:
        with open(os.path.join(folder, OWNER_FILE), encoding="ascii") as f:
            fields = f.read().split()
        pid = int(fields[0])
        start = None if len(fields) < 2 or fields[1] == "-" else int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return pid, start


def remove_stale_folders(prefix: str, tmpdir: str | None = None,
                         before_removal: Callable[[str], object] | None = None) -> list[str]:
    """Remove the folders ``<tmpdir>/<prefix>*`` (default: ``tempfile.gettempdir()``) whose
    owner is gone; returns the folders removed.

    Only a folder of this user whose ``pid`` file names a process that no longer runs (or a
    later process that reused the pid) is removed, after ``before_removal(folder)`` (what the
    folder's run left outside it: shared memory, network namespaces). Errors while removing
    are ignored (another run may be removing the same folder).
    """
    tmpdir = tmpdir or tempfile.gettempdir()
    removed = []
    for folder in sorted(glob.glob(os.path.join(glob.escape(tmpdir), glob.escape(prefix) + "*"))):
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.getuid():
            continue
        owner = read_owner(folder)
        if owner is None or process_alive(*owner):
            continue
        if before_removal is not None:
            before_removal(folder)
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.exists(folder):
            removed.append(folder)
    return removed


@contextmanager
def owned_folder(prefix: str, stale: list[str] | None = None) -> Iterator[str]:
    """A fresh folder ``<tmp>/<prefix>XXXXXXXX`` owned by this process (``pid`` file), after
    removing the stale ones of dead runs (their paths appended to ``stale``); removed at the
    end of the ``with``. The caller puts its files there, and those of the processes it
    starts (their runtime folders, logs, ``TMPDIR``); multiprocessing's temporary folder
    (``pymp-*``: the forkserver's socket) is made there where this process has none yet.

    multiprocessing removes its ``pymp-*`` folder at this process's exit (a finalizer of
    priority -100), and a forkserver keeps its socket there until then; so when that folder
    is inside, it is kept to the end of the process, with the ``pid`` file, and the folder
    removed after it (a finalizer of priority -101). A SIGKILLed process leaves the folder to
    the next run's :func:`remove_stale_folders`. This process's ``tempfile`` folder and
    ``$TMPDIR`` are left as they are: long-lived helpers made meanwhile (a test's) must not
    land in a folder that goes at the end.
    """
    import multiprocessing.util

    found = remove_stale_folders(prefix)
    if stale is not None:
        stale.extend(found)
    folder = tempfile.mkdtemp(prefix=prefix)
    write_owner(folder)
    mp_dir = ""
    try:
        old_tempdir = tempfile.tempdir
        tempfile.tempdir = folder  # (only while multiprocessing makes its folder, if it must)
        try:
            mp_dir = multiprocessing.util.get_temp_dir()
        finally:
            tempfile.tempdir = old_tempdir
        yield folder
    finally:
        inside = os.path.dirname(mp_dir) == folder
        for entry in os.listdir(folder):
            path = os.path.join(folder, entry)
            if inside and path in (mp_dir, os.path.join(folder, OWNER_FILE)):
                continue  # (the owner stays named: a SIGKILL before the exit leaves it stale)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if inside:
            multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True),
                                          exitpriority=-101)
        else:
            shutil.rmtree(folder, ignore_errors=True)

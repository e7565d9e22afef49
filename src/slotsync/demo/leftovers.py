"""What a ``slotsync demo`` leaves when it is SIGKILLed, and its removal at the next start.

A demo works in a temporary folder ``<tmp>/slotsync-demo-*`` (the daemon's socket, engine
logs, Gloo's rendezvous file). A demo stopped by Ctrl-C or SIGTERM removes it; one SIGKILLed
cannot. So every demo writes its own pid (and the process's start time, so that a reused pid is
not taken for it) into the folder's ``pid`` file, and its trainer ranks' pids into
``rank-pids``; the next demo's start removes each such folder whose demo process is gone, with
the ``/dev/shm/slotsync-<pid>-*`` segments of its ranks that are gone too (a rank unlinks its
own segments when it stops, so this only finds the segments of a rank that was itself killed).

A folder without a ``pid`` file (a demo still starting, or one from before this file existed),
with a live owner, or owned by another user is left alone.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

DEMO_FOLDER_PREFIX = "slotsync-demo-"
"""The demo's temporary folders are ``<tempfile.gettempdir()>/slotsync-demo-*``."""
OWNER_FILE = "pid"
"""In a demo's folder: ``"<pid> <start time>"`` of the demo process (start time: field 22 of
``/proc/<pid>/stat``, clock ticks since boot; ``-`` where there is no ``/proc``)."""
RANK_PIDS_FILE = "rank-pids"
"""In a demo's folder: its trainer ranks' pids, one a line (their shared-memory segments are
``/dev/shm/slotsync-<pid>-*``: ``slotsync.protocol.rank.shm_segment.SHM_PREFIX``)."""
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "slotsync-"


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


def record_rank_pids(folder: str, pids: list[int]) -> None:
    """Record the demo's trainer ranks' ``pids`` in ``folder`` (``RANK_PIDS_FILE``)."""
    tmp = os.path.join(folder, f".{RANK_PIDS_FILE}.tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.writelines(f"{p}\n" for p in pids)
    os.replace(tmp, os.path.join(folder, RANK_PIDS_FILE))


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


def _rank_pids(folder: str) -> list[int]:
    try:
        with open(os.path.join(folder, RANK_PIDS_FILE), encoding="ascii") as f:
            return [int(line) for line in f if line.strip().isdigit()]
    except OSError:
        return []


def remove_dead_ranks_segments(pids: list[int], shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the ``shm_dir/slotsync-<pid>-*`` segments of each of ``pids`` that is no longer
    running; returns the names removed."""
    removed = []
    for pid in pids:
        if process_alive(pid):
            continue
        for path in glob.glob(os.path.join(shm_dir, f"{SEGMENT_PREFIX}{pid}-*")):
            try:
                os.unlink(path)
                removed.append(os.path.basename(path))
            except FileNotFoundError:
                pass
    return removed


def remove_stale_demo_folders(tmpdir: str | None = None,
                              shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the folders ``<tmpdir>/slotsync-demo-*`` (default: ``tempfile.gettempdir()``)
    of demos that are gone, and their dead ranks' shared-memory segments in ``shm_dir``;
    returns the folders removed.

    Only a folder of this user whose ``pid`` file names a process that no longer runs (or a
    later process that reused the pid) is removed: a live demo's folder, a folder still
    without a ``pid`` file, and another user's are left alone. Errors while removing are
    ignored (another demo may be removing the same folder).
    """
    tmpdir = tmpdir or tempfile.gettempdir()
    removed = []
    for folder in sorted(glob.glob(os.path.join(tmpdir, DEMO_FOLDER_PREFIX + "*"))):
        try:
            st = os.lstat(folder)
        except OSError:
            continue
        if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.getuid():
            continue
        owner = read_owner(folder)
        if owner is None or process_alive(*owner):
            continue
        remove_dead_ranks_segments(_rank_pids(folder), shm_dir)
        shutil.rmtree(folder, ignore_errors=True)
        if not os.path.exists(folder):
            removed.append(folder)
    return removed

"""What a ``slotsync demo`` leaves when it is SIGKILLed, and its removal at the next start.

A demo works in a temporary folder ``<tmp>/slotsync-demo-*`` (the daemon's socket, engine
logs, Gloo's rendezvous file). A demo stopped by Ctrl-C or SIGTERM removes it; one SIGKILLed
cannot. So every demo writes its own pid (and the process's start time, so that a reused pid is
not taken for it) into the folder's ``pid`` file, and its trainer ranks' pids into
``rank-pids``; the next demo's start removes each such folder whose demo process is gone, with
the ``/dev/shm/slotsync-<pid>-*`` segments of its ranks that are gone too (a rank unlinks its
own segments when it stops, so this only finds the segments of a rank that was itself killed).

A ``--nodes 2`` demo also lists its network namespaces in the folder (``netns``), so that
they are removed with it.

A folder without a ``pid`` file (a demo still starting, or one from before this file existed),
with a live owner, or owned by another user is left alone. The owner file and the removal of
stale folders are ``slotsync.testing.owned_folders``' (the benchmarks' too), re-exported here.
"""

from __future__ import annotations

import glob
import os

from slotsync.demo.nodes import remove_recorded_namespaces
from slotsync.testing.owned_folders import (  # noqa: F401 - (re-exported: the demo's names)
    OWNER_FILE,
    process_alive,
    process_start_time,
    read_owner,
    remove_stale_folders,
    write_owner,
)

DEMO_FOLDER_PREFIX = "slotsync-demo-"
"""The demo's temporary folders are ``<tempfile.gettempdir()>/slotsync-demo-*``."""
RANK_PIDS_FILE = "rank-pids"
"""In a demo's folder: its trainer ranks' pids, one a line (their shared-memory segments are
``/dev/shm/slotsync-<pid>-*``: ``slotsync.protocol.rank.shm_segment.SHM_PREFIX``)."""
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "slotsync-"


def record_rank_pids(folder: str, pids: list[int]) -> None:
    """Record the demo's trainer ranks' ``pids`` in ``folder`` (``RANK_PIDS_FILE``)."""
    tmp = os.path.join(folder, f".{RANK_PIDS_FILE}.tmp")
    with open(tmp, "w", encoding="ascii") as f:
        f.writelines(f"{p}\n" for p in pids)
    os.replace(tmp, os.path.join(folder, RANK_PIDS_FILE))


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
    of demos that are gone, their dead ranks' shared-memory segments in ``shm_dir`` and the
    network namespaces of a ``--nodes 2`` demo (``slotsync.demo.nodes``); returns the
    folders removed.

    Only a folder of this user whose ``pid`` file names a process that no longer runs (or a
    later process that reused the pid) is removed: a live demo's folder, a folder still
    without a ``pid`` file, and another user's are left alone
    (``slotsync.testing.owned_folders.remove_stale_folders``).
    """
    def outside(folder: str) -> None:
        remove_dead_ranks_segments(_rank_pids(folder), shm_dir)
        remove_recorded_namespaces(folder)

    return remove_stale_folders(DEMO_FOLDER_PREFIX, tmpdir, outside)

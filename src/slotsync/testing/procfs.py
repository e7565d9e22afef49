"""Readers of ``/proc`` and ``/dev/shm`` for leak checks (Linux): a process's resident memory
and open file descriptors, its child processes, and the shared-memory segments publishers
export (``/dev/shm/slotsync-<pid>-*``, ``slotsync.protocol.rank.export.ShmSegment``'s names).

Used by the fault suite (``tests/faults/test_faults.py``) and the soak (``slotsync.bench.soak``);
moved from ``tests/faults_lib.py`` and ``bench/soak.py`` (issue 16).
"""

from __future__ import annotations

import os

SEG_PREFIX = "slotsync-"  # ShmSegment names: slotsync-<creator pid>-<n>
SHM_DIR = "/dev/shm"


def proc_status(pid: int) -> dict[str, int]:
    """``{"rss_kb": VmRSS in kB, "fds": open fd count}`` of ``pid`` from /proc.

    Raises:
        OSError: ``pid`` is gone (or /proc is not readable).
    """
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def children(pid: int) -> list[int]:
    """Direct child pids of ``pid`` (from ``/proc/*/stat``; processes that vanish while being
    read are skipped)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # field 4 (ppid) follows the ")" that closes the command name
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(name))
    return out


def shm_segments(pids: list[int] | None = None) -> list[str]:
    """Sorted ``/dev/shm/slotsync-*`` segment names (of the given publisher pids only, if
    any); ``[]`` where there is no ``/dev/shm``."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(SEG_PREFIX)]
    except FileNotFoundError:
        return []
    if pids is not None:
        want = tuple(f"{SEG_PREFIX}{p}-" for p in pids)
        names = [n for n in names if n.startswith(want)]
    return sorted(names)


def shm_usage(pids: list[int]) -> tuple[int, int]:
    """``(count, bytes)`` of the ``/dev/shm`` segments created by ``pids`` (segments unlinked
    while being read are skipped)."""
    count = size = 0
    for name in shm_segments(pids):
        try:
            size += os.stat(os.path.join(SHM_DIR, name)).st_size
            count += 1
        except OSError:
            pass
    return count, size

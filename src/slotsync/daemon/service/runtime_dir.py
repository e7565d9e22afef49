"""The daemon's socket folder and socket file: create the folder, claim the socket path from a
dead predecessor (never from a live daemon), open the bound socket to the trainer group, and
remove it at exit. Only ``ipc://`` endpoints have any of this; others are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket


class DaemonAlreadyRunning(RuntimeError):
    """Another live daemon owns the socket path."""


def ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint, else None."""
    return endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else None


def claim_ipc_path(path: str) -> None:
    """Make ``path`` free for binding: refuse if a live process listens there (a second daemon
    must not steal the socket), remove a stale socket file left by a dead one.

    Raises:
        DaemonAlreadyRunning: something accepts connections on ``path``.
        OSError: ``path`` cannot be probed or removed.
    """
    if not os.path.exists(path):
        return
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            os.unlink(path)
            return
        raise
    else:
        raise DaemonAlreadyRunning(f"another slotsyncd is listening on {path}")
    finally:
        s.close()


def prepare(endpoint: str) -> None:
    """Before binding: create the socket folder (mode 0770: the service user and its group
    only, umask aside) and claim the socket path.

    Raises:
        NotADirectoryError: the folder's path is a file.
        DaemonAlreadyRunning: a live daemon owns the socket path.
    """
    path = ipc_path(endpoint)
    if path is None:
        return
    folder = os.path.dirname(path) or "."
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"socket folder {folder} exists and is not a directory")
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
        os.chmod(folder, 0o770)
    claim_ipc_path(path)


def open_to_group(endpoint: str) -> None:
    """After binding: group members (the trainer ranks) may connect; others not at all."""
    path = ipc_path(endpoint)
    if path is not None:
        os.chmod(path, 0o770)


def release(endpoint: str) -> None:
    """At exit: remove the socket file (a missing one is fine)."""
    path = ipc_path(endpoint)
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)

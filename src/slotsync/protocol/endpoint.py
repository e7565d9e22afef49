"""Where the node's daemon listens by default: its runtime folder and ZeroMQ endpoint.

Both sides need it: the daemon binds ``default_endpoint()`` when no ``socket`` is configured
(``daemon/service/config.py`` imports it from here), and a rank-side integration connects to
it when given none (``integrations/vllm.py``). It lives in protocol/ so that rank-side code
never imports the daemon. Pure Python, no torch: the daemon may import it (design.md I6).
"""

from __future__ import annotations

import os

__all__ = ["SOCKET_NAME", "default_endpoint", "default_runtime_dir",
           "default_runtime_dir_and_origin"]

SOCKET_NAME = "slotsyncd.sock"
"""The daemon's socket file in its runtime folder."""


def default_runtime_dir() -> str:
    """``$SLOTSYNC_RUNTIME_DIR``, else ``$RUNTIME_DIRECTORY`` (systemd), else
    ``$XDG_RUNTIME_DIR/slotsync``, else ``/tmp/slotsync-<uid>``."""
    return default_runtime_dir_and_origin()[0]


def default_runtime_dir_and_origin() -> tuple[str, str]:
    """``(folder, where it came from)`` of :func:`default_runtime_dir`."""
    for var in ("SLOTSYNC_RUNTIME_DIR", "RUNTIME_DIRECTORY"):
        if os.environ.get(var):
            return os.environ[var], f"the default, ${var}"
    if os.environ.get("XDG_RUNTIME_DIR"):
        return (os.path.join(os.environ["XDG_RUNTIME_DIR"], "slotsync"),
                "the default, $XDG_RUNTIME_DIR/slotsync")
    return f"/tmp/slotsync-{os.getuid()}", "the default, /tmp/slotsync-<uid>"


def default_endpoint() -> str:
    """The endpoint a publisher connects to by default: ``ipc://<runtime_dir>/slotsyncd.sock``."""
    return f"ipc://{os.path.join(default_runtime_dir(), SOCKET_NAME)}"

"""The systemd notify protocol (``sd_notify(3)``), for ``Type=notify`` units.

The protocol is one datagram of ``KEY=value`` lines to the Unix socket in ``$NOTIFY_SOCKET``
(a leading ``@`` means the abstract namespace). It is small and fixed, so this adapter speaks
it directly rather than pulling in libsystemd bindings. Without ``$NOTIFY_SOCKET`` (not under
systemd) every call is a no-op.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    """Sends ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1`` to systemd.

    Args:
        environ: the environment to read ``NOTIFY_SOCKET`` / ``WATCHDOG_USEC`` /
            ``WATCHDOG_PID`` from (default ``os.environ``).
    """

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self._addr: str | bytes | None = None
        if addr.startswith("@"):
            self._addr = b"\0" + addr[1:].encode()
        elif addr.startswith("/"):
            self._addr = addr
        self._sock: socket.socket | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        ours = not pid or pid == str(os.getpid())
        self.watchdog_s: float | None = int(usec) / 1e6 if usec.isdigit() and ours else None
        self._last_status: str | None = None

    @property
    def enabled(self) -> bool:
        return self._addr is not None

    def notify(self, **state: str | int) -> None:
        """Send one datagram, e.g. ``notify(READY=1, STATUS="serving")``. Errors are
        swallowed: systemd going away must never take the daemon down."""
        if self._addr is None:
            return
        msg = "\n".join(f"{k}={v}" for k, v in state.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self._addr)
        except OSError:
            pass

    def status(self, line: str) -> None:
        """``STATUS=<line>`` when it changed since the last call."""
        if line != self._last_status:
            self._last_status = line
            self.notify(STATUS=line.replace("\n", " "))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

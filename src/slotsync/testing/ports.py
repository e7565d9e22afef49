"""Loopback TCP ports for the engines and status servers that tests, benchmarks and the demo
start (moved from ``slotsync.engine.launcher`` and ``tests/engines.py``, issue 16)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, then release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether TCP ``port`` on ``host`` can be bound now by a server (e.g. before an engine
    restarts on the port its killed predecessor held).

    The probe binds with ``SO_REUSEADDR``, as the engines' servers do (aiohttp's
    ``TCPSite`` and vLLM's ``create_server_socket``): without it a port whose old
    connections sit in TIME_WAIT reads as taken for a minute although a server could bind
    it at once (issue 24: every engine restart waited its full 10 s bound here)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False

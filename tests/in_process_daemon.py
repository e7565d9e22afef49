"""A real slotsync daemon in the test's own event loop, and raw ranks that speak the wire to it
by hand: what the integration tests that drive an in-process ``Daemon``
(``daemon/service/server.py``) share. Issue 36's adapter tests wrote the daemon's start, the
ranks' teardown and an event-loop poll four times over (issue 24's tests twice before them).

* :class:`Rank`: a raw DEALER that registers one rank of slot ``[0, size)`` (blocking: call
  it in a thread, ``asyncio.to_thread``, while the daemon runs on the loop);
* :func:`running_daemon`: the daemon started with a runtime folder under the test's
  ``tmp_path`` (no status port), the ZMQ context its ranks use, and everything they opened
  closed at the end, the daemon stopped;
* :func:`until`: poll a condition without blocking the loop the daemon runs on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import zmq

from slotsync.daemon.service.config import Config
from slotsync.daemon.service.server import Daemon
from slotsync.protocol import wire


class Rank:
    """A raw DEALER that registers one rank of slot [0, size)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, rank: int, size: int = 2,
                 url: str = "http://127.0.0.1:1") -> None:
        self.rank = rank
        self.s = ctx.socket(zmq.DEALER)
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.connect(endpoint)
        self.s.send(wire.encode(wire.Register(wire.PROTOCOL_VERSION, rank,
                                              wire.logical_gpu_uuid(rank), 0, size, url, True,
                                              "shm", "test-host", 4242)))
        assert self.s.poll(10_000)
        self.reply = wire.decode_from_daemon(self.s.recv())

    def send(self, msg: Any) -> None:
        """One message of the wire (``wire.encode``d)."""
        self.s.send(wire.encode(msg))

    def recv(self, timeout_s: float = 30.0) -> Any:
        """The daemon's next message to this rank; fails the test after ``timeout_s``."""
        assert self.s.poll(int(timeout_s * 1000)), f"rank {self.rank}: no reply"
        return wire.decode_from_daemon(self.s.recv())

    def close(self) -> None:
        self.s.close(linger=0)


class _Closable(Protocol):
    def close(self) -> None: ...


class DaemonRig:
    """A started in-process ``Daemon`` (``d``), the ZMQ context for its ranks (``ctx``), and
    ``ranks``: what the test opened on it (anything with ``close()``), closed at the end in
    order."""

    def __init__(self, d: Daemon) -> None:
        self.d = d
        self.ctx = zmq.Context()
        self.ranks: list[_Closable] = []

    def register(self, rank: int, size: int = 2, url: str = "http://127.0.0.1:1") -> Rank:
        """A :class:`Rank` of slot ``[0, size)`` registered with engine ``url`` (blocking:
        call it in a thread), kept to be closed at the end."""
        r = Rank(self.ctx, self.d.endpoint, rank, size=size, url=url)
        self.ranks.append(r)
        return r

    def close(self) -> None:
        for r in self.ranks:
            r.close()
        self.ctx.destroy(linger=0)


@asynccontextmanager
async def running_daemon(tmp_path: Path, **config: Any) -> AsyncIterator[DaemonRig]:
    """A ``Daemon`` of ``Config(runtime_dir=tmp_path / "rt", status_port=-1, **config)``, its
    ``adapter_dir`` ``tmp_path / "rt" / "adapters"`` unless ``config`` names one (not the
    default under ``/dev/shm``: nothing of the test left beside it), started on this loop; at
    the end its ranks are closed, the context destroyed (what a failed assertion left open
    too: ``term()`` would hang on it) and the daemon stopped."""
    config.setdefault("adapter_dir", str(tmp_path / "rt" / "adapters"))
    d = Daemon(Config(runtime_dir=str(tmp_path / "rt"), status_port=-1, **config))
    await d.start()
    rig = DaemonRig(d)
    try:
        yield rig
    finally:
        rig.close()
        await d.stop()


async def until(check: Callable[[], object], timeout_s: float = 20.0, *,
                why: Callable[[], object] = lambda: "timed out", every_s: float = 0.02
                ) -> None:
    """Poll ``check()`` every ``every_s`` seconds, yielding the event loop (the daemon runs on
    it), until it is true; fails with ``why()`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, why()
        await asyncio.sleep(every_s)

"""Which ranks are still there: connections and processes behind the daemon's ROUTER socket.

Three signals, each turned into ``SlotTable.on_connection_gone(identity, now, why)``:

* **the process exited** -- the kernel's pid of each connection (SO_PEERCRED, which libzmq puts
  in every message's ``Peer-Address`` property as ``localhost:uid:gid:pid``) is watched with a
  pidfd (readable the moment the process ends; immune to pid reuse). Where a pidfd cannot be
  had, the pid is polled with signal 0 every ``liveness_s / 2``.
* **the connection closed** -- the ROUTER's monitor reports ``EVENT_DISCONNECTED`` with the
  connection's fd; every message carries its fd (``ZMQ_SRCFD``), which maps the fd to the
  socket identity that spoke on it. libzmq has no stable per-peer disconnect notice for
  ROUTER (``ZMQ_ROUTER_NOTIFY`` is a draft API that pyzmq's bundled libzmq lacks).
* **the connection went silent** -- ZMTP heartbeats (``protocol/liveness.py`` says why
  heartbeats rather than application pings) make libzmq close a connection whose peer stopped
  answering within ``liveness_s``, which the monitor reports as above.

``ConnectionBook`` is the I/O-free bookkeeping; ``PeerWatch`` the asyncio adapter (pidfds, the
poll fallback). The monitor socket itself is read by the daemon's intake loop, before each
data message, so a disconnect is always seen before a message of a new connection that reuses
its fd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from slotsync.protocol.liveness import heartbeat_options, peer_pid

__all__ = ["ConnectionBook", "PeerWatch", "closed_why", "heartbeat_options", "peer_pid",
           "process_state"]

log = logging.getLogger("slotsync.daemon")


@dataclass
class _Peer:
    fd: int
    pid: int


@dataclass
class ConnectionBook:
    """Socket identity -> (connection fd, process pid), from the messages seen.

    Each method returns the identities that are gone because of the event: a fd that a new
    identity speaks on was closed for the identity seen on it before (libzmq reuses fds).
    """

    peers: dict[bytes, _Peer] = field(default_factory=dict)
    by_fd: dict[int, bytes] = field(default_factory=dict)

    def seen(self, identity: bytes, fd: int, pid: int) -> list[bytes]:
        """A message from ``identity`` on connection ``fd`` of process ``pid`` (0: unknown)."""
        gone: list[bytes] = []
        before = self.by_fd.get(fd)
        if before is not None and before != identity:
            gone.append(before)
            self.peers.pop(before, None)
        p = self.peers.get(identity)
        if p is not None and p.fd != fd:
            self.by_fd.pop(p.fd, None)  # (reconnected: the old connection is closed)
        self.peers[identity] = _Peer(fd, pid or (p.pid if p else 0))
        self.by_fd[fd] = identity
        return gone

    def disconnected(self, fd: int) -> list[bytes]:
        """The monitor saw connection ``fd`` close."""
        identity = self.by_fd.pop(fd, None)
        if identity is None:
            return []
        self.peers.pop(identity, None)
        return [identity]

    def pid_of_fd(self, fd: int) -> int:
        """The pid of the process last seen on connection ``fd``, 0 if unknown."""
        identity = self.by_fd.get(fd)
        return self.peers[identity].pid if identity is not None else 0

    def exited(self, pid: int) -> list[bytes]:
        """Process ``pid`` ended: every identity it spoke through."""
        gone = [i for i, p in self.peers.items() if p.pid == pid]
        for i in gone:
            self.by_fd.pop(self.peers.pop(i).fd, None)
        return gone

    def pids(self) -> set[int]:
        return {p.pid for p in self.peers.values() if p.pid}


class PeerWatch:
    """Watches the processes behind the daemon's connections; calls ``on_exit(pid)`` once when
    one ends (from the event loop).

    Args:
        on_exit: called with the pid of a process that ended.
        poll_s: interval of the signal-0 fallback where no pidfd can be opened.
    """

    def __init__(self, on_exit: Callable[[int], None], poll_s: float) -> None:
        self._on_exit = on_exit
        self._poll_s = poll_s
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._polled: set[int] = set()
        self._task: asyncio.Task | None = None
        self._ended_pids: dict[int, asyncio.Event] = {}  # pid -> set when it ended

    def watch(self, pid: int) -> None:
        """Start watching ``pid`` (no-op if already watched, or 0)."""
        if not pid or pid in self._fds or pid in self._polled or pid == os.getpid():
            return
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            loop.call_soon(self._ended, pid)  # already gone
            return
        except (OSError, AttributeError) as e:  # no pidfds (old kernel, seccomp): poll
            log.debug("no pidfd for pid %d (%s): polling it", pid, e)
            self._polled.add(pid)
            if self._task is None:
                self._task = asyncio.create_task(self._poll(), name="slotsync-pid-poll")
            return
        self._fds[pid] = fd
        loop.add_reader(fd, self._ended, pid)

    async def exits_within(self, pid: int, timeout_s: float) -> bool:
        """Whether watched process ``pid`` ends within ``timeout_s`` (a killed process's
        connection closes while it is still being torn down: this tells an exit from a close
        by a process that lives on)."""
        if pid not in self._fds and pid not in self._polled:
            return not _alive(pid)
        ev = self._ended_pids.setdefault(pid, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await ev.wait()
        return ev.is_set() or not _alive(pid)

    def _ended(self, pid: int) -> None:
        ev = self._ended_pids.pop(pid, None)
        if ev is not None:
            ev.set()
        self.forget(pid)
        self._on_exit(pid)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            for pid in list(self._polled):
                if not _alive(pid):
                    self._ended(pid)

    def forget(self, pid: int) -> None:
        """Stop watching ``pid`` (no connection of it is left)."""
        fd = self._fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)
        self._polled.discard(pid)

    def keep_only(self, pids: set[int]) -> None:
        """Stop watching every pid not in ``pids`` (no connection of it is left)."""
        for pid in [*self._fds, *self._polled]:
            if pid not in pids:
                self.forget(pid)

    async def close(self) -> None:
        for pid in list(self._fds):
            self.forget(pid)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T`` stopped,
    ``t`` stopped by a tracer, ...), '' when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    rest = stat.rpartition(")")[2].split()  # (after the command name, which may hold spaces)
    return rest[0] if rest else ""


def closed_why(pid: int, state: str, liveness_s: float, frame_limit: int) -> str:
    """Why the connection of process ``pid`` (0: unknown), which did not exit and sent no
    ``wire.Close``, closed; ``state``: its ``process_state``. A stopped process cannot answer
    ZMTP heartbeats (libzmq's I/O thread answers them, whatever the program does), so that is
    the cause when it is stopped; a running one answers them, so it closed its socket without
    ``Publisher.close()``, or libzmq dropped it for a frame over ``frame_limit`` bytes (the
    socket's MAXMSGSIZE: libzmq gives no reason, and a ``Publisher`` checks its frames
    against the daemon's cap). Issue 24: every cause used to be listed for each close."""
    who = f"its process (pid {pid})" if pid else "its process"
    if state in ("T", "t"):
        return (f"it answered no heartbeat within liveness_s={liveness_s:g} s: {who} is "
                "stopped (SIGSTOP, job control or a debugger)")
    running = f"{who} is still running" if state else f"{who} did not exit"
    return (f"its connection closed without a Close message while {running} (so not for "
            "missed heartbeats): it closed its socket without Publisher.close() (another "
            f"client, or an older slotsync), or sent a frame over the socket's limit of "
            f"{frame_limit} bytes, which libzmq drops with the connection")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True

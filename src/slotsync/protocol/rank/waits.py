"""A publisher's sends and waits on its ``DaemonLink``: the I/O half of the conversation whose
rules live in ``session.py``.

``DaemonWaits`` polls the link and its connection monitor until a deadline, turns every frame
that arrives into a ``PublisherSession.receive`` input and acts on the outcome (return the
awaited reply, keep an early ack, raise an Error that concerns us, drop a stale reply), and
notices a daemon that went away (the monitor's disconnect) or refused our credentials (ZAP).
It owns no update state: what an Error does to the open update is the ``on_error`` callback's
business (``Publisher._error``: abort or end it, per ``PublisherSession.error_action``), and a
lost daemon ends the open update through ``end_update``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable

import zmq

from slotsync.protocol import wire
from slotsync.protocol.errors import DAEMON_GONE, SlotsyncError, SlotsyncTimeout
from slotsync.protocol.rank.connect_check import check_endpoint
from slotsync.protocol.rank.link import DaemonLink
from slotsync.protocol.rank.session import Awaited, Outcome, PublisherSession

__all__ = ["DaemonWaits"]

log = logging.getLogger("slotsync.protocol.rank.publisher")  # (the log lines stay the publisher's)

ASK_S = 3.0
"""Seconds a publisher whose wait expired waits for the daemon's answer to its ``wire.Query``
(issue 24): long enough for a daemon that runs, short beside any ``timeout_s``."""


def short_timeout_warning(rank: int, timeout_s: float, reg: wire.Registered) -> str:
    """Why ``timeout_s`` (seconds) is shorter than the daemon's deadlines on the slot's ranks
    that ``reg`` told (``Registered.begin_deadline_s``, ``chunk_deadline_s``), or '': such a
    publisher gives up before the daemon fails the update naming the missing ranks."""
    short = [f"{name} deadline ({d:g} s)" for name, d in (
        ("begin", reg.begin_deadline_s), ("chunk", reg.chunk_deadline_s)) if timeout_s < d]
    if not short:
        return ""
    return (f"rank {rank}: timeout_s={timeout_s:g} s is shorter than slotsyncd's "
            f"{' and '.join(short)}: when a rank of the slot is late, this publisher times out "
            "first (it then asks the daemon what it waits for); a timeout_s above the "
            "daemon's deadlines lets the daemon's own error name the missing ranks")


class DaemonWaits:
    """Sends to, and waits for replies from, the daemon on ``link`` for ``session``.

    Args:
        link: the publisher's connected (monitored) DEALER socket.
        session: the update state machine that says what each reply means.
        endpoint: the daemon's endpoint (named in errors).
        rank: the trainer rank (named in log lines).
        slot_range: ``(start, end)`` of the rank's engine slot (carried by errors).
        timeout_s: deadline of every wait, in seconds (design.md I5).
        liveness_s: the heartbeat bound, in seconds (named when the daemon is gone).
        on_error: turns a daemon ``Error`` that concerns us into the exception to raise,
            ending or aborting the open update as it must.
        end_update: forgets the open update (its daemon is gone).
    """

    def __init__(self, link: DaemonLink, session: PublisherSession, *, endpoint: str,
                 rank: int, slot_range: tuple[int, int], timeout_s: float, liveness_s: float,
                 on_error: Callable[[wire.Error], SlotsyncError],
                 end_update: Callable[[], None]) -> None:
        self.link = link
        self.session = session
        self.endpoint = endpoint
        self.rank = rank
        self.slot_range = slot_range
        self.timeout_s = timeout_s
        self.liveness_s = liveness_s
        self.on_error = on_error
        self.end_update = end_update
        self.connected: bool | None = None  # None: not yet (the first handshake is pending)
        self.wait_s = 0.0  # seconds spent in ``wait`` since the caller last reset it

    def decode(self, frame: bytes) -> wire.FromDaemon:
        """The daemon's reply in ``frame``.

        Raises:
            SlotsyncError: phase ``protocol``: the frame does not decode.
        """
        try:
            return wire.decode_from_daemon(frame)
        except wire.ProtocolError as e:
            raise SlotsyncError(
                "protocol", str(e), slot=self.slot_range, update_id=self.session.update_id
            ) from None

    def drain(self) -> None:
        """Handle replies that arrived unasked (never waits): keep acks of chunks in flight,
        raise an Error of the open update (or one with no update id); drop stale acks and
        errors of other update ids."""
        while self.link.has_message():
            msg = self.decode(self.link.recv_frame())
            outcome = self.session.receive(msg)
            if outcome is Outcome.ERROR:
                assert isinstance(msg, wire.Error)
                raise self.on_error(msg)
            if outcome is Outcome.STALE:
                log.debug("rank %d: ignoring stale reply %r", self.rank, msg)

    def send(self, msg: wire.ToDaemon | wire.OutgoingChunk) -> None:
        """Send ``msg`` after draining the replies that arrived.

        Raises:
            ValueError: its frame is over the daemon's ``max_message_bytes`` (learnt at
                registration).
            SlotsyncTimeout: no room to send it within ``timeout_s``.
            SlotsyncError: a reply drained first was an Error that concerns us.
        """
        self.drain()
        frame = wire.encode(msg)
        registered = self.session.registered
        cap = registered.max_message_bytes if registered else 0
        if cap and len(frame) > cap:
            n = len(msg.names) if isinstance(msg, wire.Chunk | wire.OutgoingChunk) else 0
            raise ValueError(
                f"{type(msg).__name__} of {n} tensors encodes to {len(frame)} bytes, over the "
                f"daemon's max_message_bytes of {cap}: send fewer tensors per chunk (a smaller "
                "staging_bytes) or raise the daemon's --max-message-bytes"
            )
        try:
            self.link.send(frame)
        except zmq.Again:
            raise SlotsyncTimeout(
                type(msg).__name__.lower(),
                f"room to send {type(msg).__name__}",
                self.timeout_s,
                endpoint=self.endpoint,
                slot=self.slot_range,
                update_id=self.session.update_id,
            ) from None

    def goodbye(self, reason: str) -> None:
        """Tell the daemon this rank's connection closes on purpose (``wire.Close``), so that
        it logs a clean close as one rather than guessing (issue 24); only while registered
        and connected, never waiting (the socket's linger lets it out)."""
        if self.session.registered is None or self.connected is not True:
            return
        with contextlib.suppress(zmq.ZMQError):
            self.link.send(wire.Close(reason[:200]), block=False)

    def read_monitor(self, *, during_update: bool, phase: str = "register",
                     waited_for: str = "") -> None:
        """Handle the connection's pending events (never waits).

        Raises:
            SlotsyncError: the daemon refused our credentials; or, ``during_update`` (while
                waiting for a reply), the connection closed (``code="daemon_gone"``): the
                daemon exited, was killed or stopped answering heartbeats within
                ``liveness_s``. A daemon that restarts forgets the update in flight, so it
                ends here; the next ``begin`` registers again.
        """
        for event in self.link.events():
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise SlotsyncError(
                    "register",
                    f"the daemon at {self.endpoint} refused this process (uid "
                    f"{os.getuid()}, gid {os.getgid()}): not in its allow_uids / "
                    "allow_gids (see the daemon's peer_refused log line)",
                    slot=self.slot_range,
                )
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
                if during_update:
                    raise self.daemon_gone(phase, waited_for)

    def daemon_gone(self, phase: str, waited_for: str) -> SlotsyncError:
        """The error for a connection that closed while waiting for ``waited_for``; ends the
        open update (the daemon that held it is gone) and forgets the registration."""
        pid = self.link.peer_pid
        who = f"slotsyncd (pid {pid})" if pid else "slotsyncd"
        try:
            check_endpoint(self.endpoint, timeout_s=0.5)
            why = ("it stopped, restarted or was killed, or answered no heartbeat within "
                   f"liveness_s={self.liveness_s:g} s")
        except SlotsyncError as e:
            why = e.message
        uid = self.session.update_id
        registered = self.session.registered
        if registered is not None and registered.node:  # (issue 25: name who drives it)
            why += (f"; the engine of slot [{self.slot_range[0]}, {self.slot_range[1]}) is "
                    f"driven by the daemon of node {registered.node}")
        if uid is not None:
            self.end_update()
        self.session.forget_registration()  # (the next begin registers with whichever
        self.link.peer_pid = 0  # daemon listens)
        # (``waited_for`` names the update already, "Ack(begin) for update 67", except for
        # Registered: "update 67 of update 67" said nothing twice)
        during = (f" of update {uid}" if uid is not None and f"update {uid}" not in waited_for
                  else "")
        return SlotsyncError(
            phase, f"lost the connection to {who} at {self.endpoint} while waiting for "
            f"{waited_for}{during}: {why}", slot=self.slot_range, update_id=uid,
            code=DAEMON_GONE)

    def wait(self, awaited: Awaited) -> wire.FromDaemon:
        """Receive until the ``awaited`` reply comes; raise for an Error that concerns us.
        Adds the time spent to ``wait_s``.

        Raises:
            SlotsyncTimeout: nothing matched within ``timeout_s``.
            SlotsyncError: an Error of the open update (or without update id) arrived, or
                the connection closed.
        """
        t0 = time.perf_counter()
        try:
            return self._wait_loop(awaited)
        finally:
            self.wait_s += time.perf_counter() - t0

    def _wait_loop(self, awaited: Awaited) -> wire.FromDaemon:
        phase, waited_for = awaited.phase, awaited.describe()
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                got, says = self.ask(awaited)
                if got is not None:
                    return got
                raise SlotsyncTimeout(
                    phase,
                    waited_for,
                    self.timeout_s,
                    endpoint=self.endpoint,
                    slot=self.slot_range,
                    update_id=self.session.update_id,
                    daemon_says=says,
                )
            ready = self.link.poll(max(0.001, remaining))
            if ready == "event":
                self.read_monitor(during_update=True, phase=phase, waited_for=waited_for)
                continue
            if ready is None:
                continue
            msg = self.decode(self.link.recv_frame())
            outcome = self.session.receive(msg, awaited)
            if outcome is Outcome.MATCH:
                if isinstance(msg, wire.Registered):
                    warning = short_timeout_warning(self.rank, self.timeout_s, msg)
                    if warning:
                        log.warning("%s", warning)
                return msg
            if outcome is Outcome.ERROR:
                assert isinstance(msg, wire.Error)
                raise self.on_error(msg)
            if outcome is Outcome.STALE:
                log.debug("rank %d: ignoring stale reply %r while waiting for %s",
                          self.rank, msg, waited_for)

    def what_daemon_waits_for(self, update_id: int | None) -> str:
        """What the daemon says it is waiting for in update ``update_id`` (its
        ``wire.Waiting.text``: the phase, the ranks, the deadline), asked with a ``wire.Query``
        and waited for up to ``ASK_S`` seconds (at most ``timeout_s``); '' when it does not
        answer (an older daemon, one gone). For an interrupted wait (``adapters/round.py``):
        the update is given up, so every other reply read meanwhile is dropped, and nothing
        is raised (a connection that closed is noted, ``connected``, for the next call)."""
        try:
            self.link.send(wire.encode(wire.Query(update_id)), block=False)
        except zmq.ZMQError:
            return ""
        deadline = time.monotonic() + min(ASK_S, self.timeout_s)
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                ready = self.link.poll(remaining)
                if ready == "event":
                    self.read_monitor(during_update=False)
                    if self.connected is False:
                        return ""
                    continue
                if ready is None:
                    continue
                msg = wire.decode_from_daemon(self.link.recv_frame())
            except (zmq.ZMQError, wire.ProtocolError, SlotsyncError):
                return ""
            if isinstance(msg, wire.Waiting):
                return msg.text
        return ""

    def ask(self, awaited: Awaited) -> tuple[wire.FromDaemon | None, str]:
        """The wait for ``awaited`` expired: ask the daemon what it is waiting for
        (``wire.Query``) and wait up to ``ASK_S`` seconds (at most ``timeout_s``) for its
        ``wire.Waiting``.

        Returns ``(reply, says)``: the awaited reply if it came meanwhile (else None), and
        the daemon's answer in words ('' when none came: an older daemon, which refuses the
        query, or one that does not answer -- then the timeout asks whether it still runs).

        Raises:
            SlotsyncError: an Error that concerns us came meanwhile, or the connection closed.
        """
        try:
            self.link.send(wire.encode(wire.Query(awaited.update_id)))
        except zmq.ZMQError:
            return None, ""
        deadline = time.monotonic() + min(ASK_S, self.timeout_s)
        while (remaining := deadline - time.monotonic()) > 0:
            ready = self.link.poll(remaining)
            if ready == "event":
                self.read_monitor(during_update=True, phase=awaited.phase,
                                  waited_for=awaited.describe())
                continue
            if ready is None:
                continue
            msg = self.decode(self.link.recv_frame())
            if isinstance(msg, wire.Waiting):
                return None, msg.text
            if isinstance(msg, wire.Error) and msg.phase == "decode" and msg.update_id is None:
                return None, ""  # (a daemon older than Query refused it)
            outcome = self.session.receive(msg, awaited)
            if outcome is Outcome.MATCH:
                return msg, ""
            if outcome is Outcome.ERROR:
                assert isinstance(msg, wire.Error)
                raise self.on_error(msg)
        return None, ""

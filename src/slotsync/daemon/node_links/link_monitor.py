"""What the ZeroMQ socket monitor says of a peer link's connections, and the words for it.

I/O-free: ``peer_io.py`` hands in each event of its sockets' monitors (libzmq 4.3's v1
events: an event number and a value) and gets back a fact that the state machines
(``relay.RelayLinks``, ``owner_links.OwnerLinks``) take; the texts below are what ranks, logs
and ``/status`` then say (issue 35: a refusal told as one, a key mismatch named with the file
to check, nothing listening told apart from no answer).

What libzmq 4.3.5 reports, as seen on its sockets (``tests/unit/test_link_monitor.py``):

* connecting (a relaying node's DEALER): ``CONNECT_DELAYED``, then ``CONNECTED`` (fd) once
  TCP is up, then ``HANDSHAKE_SUCCEEDED``. A connect that fails (refused, host unreachable,
  the OS's connect timeout) is ``CLOSED`` (fd) and ``CONNECT_RETRIED``; the errno is not in
  the event, so the adapter asks the OS itself (``connect_failure``). A host that never
  answers gives no event at all until the OS gives up (minutes).
* a handshake the owner refuses by key (ZAP 400): ``HANDSHAKE_FAILED_AUTH`` (the ZAP status)
  and ``DISCONNECTED``, and **no reconnect ever** (the session is ended for good): the adapter
  connects again itself (``peer_state.Reconnect``).
* a handshake whose CURVE boxes do not open (the relaying node holds another public key for
  the owner than the owner's own): the owner sees ``HANDSHAKE_FAILED_PROTOCOL`` (``ZMTP
  cryptographic``) and ``DISCONNECTED`` (fd), one right after the other on its I/O thread;
  the relaying node only ``HANDSHAKE_FAILED_NO_DETAIL`` and ``DISCONNECTED``: the owner
  closed the connection during the handshake.
* a connection closed after the handshake (the peer's daemon killed, stopped, its host down):
  ``DISCONNECTED`` (fd) on both ends, at once where the peer's kernel closed it.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

DEALER_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                 | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                 | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
"""The monitor events a relaying node's connection to an owner needs."""

ROUTER_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                 | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
"""The monitor events an owner's listener needs (a refused key is told by ``zmq.auth``)."""

_PROTOCOL_ERRORS = {getattr(zmq, n): n[len("PROTOCOL_ERROR_"):].lower().replace("_", " ")
                    for n in dir(zmq) if n.startswith("PROTOCOL_ERROR_")}


def protocol_error_name(code: int) -> str:
    """libzmq's ``ZMQ_PROTOCOL_ERROR_*`` code in words (``"zmtp cryptographic"``)."""
    return _PROTOCOL_ERRORS.get(code, f"protocol error {code:#x}")


# ------------------------------------------------------------------------------ facts


@dataclass(frozen=True)
class Handshaken:
    """The connection is made and CURVE-authenticated both ways."""


@dataclass(frozen=True)
class Closed:
    """The connection on file descriptor ``fd`` closed (after its handshake, or during it)."""

    fd: int


@dataclass(frozen=True)
class ConnectFailed:
    """A connect attempt failed before any TCP connection (why: ask the OS,
    ``connect_failure``)."""


@dataclass(frozen=True)
class HandshakeFailed:
    """The handshake failed: ``kind`` ``"auth"`` (the owner's ``zmq.auth`` refused this
    node's key; ``code``: the ZAP status), ``"protocol"`` (``code``: a
    ``ZMQ_PROTOCOL_ERROR_*``) or ``"closed"`` (the other end closed the connection during the
    handshake; ``code``: errno). ``fd``: the connection's, where known (the owner's side)."""

    kind: str
    code: int
    fd: int | None = None


LinkFact = Handshaken | Closed | ConnectFailed | HandshakeFailed


class DealerWatch:
    """A relaying node's connection to one owner, from its DEALER's monitor events."""

    def __init__(self) -> None:
        self.failed = False  # a handshake failure was told for the connection now open

    def on_event(self, event: int, value: int) -> LinkFact | None:
        """One monitor event (``zmq.utils.monitor.parse_monitor_message``'s ``event`` and
        ``value``); the fact it tells, or None."""
        if event == zmq.EVENT_CONNECTED:
            self.failed = False
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return Handshaken()
        elif event == zmq.EVENT_CLOSED:
            return ConnectFailed()
        elif event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                       zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            self.failed = True
            return HandshakeFailed({zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
                                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol"}.get(
                                        event, "closed"), value)
        elif event == zmq.EVENT_DISCONNECTED and not self.failed:
            return Closed(value)
        return None


class RouterWatch:
    """An owner's listener, from its ROUTER's monitor events: which connection closed, and
    which failed its handshake (from where). libzmq tells a failed handshake right before the
    same connection's ``DISCONNECTED`` (one I/O thread), which names its fd; the adapter
    learns each accepted fd's remote address (``accepted``)."""

    def __init__(self) -> None:
        self.addresses: dict[int, str] = {}  # fd -> the remote "host:port", while open
        self._failed: HandshakeFailed | None = None

    def accepted(self, fd: int, address: str) -> None:
        """Connection ``fd`` was accepted from ``address`` (``"host:port"``, '' unknown)."""
        self.addresses[fd] = address

    def on_event(self, event: int, value: int) -> LinkFact | None:
        """One monitor event; ``Closed(fd)`` for a connection that closed after its handshake,
        ``HandshakeFailed`` (with its fd) for one that failed it, else None."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._failed = HandshakeFailed("protocol", value)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._failed = HandshakeFailed("closed", value)
        elif event == zmq.EVENT_DISCONNECTED:
            failed, self._failed = self._failed, None
            if failed is not None:
                return HandshakeFailed(failed.kind, failed.code, value)
            return Closed(value)
        return None

    def forget(self, fd: int) -> str:
        """Connection ``fd`` is gone: its address, no longer kept."""
        return self.addresses.pop(fd, "")


# ------------------------------------------------------------------------------ words


def key_refused(owner: str, node: str, status: int) -> str:
    """The owner's ``zmq.auth`` refused this node's key (ZAP ``status``)."""
    return (f"node {owner}'s daemon does not accept this node's key (ZAP {status}): its "
            f"peer_public_keys must hold {node}.key with this node's public key (the pair in "
            "this node's curve_secret_key)")


def handshake_failed(owner: str, kind: str, code: int, key_file: str) -> str:
    """A handshake with ``owner`` failed otherwise (``HandshakeFailed`` ``kind`` and
    ``code``); ``key_file``: where this node reads ``owner``'s public key."""
    if kind == "protocol" and code == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (f"what answers there does not speak CURVE (mechanism mismatch): is "
                f"owner_address node {owner}'s peer_listen, not another ZeroMQ service?")
    if kind == "closed":
        how = "node {o}'s daemon closed the connection during the CURVE handshake"
    else:
        how = f"the CURVE handshake with node {{o}} failed ({protocol_error_name(code)})"
    return (how.format(o=owner) + f": likely a key mismatch: {key_file} must hold node "
            f"{owner}'s current public key (compare it with the {owner}.key that `slotsync "
            f"keys {owner}` made beside node {owner}'s curve_secret_key)")


def connect_failure(owner: str, address: str, kind: str, detail: str = "") -> str:
    """Why a connect to ``owner``'s ``address`` failed: ``kind`` ``"refused"`` (nothing
    listens there), ``"unreachable"`` (``detail``: the OS's words, e.g. "No route to host")
    or ``"no answer"`` (connecting, nothing heard yet)."""
    check = f"check owner_address, and that node {owner}'s daemon runs with peer_listen there"
    if kind == "refused":
        return f"nothing listens at {address} (connection refused): {check}"
    if kind == "unreachable":
        return f"no host answers at {address} ({detail}): {check}"
    return (f"no answer from {address} (a host down, a network cut, or a firewall dropping "
            f"the packets): {check}")


def handshake_from(address: str, node: str, kind: str, code: int) -> str:
    """The owner's log line for a handshake that failed from ``address``: what it means."""
    if kind == "protocol" and code == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        why = (f"it holds a public key for node {node} that is not this node's own (a stale "
               f"or another node's {node}.key): copy this node's {node}.key into its "
               "peer_public_keys")
    elif kind == "protocol":
        why = f"{protocol_error_name(code)}: is it a slotsync daemon with a CURVE key pair?"
    else:
        why = "it closed the connection during the handshake"
    return f"a connection from {address or 'an unknown address'} failed the CURVE handshake: {why}"

"""The peer link's messages: what the daemons of different nodes say to each other.

Transport: one ZeroMQ DEALER socket per owner, on each node whose ranks feed an engine that
another node's daemon owns, connected over TCP to the owner's ROUTER (``peer_listen``), both
ends authenticated and encrypted with CURVE (``peer_keys.py``). Each ZeroMQ message carries
one frame: a msgpack map of one struct below, tagged by ``type``. Nothing is pickled: a
rank's frames cross inside ``Relay`` as the rank sent them (``protocol/wire/`` bytes, which
the owner decodes and validates as it does a local rank's), and the owner's replies cross
inside ``Deliver`` as it would have sent them to a local rank.

Conversation (``relaying node`` is the non-owning daemon; ``owner`` the engine's)::

    relaying node -> owner                      owner -> relaying node
    Hello(node, engines, ...)                   Welcome(node) | Refuse(reason)   (then closes)
    Relay(origin, pid, frame)   x many          Deliver(origin, frame)           x many
    Gone(origins, why)                          (the ranks' connections ended on that node)
    Ping(sent_s)                                Pong(sent_s)                     (both ways)

``origin`` is the rank's socket identity on the relaying node's ROUTER; the owner keys the
rank as ``relayed_identity(node, origin)``. Every message but ``Hello`` before a ``Welcome``
is refused. See docs/architecture.md "Engines over several nodes" for why the link relays
frames rather than merging each node's part of a chunk first.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from slotsync.daemon.core.registration import split_relayed  # noqa: F401 (the core reads it)

PEER_PROTOCOL_VERSION = 2
"""Bumped on any incompatible change below; checked in ``Hello``. 2: ``SpanEngine`` carries
``owner_address`` (issue 35)."""

NodeName = Annotated[str, msgspec.Meta(min_length=1, max_length=255,
                                       pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
Identity = Annotated[bytes, msgspec.Meta(min_length=1, max_length=255)]
MAX_PEER_FRAME_BYTES = 128 * 1024 * 1024
"""Largest frame on the link (bytes): a relayed rank frame is capped by the relaying daemon's
``max_message_bytes`` (64 MiB by default), plus the envelope."""


class SpanPart(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One node's part of a spanning engine: trainer ranks ``[start, end)``, in worker order."""

    node: NodeName
    start: Annotated[int, msgspec.Meta(ge=0)]
    end: Annotated[int, msgspec.Meta(ge=0)]


class SpanEngine(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A spanning engine as a daemon's engine table declares it (``config.EngineEntry``)."""

    url: str
    slot_start: int
    slot_size: int
    owner: NodeName
    parts: tuple[SpanPart, ...]
    gpu_uuids: tuple[str, ...] = ()
    # the owner's peer_listen as the engine table names it (issue 35: compared in Hello like
    # every other key, since the docs promise that any difference is refused)
    owner_address: str = ""


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """First message of a relaying node: who it is and which of the owner's engines its
    table declares (compared with the owner's own, entry by entry)."""

    node: NodeName
    protocol_version: int
    daemon_version: str
    engines: list[SpanEngine]


class Welcome(msgspec.Struct, tag="welcome", forbid_unknown_fields=True):
    """The owner accepted the ``Hello``: relayed frames are taken from now on."""

    node: NodeName


class Refuse(msgspec.Struct, tag="refuse", forbid_unknown_fields=True):
    """The owner refused the ``Hello`` (``reason`` names what differs); nothing relayed is
    taken until a new ``Hello`` is accepted."""

    reason: str


class Relay(msgspec.Struct, tag="relay", forbid_unknown_fields=True):
    """A frame of a rank of the relaying node, as the rank sent it. ``pid``: the rank's
    process id on that node (0: unknown)."""

    origin: Identity
    pid: Annotated[int, msgspec.Meta(ge=0)]
    frame: bytes


class Deliver(msgspec.Struct, tag="deliver", forbid_unknown_fields=True):
    """A frame for the rank ``origin`` of the relaying node (``wire.FromDaemon`` bytes)."""

    origin: Identity
    frame: bytes


class Gone(msgspec.Struct, tag="gone", forbid_unknown_fields=True):
    """The connections of these ranks ended on the relaying node, for reason ``why``."""

    origins: list[Identity]
    why: str


class Ping(msgspec.Struct, tag="ping", forbid_unknown_fields=True):
    """Liveness and round-trip time: answered at once with ``Pong(sent_s)``. ``sent_s``: the
    sender's monotonic clock (seconds), only ever compared with the sender's own."""

    sent_s: float


class Pong(msgspec.Struct, tag="pong", forbid_unknown_fields=True):
    """The answer to ``Ping``, echoing its ``sent_s``."""

    sent_s: float


PeerMessage = Hello | Welcome | Refuse | Relay | Deliver | Gone | Ping | Pong

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerMessage)


class PeerProtocolError(ValueError):
    """A frame on the peer link that is not a valid message (the text names the field)."""


def encode_peer(msg: PeerMessage) -> bytes:
    """One message as one msgpack frame."""
    return _encoder.encode(msg)


def decode_peer(frame: bytes) -> PeerMessage:
    """Decode and validate one frame from a peer daemon.

    Raises:
        PeerProtocolError: not msgpack, an unknown type, a missing or wrong field, or over
            ``MAX_PEER_FRAME_BYTES``.
    """
    if len(frame) > MAX_PEER_FRAME_BYTES:
        raise PeerProtocolError(f"frame of {len(frame)} bytes is over the link's limit of "
                                f"{MAX_PEER_FRAME_BYTES}")
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as e:
        raise PeerProtocolError(str(e)) from None


def relayed_identity(node: str, origin: bytes) -> bytes:
    """The owner's key for rank socket ``origin`` of ``node``: never equal to a local ROUTER
    identity (libzmq's start with a zero byte and are 5 bytes long)."""
    return b"peer:" + node.encode() + b"/" + origin

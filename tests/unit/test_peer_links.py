"""The peer links' state machines, both sides (issue 25 B/C; ``daemon/node_links/owner_links.py``,
``daemon/node_links/relay.py``): what each event returns, with no socket in sight."""

from __future__ import annotations

import msgspec

from slotsync.daemon.node_links import spans
from slotsync.daemon.node_links.owner_links import OwnerLinks
from slotsync.daemon.node_links.peer_state import RanksGone, ReplyRank, SendPeer, ToRank, ToTable
from slotsync.daemon.node_links.peer_wire import (
    PEER_PROTOCOL_VERSION,
    Deliver,
    Gone,
    Hello,
    Ping,
    Pong,
    Refuse,
    Relay,
    SpanPart,
    Welcome,
    decode_peer,
    encode_peer,
    relayed_identity,
    split_relayed,
)
from slotsync.daemon.node_links.relay import RelayLinks
from slotsync.daemon.service.config import EngineEntry
from slotsync.protocol.wire import PROTOCOL_VERSION, Begin, Error, Register, encode

ENTRY = EngineEntry("http://10.0.0.1:8000", 0, 8, (), "node0", "tcp://10.0.0.1:9461",
                    (SpanPart("node0", 0, 4), SpanPart("node1", 4, 8)))
LIVE = 10.0


def _owner() -> OwnerLinks:
    return OwnerLinks("node0", spans.roles([ENTRY], "node0").owned, LIVE)


def _relay() -> RelayLinks:
    return RelayLinks(spans.roles([ENTRY], "node1"), LIVE, "test")


def _hello(node="node1", engines=None) -> Hello:
    return Hello(node, PEER_PROTOCOL_VERSION, "test",
                 [spans.span_engine(ENTRY)] if engines is None else engines)


def _register(rank=4, slot=(0, 8)) -> Register:
    return Register(PROTOCOL_VERSION, rank, "GPU-" + "a" * 8 + "-0000-0000-0000-" + "0" * 12,
                    slot[0], slot[1] - slot[0], "http://10.0.0.1:8000", True, "shm")


def _of(kind, actions):
    return [a for a in actions if isinstance(a, kind)]


def test_every_link_message_round_trips_typed():
    for msg in (_hello(), Welcome("node0"), Refuse("x"), Relay(b"\x00ab", 7, b"frame"),
                Deliver(b"\x00ab", b"f"), Gone([b"\x00ab"], "why"), Ping(1.5), Pong(1.5)):
        assert decode_peer(encode_peer(msg)) == msg
    assert split_relayed(relayed_identity("node1", b"\x00\x01")) == ("node1", b"\x00\x01")
    assert split_relayed(b"\x00abcd") is None


def test_owner_takes_relayed_frames_only_after_an_accepted_hello():
    o = _owner()
    assert o.on_message("node1", Relay(b"r4", 11, b"frame"), 0.0) == []  # (no Hello yet)
    (welcome,) = _of(SendPeer, o.on_message("node1", _hello(), 0.0))
    assert welcome.msg == Welcome("node0") and o.links["node1"].up
    (to_table,) = o.on_message("node1", Relay(b"r4", 11, b"frame"), 1.0)
    assert to_table == ToTable(relayed_identity("node1", b"r4"), b"frame", 11)
    (deliver,) = o.deliver(relayed_identity("node1", b"r4"), b"reply")
    assert deliver == SendPeer("node1", Deliver(b"r4", b"reply"))
    (gone,) = o.on_message("node1", Gone([b"r4"], "its process (pid 11) exited"), 2.0)
    assert gone == RanksGone([relayed_identity("node1", b"r4")],
                             "its process (pid 11) exited, on node node1")


def test_owner_refuses_a_hello_naming_the_difference():
    o = _owner()
    other = EngineEntry(ENTRY.url, 0, 8, (), "node0", ENTRY.owner_address,
                        (SpanPart("node0", 0, 2), SpanPart("node1", 2, 8)))
    actions = o.on_message("node1", _hello(engines=[spans.span_engine(other)]), 0.0)
    (refuse,) = _of(SendPeer, actions)
    assert isinstance(refuse.msg, Refuse) and "node1 [2, 8)" in refuse.msg.reason
    assert not o.links["node1"].up and o.links["node1"].state.startswith("refused")
    # a key that speaks as another node
    (refuse,) = _of(SendPeer, o.on_message("node1", _hello(node="node0"), 0.0))
    assert "the key of node node1 speaks as node node0" in refuse.msg.reason
    # a node that takes part in no engine of ours
    (refuse,) = _of(SendPeer, o.on_message("node7", _hello(node="node7"), 0.0))
    assert "drives no engine over node node7" in refuse.msg.reason


def test_owner_silent_link_fails_its_ranks_within_liveness():
    o = _owner()
    o.on_message("node1", _hello(), 0.0)
    o.on_message("node1", Relay(b"r4", 11, b"f"), 0.0)
    pings = _of(SendPeer, o.poll(LIVE / 5))
    assert pings and isinstance(pings[0].msg, Ping)
    assert o.next_deadline() is not None and o.next_deadline() <= 0.8 * LIVE
    assert _of(RanksGone, o.poll(0.8 * LIVE - 0.1)) == []
    (gone,) = _of(RanksGone, o.poll(0.8 * LIVE + 0.1))
    assert gone.identities == [relayed_identity("node1", b"r4")]
    assert "node node1's daemon is unreachable" in gone.why
    assert gone.link_lost  # (their daemon told them it failed: the update fails, issue 25 C)
    assert not o.links["node1"].up and o.links["node1"].downs == 1
    assert o.deliver(relayed_identity("node1", b"r4"), b"x") == []  # (dropped while down)


def test_owner_reconnect_drops_what_the_old_connection_relayed():
    o = _owner()
    o.on_message("node1", _hello(), 0.0)
    o.on_message("node1", Relay(b"r4", 11, b"f"), 0.0)
    actions = o.on_message("node1", _hello(), 1.0)
    (gone,) = _of(RanksGone, actions)
    assert gone.identities == [relayed_identity("node1", b"r4")]
    assert "connected again" in gone.why and o.links["node1"].up


def test_relay_holds_frames_until_welcome_then_forwards_unchanged():
    r = _relay()
    reg = _register()
    frame = encode(reg)
    assert r.on_rank_message(b"r4", reg, frame, 11, 0.0) == []  # (link coming up)
    (hello,) = _of(SendPeer, r.on_connected("node0", 0.1))
    assert hello.msg == _hello() and hello.node == "node0"
    (relayed,) = _of(SendPeer, r.on_message("node0", Welcome("node0"), 0.2))
    assert relayed.msg == Relay(b"r4", 11, frame)
    (deliver,) = r.on_message("node0", Deliver(b"r4", b"ack"), 0.3)
    assert deliver == ToRank(b"r4", b"ack")
    # a rank of a slot this node drives itself is not relayed
    assert r.on_rank_message(b"r9", _register(9, (8, 12)), b"", 1, 0.4) is None


def test_relay_link_down_fails_each_rank_naming_the_owner():
    r = _relay()
    r.on_connected("node0", 0.0)
    r.on_message("node0", Welcome("node0"), 0.0)
    r.on_rank_message(b"r4", _register(), b"reg", 11, 0.0)
    r.on_rank_message(b"r4", Begin(7, "v7"), b"begin", 11, 0.0)
    (err,) = _of(ReplyRank, r.poll(0.8 * LIVE + 0.1))
    assert isinstance(err.msg, Error) and err.msg.fatal and err.msg.phase == "begin"
    assert err.msg.update_id == 7
    assert "node node0's daemon, which drives this engine, cannot be reached at " \
        "tcp://10.0.0.1:9461" in err.msg.message
    # forgotten: its next message goes to the slot table, which says "not registered"
    assert r.on_rank_message(b"r4", Begin(8, "v8"), b"begin", 11, LIVE) is None


def test_relay_refused_link_answers_at_once_and_gives_up_waiting():
    r = _relay()
    r.on_connected("node0", 0.0)
    r.on_rank_message(b"r4", _register(), b"reg", 11, 0.0)
    (err,) = _of(ReplyRank, r.on_message("node0", Refuse("node node1 declares ..."), 0.1))
    # (reached, and it said no: told as a refusal, not as "cannot be reached", issue 35)
    assert "node node0's daemon, which drives this engine, refused this node's peer link at " \
        "tcp://10.0.0.1:9461: node node1 declares" in err.msg.message
    assert "cannot be reached" not in err.msg.message
    (err,) = _of(ReplyRank, r.on_rank_message(b"r5", _register(5), b"reg", 12, 0.2))
    assert err.msg.phase == "register"
    # never connected: a rank waits up to liveness_s, then is told
    r2 = _relay()
    assert r2.on_rank_message(b"r4", _register(), b"reg", 11, 0.0) == []
    assert r2.poll(LIVE - 0.1) == []
    (err,) = _of(ReplyRank, r2.poll(LIVE + 0.1))
    assert "not connected within 10 s" in err.msg.message


def test_relay_tells_the_owner_which_ranks_are_gone():
    r = _relay()
    r.on_connected("node0", 0.0)
    r.on_message("node0", Welcome("node0"), 0.0)
    r.on_rank_message(b"r4", _register(), b"reg", 11, 0.0)
    actions, rest = r.on_ranks_gone([b"r4", b"local"], "its process (pid 11) exited")
    assert rest == [b"local"]
    assert actions == [SendPeer("node0", Gone([b"r4"], "its process (pid 11) exited"))]


def test_link_messages_refuse_unknown_fields():
    raw = msgspec.msgpack.encode({"type": "ping", "sent_s": 1.0, "extra": 1})
    try:
        decode_peer(raw)
    except ValueError as e:
        assert "extra" in str(e)
    else:
        raise AssertionError("an unknown field was accepted")


def test_relay_sends_a_relayed_ranks_malformed_frame_to_the_owner():
    """A frame that fails validation on the relaying node still reaches the owner, whose
    table knows the rank and fails its update at once naming it (issue 24 D, over nodes)."""
    r = _relay()
    r.on_connected("node0", 0.0)
    r.on_message("node0", Welcome("node0"), 0.0)
    r.on_rank_message(b"r4", _register(), b"reg", 11, 0.0)
    (sent,) = r.on_bad_frame(b"r4", b"\x81junk", 11)
    assert sent == SendPeer("node0", Relay(b"r4", 11, b"\x81junk"))
    assert r.on_bad_frame(b"other", b"junk", 1) is None  # (not relayed: this node answers)


def test_relay_refused_key_tells_waiting_ranks_at_once_and_logs_once():
    r = _relay()
    r.on_rank_message(b"r4", _register(), b"reg", 11, 0.0)
    actions = r.on_handshake_failed("node0", 0.5, "node node0's daemon does not accept this "
                                    "node's key (is node1.key in its peer_public_keys?)")
    (err,) = _of(ReplyRank, actions)
    assert "does not accept this node's key" in err.msg.message
    assert len([a for a in actions if type(a).__name__ == "LinkEvent"]) == 1
    again = r.on_handshake_failed("node0", 1.0, "node node0's daemon does not accept this "
                                  "node's key (is node1.key in its peer_public_keys?)")
    assert again == []  # (libzmq retries; the log says it once)


def test_a_closed_relayed_rank_is_forgotten_by_the_owner_when_its_connection_ends():
    """Publisher.close() sends Close, then its connection ends: the relay tells the owner
    with Gone, so the owner's link does not keep the rank for good (found by a deploy trial:
    relayed_ranks grew with every job)."""
    from slotsync.protocol.wire import Close

    r, o = _relay(), _owner()
    r.on_connected("node0", 0.0)
    r.on_message("node0", Welcome("node0"), 0.0)
    o.on_message("node1", _hello(), 0.0)
    for msg in (_register(), Close()):
        (sent,) = r.on_rank_message(b"r4", msg, encode(msg), 11, 0.1)
        o.on_message("node1", sent.msg, 0.1)
    assert o.status(0.2)[0]["relayed_ranks"] == 1
    actions, rest = r.on_ranks_gone([b"r4"], "its connection closed")
    assert rest == [] and len(actions) == 1
    o.on_message("node1", actions[0].msg, 0.3)
    assert o.status(0.4)[0]["relayed_ranks"] == 0


def test_a_link_that_never_connects_is_logged_once_even_with_no_rank_waiting():
    """A wrong owner_address left node1's log silent (fresh-user trial): now one warning
    after liveness_s, and again only after the link was up and went down."""
    r = _relay()
    assert r.poll(0.0) == []
    assert r.next_deadline() is not None and r.next_deadline() <= LIVE + 0.1
    (warn,) = r.poll(LIVE + 0.1)
    assert warn.event == "peer_not_connected" and warn.fields["address"] == ENTRY.owner_address
    assert r.poll(2 * LIVE) == []  # (once per outage)

"""Issue 35 items 1-5, without a namespace: what libzmq's socket monitor says of the peer
link's connections (``daemon/node_links/link_monitor.py``, on real sockets over loopback), and
what the I/O-free state machines do with it (``owner_links.py``, ``relay.py``, the slot
table). The same faults between real nodes: ``tests/faults/test_peer_link_faults.py`` and
``tests/faults/test_multi_node_faults.py``."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
import zmq.auth.thread
import zmq.utils.monitor
from test_coordinator import Harness, chunk, ident
from test_peer_links import ENTRY, LIVE, _hello, _of, _owner, _register, _relay

from slotsync.daemon.node_links import link_monitor
from slotsync.daemon.node_links.link_monitor import (
    Closed,
    ConnectFailed,
    DealerWatch,
    HandshakeFailed,
    Handshaken,
    RouterWatch,
)
from slotsync.daemon.node_links.peer_state import (
    LinkEvent,
    RanksGone,
    Reconnect,
    ReplyRank,
    ping_interval,
    silence_limit,
)
from slotsync.daemon.node_links.peer_wire import Relay, Welcome, relayed_identity
from slotsync.protocol.wire import Error
from slotsync.testing.ports import free_port

# ------------------------------------------------------------------------------ libzmq


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


class _Allow:
    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys

    def callback(self, _domain: str, key: bytes) -> bool:
        return key in self.keys


def _server(ctx: zmq.Context, secret: bytes, public: bytes, allowed: set[bytes]):
    auth = zmq.auth.thread.ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("t", _Allow(allowed))
    sock = ctx.socket(zmq.ROUTER)
    sock.curve_server, sock.curve_secretkey, sock.curve_publickey = True, secret, public
    sock.zap_domain, sock.linger = b"t", 0
    mon = sock.get_monitor_socket(link_monitor.ROUTER_EVENTS | zmq.EVENT_ACCEPTED)
    sock.bind("tcp://127.0.0.1:0")
    return auth, sock, mon, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _client(ctx: zmq.Context, server_key: bytes, address: str):
    pub, sec = zmq.curve_keypair()
    sock = ctx.socket(zmq.DEALER)
    sock.curve_serverkey, sock.curve_secretkey, sock.curve_publickey = server_key, sec, pub
    sock.linger = 0
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    mon = sock.get_monitor_socket(link_monitor.DEALER_EVENTS)
    sock.connect(address)
    return sock, mon, pub


def _facts(mon: zmq.Socket, watch, seconds: float, until=None) -> list:
    """Feed ``mon``'s events to ``watch`` for up to ``seconds``; the facts (ACCEPTED goes to
    a RouterWatch's ``accepted``)."""
    out: list = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (until and until(out)):
        if mon.poll(50):
            ev = zmq.utils.monitor.parse_monitor_message(mon.recv_multipart())
            if ev["event"] == zmq.EVENT_ACCEPTED:
                watch.accepted(ev["value"], "here")
                continue
            fact = watch.on_event(ev["event"], ev["value"])
            if fact is not None:
                out.append(fact)
    return out


def test_a_refused_key_is_a_handshake_failure_after_which_libzmq_never_reconnects(ctx):
    """Item 3's cause: after the owner's zmq.auth refused the key, libzmq gives the connection
    up for good (no CONNECT_RETRIED, nothing more), so the adapter must connect again."""
    spub, ssec = zmq.curve_keypair()
    allowed: set[bytes] = set()
    auth, _srv, _smon, address = _server(ctx, ssec, spub, allowed)
    try:
        _sock, mon, cpub = _client(ctx, spub, address)
        watch = DealerWatch()
        facts = _facts(mon, watch, 5, until=lambda f: f)
        assert facts == [HandshakeFailed("auth", 400)]
        allowed.add(cpub)  # (fixed on the owner's side: libzmq alone never tries again)
        assert _facts(mon, watch, 1.0) == []
    finally:
        auth.stop()


def test_a_stale_owner_key_fails_the_handshake_on_both_sides_with_the_owners_fd(ctx):
    """Item 4: the relaying node holds another public key for the owner. The owner's monitor
    says "zmtp cryptographic" right before that connection's DISCONNECTED (its fd, whose
    address was taken at ACCEPTED); the relaying node only sees the connection closed during
    the handshake."""
    spub, ssec = zmq.curve_keypair()
    stale, _ = zmq.curve_keypair()
    auth, _srv, smon, address = _server(ctx, ssec, spub, set())
    try:
        _sock, cmon, _ = _client(ctx, stale, address)
        router, dealer = RouterWatch(), DealerWatch()
        (client_fact, *_) = _facts(cmon, dealer, 5, until=lambda f: f)
        assert client_fact == HandshakeFailed("closed", client_fact.code)
        (owner_fact, *_) = _facts(smon, router, 5, until=lambda f: f)
        assert owner_fact.kind == "protocol" and owner_fact.fd is not None
        assert owner_fact.code == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC
        assert router.forget(owner_fact.fd) == "here"
        text = link_monitor.handshake_from("10.0.0.2:5000", "node0", owner_fact.kind,
                                           owner_fact.code)
        assert "10.0.0.2:5000" in text and "node0.key" in text and "stale" in text
    finally:
        auth.stop()


def test_a_closed_connection_is_told_with_the_fd_its_frames_came_from(ctx):
    """Item 2: a killed daemon's connection closes at once; the owner's monitor names its
    fd, the one each of its frames carries (zmq.SRCFD), so the link it carried is known."""
    spub, ssec = zmq.curve_keypair()
    auth, srv, smon, address = _server(ctx, ssec, spub, set())
    try:
        sock, cmon, cpub = _client(ctx, spub, address)
        auth.configure_curve_callback("t", _Allow({cpub}))
        assert _facts(cmon, DealerWatch(), 5, until=lambda f: f) == [Handshaken()]
        sock.send(b"hello")
        assert srv.poll(5000)
        fd = srv.recv_multipart(copy=False)[1].get(zmq.SRCFD)
        router = RouterWatch()
        _facts(smon, router, 0.3)
        sock.close(linger=0)
        assert _facts(smon, router, 5, until=lambda f: f) == [Closed(fd)]
    finally:
        auth.stop()


def test_nothing_listening_is_a_failed_connect_not_a_handshake(ctx):
    """Item 5: a connect where nothing listens closes before any connection (CLOSED): the
    adapter asks the OS why; no handshake failure is told."""
    port = free_port()  # (nothing listens there)
    _sock, mon, _ = _client(ctx, zmq.curve_keypair()[0], f"tcp://127.0.0.1:{port}")
    facts = _facts(mon, DealerWatch(), 5, until=lambda f: f)
    assert facts and all(f == ConnectFailed() for f in facts)


# ------------------------------------------------------------------------------ the owner


def _owner_with_ranks(conn: int = 7):
    o = _owner()
    o.on_message("node1", _hello(), 0.0, conn)
    for r in range(4, 8):
        o.on_message("node1", Relay(f"r{r}".encode(), 100 + r, b"f"), 0.1, conn)
    return o


def test_owner_link_goes_down_at_once_when_its_connection_closes_naming_every_rank():
    """Items 1 and 2: the connection that said the Hello closes (node1's daemon killed): the
    link is down at once, well before the silence limit, and one RanksGone names all four
    relayed ranks, the cause node1's daemon, their memory released."""
    o = _owner_with_ranks(conn=7)
    assert o.on_connection_closed(8, 0.2) == []  # (another connection: nothing)
    actions = o.on_connection_closed(7, 0.2)
    (gone,) = _of(RanksGone, actions)
    assert 0.2 < silence_limit(LIVE)
    assert sorted(gone.identities) == [relayed_identity("node1", f"r{r}".encode())
                                       for r in range(4, 8)]
    assert gone.why.startswith("node node1's daemon is unreachable: its peer-link connection "
                               "closed") and gone.link_lost
    assert not o.links["node1"].up and o.links["node1"].downs == 1
    assert o.on_connection_closed(7, 0.3) == []  # (told once)


def test_owner_ignores_the_close_of_a_connection_a_reconnect_replaced():
    o = _owner_with_ranks(conn=7)
    o.on_message("node1", _hello(), 1.0, 9)  # (node1 connected again: fd 9 carries it now)
    assert o.on_connection_closed(7, 1.1) == []
    assert o.links["node1"].up
    assert _of(LinkEvent, o.on_connection_closed(9, 1.2))[0].event == "peer_link_down"


def test_a_lost_links_ranks_fail_the_update_once_naming_all_of_them():
    """Item 1: the table takes the node's ranks together: one failure, every one in
    ``missing_ranks`` and the text (it named the first one only: rank 6 in one run, 7 in
    the next)."""
    h = Harness(size=4, timeouts=None)
    h.register_all()
    h.begin(0)
    for r in range(4):
        h.send(r, chunk(0, 0, r))
    h.run(h.table.on_connections_gone([ident(r) for r in (1, 2, 3)], h.now,
                                      "node node1's daemon is unreachable: its peer-link "
                                      "connection closed", released=True))
    errors = [m for m in h.replies[0] if isinstance(m, Error)]
    (err,) = errors
    assert err.phase == "rank_gone" and err.missing_ranks == [1, 2, 3]
    assert "ranks 1 (" in err.message and ", 2 (" in err.message and ", 3 (" in err.message
    assert "are gone: node node1's daemon is unreachable" in err.message
    assert h.coord.engine.needs_full_update and h.coord.engine.paused


# ------------------------------------------------------------------------------ the relay


def test_a_refused_handshake_is_tried_again_within_liveness():
    """Item 3: after a refused key (or a failed handshake) the relay asks for a Reconnect
    every ping_interval until a handshake succeeds, so a fix on the owner's side brings the
    link back within liveness_s."""
    r = _relay()
    r.on_handshake_failed("node0", 1.0, link_monitor.key_refused("node0", "node1", 400))
    assert r.next_deadline() is not None and r.next_deadline() <= 1.0 + ping_interval(LIVE)
    assert _of(Reconnect, r.poll(1.0 + ping_interval(LIVE) / 2)) == []
    assert _of(Reconnect, r.poll(1.0 + ping_interval(LIVE))) == [Reconnect("node0")]
    r.on_handshake_failed("node0", 3.0, link_monitor.key_refused("node0", "node1", 400))
    assert _of(Reconnect, r.poll(3.0 + ping_interval(LIVE))) == [Reconnect("node0")]
    r.on_connected("node0", 4.0)
    r.on_message("node0", Welcome("node0"), 4.1)
    assert _of(Reconnect, r.poll(10.0)) == [] and r.owners["node0"].link.up


def test_a_refused_key_is_told_to_ranks_as_a_refusal():
    """Item 5: reached, and it said no: not "cannot be reached"."""
    r = _relay()
    r.on_handshake_failed("node0", 0.5, link_monitor.key_refused("node0", "node1", 400))
    (err,) = _of(ReplyRank, r.on_rank_message(b"r4", _register(), b"reg", 11, 0.6))
    assert f"refused this node's peer link at {ENTRY.owner_address}: node node0's daemon " \
        "does not accept this node's key" in err.msg.message
    assert "node1.key" in err.msg.message and "cannot be reached" not in err.msg.message


def test_a_stale_owner_key_is_told_as_a_likely_key_mismatch_naming_the_file():
    """Item 4: not "not connected within 10 s"."""
    r = _relay()
    why = link_monitor.handshake_failed("node0", "closed", 104, "/etc/slotsync/peers/node0.key")
    r.on_handshake_failed("node0", 0.5, why)
    (err,) = _of(ReplyRank, r.on_rank_message(b"r4", _register(), b"reg", 11, 0.6))
    assert "likely a key mismatch: /etc/slotsync/peers/node0.key must hold node node0's " \
        "current public key" in err.msg.message
    assert "not connected within" not in err.msg.message


def test_nothing_listening_and_no_answer_are_told_apart():
    """Item 5: a refused connect says nothing listens there (check owner_address); a connect
    that met nothing at all says no answer."""
    r = _relay()
    r.on_rank_message(b"r4", _register(), b"reg", 11, 0.0)
    r.on_connect_failed("node0", 0.1, link_monitor.connect_failure(
        "node0", ENTRY.owner_address, "refused"))
    (err,) = _of(ReplyRank, r.poll(LIVE + 0.1))
    assert f"cannot be reached at {ENTRY.owner_address} (down: not connected within 10 s: " \
        f"nothing listens at {ENTRY.owner_address} (connection refused): check " \
        "owner_address" in err.msg.message
    r2 = _relay()
    r2.on_rank_message(b"r4", _register(), b"reg", 11, 0.0)
    (err,) = _of(ReplyRank, r2.poll(LIVE + 0.1))
    assert f"no answer from {ENTRY.owner_address}" in err.msg.message
    assert "nothing listens" not in err.msg.message


# ------------------------------------------------------------------------------ the order


def test_an_engine_failure_reaches_the_table_only_after_the_peer_links_settled():
    """Item 1's order: an engine call's failure waits for the links' news (``settle``: the
    listener's monitor events, the silence), so that a link lost first fails the update with
    its cause, and the engine's consequential error (the lost node's ranks freed the memory
    it reads) finds the update already failed."""
    import asyncio
    from types import SimpleNamespace

    from slotsync.daemon.core.actions import EngineCall
    from slotsync.daemon.engine_http import EngineError
    from slotsync.daemon.logs import RateLimiter
    from slotsync.daemon.service.executor import ActionExecutor
    from slotsync.daemon.service.mid_update_record import MidUpdateRecord

    order: list[str] = []

    class Table:
        def coordinator(self, slot):
            return SimpleNamespace(engine_url="http://engine:8000", engine=None)

        def on_connection_lost(self, url, now):
            return []

        def on_engine_result(self, slot, call_id, ok, result, error, now):
            order.append(f"table: ok={ok}")
            return []

        def mid_update_engines(self):
            return []

    class Families:
        def client_for(self, engine, url):
            return url, lambda *a: SimpleNamespace(connection_errors=0)

        async def call(self, client, route, body, engine):
            raise EngineError(route, 500, "No such file or directory: '/dev/shm/slotsync-1-r4'")

    async def settle() -> None:
        order.append("settle")

    async def main() -> None:
        ex = ActionExecutor(Table(), MidUpdateRecord(None), SimpleNamespace(
            observe_request=lambda *a: None), lambda *a: asyncio.sleep(0),
            RateLimiter(1, 1.0), 1.0, lambda: None, time.monotonic, Families())
        ex.settle = settle
        await ex.execute([EngineCall(1, 0, "update_weights", {}, (0, 8))])
        await asyncio.gather(*ex.tasks)

    asyncio.run(main())
    assert order == ["settle", "table: ok=False"]


def test_a_handshake_with_something_that_is_not_curve_is_not_called_a_key_mismatch():
    text = link_monitor.handshake_failed("node0", "protocol",
                                         zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, "k")
    assert "does not speak CURVE" in text and "key mismatch" not in text
    text = link_monitor.handshake_failed("node0", "protocol",
                                         zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, "/p/node0.key")
    assert "(zmtp cryptographic): likely a key mismatch: /p/node0.key" in text

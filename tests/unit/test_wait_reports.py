"""A publisher whose own ``timeout_s`` expired asks the daemon what it is waiting for, and its
``SlotsyncTimeout`` says so, instead of "is slotsyncd still running?" when the daemon runs and
waits for another rank of the slot (issue 24, Why 4: a fresh-user trial's 20 s timeout_s
under the daemon's longer begin deadline)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from test_coordinator import Harness, chunk, ident
from test_publisher import (  # noqa: F401 -- the fixtures
    NEXT_ID,
    FakeDaemon,
    _publisher,
    _tensors,
    endpoint,
    happy,
    make_daemon,
)

from slotsync.daemon.core.coordinator import Timeouts
from slotsync.protocol import wire
from slotsync.protocol.errors import SlotsyncTimeout
from slotsync.protocol.wire import Begin, Error, Query, Waiting


def _ask(h: Harness, rank: int, update_id: int | None) -> Waiting:
    (reply,) = h.table.on_message(ident(rank), Query(update_id), h.now)
    assert isinstance(reply.msg, Waiting), reply
    return reply.msg


def test_the_daemon_names_the_ranks_whose_begin_it_waits_for_and_its_deadline():
    h = Harness(size=4, timeouts=Timeouts(60, 10, 10))
    h.register_all()
    h.now = 1.0
    h.send(0, Begin(0, "v5"))
    h.send(1, Begin(0, "v5"))
    h.now = 20.0
    w = _ask(h, 0, 0)
    assert w.text == ("slotsyncd is waiting for the begin of rank(s) 2, 3 of slot [0, 4) "
                      "(update 0); its begin deadline (begin_timeout_s) is 60 s, 41 s left")
    assert (w.phase, w.missing_ranks, w.deadline_s, w.left_s) == ("begin", [2, 3], 60.0, 41.0)
    # nothing changed: the update still waits, no engine call went out for the query
    assert h.coord.current is not None and h.coord.current.update_id == 0


def test_the_daemon_names_a_chunk_wait_an_unknown_update_and_no_update():
    h = Harness(timeouts=Timeouts(10, 30, 10))
    h.register_all()
    h.begin(0)
    h.send(0, chunk(0, 0, 0))
    w = _ask(h, 0, 0)
    assert w.text.startswith("slotsyncd is waiting for the chunk 0 of rank(s) 1 of slot [0, 2) "
                             "(update 0); its chunk deadline (chunk_timeout_s) is 30 s"), w.text
    assert "update 0, not update 3" in _ask(h, 0, 3).text
    h.now = 100.0
    h.run(h.coord.poll(h.now))  # the chunk deadline fails the update
    w = _ask(h, 1, 0)
    assert w.update_id is None and "no update in flight for slot [0, 2)" in w.text, w.text
    assert "its last update failed" in w.text and "rank(s) [1]" in w.text, w.text
    w = _ask(h, 7, None)  # (a connection that never registered)
    assert "does not know this connection" in w.text, w.text


def _waits_for_rank_2(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
    """A daemon that never acknowledges the begin: another rank of the slot never began."""
    if isinstance(msg, Query):
        return [Waiting(msg.update_id, "slotsyncd is waiting for the begin of rank(s) 2, 3 of "
                        "slot [0, 4) (update 7); its begin deadline (begin_timeout_s) is 60 s, "
                        "58 s left", "begin", [2, 3], 60.0, 58.0)]
    return [] if isinstance(msg, wire.Chunk | wire.Commit) else happy(msg)


def test_a_publisher_timeout_names_what_the_daemon_waits_for(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:  # noqa: F811
    daemon = make_daemon(_waits_for_rank_2)
    with _publisher(endpoint, timeout_s=0.5) as pub, pytest.raises(SlotsyncTimeout) as ei:
        pub.publish(_tensors(), "v1")
    text = str(ei.value)
    assert "slotsyncd is waiting for the begin of rank(s) 2, 3 of slot [0, 4)" in text, text
    assert "begin deadline (begin_timeout_s) is 60 s" in text, text
    assert "still running" not in text, text
    assert ei.value.daemon_says.startswith("slotsyncd is waiting")
    assert [q.update_id for q in daemon.of_type(Query)] == [NEXT_ID]


def test_a_daemon_that_does_not_answer_the_question_is_asked_whether_it_runs(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:  # noqa: F811
    def older_daemon(msg: wire.ToDaemon) -> list[wire.FromDaemon]:  # (refuses Query)
        if isinstance(msg, Query):
            return [Error("decode", "bad message: Invalid value 'query'", fatal=False)]
        return [] if isinstance(msg, wire.Chunk | wire.Commit) else happy(msg)

    make_daemon(older_daemon)
    with _publisher(endpoint, timeout_s=0.5) as pub, pytest.raises(SlotsyncTimeout) as ei:
        pub.publish(_tensors(), "v1")
    assert "is slotsyncd still running?" in str(ei.value) and not ei.value.daemon_says


def test_registration_warns_when_timeout_s_is_shorter_than_the_daemons_deadlines(
        make_daemon: Callable[..., FakeDaemon], endpoint: str,  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    def deadlines(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Register):
            return [wire.Registered(msg.rank, msg.slot_start, msg.slot_size, NEXT_ID,
                                    begin_deadline_s=60.0, chunk_deadline_s=10.0)]
        return happy(msg)

    make_daemon(deadlines)
    with caplog.at_level(logging.WARNING, "slotsync.protocol.rank.publisher"), \
            _publisher(endpoint, timeout_s=20.0) as pub:
        pub.register()
    assert ("rank 1: timeout_s=20 s is shorter than slotsyncd's begin deadline (60 s)"
            in caplog.text), caplog.text
    assert "chunk deadline" not in caplog.text


def test_the_daemon_tells_its_deadlines_at_registration():
    h = Harness(timeouts=Timeouts(60, 30, 10))
    h.register_all()
    reg = h.last(0)
    assert (reg.begin_deadline_s, reg.chunk_deadline_s) == (60.0, 30.0)

"""The publisher's update state machine (``protocol/rank/session.py``), without sockets or a GPU:
messages in, decisions out."""

from __future__ import annotations

import pytest

from slotsync.protocol import wire
from slotsync.protocol.chunking import MessageBound, cut, cuts_before
from slotsync.protocol.errors import SlotsyncError
from slotsync.protocol.rank import session as ps
from slotsync.protocol.topology import EngineSlot

NEXT = 7


def _registered(rank: int = 1, start: int = 0, size: int = 2) -> wire.Registered:
    return wire.Registered(protocol_version=wire.PROTOCOL_VERSION, rank=rank, slot_start=start,
                           slot_size=size, next_update_id=NEXT)


def _session() -> ps.PublisherSession:
    s = ps.PublisherSession(1, EngineSlot(0, 2))
    s.registration(_registered())
    return s


def _chunk(s: ps.PublisherSession, n: int = 4) -> ps.SentChunk:
    index = s.add_chunk(n)
    c = ps.SentChunk(index, [f"t{index}"], ["float32"], [[1]], [n], [])
    s.chunk_message(c)
    s.chunk_sent(c)
    return c


def _ack(phase: str, uid: int = NEXT, index: int = -1) -> wire.Ack:
    return wire.Ack(update_id=uid, phase=phase, index=index)  # type: ignore[arg-type]


def test_update_ids_come_from_registration_and_grow_per_update() -> None:
    s = _session()
    assert s.begin("v").update_id == NEXT
    with pytest.raises(RuntimeError, match="still open"):
        s.begin("v2")
    s.end()  # failed or not: the next update takes the next id (I7)
    assert s.begin("v2").update_id == NEXT + 1


def test_registration_for_another_rank_or_protocol_is_refused() -> None:
    s = ps.PublisherSession(1, EngineSlot(0, 2))
    with pytest.raises(SlotsyncError, match="but this is rank 1"):
        s.registration(_registered(rank=0))
    bad = wire.Registered(protocol_version=wire.PROTOCOL_VERSION + 1, rank=1, slot_start=0,
                          slot_size=2, next_update_id=0)
    with pytest.raises(SlotsyncError, match="protocol version"):
        s.registration(bad)
    assert s.registered is None


def test_acks_are_taken_in_order_and_an_early_ack_is_kept() -> None:
    s = _session()
    s.begin("v")
    for _ in range(3):
        _chunk(s)
    # chunk 1's ack comes first: kept, but chunk 0's must be awaited before it is taken
    assert s.receive(_ack("chunk", index=1)) is ps.Outcome.KEPT
    assert s.take_acked(0) == ([], 0)
    s.chunk_acked(0)
    assert s.take_acked(0) == ([0, 1], 2)
    assert s.take_acked(1) == ([], None)  # one unacked is allowed


def test_an_awaited_ack_matches_and_others_are_stale() -> None:
    s = _session()
    s.begin("v")
    _chunk(s)
    awaited = ps.Awaited("chunk", NEXT, 0)
    assert s.receive(_ack("chunk", index=0), awaited) is ps.Outcome.MATCH
    assert s.receive(_ack("chunk", uid=NEXT - 1, index=0)) is ps.Outcome.STALE
    assert s.receive(_ack("chunk", index=5)) is ps.Outcome.STALE  # never sent
    assert awaited.describe() == f"Ack(chunk, index=0) for update {NEXT}"


def test_the_begins_ack_read_early_is_kept() -> None:
    s = _session()
    s.begin("v")
    assert s.begin_due()
    assert s.receive(_ack("begin")) is ps.Outcome.KEPT and s.begin_acked
    s.begin_settled()
    assert not s.begin_due()
    assert s.receive(_ack("begin")) is ps.Outcome.STALE


def test_an_error_for_another_update_is_ignored_and_ours_fails_the_update() -> None:
    s = _session()
    s.begin("v")
    other = wire.Error(phase="chunk", message="old", update_id=NEXT - 1)
    assert s.receive(other) is ps.Outcome.STALE
    assert s.error_action(other) is ps.ErrorAction.NONE
    ours = wire.Error(phase="chunk", message="engine down", update_id=NEXT)
    assert s.receive(ours) is ps.Outcome.ERROR
    assert s.error_action(ours) is ps.ErrorAction.END
    refused = wire.Error(phase="protocol", message="cannot decode")  # no update id
    assert s.error_action(refused) is ps.ErrorAction.ABORT


def test_a_refused_begin_is_sent_again_with_the_chunks_sent_before_its_ack() -> None:
    s = _session()
    s.begin("v")
    c = _chunk(s)
    gone = wire.Error(phase="register", message="not registered", update_id=NEXT,
                      code=wire.NOT_REGISTERED)
    assert s.receive(gone) is ps.Outcome.REFUSED and s.begin_refused is gone
    assert s.error_action(gone) is ps.ErrorAction.KEEP
    s.update_id = None  # (the publisher registers again)
    s.registration(wire.Registered(protocol_version=wire.PROTOCOL_VERSION, rank=1,
                                   slot_start=0, slot_size=2, next_update_id=40))
    begin, chunks = s.rebegin()
    assert begin.update_id == 40 and begin.weight_version == "v"
    assert [(m.update_id, m.index, m.names) for m in chunks] == [(40, c.index, c.names)]
    # the resent begin's ack is kept; a second refusal ends the update
    assert s.receive(_ack("begin", uid=40)) is ps.Outcome.KEPT
    again = wire.Error(phase="register", message="not registered", update_id=40,
                       code=wire.NOT_REGISTERED)
    assert s.receive(again) is ps.Outcome.ERROR
    assert s.error_action(again) is ps.ErrorAction.END


def test_end_reports_the_acks_read_but_not_taken_and_forgets_the_update() -> None:
    s = _session()
    s.begin("v")
    _chunk(s)
    _chunk(s)
    s.receive(_ack("chunk", index=1))
    assert s.end() == {1}  # (its exports were mapped: not given back)
    assert s.update_id is None and not s.unacked
    with pytest.raises(RuntimeError, match="no update is open"):
        s.commit()


def test_a_region_is_reused_only_after_its_previous_chunks_ack() -> None:
    assert [ps.region_of(k, 3) for k in range(5)] == [0, 1, 2, 0, 1]
    # before chunk k's copy into region k % n, chunk k - n must be acknowledged: at most
    # n - 1 unacked
    assert ps.unacked_before_copy(max_unacked=3, regions=4) == 3
    assert ps.unacked_before_copy(max_unacked=3, regions=2) == 1
    assert ps.unacked_before_copy(max_unacked=3, regions=1) == 0


def test_commit_counts_the_chunks() -> None:
    s = _session()
    s.begin("v")
    _chunk(s, 10)
    _chunk(s, 6)
    assert s.commit() == wire.Commit(update_id=NEXT, num_chunks=2) and s.bytes == 16


def test_the_one_chunking_rule() -> None:
    assert not cuts_before(0, 100, False, 10)  # an empty chunk takes any tensor
    assert cuts_before(6, 5, True, 10) and not cuts_before(5, 5, True, 10)
    assert list(cut([4, 4, 4, 20, 1], lambda n: n, 10)) == [[4, 4], [4], [20], [1]]


def test_message_bound_names_the_chunk_over_the_cap() -> None:
    bound = MessageBound("shm", packed=False)
    items = [(f"t{i}", 2, 4) for i in range(100)]
    bound.check(items, limit=1000, cap=10**6)
    with pytest.raises(ValueError, match="chunk 0 of this update"):
        bound.check(items, limit=1000, cap=2000)


def test_draft_chunks_come_after_every_main_chunk() -> None:
    """Issue 18: the draft part is declared at the begin, follows at least one main chunk,
    and no main chunk follows it; each chunk's message carries its part; a re-sent begin keeps
    the declaration."""
    s = _session()
    begin = s.begin("v", draft=True)
    assert begin.draft is True
    with pytest.raises(ValueError, match="needs at least one main chunk"):
        s.next_chunk_part(True)
    s.next_chunk_part(False)
    c0 = _chunk(s)
    s.next_chunk_part(True)
    c1 = ps.SentChunk(s.add_chunk(4), ["d"], ["float32"], [[1]], [4], [],
                      s.chunk_is_draft(1))
    assert [s.chunk_is_draft(c.index) for c in (c0, c1)] == [False, True]
    assert s.chunk_message(c1).draft is True and s.chunk_message(c0).draft is False
    s.next_chunk_part(True)  # (more draft chunks)
    with pytest.raises(ValueError, match="a main chunk after the draft part began"):
        s.next_chunk_part(False)
    s.update_id = None
    s.registration(_registered())
    assert s.rebegin()[0].draft is True
    s.end()
    s.begin("w")
    with pytest.raises(ValueError, match="declared no draft part"):
        s.next_chunk_part(True)


def test_an_adapter_round_takes_the_shared_update_id_and_an_error_ends_it() -> None:
    # (issue 36: base-weight and adapter rounds share one id sequence on a slot)
    s = _session()
    assert s.adapter_round() == NEXT and s.update_id == NEXT
    with pytest.raises(RuntimeError, match="still open"):
        s.begin("v")
    with pytest.raises(RuntimeError, match="still open"):
        s.adapter_round()
    begin_ack = ps.Awaited("adapter_begin", NEXT)
    assert s.receive(_ack("adapter_begin"), begin_ack) is ps.Outcome.MATCH
    assert s.receive(_ack("adapter_data"), begin_ack) is ps.Outcome.STALE
    assert begin_ack.describe() == f"Ack(adapter_begin) for update {NEXT}"
    # a daemon that forgot us (restarted) ends the round: nothing of it goes out again
    gone = wire.Error("register", "not registered", update_id=NEXT, code=wire.NOT_REGISTERED)
    assert s.receive(gone, ps.Awaited("adapter_begin", NEXT)) is ps.Outcome.ERROR
    assert s.error_action(gone) is ps.ErrorAction.END
    s.end()
    assert s.begin("v").update_id == NEXT + 1  # (the next round, base or adapter)

"""The pure parts the coordinator wires together (issue 16): the chunk window
(``daemon/core/chunk_window.py``), the begin driver (``update.begin_step``) and the engine check
after a failed update (``recovery.engine_check``), each without a coordinator."""

from __future__ import annotations

import pytest

from slotsync.daemon.core import chunk_window, recovery
from slotsync.daemon.core.aggregation import ChunkMismatch
from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.registration import RankInfo
from slotsync.daemon.core.update import BEGIN_STAGES, Update, begin_step
from slotsync.daemon.vllm import family as vllm_family
from slotsync.daemon.vllm.family import VLLM
from slotsync.protocol.wire import Chunk, ShmHandle

FACTS = chunk_window.MergeFacts({0: "GPU-0", 1: "GPU-1"}, True, "shm", 2, VLLM)


def one_chunk(index: int, rank: int) -> Chunk:
    """A packed chunk of one float32 tensor ``w`` of 4 elements (16 bytes)."""
    return Chunk(7, index, ["w"], ["float32"], [[4]], [16], [ShmHandle(f"s{rank}", 0, 16)])


def begun(*ranks: int) -> Update:
    return Update(7, "v1", 0.0, set(ranks), 0.0)


def test_receive_merges_only_once_every_rank_sent_the_chunk(monkeypatch):
    seen: list[int] = []
    monkeypatch.setattr(vllm_family, "merge_chunk",
                        lambda idx, got, *a, **k: seen.append(idx) or f"merged {idx}")
    u = begun(0, 1)
    assert chunk_window.receive(u, 0, one_chunk(0, 0), 1.0, 2, FACTS) == ""
    assert seen == [] and u.sent_count == {0: 1} and u.first_arrival == {0: 1.0}
    assert chunk_window.receive(u, 1, one_chunk(0, 1), 2.0, 2, FACTS) == ""
    assert seen == [0] and u.merged == {0: "merged 0"} and u.last_progress == 2.0


def test_receive_refuses_a_chunk_out_of_order():
    u = begun(0)
    assert chunk_window.receive(u, 0, one_chunk(1, 0), 1.0, 2, FACTS) == (
        "rank 0 sent chunk 1, expected chunk 0")
    assert chunk_window.receive(u, 1, one_chunk(0, 1), 1.0, 2, FACTS) == (
        "rank 1 sent chunk 0 before its begin")
    assert u.pending == {}


def test_a_mismatch_is_kept_until_its_turn():
    got = {0: one_chunk(0, 0), 1: Chunk(7, 0, ["x"], ["float32"], [[4]], [16],
                                        [ShmHandle("s1", 0, 16)])}
    assert isinstance(chunk_window.merge(0, got, FACTS), ChunkMismatch)


@pytest.mark.parametrize("limit", [1, 3])
def test_to_send_hands_out_merged_chunks_in_index_order_up_to_the_window(limit):
    u = begun(0, 1)
    u.merged = {0: "m0", 1: "m1", 3: "m3"}  # 2 not complete yet
    ready, mismatch = chunk_window.to_send(u, 0, limit)
    assert mismatch is None
    assert ready == [(0, "m0"), (1, "m1")][:limit]
    assert u.next_send == len(ready) and 3 in u.merged
    assert chunk_window.to_send(u, limit, limit) == ([], None)  # the window is full


def test_a_mismatch_fails_only_once_no_chunk_is_left_at_the_engine():
    u = begun(0, 1)
    bad = ChunkMismatch("ranks differ")
    u.merged = {0: "m0", 1: bad}
    assert chunk_window.to_send(u, 0, 3) == ([(0, "m0")], None)
    assert chunk_window.to_send(u, 1, 3) == ([], None)  # chunk 0 still at the engine
    assert chunk_window.to_send(u, 0, 3) == ([], bad)


def test_acks_follow_index_order():
    u = begun(0, 1)
    for k in range(3):
        u.pending[k] = {0: one_chunk(k, 0), 1: one_chunk(k, 1)}
    assert chunk_window.returned(u, 1) == []  # chunk 0 is still at the engine
    assert chunk_window.returned(u, 0) == [0, 1]
    assert chunk_window.returned(u, 2) == [2]
    assert u.next_index == 3 and u.consumed_bytes == 48 and u.names == {"w"}


def test_commit_rules():
    u = begun(0, 1)
    u.sent_count = {0: 2, 1: 2}
    assert chunk_window.commit(u, 0, 1, 2, 1.0) == chunk_window.CommitRefusal(
        "rank 0 committed 1 chunks but sent 2", missing=(0,))
    assert chunk_window.commit(u, 0, 2, 2, 1.0) is None
    assert chunk_window.commit(u, 0, 2, 2, 1.0) == chunk_window.CommitRefusal(
        "rank 0 committed twice", fails=False)
    assert chunk_window.commit(u, 1, 2, 2, 2.0) is None and u.last_progress == 2.0
    empty = begun(0, 1)
    assert chunk_window.commit(empty, 0, 0, 2, 1.0) is None
    refused = chunk_window.commit(empty, 1, 0, 2, 1.0)
    assert refused is not None and "has no chunks" in refused.text and refused.fails


def ranks(n: int) -> dict[int, RankInfo]:
    return {r: RankInfo(r, b"id", f"GPU-{r}", "host", 1) for r in range(n)}


def test_begin_step_runs_the_stages_in_order_and_waits_for_every_rank_and_a_chunk():
    engine, u = EngineSession(), begun(0)
    assert begin_step(u, engine, ranks(1), 2, False, "url").stage is None  # registering
    assert begin_step(u, engine, ranks(2), 2, True, "url").stage is None  # a call out
    # the vLLM version first (not known yet), then the probe
    assert begin_step(u, engine, ranks(2), 2, False, "url").stage is BEGIN_STAGES[0]
    assert BEGIN_STAGES[0].name == "version"
    assert begin_step(u, engine, ranks(2), 2, False, "url").stage.name == "probe"
    assert begin_step(u, engine, ranks(2), 2, False, "url").stage.name == "init"
    engine.initialized = True
    step = begin_step(u, engine, ranks(2), 2, False, "url")
    assert (step.stage, step.check, step.fail) == (None, False, "")  # rank 1 has not begun
    u.begun.add(1)
    assert begin_step(u, engine, ranks(2), 2, False, "url").stage is None  # no chunk yet
    u.sent_count[0] = 1
    assert begin_step(u, engine, ranks(2), 2, False, "url").stage.name == "pause"
    assert begin_step(u, engine, ranks(2), 2, False, "url").stage.name == "start"  # no recover
    assert begin_step(u, engine, ranks(2), 2, False, "url").stage is None  # start in flight


def test_begin_step_checks_replies_and_fails_out_of_step():
    engine, u = EngineSession(), begun(0, 1)
    u.stage = [st.name for st in BEGIN_STAGES].index("init")  # after the probe
    engine.replies_suspect = True
    assert begin_step(u, engine, ranks(2), 2, False, "url").check
    engine.out_of_step = "out of step"
    assert begin_step(u, engine, ranks(2), 2, False, "url").fail == "out of step"


def test_engine_check_resumes_a_paused_engine_and_reports_what_it_did():
    engine = EngineSession()
    step = recovery.engine_check(engine, "is_paused", True, {"is_paused": True}, "", (0, 2),
                                 "url", 3)
    assert step.then == "resume" and not step.advance
    step = recovery.engine_check(engine, "resume", True, {}, "", (0, 2), "url", 3)
    assert [e.event for e in step.events] == ["engine_resumed_after_failure"] and step.advance
    assert engine.paused is False
    step = recovery.engine_check(engine, "is_paused", False, None, "HTTP 500", (0, 2), "url", 3)
    assert [e.event for e in step.events] == ["engine_state_unknown"] and not step.advance
    assert engine.paused is True and "may still be paused" in step.note
    step = recovery.engine_check(engine, "is_paused", True, {"is_paused": False}, "", (0, 2),
                                 "url", 3)
    assert step.advance and not step.events and engine.paused is False

"""Rank-local payloads (issue 18 A, daemon/core/rank_local.py): the list-form ``update_info`` the
coordinator builds, one entry per engine worker, and each refusal before the pause.

Driven through the same scripted engine and harness as test_coordinator.py (no sockets, no
clock)."""

from __future__ import annotations

import base64
import json
import pickle

import msgspec
import pytest
from test_coordinator import URL, Harness

from slotsync.daemon.core.rank_local import (
    chunk_refusal,
    shared_refusal,
    table_refusal,
)
from slotsync.daemon.vllm.ipc_pickle import pickle_unpacked
from slotsync.daemon.vllm.merge import merge_rank_local
from slotsync.protocol import wire
from slotsync.protocol.rank.inputs import rank_local_args as _rank_local_args
from slotsync.protocol.topology import EngineSlot
from slotsync.protocol.wire import Ack, Begin, Chunk, Commit, Error, ShmHandle, logical_gpu_uuid

SIZE = 4
UUIDS = tuple(logical_gpu_uuid(i) for i in range(SIZE))


def experts(rank: int, n: int = 2) -> list[str]:
    return [f"model.layers.0.mlp.experts.{rank * n + j}.w" for j in range(n)]


def tensors_of(rank: int) -> list[str]:
    """Rank ``rank``'s tensors in send order: a shared one, then its experts."""
    return ["model.embed.weight", *experts(rank)]


def lbegin(uid: int, rank: int, names: list[str], worker: int | None = None,
           dtype: str = "float32", shape: tuple[int, ...] = (2, 2)) -> Begin:
    shapes = [list(shape) for _ in names]
    return Begin(uid, "v1", rank_local=True, worker_rank=rank if worker is None else worker,
                 names=names, dtype_names=[dtype] * len(names), shapes=shapes)


def lchunk(uid: int, index: int, rank: int, names: list[str], packed: bool = True) -> Chunk:
    sizes = [16] * len(names)
    if packed:
        handles = [ShmHandle(f"seg-{rank}-{index}", 0, sum(sizes))]
    else:
        handles = [ShmHandle(f"seg-{rank}-{index}", 64 * i, 16) for i in range(len(names))]
    return Chunk(uid, index, names, ["float32"] * len(names), [[2, 2]] * len(names), sizes,
                 handles)


def harness(table: tuple[str, ...] | None = UUIDS, packed: bool = True) -> Harness:
    h = Harness(size=SIZE, packed=packed)
    h.table.set_engine_table({(0, SIZE): URL}, {(0, SIZE): table} if table else None)
    h.register_all()
    return h


def update_infos(h: Harness) -> list:
    return [json.loads(bytes(b["update_info"])) for r, b in zip(h.engine.calls, h.engine.bodies,
                                                                 strict=True)
            if r == "update_weights"]


def uuid_in(entry: dict) -> list[str]:
    """The GPU UUIDs an entry's pickled handles name (the test reads the pickle's bytes; the
    unpacked empty list it loads, a plain ``[]``)."""
    raw = base64.b64decode(entry["ipc_handles_pickled"])
    return [u for u in UUIDS if u.encode() in raw]


@pytest.mark.parametrize("packed", [True, False])
def test_rank_local_round_sends_one_entry_per_worker_and_empty_entries_for_short_ranks(packed):
    """Each rank its own experts plus the shared tensor; rank 3 sends a second chunk, the
    others commit after one: chunk 1's entries of workers 0-2 are empty (packed: naming the
    rank's last buffer, ``tensor_sizes`` []; unpacked: ``ipc_handles`` []). Acks go to the
    ranks that sent the chunk; one start, one finish."""
    h = harness(packed=packed)
    for r in range(SIZE):
        names = tensors_of(r) + (["model.layers.0.mlp.experts.99.w"] if r == 3 else [])
        h.send(r, lbegin(0, r, names))
    for r in range(SIZE):
        h.send(r, lchunk(0, 0, r, tensors_of(r), packed))
    h.send(3, lchunk(0, 1, 3, ["model.layers.0.mlp.experts.99.w"], packed))
    for r in range(SIZE):
        h.send(r, Commit(0, 2 if r == 3 else 1))
    assert h.engine.calls.count("start_weight_update") == 1
    assert h.engine.calls.count("finish_weight_update") == 1
    first, second = update_infos(h)
    assert [e["names"] for e in first] == [tensors_of(w) for w in range(SIZE)]
    assert [uuid_in(e) for e in first] == [[u] for u in UUIDS]
    assert [e["names"] for e in second] == [[], [], [], ["model.layers.0.mlp.experts.99.w"]]
    for w in range(3):
        e = second[w]
        assert e["dtype_names"] == [] and e["shapes"] == []
        if packed:
            assert e["tensor_sizes"] == [] and uuid_in(e) == [UUIDS[w]]
        else:
            assert pickle.loads(base64.b64decode(e["ipc_handles_pickled"])) == []
    for r in range(SIZE):
        acks = [(m.phase, m.index) for m in h.replies[r] if isinstance(m, Ack)]
        chunks = [("chunk", 0), ("chunk", 1)] if r == 3 else [("chunk", 0)]
        assert acks == [("begin", -1), *chunks, ("commit", -1)]
    assert h.coord.last_version == "v1"
    assert h.coord.engine.last_ok_names == {n for r in range(SIZE) for n in tensors_of(r)} | {
        "model.layers.0.mlp.experts.99.w"}


def _refused(h: Harness, begins: list[Begin], *, first_chunk: bool = True) -> str:
    for r, b in enumerate(begins):
        h.send(r, b)
    if first_chunk and not any(isinstance(m, Error) for m in h.replies.get(0, [])):
        h.send(0, lchunk(0, 0, 0, list(begins[0].names or ["a"])))
    assert "pause" not in h.engine.calls and "start_weight_update" not in h.engine.calls
    errors = [m for m in h.replies[0] if isinstance(m, Error)]
    assert errors, h.replies[0]
    return errors[-1].message


def test_ranks_disagreeing_on_the_mode_are_refused_naming_them():
    h = harness()
    begins = [lbegin(0, r, tensors_of(r)) for r in range(3)] + [Begin(0, "v1")]
    msg = _refused(h, begins, first_chunk=False)
    assert "rank(s) [0, 1, 2] begin in rank-local mode, rank(s) [3] do not" in msg


def test_shared_tensor_that_disagrees_is_refused_before_the_pause():
    h = harness()
    begins = [lbegin(0, r, tensors_of(r)) for r in range(3)]
    begins.append(lbegin(0, 3, tensors_of(3), shape=(4, 2)))
    msg = _refused(h, begins)
    assert "shared tensor 'model.embed.weight'" in msg
    assert "rank 0 declares float32 [2, 2], rank 3 float32 [4, 2]" in msg


def test_rank_local_without_an_engine_table_is_refused_naming_the_url_and_the_setting():
    msg = _refused(harness(table=None), [lbegin(0, r, tensors_of(r)) for r in range(SIZE)])
    assert URL in msg and "engines[].gpu_uuids" in msg


def test_misordered_worker_table_is_refused_naming_the_worker_and_both_uuids():
    table = (UUIDS[1], UUIDS[0], UUIDS[2], UUIDS[3])
    msg = _refused(harness(table), [lbegin(0, r, tensors_of(r)) for r in range(SIZE)])
    assert "misordered worker table: rank 0 publishes for worker 0" in msg
    assert UUIDS[1] in msg and UUIDS[0] in msg


def test_rank_whose_uuid_is_not_in_the_table_is_refused_naming_it():
    stranger = logical_gpu_uuid(77)
    msg = _refused(harness((*UUIDS[:3], stranger)),
                   [lbegin(0, r, tensors_of(r)) for r in range(SIZE)])
    assert f"rank 3's GPU UUID {UUIDS[3]} is not in engine {URL}" in msg


def test_worker_without_an_entry_is_refused_naming_it():
    begins = [lbegin(0, r, tensors_of(r), worker=min(r, 2)) for r in range(SIZE)]
    msg = _refused(harness(), begins)
    assert "worker(s) [3]" in msg and "ranks [2, 3] all publish for worker 2" in msg


def test_chunk_other_than_the_declared_tensors_fails_the_update():
    h = harness()
    for r in range(SIZE):
        h.send(r, lbegin(0, r, tensors_of(r)))
    h.send(1, lchunk(0, 0, 1, ["model.embed.weight", "undeclared"]))
    err = [m for m in h.replies[1] if isinstance(m, Error)][-1]
    assert "tensor 'undeclared'" in err.message and "declared at #1" in err.message


def test_commit_before_every_declared_tensor_was_sent_fails():
    h = harness()
    for r in range(SIZE):
        h.send(r, lbegin(0, r, tensors_of(r)))
    h.send(0, lchunk(0, 0, 0, ["model.embed.weight"]))
    h.send(0, Commit(0, 1))
    err = [m for m in h.replies[0] if isinstance(m, Error)][-1]
    assert "after sending 1 of the 3 tensors its begin declared" in err.message


def test_table_refusal_rules():
    own = {r: UUIDS[r] for r in range(SIZE)}
    workers = {r: r for r in range(SIZE)}
    assert table_refusal(own, workers, UUIDS, None, SIZE, URL) == ""
    assert "lists 4 GPU UUIDs but the engine has 8 workers" in table_refusal(
        own, workers, UUIDS, None, 8, URL)
    assert "reports its workers' GPU UUIDs" in table_refusal(
        own, workers, UUIDS, UUIDS[::-1], SIZE, URL)
    assert "publishes for worker 9" in table_refusal(own, {**workers, 3: 9}, UUIDS, None,
                                                     SIZE, URL)


def test_shared_and_chunk_checks():
    assert shared_refusal({0: (["a", "b"], ["bfloat16"] * 2, [[1], [2]]),
                           1: (["a", "c"], ["bfloat16"] * 2, [[1], [9]])}) == ""
    assert "'a'" in shared_refusal({0: (["a"], ["bfloat16"], [[1]]),
                                    1: (["a"], ["float32"], [[1]])})
    decl = (["a", "b"], ["float32"] * 2, [[2, 2]] * 2)
    assert chunk_refusal(decl, 1, 0, lchunk(0, 1, 0, ["b"])) == ""
    assert "past the 2" in chunk_refusal(decl, 1, 0, lchunk(0, 1, 0, ["b", "c"]))


def test_merge_names_a_worker_without_a_rank():
    c = lchunk(0, 0, 0, ["a"])
    with pytest.raises(ValueError, match=r"no entry for engine worker\(s\) \[1\]"):
        merge_rank_local(0, {0: c}, {0: 0}, {0: UUIDS[0]}, {}, packed=True, transport="shm",
                         world_size=2)
    with pytest.raises(ValueError, match="sent no chunk whose buffer"):
        merge_rank_local(0, {0: c}, {0: 0, 1: 1}, {0: UUIDS[0], 1: UUIDS[1]}, {},
                         packed=True, transport="shm", world_size=2)


def test_begin_wire_fields_omitted_outside_rank_local_mode_and_checked_inside():
    assert msgspec.msgpack.encode(Begin(0, "v")) == msgspec.msgpack.encode(
        Begin(0, "v", manifest=b""))
    assert b"rank_local" not in msgspec.msgpack.encode(Begin(0, "v"))
    enc = msgspec.msgpack.encode(lbegin(3, 1, ["a", "b"]))
    back = wire.decode_to_daemon(enc)
    assert back.rank_local and back.worker_rank == 1 and back.names == ["a", "b"]
    bad = msgspec.msgpack.encode({"type": "begin", "update_id": 0, "weight_version": "v",
                                  "rank_local": True, "worker_rank": 0, "names": ["a"]})
    with pytest.raises(ValueError, match="dtype_names has 0 entries"):
        wire.decode_to_daemon(bad)
    with pytest.raises(ValueError, match="belong to rank-local mode"):
        Begin(0, "v", worker_rank=2)
    with pytest.raises(ValueError, match="a tensor name repeats"):
        lbegin(0, 0, ["a", "a"])
    with pytest.raises(ValueError, match="declares no tensor"):
        lbegin(0, 0, [])
    with pytest.raises(ValueError, match="its manifest must be empty"):
        Begin(0, "v", manifest=b"abcd", rank_local=True, worker_rank=0, names=["a"],
              dtype_names=["float32"], shapes=[[1]])


def test_empty_unpacked_entry_is_the_pickle_of_an_empty_list():
    assert pickle.loads(pickle_unpacked([UUIDS[0]], [[]])) == []


def test_publisher_rank_local_arguments():
    slot = EngineSlot(4, 4)
    assert _rank_local_args(6, slot, False, None) == (False, -1)
    assert _rank_local_args(6, slot, True, None) == (True, 2)
    assert _rank_local_args(6, slot, True, 0) == (True, 0)
    with pytest.raises(ValueError, match="needs rank_local=True"):
        _rank_local_args(6, slot, False, 1)
    with pytest.raises(ValueError, match=r"rank 6: worker_rank must be an int in \[0, 4\)"):
        _rank_local_args(6, slot, True, 4)


def test_a_whole_qwen3_30b_a3b_declaration_is_a_small_begin_frame():
    """The rank-local begin declares the rank's tensors in clear: even all 18,867 tensors of
    Qwen3-30B-A3B (EP8 ranks declare ~2,700) make a frame of about 1.2 MB, far below the
    daemon's 64 MiB default cap, and it decodes."""
    from slotsync.bench.ep import worker_specs
    from slotsync.bench.model import qwen3_moe_specs

    specs = qwen3_moe_specs()
    for part, limit in ((specs, 1_300_000), (worker_specs(specs, 128, 8, 0), 200_000)):
        b = Begin(0, "v", rank_local=True, worker_rank=0, names=[s.name for s in part],
                  dtype_names=[s.dtype for s in part], shapes=[list(s.shape) for s in part])
        frame = msgspec.msgpack.encode(b)
        assert len(frame) < limit < wire.MAX_MESSAGE_BYTES_DEFAULT
        assert wire.decode_to_daemon(frame).names == b.names


def test_rank_local_publisher_refuses_an_iterator_without_a_manifest_before_sending():
    """The begin must declare the rank's tensors: an iterator without ``manifest=`` is
    refused before anything is allocated or sent (no daemon is needed to see it)."""
    import torch

    from slotsync.protocol.rank.publisher import Publisher

    with Publisher("ipc:///nonexistent/slotsyncd.sock", 0, (0, 1), "http://127.0.0.1:1",
                   transport="shm", rank_local=True) as pub:
        with pytest.raises(ValueError, match="rank-local mode declares the update's tensors"):
            pub.publish(iter([("a", torch.zeros(2))]), "v")
        assert pub.update_id is None


def test_rank_local_on_a_vllm_without_list_form_is_refused_before_the_pause():
    """vLLM 0.27 and 0.28 are spoken, but take one update_info dict for every worker (the list
    form is 0.29+, vllm_versions.FEATURES): a rank-local round is refused before the pause,
    naming the version; a dict-form round on the same engine still goes."""
    h = harness()
    h.engine.vllm_version = "0.28.0"
    msg = _refused(h, [lbegin(0, r, tensors_of(r)) for r in range(SIZE)])
    assert "list-form update_info" in msg and "needs vLLM 0.29 or later" in msg, msg
    assert "0.28.0" in msg and URL in msg, msg


def test_draft_round_on_a_vllm_without_draft_sessions_is_refused():
    """update.draft_refusal names the missing feature where the version lacks draft
    sessions (0.26+); with 0.32 the draft part may go."""
    from slotsync.daemon.core.engine_session import EngineSession
    from slotsync.daemon.core.update import Update
    from slotsync.daemon.vllm.family import draft_refusal

    u = Update(0, "v1", 0.0, {0}, 0.0, draft=True)
    e = EngineSession()
    e.vllm_version = "0.25.0"
    assert "needs vLLM 0.26 or later" in draft_refusal(u, e)
    e.vllm_version = "0.32.0"
    assert draft_refusal(u, e) == ""


def test_every_rank_is_told_the_disagreement_once_all_have_begun():
    """A fresh-user trial found it: the update failed at the first begin that disagreed, so
    the ranks that began after it began the next update and were told "rank 0 is gone"
    there. Now the failure waits for every begin (the pause does anyway) and every rank gets
    the disagreement itself."""
    h = harness()
    begins = [lbegin(0, 0, tensors_of(0)), Begin(0, "v1")] + [
        lbegin(0, r, tensors_of(r)) for r in (2, 3)]
    for r, b in enumerate(begins[:3]):
        h.send(r, b)
        assert not any(isinstance(m, Error) for rr in h.replies for m in h.replies[rr]), r
    h.send(3, begins[3])
    for r in range(SIZE):
        errors = [m for m in h.replies[r] if isinstance(m, Error)]
        assert errors and "must agree on rank-local mode" in errors[-1].message, (r, errors)
        assert errors[-1].update_id == 0
    assert "pause" not in h.engine.calls

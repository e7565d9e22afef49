"""A registered rank's frame that fails validation is answered at once and fails its update
with that cause, every rank told (issue 24, daemon/core/malformed.py). Before, it was answered
with a decode error naming no rank and the slot's update went on, to fail later with an
unrelated cause or at a deadline naming ranks as missing what they did send.

Driven through the scripted engine and harness of test_coordinator.py (no sockets, no clock).
"""

from __future__ import annotations

import msgspec
import pytest
from test_coordinator import Harness, ident

from slotsync.protocol import wire
from slotsync.protocol.wire import Begin, Error, ProtocolError


def refused(frame: dict) -> ProtocolError:
    """The error ``wire.decode_to_daemon`` raises for ``frame`` (a msgpack map)."""
    with pytest.raises(ProtocolError) as e:
        wire.decode_to_daemon(msgspec.msgpack.encode(frame), cache=wire.ChunkMetaCache())
    return e.value


def empty_chunk(update_id: int) -> dict:
    return {"type": "chunk", "update_id": update_id, "index": 0, "names": [],
            "dtype_names": [], "shapes": [], "tensor_sizes": [], "handles": []}


def test_decode_errors_name_the_message_kind_the_field_and_the_update():
    e = refused(empty_chunk(7))
    assert (e.kind, e.field, e.update_id) == ("chunk", "names", 7)
    e = refused({**empty_chunk(0), "names": ["a"]})  # a rule across fields (__post_init__)
    assert (e.kind, e.field) == ("chunk", "dtype_names")
    e = refused({**empty_chunk(0), "names": ["a"], "dtype_names": ["uint8"], "shapes": [[4]],
                 "tensor_sizes": [4], "handles": [["shm", "bad name!", 0, 4]]})
    assert e.field == "handles[0].segment"
    e = refused({"type": "commit", "update_id": 1, "num_chunks": -1})
    assert (e.kind, e.field, e.update_id) == ("commit", "num_chunks", 1)
    with pytest.raises(ProtocolError) as junk:
        wire.decode_to_daemon(b"junk")
    assert (junk.value.kind, junk.value.field, junk.value.update_id) == ("", "", None)


def test_a_registered_ranks_malformed_chunk_fails_its_update_at_once_every_rank_told():
    h = Harness(size=3)
    h.register_all()
    h.engine.hold = True  # the begin's probe is still out: the engine is not paused
    for r in range(3):
        h.send(r, Begin(0, "v"))
    h.run(h.table.on_bad_message(ident(1), refused(empty_chunk(0)), h.now))
    for r in range(3):
        err = h.last(r)
        assert isinstance(err, Error) and err.phase == "chunk" and err.update_id == 0, err
        assert "rank 1 sent a chunk message the daemon cannot accept (field 'names')" in \
            err.message, err.message
    assert h.coord.current is None and h.ended[-1].outcome == "failed"
    assert "pause" not in h.engine.calls and "pause" not in [c.route for c in h.pending_calls]


def test_without_an_update_only_the_rank_is_told_and_a_stranger_gets_a_decode_error():
    h = Harness(size=2)
    h.register_all()
    h.run(h.table.on_bad_message(ident(0), refused(empty_chunk(5)), h.now))
    err = h.last(0)
    assert isinstance(err, Error) and not err.fatal and err.update_id == 5
    assert "rank 0 sent a chunk message" in err.message and "'names'" in err.message
    assert not any(isinstance(m, Error) for m in h.replies[1])
    h.run(h.table.on_bad_message(ident(9), refused(empty_chunk(0)), h.now))
    assert h.last(9).phase == "decode" and not h.last(9).fatal

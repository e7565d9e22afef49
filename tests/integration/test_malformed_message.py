"""A registered rank's malformed message against a real slotsyncd (issue 24): every rank of
the slot is told at once, naming the rank, the message kind and the field, instead of the
update going on to fail later with another cause or at a deadline."""

from __future__ import annotations

import socket

import msgspec
import zmq
from test_daemon_liveness import Rank

from slotsync.daemon.launcher import DaemonProcess
from slotsync.protocol import wire


def test_a_malformed_chunk_fails_the_update_at_once_naming_rank_kind_and_field(tmp_path):
    # an "engine" that accepts connections and never answers: the begin's probe stays out,
    # so the update is in flight, the engine never paused, when the bad chunk arrives
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    ctx = zmq.Context()
    ranks: list[Rank] = []
    try:
        with DaemonProcess(runtime_dir=str(tmp_path)) as d:
            ranks += [Rank(ctx, d.endpoint, r, size=2, url=url) for r in (0, 1)]
            assert all(isinstance(r.reply, wire.Registered) for r in ranks)
            for r in ranks:
                r.s.send(wire.encode(wire.Begin(0, "v")))
            ranks[1].s.send(msgspec.msgpack.encode({
                "type": "chunk", "update_id": 0, "index": 0, "names": [], "dtype_names": [],
                "shapes": [], "tensor_sizes": [], "handles": []}))
            for r in ranks:
                assert r.s.poll(20_000), "no reply: the malformed chunk was dropped"
                err = wire.decode_from_daemon(r.s.recv())
                assert isinstance(err, wire.Error) and err.update_id == 0, err
                assert err.phase == "chunk", err
                assert "rank 1 sent a chunk message" in err.message, err.message
                assert "(field 'names')" in err.message, err.message
    finally:
        for r in ranks:
            r.close()
        ctx.term()
        silent.close()

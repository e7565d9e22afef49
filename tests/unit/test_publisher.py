"""Publisher against a scripted fake daemon (zmq ROUTER in a thread), shm transport.

Over ~500 lines on purpose: it holds one thing, the Publisher's behaviour against the one fake
daemon they share (issue 16).
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from router_thread import RouterThread
from router_thread import read_shm as _read_shm

from slotsync.protocol import wire
from slotsync.protocol.errors import SlotsyncError, SlotsyncTimeout
from slotsync.protocol.rank.pipeline import ChunkPipeline
from slotsync.protocol.rank.publisher import Publisher, PublishStats

Script = Callable[[wire.ToDaemon], list[wire.FromDaemon]]
ENGINE = "http://127.0.0.1:8000"
NEXT_ID = 7


class FakeDaemon(RouterThread):
    """A ROUTER socket that decodes (and so validates) every message like the real daemon,
    records it, reads the shared memory a chunk points at, and answers from ``script``."""

    def __init__(self, endpoint: str, script: Script) -> None:
        self.endpoint = endpoint
        self.script = script
        self.received: list[wire.ToDaemon] = []
        self.chunk_data: list[dict[str, bytes]] = []  # per chunk: name -> bytes read
        self.packed: bool | None = None
        super().__init__(endpoint)

    def answer(self, ident: bytes, msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        self.received.append(msg)
        if isinstance(msg, wire.Register):
            self.packed = msg.packed
        if isinstance(msg, wire.Chunk):
            try:
                self.chunk_data.append(self._read_chunk(msg))
            except FileNotFoundError:
                # (a chunk sent before the update failed: the publisher has unlinked its
                # segment; tests that check the data see it missing)
                self.chunk_data.append({})
        return self.script(msg)

    def _read_chunk(self, c: wire.Chunk) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        if not all(isinstance(h, wire.ShmHandle) for h in c.handles):
            return out  # (a test's stand-in CUDA handles: nothing to read here)
        if self.packed:
            (h,) = c.handles
            assert isinstance(h, wire.ShmHandle)
            blob = _read_shm(h)
            off = 0
            for name, n in zip(c.names, c.tensor_sizes, strict=True):
                out[name] = blob[off : off + n]
                off += n
        else:
            for name, h in zip(c.names, c.handles, strict=True):
                assert isinstance(h, wire.ShmHandle)
                out[name] = _read_shm(h)
        return out

    def of_type(self, cls: type) -> list:
        return [m for m in self.received if isinstance(m, cls)]

    def until_received(self, cls: type, timeout_s: float = 10.0) -> list:
        """The messages of ``cls`` received, once there is one (polled: the thread may not
        have read what the publisher just sent) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not self.of_type(cls) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.of_type(cls)


def happy(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
    if isinstance(msg, wire.Register):
        return [wire.Registered(rank=msg.rank, slot_start=msg.slot_start,
                                slot_size=msg.slot_size, next_update_id=NEXT_ID)]
    if isinstance(msg, wire.Begin):
        return [wire.Ack(update_id=msg.update_id, phase="begin")]
    if isinstance(msg, wire.Chunk):
        return [wire.Ack(update_id=msg.update_id, phase="chunk", index=msg.index)]
    if isinstance(msg, wire.Commit):
        return [wire.Ack(update_id=msg.update_id, phase="commit")]
    return []


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    path = tmp_path / "d.sock"
    if len(str(path)) > 100:  # AF_UNIX path limit
        pytest.skip("tmp_path too long for an ipc:// endpoint")
    return f"ipc://{path}"


@pytest.fixture
def make_daemon(endpoint: str) -> Iterator[Callable[[Script], FakeDaemon]]:
    daemons: list[FakeDaemon] = []

    def make(script: Script = happy) -> FakeDaemon:
        d = FakeDaemon(endpoint, script)
        daemons.append(d)
        return d

    yield make
    for d in daemons:
        d.close()


def _publisher(endpoint: str, **kw: object) -> Publisher:
    kw.setdefault("transport", "shm")
    kw.setdefault("timeout_s", 5.0)
    return Publisher(endpoint, 1, (0, 2), ENGINE, **kw)  # type: ignore[arg-type]


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mask", torch.rand(5, 3, generator=g) > 0.5),
        ("model.layers.0.idx", torch.arange(10, dtype=torch.int64)),
        ("model.layers.0.w", torch.randn(8, 6, generator=g).t()),  # non-contiguous fp32
        ("model.norm.weight", torch.ones(8, dtype=torch.float16)),
    ]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _no_segments() -> list[str]:
    return glob.glob(f"/dev/shm/slotsync-{os.getpid()}-*")


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_happy_path(make_daemon: Callable[..., FakeDaemon], endpoint: str,
                    packed: bool, caplog: pytest.LogCaptureFixture) -> None:
    daemon = make_daemon()
    named = _tensors()
    staging = 300  # bytes: forces several chunks
    with _publisher(endpoint, packed=packed, staging_bytes=staging) as pub:
        reg = pub.register()
        assert reg.next_update_id == NEXT_ID
        with caplog.at_level(logging.DEBUG, logger="slotsync.protocol.rank.publisher"):
            stats = pub.publish(iter(named), weight_version="step-1")
        assert isinstance(stats, PublishStats)
        total = sum(len(_raw(t)) for _, t in named)
        assert stats.bytes == total and stats.seconds > 0
        # greedy cut in iteration order: 256+15 | 80+192+16 bytes, each <= staging
        chunks = daemon.of_type(wire.Chunk)
        assert [c.names for c in chunks] == [
            ["model.embed_tokens.weight", "model.layers.0.mask"],
            ["model.layers.0.idx", "model.layers.0.w", "model.norm.weight"],
        ]
        assert [c.nbytes for c in chunks] == [271, 288]
        assert stats.chunks == 2
        assert all(c.nbytes <= staging for c in chunks)
        assert [c.index for c in chunks] == [0, 1]
        assert {c.update_id for c in chunks} == {NEXT_ID}
        assert all(len(c.handles) == (1 if packed else len(c.names)) for c in chunks)
        # what the daemon read from shared memory equals the tensors' bytes
        seen = {k: v for d in daemon.chunk_data for k, v in d.items()}
        assert seen == {n: _raw(t) for n, t in named}
        assert any("chunk 1 acknowledged" in r.getMessage() for r in caplog.records)
        commit = daemon.of_type(wire.Commit)
        assert [(c.update_id, c.num_chunks) for c in commit] == [(NEXT_ID, 2)]
        if not packed:  # per-update segments are unlinked once the commit is acked
            assert _no_segments() == []
        # the next round uses the next update id
        pub.publish(named[:1], weight_version="step-2")
        assert [b.update_id for b in daemon.of_type(wire.Begin)] == [NEXT_ID, NEXT_ID + 1]
        assert [b.weight_version for b in daemon.of_type(wire.Begin)] == ["step-1", "step-2"]
    assert _no_segments() == []
    reg_msg = daemon.of_type(wire.Register)[0]
    assert reg_msg.rank == 1 and (reg_msg.slot_start, reg_msg.slot_size) == (0, 2)
    assert reg_msg.gpu_uuid == wire.logical_gpu_uuid(1)
    assert reg_msg.transport == "shm" and reg_msg.packed is packed
    assert reg_msg.protocol_version == wire.PROTOCOL_VERSION and reg_msg.pid == os.getpid()
    assert reg_msg.engine_url == ENGINE
    assert daemon.of_type(wire.Abort) == []


def test_daemon_error_on_chunk(make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Chunk) and msg.index == 1:
            return [wire.Error(phase="chunk", message="rank 0 never sent chunk 1",
                               slot=[0, 2], update_id=msg.update_id, missing_ranks=[0])]
        return happy(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint, staging_bytes=300) as pub:
        with pytest.raises(SlotsyncError) as ei:
            pub.publish(_tensors(), "v1")
        e = ei.value
        assert not isinstance(e, SlotsyncTimeout)
        assert e.phase == "chunk" and e.slot == (0, 2) and e.update_id == NEXT_ID
        assert e.missing_ranks == (0,) and e.message == "rank 0 never sent chunk 1"
        assert "missing ranks [0]" in str(e) and "slot [0, 2)" in str(e)
        assert pub.update_id is None
        # (a Commit may have gone out behind the last chunk, before the error came back: the
        # daemon answers it with "already failed", which the next update ignores as stale)
        assert all(c.update_id == NEXT_ID for c in daemon.of_type(wire.Commit))
        assert daemon.of_type(wire.Abort) == []  # the daemon already failed the update
        # the failed update's id is not reused (I7)
        pub.publish(_tensors()[:1], "v2")
        assert daemon.of_type(wire.Begin)[-1].update_id == NEXT_ID + 1
    assert _no_segments() == []


def test_no_reply_times_out(make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        return [] if isinstance(msg, wire.Chunk) else happy(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint, timeout_s=0.5) as pub:
        t0 = time.monotonic()
        with pytest.raises(SlotsyncTimeout) as ei:
            pub.publish(_tensors(), "v1")
        elapsed = time.monotonic() - t0
        assert 0.45 <= elapsed < 2.0
        e = ei.value
        assert isinstance(e, TimeoutError) and isinstance(e, SlotsyncError)
        assert e.phase == "chunk" and e.update_id == NEXT_ID and e.timeout_s == 0.5
        assert "Ack(chunk, index=0)" in str(e) and endpoint in str(e)
        assert "is slotsyncd still running?" in str(e)  # (its socket file is there)
        aborts = daemon.until_received(wire.Abort)
        assert [a.update_id for a in aborts] == [NEXT_ID]
        assert "SlotsyncTimeout" in aborts[0].reason
    assert _no_segments() == []


def test_no_daemon_register_says_so_at_once(endpoint: str) -> None:
    # (issue 15 C: before, the rank waited its whole timeout_s and then guessed)
    with _publisher(endpoint, timeout_s=60) as pub:
        t0 = time.monotonic()
        with pytest.raises(SlotsyncError, match=r"no socket at .*d\.sock: is slotsyncd running"):
            pub.register()
        assert time.monotonic() - t0 < 30  # (1 s in fact; far below timeout_s)


def test_stale_socket_of_a_killed_daemon_is_named_at_register(endpoint: str) -> None:
    import socket as _socket

    path = endpoint[len("ipc://"):]
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    s.bind(path)  # bound, never listening, then closed: the file a SIGKILLed daemon leaves
    s.close()
    with _publisher(endpoint, timeout_s=60) as pub:
        with pytest.raises(SlotsyncError, match=r"exists but nothing listens on it"):
            pub.register()


def test_daemon_that_never_answers_register_times_out(endpoint: str) -> None:
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # listens, reads nothing
    silent.bind(endpoint)
    try:
        with _publisher(endpoint, timeout_s=0.5) as pub:
            with pytest.raises(SlotsyncTimeout, match=r"no Registered from the daemon"):
                pub.register()
    finally:
        silent.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_tensor_larger_than_staging_goes_as_a_chunk_of_its_own(
        make_daemon: Callable[..., FakeDaemon], endpoint: str, packed: bool) -> None:
    """Issue 17: a tensor larger than ``staging_bytes`` is no error: it travels alone, in a
    chunk whose one handle covers exactly its bytes (packed: its own segment, not a staging
    region), and nothing is left in /dev/shm after the commit."""
    daemon = make_daemon()
    big = torch.arange(64, dtype=torch.float32)
    with _publisher(endpoint, staging_bytes=100, packed=packed) as pub:
        named = [("small", torch.zeros(4)), ("big.weight", big), ("after", torch.ones(4))]
        pub.publish(named, "v1")
        chunks = daemon.of_type(wire.Chunk)
        assert [c.names for c in chunks] == [["small"], ["big.weight"], ["after"]]
        (h,) = chunks[1].handles
        assert isinstance(h, wire.ShmHandle) and h.offset == 0 and h.nbytes == 256
        if packed:
            assert h.segment not in {c.handles[0].segment for c in (chunks[0], chunks[2])}
        assert daemon.chunk_data[1] == {"big.weight": big.numpy().tobytes()}
    assert _no_segments() == []


def test_register_error(make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Register):
            return [wire.Error(phase="register", message="slot disagrees with rank 0",
                               slot=[0, 2])]
        return []

    make_daemon(script)
    with _publisher(endpoint) as pub, pytest.raises(SlotsyncError, match="disagrees") as ei:
        pub.register()
    assert ei.value.phase == "register" and ei.value.update_id is None


def test_stale_replies_ignored_and_pending_error_raised(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Begin):
            return [
                wire.Ack(update_id=msg.update_id - 1, phase="begin"),  # stale
                wire.Error(phase="commit", message="old", update_id=msg.update_id - 3),
                wire.Ack(update_id=msg.update_id, phase="begin"),
            ]
        if isinstance(msg, wire.Chunk):
            # the ack, then an unsolicited failure of this update (e.g. the engine died)
            return [wire.Ack(update_id=msg.update_id, phase="chunk", index=msg.index),
                    wire.Error(phase="engine", message="engine went away", slot=[0, 2],
                               update_id=msg.update_id)]
        return happy(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint) as pub:
        uid = pub.begin("v1")
        assert uid == NEXT_ID
        pub.send_chunk([("a", torch.ones(3))])
        assert pub._link.sock.poll(10_000), "the Error did not arrive"  # (behind chunk 0's ack)
        with pytest.raises(SlotsyncError, match="engine went away") as ei:
            pub.send_chunk([("b", torch.ones(3))])
        assert ei.value.phase == "engine"
        assert len(daemon.of_type(wire.Chunk)) == 1  # checked before sending
        assert pub.update_id is None


def test_send_chunk_misuse(make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    make_daemon()
    with _publisher(endpoint) as pub:
        with pytest.raises(RuntimeError, match="no update is open"):
            pub.send_chunk([("a", torch.ones(1))])
        pub.begin("v")
        with pytest.raises(RuntimeError, match="still open"):
            pub.begin("v")
        with pytest.raises(ValueError, match="duplicate"):
            pub.send_chunk([("a", torch.ones(1)), ("a", torch.ones(1))])
        with pytest.raises(ValueError, match="at least one"):
            pub.send_chunk([])
        pub.abort("test")
        assert pub.update_id is None


def test_close_leaves_no_shm(make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        return [] if isinstance(msg, wire.Commit) else happy(msg)

    make_daemon(script)
    for packed in (True, False):
        pub = _publisher(endpoint, packed=packed, staging_bytes=4096)
        pub.begin("v")
        pub.send_chunk(_tensors())
        assert _no_segments() != []  # staging or per-update segment exists
        pub.close()  # with the update still open: aborted, everything unlinked
        pub.close()
        assert pub.closed
        assert _no_segments() == []
        with pytest.raises(RuntimeError, match="closed"):
            pub.begin("v")


def test_publisher_argument_checks(endpoint: str) -> None:
    with pytest.raises(ValueError, match="rank 3 is not in its engine slot"):
        Publisher(endpoint, 3, (0, 2), ENGINE, transport="shm")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        Publisher(endpoint, 0, (0, 2), ENGINE, transport="cuda", device="cpu")
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"staging_buffers must be 1..8, got {bad}"):
            Publisher(endpoint, 0, (0, 2), ENGINE, transport="shm", staging_buffers=bad)
    for kw, text in [({"staging_buffers": 2.5}, "staging_buffers must be an int, got float"),
                     ({"staging_buffers": "4"}, "staging_buffers must be an int, got str"),
                     ({"staging_bytes": 1e6}, "staging_bytes must be an int, got float"),
                     ({"packed": "yes"}, "packed must be True or False, got str"),
                     ({"timeout_s": "5"}, "timeout_s must be a number of seconds, got str"),
                     ({"gpu_uuid": 5}, "gpu_uuid must be a str, got int")]:
        with pytest.raises(TypeError, match=text):
            Publisher(endpoint, 0, (0, 2), ENGINE, transport="shm", **kw)  # type: ignore[arg-type]
    for bad_rank in ("0", 0.0, True):  # (not "rank 0 is not in its engine slot [0, 2)")
        with pytest.raises(TypeError, match=f"rank must be an int, got {type(bad_rank).__name__}"):
            Publisher(endpoint, bad_rank, (0, 2), ENGINE, transport="shm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s must be positive and finite, got inf"):
        Publisher(endpoint, 0, (0, 2), ENGINE, transport="shm", timeout_s=float("inf"))
    # Refused at once, not after timeout_s at register(): the daemon serves only ipc://.
    for bad_endpoint in ("tcp://127.0.0.1:5555", "ipc://relative.sock", "/run/x.sock"):
        with pytest.raises(ValueError, match=f"endpoint '{re.escape(bad_endpoint)}' must be "
                                             "ipc:///absolute/path"):
            Publisher(bad_endpoint, 0, (0, 2), ENGINE, transport="shm")
    with pytest.raises(ValueError, match="engine_url 'ftp://x' must be http://host:port"):
        Publisher(endpoint, 0, (0, 2), "ftp://x", transport="shm")
    with pytest.raises(TypeError, match="engine_url must be a str, got NoneType"):
        Publisher(endpoint, 0, (0, 2), None, transport="shm")  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA build of torch and a visible GPU"):
            Publisher(endpoint, 0, (0, 2), ENGINE, transport="cuda")
    pub = Publisher(endpoint, 0, (0, 2), ENGINE, device="cpu",
                    gpu_uuid="GPU-AAAAAAAA-0000-0000-0000-000000000001")
    try:
        assert pub.transport == "shm"
        assert pub.gpu_uuid == "aaaaaaaa-0000-0000-0000-000000000001"
    finally:
        pub.close()


def _many_tensors(n: int = 6) -> list[tuple[str, torch.Tensor]]:
    """``n`` float32 tensors of 64 bytes each, distinct contents."""
    return [(f"model.layers.{i}.w", torch.full((16,), float(i))) for i in range(n)]


def test_unpacked_publish_sends_the_next_chunk_before_the_ack(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """Unpacked, a rank keeps one chunk in flight ahead of its ack: this daemon acks chunk
    k-1 only once chunk k arrived, which a publisher that waits for each ack before sending
    the next chunk could never satisfy (it would time out)."""
    n = 6
    last = n - 1

    def ack_behind(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Chunk):
            acks = []
            if msg.index > 0:
                acks.append(wire.Ack(update_id=msg.update_id, phase="chunk", index=msg.index - 1))
            if msg.index == last:
                acks.append(wire.Ack(update_id=msg.update_id, phase="chunk", index=last))
            return acks
        return happy(msg)

    daemon = make_daemon(ack_behind)
    with _publisher(endpoint, packed=False, staging_bytes=64, timeout_s=2.0) as pub:
        stats = pub.publish(_many_tensors(n), weight_version="v")
    assert stats.chunks == n
    assert [c.index for c in daemon.of_type(wire.Chunk)] == list(range(n))
    assert [c.num_chunks for c in daemon.of_type(wire.Commit)] == [n]
    assert stats.wait_seconds > 0 and stats.export_seconds > 0


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_packed_staging_region_is_not_refilled_before_the_ack(
    make_daemon: Callable[..., FakeDaemon], endpoint: str, buffers: int
) -> None:
    """Packed, a staging region is refilled only after the ack of the chunk that used it
    (design.md I3). With two or more regions the next chunk is filled into another one and
    already sent while the engine loads the current chunk; with one it is sent only after the
    ack. Regions are used in turn."""
    held: list[tuple[int, bool, bool, int]] = []  # (index, bytes unchanged, next sent, offset)

    def slow_engine(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Chunk):
            (h,) = msg.handles
            assert isinstance(h, wire.ShmHandle)
            before = _read_shm(h)
            time.sleep(0.2)  # the engine is loading this chunk
            next_sent = bool(daemon._sock.poll(0))  # chunk k+1 already waiting?
            held.append((msg.index, _read_shm(h) == before, next_sent, h.offset))
        return happy(msg)

    daemon = make_daemon(slow_engine)
    named = _many_tensors(4)
    with _publisher(endpoint, packed=True, staging_bytes=64, staging_buffers=buffers) as pub:
        pub.publish(named, weight_version="v")
    assert [i for i, *_ in held] == [0, 1, 2, 3]
    assert all(same for _, same, _, _ in held)  # never overwritten before its ack
    assert [nxt for _, _, nxt, _ in held[:-1]] == [buffers > 1] * 3
    assert [off for *_, off in held] == [64 * (k % buffers) for k in range(4)]
    seen = {k: v for d in daemon.chunk_data for k, v in d.items()}
    assert seen == {n: _raw(t) for n, t in named}


@pytest.mark.parametrize(("buffers", "slow"), [(4, False), (2, True), (1, False)],
                         ids=["4 regions", "2 regions, acks late", "1 region"])
def test_publish_lays_out_the_next_chunk_before_sending_the_one_being_copied(
    make_daemon: Callable[..., FakeDaemon], endpoint: str, monkeypatch: pytest.MonkeyPatch,
    buffers: int, slow: bool,
) -> None:
    """Packed ``publish`` launches chunk k's copy, lays chunk k+1 out (the per-tensor CPU
    work) while the copy runs, and only then waits for the copy and sends chunk k; the last
    chunk goes out with the commit. When chunk k+1's region is already free (its last chunk
    acknowledged), chunk k+1's copy is launched before chunk k is sent, so the copies run back
    to back; when it is not (acks still due, or one region), chunk k is sent first and then the
    ack awaited. ``send_chunk`` still sends at once."""
    from slotsync.protocol.rank.staging import ShmStagingBuffer, StagingBuffer

    events: list[tuple[str, int]] = []
    plan, launch = ShmStagingBuffer.plan, StagingBuffer.launch
    send = ChunkPipeline._send_chunk_message

    def traced_plan(self: Any, items: Any, region: int = 0, sizes: Any = None, **kw: Any) -> Any:
        events.append(("plan", int(items[0][0].split(".")[2])))
        return plan(self, items, region, sizes, **kw)

    def traced_launch(self: Any, p: Any, region: int = 0) -> None:
        events.append(("launch", int(p.layout.names[0].split(".")[2])))
        launch(self, p, region)

    def traced_send(self: Any, uid: int, index: int, *rest: Any) -> None:
        events.append(("send", index))
        send(self, uid, index, *rest)

    def slow_engine(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Chunk):
            time.sleep(0.2)  # acks come back after the next chunk was laid out
        return happy(msg)

    monkeypatch.setattr(ShmStagingBuffer, "plan", traced_plan)
    monkeypatch.setattr(StagingBuffer, "launch", traced_launch)
    monkeypatch.setattr(ChunkPipeline, "_send_chunk_message", traced_send)
    daemon = make_daemon(slow_engine if slow else happy)
    named = _many_tensors(3)
    with _publisher(endpoint, packed=True, staging_bytes=64, staging_buffers=buffers) as pub:
        pub.publish(named, weight_version="v")
        head = [("plan", 0), ("launch", 0), ("plan", 1)]
        if buffers == 4:  # every region free: each copy is queued before the previous send
            assert events == head + [("launch", 1), ("send", 0), ("plan", 2), ("launch", 2),
                                     ("send", 1), ("send", 2)]
        elif buffers == 2:  # chunk 2 needs chunk 0's region: chunk 1 goes out first
            assert events == head + [("launch", 1), ("send", 0), ("plan", 2), ("send", 1),
                                     ("launch", 2), ("send", 2)]
        else:  # one region: send, then the ack, then the next copy
            assert events == head + [("send", 0), ("launch", 1), ("plan", 2), ("send", 1),
                                     ("launch", 2), ("send", 2)]
        events.clear()
        pub.begin("v2")
        pub.send_chunk(named[:1])
        assert events == [("plan", 0), ("launch", 0), ("send", 0)]
        pub.commit()
    seen = {k: v for d in daemon.chunk_data for k, v in d.items()}
    assert seen == {n: _raw(t) for n, t in named}


@pytest.mark.parametrize("begin_ok", [True, False], ids=["acked", "refused"])
def test_publish_sends_chunks_while_the_begin_is_in_flight_and_gives_them_back_if_it_fails(
    make_daemon: Callable[..., FakeDaemon], endpoint: str, monkeypatch: pytest.MonkeyPatch,
    begin_ok: bool,
) -> None:
    """``publish`` does not wait for ``Ack(begin)``: while the daemon pauses and starts the
    engine (a slow begin here), chunks are copied, exported and sent (the daemon holds them
    until the engine has started), packed and unpacked alike; the begin's ack is awaited
    before any chunk's. If the begin fails, the exports sent meanwhile are given back, each
    once (``release_unconsumed``), since no engine will map them."""
    from slotsync.protocol.rank import export_ledger
    from slotsync.protocol.rank.chunk_export import ChunkExporter
    from slotsync.protocol.rank.staging import ShmStagingBuffer

    events: list[str] = []
    released: list[int] = []
    monkeypatch.setattr(export_ledger, "release_unconsumed",
                        lambda h: released.append(h.ref_counter_offset))
    exports = itertools.count()

    def handle(self: Any, region: int = 0) -> wire.CudaIpcHandle:
        events.append("export")
        return _stand_in_cuda_handle(self.capacity, next(exports))

    def export_unpacked(self: Any, items: Any) -> Any:
        events.append("export")
        return export(self, items)

    export = ChunkExporter.unpacked
    monkeypatch.setattr(ShmStagingBuffer, "handle", handle)
    monkeypatch.setattr(ChunkExporter, "unpacked", export_unpacked)

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Begin):
            time.sleep(0.3)  # pause + start on a slow engine
            events.append("begin answered")
            if not begin_ok:
                return [wire.Error(phase="begin", message="engine down",
                                   update_id=msg.update_id)]
        if isinstance(msg, wire.Chunk) and not begin_ok:
            return []  # the update failed: nothing more is acknowledged
        return happy(msg)

    daemon = make_daemon(script)
    for packed in (True, False):
        events.clear()
        with _publisher(endpoint, packed=packed, staging_bytes=64) as pub:
            if begin_ok:
                pub.publish(_many_tensors(3), weight_version="v")
            else:
                with pytest.raises(SlotsyncError, match="engine down"):
                    pub.publish(_many_tensors(3), weight_version="v")
        # chunks were exported (and sent: one chunk per export) before the begin was answered
        assert events.index("export") < events.index("begin answered"), events
    chunks = daemon.of_type(wire.Chunk)
    assert len(chunks) >= 2  # at least the first chunk of each mode went out early
    if begin_ok:
        assert released == []
    else:  # the packed chunks' exports (stand-in CUDA handles), each once
        sent = [m.handles[0].ref_counter_offset for m in chunks
                if isinstance(m.handles[0], wire.CudaIpcHandle)]
        assert sent and sorted(released) == sorted(sent)


def test_publish_sends_a_chunk_from_within_the_next_chunks_layout_once_copied(
    make_daemon: Callable[..., FakeDaemon], endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Laying out a chunk of thousands of tensors takes milliseconds: the chunk copied before
    it goes out from within that layout as soon as its copy is done, not after it."""
    from slotsync.protocol.rank import staging

    events: list[str] = []
    plan, send = staging.plan_pack, ChunkPipeline._send_chunk_message

    def traced_plan(buf: Any, items: Any, *a: Any, **kw: Any) -> Any:
        k = int(items[0][0].split(".")[2]) // 200
        events.append(f"layout {k} begins")
        out = plan(buf, items, *a, **kw)
        events.append(f"layout {k} ends")
        return out

    def traced_send(self: Any, uid: int, index: int, *rest: Any) -> None:
        events.append(f"send {index}")
        send(self, uid, index, *rest)

    monkeypatch.setattr(staging, "plan_pack", traced_plan)
    monkeypatch.setattr(ChunkPipeline, "_send_chunk_message", traced_send)
    make_daemon()
    def named() -> Iterator[tuple[str, torch.Tensor]]:  # 3 chunks of 200 tensors
        for i, item in enumerate(_many_tensors(600)):
            if i == 200:
                time.sleep(0.2)  # (chunk 0's copy is done when the first poll looks)
            yield item

    with _publisher(endpoint, packed=True, staging_bytes=200 * 64) as pub:
        assert pub.publish(named(), weight_version="v").chunks == 3
    assert events == ["layout 0 begins", "layout 0 ends", "layout 1 begins", "send 0",
                      "layout 1 ends", "layout 2 begins", "send 1", "layout 2 ends",
                      "send 2"], events


def test_daemon_restart_seen_while_chunk_0_is_copied_registers_again(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """A restarted daemon answers the Begin with "not registered" while the publisher lays
    out chunk 1 (reading replies between blocks of tensors), and refuses the chunk sent after
    it the same way, as slotsyncd does (each refusal names its message's update id): the
    publisher registers again (the chunk's refusal is not taken for the registration's
    answer), begins once more and sends again, under the new update id, the chunk it already
    sent; the refusals that come late are ignored."""
    begins: list[int] = []
    known = [True]  # the daemon restarts before the first begin

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Register):
            known[0] = True
        elif isinstance(msg, wire.Begin):
            begins.append(msg.update_id)
            if len(begins) == 1:
                known[0] = False
        if not known[0]:
            return [wire.Error(phase="register", message="not registered",
                               update_id=getattr(msg, "update_id", None),
                               code=wire.NOT_REGISTERED)]
        return happy(msg)

    def named() -> Iterator[tuple[str, torch.Tensor]]:  # 3 chunks of 200 tensors
        for i, item in enumerate(_many_tensors(600)):
            if i == 200:
                time.sleep(0.2)  # (the refusal is there when chunk 1's layout reads replies)
            yield item

    daemon = make_daemon(script)
    with _publisher(endpoint, packed=True, staging_bytes=200 * 64) as pub:
        assert pub.publish(named(), weight_version="v").chunks == 3
    assert len(daemon.of_type(wire.Register)) == 2 and len(begins) == 2
    seen = {k: v for d in daemon.chunk_data for k, v in d.items()}
    assert seen == {n: _raw(t) for n, t in _many_tensors(600)}
    # chunk 0 went out under the refused update id, then again under the new one
    sent = [(m.update_id, m.index) for m in daemon.of_type(wire.Chunk)]
    assert sent[0] == (begins[0], 0) and sent[-3:] == [(begins[1], k) for k in range(3)]


def test_refusals_of_chunks_sent_after_a_refused_begin_are_not_taken_for_registration(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """One chunk, sent before a restarted daemon's slow "not registered" answer to the Begin:
    that chunk's own refusal arrives while the publisher registers again. It answers the
    chunk, not the Register (it names an update id), so the registration goes on, and the
    update succeeds with the chunk sent again."""
    known = [True]

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Register):
            known[0] = True
        if isinstance(msg, wire.Begin) and not known[0]:
            time.sleep(0.2)  # chunk 0 is sent meanwhile
        if not known[0]:
            return [wire.Error(phase="register", message="not registered",
                               update_id=getattr(msg, "update_id", None),
                               code=wire.NOT_REGISTERED)]
        return happy(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint, packed=True, staging_bytes=256) as pub:
        pub.register()
        known[0] = False  # the daemon restarts: this connection is unknown to it
        assert pub.publish(_many_tensors(2), weight_version="v").chunks == 1
    kinds = [type(m).__name__ for m in daemon.received
             if not isinstance(m, wire.Close)]  # (close()'s goodbye: may come in late)
    assert kinds == ["Register", "Begin", "Chunk", "Register", "Begin", "Chunk", "Commit"]


def test_second_thread_is_refused_while_one_publishes(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """A Publisher is used by one thread at a time: a second thread's publish (or begin,
    commit) while one runs raises at once, and the first update succeeds; the daemon sees one
    Begin, so no engine is left paused by the second."""
    daemon = make_daemon()
    inside = threading.Event()
    release = threading.Event()

    def slow() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(_many_tensors(4)):
            if i == 2:
                inside.set()
                release.wait(5)
            yield item

    errors: list[BaseException] = []
    with _publisher(endpoint, packed=True, staging_bytes=64) as pub:
        first = threading.Thread(target=lambda: pub.publish(slow(), weight_version="v1"))
        first.start()
        assert inside.wait(5)
        for call in (lambda: pub.publish(_many_tensors(2), weight_version="v2"),
                     lambda: pub.begin("v2"), pub.commit):
            try:
                call()
            except RuntimeError as e:
                errors.append(e)
        release.set()
        first.join(10)
        assert not first.is_alive()
        assert pub.publish(_many_tensors(2), weight_version="v3").chunks == 2  # usable again
    assert len(errors) == 3 and all("another thread is using this Publisher" in str(e)
                                    for e in errors), errors
    assert [m.weight_version for m in daemon.of_type(wire.Begin)] == ["v1", "v3"]
    assert len(daemon.of_type(wire.Commit)) == 2


def test_commit_goes_out_before_the_last_chunks_are_acknowledged(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """The daemon finishes as soon as the engine loaded every chunk; the rank need not hear
    of the last loads first. This daemon acks chunks only once the commit is in."""
    held: list[wire.Chunk] = []

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Chunk):
            held.append(msg)
            return []
        if isinstance(msg, wire.Commit):
            acks = [wire.Ack(update_id=c.update_id, phase="chunk", index=c.index) for c in held]
            return [*acks, wire.Ack(update_id=msg.update_id, phase="commit")]
        return happy(msg)

    make_daemon(script)
    with _publisher(endpoint, packed=True, staging_bytes=64, timeout_s=2.0) as pub:
        assert pub.publish(_many_tensors(2), weight_version="v").chunks == 2  # two regions


def test_ack_read_before_it_is_awaited_is_kept(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """Unpacked, chunk k's ack often arrives while the caller's iterator still produces chunk
    k+1; the publisher reads it when it next sends and must count it, not drop it as stale."""
    make_daemon()

    def slow_iter() -> Iterator[tuple[str, torch.Tensor]]:
        for item in _many_tensors(4):
            time.sleep(0.1)  # the ack of the previous chunk arrives meanwhile
            yield item

    with _publisher(endpoint, packed=False, staging_bytes=64, timeout_s=2.0) as pub:
        assert pub.publish(slow_iter(), weight_version="v").chunks == 4


def test_publish_refuses_empty_and_bad_items_before_touching_the_engine(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """Nothing to send, or something that is not (name, tensor) pairs, is refused before the
    begin (which would pause the engine); a mapping such as a state dict is accepted."""
    daemon = make_daemon()
    with _publisher(endpoint, packed=True, staging_bytes=256) as pub:
        with pytest.raises(ValueError, match="publish got no tensors"):
            pub.publish(iter([]), weight_version="v")
        with pytest.raises(TypeError, match=r"state_dict\(\)\.items\(\)"):
            pub.publish(["model.w"], weight_version="v")  # type: ignore[list-item]
        with pytest.raises(TypeError, match=r"\(str, list\) for 'w'"):
            pub.publish([("w", [1, 2])], weight_version="v")  # type: ignore[list-item]
        w = torch.zeros(2)
        with pytest.raises(ValueError, match="'w' appears twice"):
            pub.publish([("w", w), ("w", w)], weight_version="v")
        with pytest.raises(ValueError, match="must have 1 to 1024 characters"):
            pub.publish([("", w), ("w", w)], weight_version="v")
        with pytest.raises(ValueError, match="tensor 'c': dtype torch.complex64 is not supported"):
            pub.publish([("w", w), ("c", torch.zeros(2, dtype=torch.complex64))], "v")
        with pytest.raises(ValueError, match="'m' is on the meta device"):
            pub.publish([("w", w), ("m", torch.zeros(2, device="meta"))], weight_version="v")
        with pytest.raises(ValueError, match="'s' has layout torch.sparse_coo: only dense"):
            pub.publish([("w", w), ("s", torch.zeros(2).to_sparse())], weight_version="v")
        with warnings.catch_warnings():  # ("sparse CSR support is in beta")
            warnings.simplefilter("ignore")
            csr = torch.ones(3, 3).to_sparse_csr()
        with pytest.raises(ValueError, match="'s' has layout torch.sparse_csr: only dense"):
            pub.publish({"w": w, "s": csr}, weight_version="v")
        with pytest.raises(ValueError, match="'m' is on the meta device"):  # a mapping too
            pub.publish({"w": w, "m": torch.zeros(2, device="meta")}, weight_version="v")
        for version, err, text in [(5, TypeError, "weight_version must be a str, got int"),
                                   ("", ValueError, "must have 1 to 256 characters .it has 0"),
                                   ("v" * 257, ValueError, "1 to 256 characters .it has 257")]:
            with pytest.raises(err, match=text):
                pub.publish([("w", w)], weight_version=version)  # type: ignore[arg-type]
        assert daemon.of_type(wire.Begin) == []
        stats = pub.publish(dict(_many_tensors(2)), weight_version="v")
        assert stats.chunks == 1 and len(daemon.of_type(wire.Begin)) == 1


def test_a_refused_chunk_aborts_the_update_so_the_engine_is_not_left_paused(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """The daemon answers a frame it cannot use with an Error that carries no update id and
    does not fail the update; the publisher then aborts the update itself, so the daemon
    fails it at once (every rank is told, the slot wants a full update, I4) instead of at its
    commit deadline (10 minutes by default)."""

    def refuse_chunks(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Chunk):
            return [wire.Error("decode", "bad message: something", fatal=False)]
        return happy(msg)

    daemon = make_daemon(refuse_chunks)
    with _publisher(endpoint, packed=True, staging_bytes=64) as pub:
        with pytest.raises(SlotsyncError, match="bad message"):
            pub.publish(_many_tensors(2), weight_version="v")
        (abort,) = daemon.until_received(wire.Abort, 5.0)
        (begin,) = daemon.of_type(wire.Begin)
        assert abort.update_id == begin.update_id and "refused a message" in abort.reason


def _stand_in_cuda_handle(nbytes: int, offset: int) -> wire.CudaIpcHandle:
    """A well-formed CUDA IPC handle record whose ref-counter slot is ``offset``."""
    return wire.CudaIpcHandle("torch.Tensor", (nbytes,), (1,), 0, "torch.storage.TypedStorage",
                              "uint8", 0, b"\x07" * 66, nbytes, 0, False, b"/torch_1_2", offset,
                              b"\x09" * 64, True)


@pytest.mark.parametrize("fail_at", [2, None], ids=["chunk 2 fails", "success"])
def test_failed_update_gives_back_the_exports_the_engine_never_acknowledged(
    make_daemon: Callable[..., FakeDaemon], endpoint: str, monkeypatch: pytest.MonkeyPatch,
    fail_at: int | None,
) -> None:
    """An export no consumer maps keeps its block in torch's IPC limbo for good (on the H200
    every failed packed update kept its staging block). When an update fails, the publisher
    gives back the exports of every chunk the engine did not acknowledge -- each once -- and
    none of those it acknowledged; a successful update gives back nothing."""
    from slotsync.protocol.rank import export_ledger
    from slotsync.protocol.rank.staging import ShmStagingBuffer

    released: list[int] = []
    monkeypatch.setattr(export_ledger, "release_unconsumed",
                        lambda h: released.append(h.ref_counter_offset))
    exports = itertools.count()
    monkeypatch.setattr(ShmStagingBuffer, "handle",
                        lambda self, region=0: _stand_in_cuda_handle(self.capacity, next(exports)))

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Chunk) and msg.index == fail_at:
            return [wire.Error("engine", "engine failed", [0, 2], msg.update_id, [])]
        if isinstance(msg, wire.Chunk) and fail_at is not None and msg.index > fail_at:
            return []  # already failed
        return happy(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint, packed=True, staging_bytes=64, staging_buffers=4) as pub:
        if fail_at is None:
            pub.publish(_many_tensors(6), weight_version="v")
        else:
            with pytest.raises(SlotsyncError, match="engine failed"):
                pub.publish(_many_tensors(6), weight_version="v")

    def sent_exports() -> dict[int, int]:
        return {m.index: m.handles[0].ref_counter_offset for m in daemon.of_type(wire.Chunk)}

    # The fake daemon's thread may still be reading chunks the publisher sent before it saw
    # the failure (a loaded machine): wait until it read every one the publisher gave back.
    deadline = time.monotonic() + 10
    while not set(released) <= set(sent_exports().values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = sent_exports()
    if fail_at is None:
        assert len(sent) == 6 and released == []
    else:
        assert max(sent) >= fail_at  # chunk 2 went out (and maybe some after it)
        assert sorted(released) == sorted(off for k, off in sent.items() if k >= fail_at)


def _with_message_cap(cap: int) -> Script:
    """``happy``, from a daemon whose ``max_message_bytes`` is ``cap``."""
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Register):
            return [wire.Registered(rank=msg.rank, slot_start=msg.slot_start,
                                    slot_size=msg.slot_size, next_update_id=NEXT_ID,
                                    max_message_bytes=cap)]
        return happy(msg)

    return script


def test_chunk_message_over_the_daemons_cap_is_refused_before_the_begin(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """A list or mapping whose chunk would not fit the daemon's max_message_bytes (told at
    registration) is refused before the Begin, so the engine is not paused; an iterator is
    refused when its chunk is sent (as documented)."""
    daemon = make_daemon(_with_message_cap(4096))
    many = [(f"model.layers.{i}.mlp.experts.{i}.w", torch.zeros(1)) for i in range(200)]
    for packed in (True, False):
        with _publisher(endpoint, packed=packed, staging_bytes=1 << 20) as pub:
            begins = len(daemon.of_type(wire.Begin))
            with pytest.raises(ValueError, match=r"chunk 0 of this update would encode to "
                               r"about \d+ bytes or more .* max_message_bytes of 4096"):
                pub.publish(many, weight_version="v")
            assert len(daemon.of_type(wire.Begin)) == begins
            pub.publish(many[:5], weight_version="v")  # a small one goes through
            pub.publish(many[:1], weight_version="v")
    assert len(daemon.of_type(wire.Begin)) == 4


def test_a_small_update_passes_the_smallest_message_cap(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    """The pre-check's bound stays close to the real size: three small tensors pass a daemon
    at its smallest max_message_bytes (1024), packed and unpacked (the real frames are
    ~150-250 bytes)."""
    daemon = make_daemon(_with_message_cap(1024))
    for packed in (True, False):
        with _publisher(endpoint, packed=packed, staging_bytes=4096) as pub:
            pub.publish(dict(_many_tensors(3)), weight_version="v")
    assert len(daemon.of_type(wire.Commit)) == 2


def test_staging_that_cannot_be_allocated_fails_before_the_begin(
    make_daemon: Callable[..., FakeDaemon], endpoint: str
) -> None:
    daemon = make_daemon()
    with _publisher(endpoint, packed=True, staging_bytes=1 << 50) as pub:
        with pytest.raises(MemoryError, match=r"cannot allocate 4 staging region\(s\) of "
                           r"1125899906842624 bytes .* on /dev/shm"):
            pub.publish([("w", torch.zeros(2))], weight_version="v")
    assert daemon.of_type(wire.Begin) == []


def test_the_begins_manifest_is_each_rounds_own_when_digests_are_kept(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    """The per-tensor digests kept across rounds (manifest_cache.py, issue 27) give exactly
    ``manifest_of`` of each round's tensors: the same round twice, then one tensor reshaped
    (the digest at its position changes), then a renamed one; an iterator with
    ``manifest=`` as a list of torch dtypes and another with vLLM's dtype names agree."""
    from slotsync.protocol.manifest import DIGEST_BYTES, manifest_of
    from slotsync.protocol.rank.inputs import manifest_entries as _entries

    daemon = make_daemon()
    named = _tensors()
    reshaped = [*named[:2], ("model.layers.0.idx", named[2][1].view(2, 5)), *named[3:]]
    renamed = [*named[:4], ("model.final_norm.weight", named[4][1])]
    rounds = [named, named, reshaped, renamed]
    with _publisher(endpoint) as pub:
        for i, tensors in enumerate(rounds):
            pub.publish(tensors, weight_version=f"v{i}")
        spelled = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in named]
        pub.publish(iter(named), weight_version="v4", manifest=spelled)
    sent = [b.manifest for b in daemon.of_type(wire.Begin)]
    want = [manifest_of(_entries([(n, t.dtype, t.shape) for n, t in ts]))
            for ts in [*rounds, named]]
    assert sent == want
    assert sent[0] == sent[1] == sent[4]
    differ = [i for i in range(len(named))
              if sent[0][i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]
              != sent[2][i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]]
    assert differ == [2]
    assert sent[3][:4 * DIGEST_BYTES] == sent[0][:4 * DIGEST_BYTES] and sent[3] != sent[0]


def test_digest_cache_stays_bounded_when_names_change_every_round() -> None:
    from slotsync.protocol.manifest import manifest_of
    from slotsync.protocol.rank.inputs import manifest_entries as _entries
    from slotsync.protocol.rank.manifest_cache import DigestCache

    cache = DigestCache(lambda e: _entries((e,))[0], max_entries=10)
    for r in range(5):
        m = [(f"round{r}.t{i}", torch.float32, (i + 1,)) for i in range(6)]
        assert cache.manifest(m) == manifest_of(_entries(m))
        assert len(cache) <= 10
    big = [(f"t{i}", "float32", [2]) for i in range(25)]  # one manifest over the bound
    assert cache.manifest(big) == manifest_of(_entries(big)) and len(cache) == 25
    with pytest.raises(ValueError, match="complex64|dtype"):
        cache.manifest([("z", torch.complex64, (1,))])


def test_publish_holds_the_garbage_collector_and_gives_it_back(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    """No cyclic collection during a round (gc_hold.py; issue 27: a full collection of the
    trainer's objects every few rounds while the engine waited): the collector is off while
    publish consumes the tensors, on again after -- also after a failed round -- and one the
    caller had turned off stays off."""
    import gc

    seen: list[bool] = []

    def watched() -> Iterator[tuple[str, torch.Tensor]]:
        for item in _tensors():
            seen.append(gc.isenabled())
            yield item

    def fail_chunk_1(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Chunk) and msg.index == 1:
            return [wire.Error(update_id=msg.update_id, phase="chunk", message="refused")]
        return happy(msg)

    assert gc.isenabled()
    make_daemon(fail_chunk_1)
    with _publisher(endpoint, staging_bytes=300) as pub:
        with pytest.raises(SlotsyncError, match="refused"):
            pub.publish(watched(), weight_version="v0")
        assert seen and not any(seen) and gc.isenabled()
        gc.disable()
        try:
            seen.clear()
            with pytest.raises(SlotsyncError, match="refused"):
                pub.publish(watched(), weight_version="v1")
            assert seen and not any(seen) and not gc.isenabled()
        finally:
            gc.enable()


@pytest.mark.parametrize(("transport", "packed", "warmed"), [
    ("cuda", True, True), ("cuda", False, False), ("shm", True, False)])
def test_the_copy_kernel_is_compiled_at_register_for_a_packed_cuda_rank(
        monkeypatch: pytest.MonkeyPatch, transport: str, packed: bool, warmed: bool) -> None:
    """Issue 27 C: a packed rank on CUDA compiles the gather kernel at ``register()``, not in
    its first publish (inside the engine's pause); unpacked or shared memory has no kernel."""
    from slotsync.protocol.rank import gather
    from slotsync.protocol.rank.chunk_export import ChunkExporter

    calls: list[tuple[torch.device, bool]] = []
    monkeypatch.setattr(gather, "available", lambda: True)
    monkeypatch.setattr(gather, "warm_up", lambda dev, *, scatter: calls.append((dev, scatter)))
    dev = torch.device("cuda", 0) if transport == "cuda" else torch.device("cpu")
    ChunkExporter(transport, dev, 0, 1 << 20, 2).warm_up(packed)  # (allocates nothing)
    assert calls == ([(dev, False)] if warmed else [])


def test_a_kernel_that_cannot_compile_at_register_is_logged_not_raised(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The warm-up only starts later work early: its failure leaves the first chunk to
    compile (or refuse) the kernel as before, with a warning naming the rank."""
    from slotsync.protocol.rank import gather
    from slotsync.protocol.rank.chunk_export import ChunkExporter

    def broken(dev: torch.device, *, scatter: bool) -> None:
        raise RuntimeError("ptxas fatal")

    monkeypatch.setattr(gather, "available", lambda: True)
    monkeypatch.setattr(gather, "warm_up", broken)
    ChunkExporter("cuda", torch.device("cuda", 0), 3, 1 << 20, 2).warm_up(True)
    assert "rank 3: could not compile the packed copy kernel" in caplog.text
    assert "ptxas fatal" in caplog.text


def test_register_warms_the_exporter_before_it_registers(
        make_daemon: Callable[..., FakeDaemon], endpoint: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``Publisher.register`` asks its exporter to warm up (with the publisher's mode) before
    the registration goes out, so that the first publish finds the kernel compiled."""
    from slotsync.protocol.rank.chunk_export import ChunkExporter

    seen: list[tuple[bool, bool]] = []
    monkeypatch.setattr(ChunkExporter, "warm_up",
                        lambda self, packed: seen.append((packed, pub.registered is None)))
    make_daemon()
    with _publisher(endpoint, packed=False) as pub:
        pub.register()
        assert seen == [(False, True)] and pub.registered is not None

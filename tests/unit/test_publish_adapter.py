"""``Publisher.publish_adapter`` (issue 36, the rank's side) against the scripted fake daemon of
test_publisher.py (a ZeroMQ ROUTER that decodes every message as the daemon does), shm
transport on the CPU: the messages sent (rows, digests, offsets), both transports, the errors
(before anything is sent, an Error reply, a deadline, a daemon gone, an interrupt, an older
daemon, a daemon restart), and that nothing is left in /dev/shm on any path.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable

import msgspec
import pytest
import test_publisher
import torch
from test_publisher import NEXT_ID, FakeDaemon, _no_segments, _publisher, _raw, _read_shm, happy

from slotsync.protocol import wire
from slotsync.protocol.errors import DAEMON_GONE, SlotsyncError, SlotsyncTimeout
from slotsync.protocol.rank.adapters import inputs as adapter_inputs
from slotsync.protocol.rank.adapters.round import ADAPTERS_UNSUPPORTED, AdapterStats

Script = Callable[[wire.ToDaemon], list[wire.FromDaemon]]
endpoint = test_publisher.endpoint  # (the fixtures: an ipc:// endpoint, a FakeDaemon there)
make_daemon = test_publisher.make_daemon
PREFIX = "base_model.model.model.layers.0.self_attn"
CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": {"v_proj", "q_proj"}, "peft_type": "LORA",
          "bias": "none"}


def _adapter() -> dict[str, torch.Tensor]:
    """PEFT names as get_peft_model_state_dict gives them (no adapter name), r = 4."""
    g = torch.Generator().manual_seed(3)
    return {
        f"{PREFIX}.q_proj.lora_A.weight": torch.randn(4, 16, generator=g).to(torch.bfloat16),
        f"{PREFIX}.q_proj.lora_B.weight": torch.randn(16, 4, generator=g).to(torch.bfloat16),
        f"{PREFIX}.v_proj.lora_A.weight": torch.randn(16, 4, generator=g).t(),  # non-contiguous
        f"{PREFIX}.v_proj.lora_B.weight": torch.randn(8, 4, generator=g),
    }


class Adapterd:
    """A script for FakeDaemon answering adapter rounds, reading each AdapterData's part from
    shared memory while the rank keeps it (and recording what it read)."""

    def __init__(self, transport: str = "host", served: str = "") -> None:
        self.transport = transport
        self.served = served
        self.parts: list[bytes] = []  # per AdapterData: the bytes its handle covered
        self.begins: list[wire.AdapterBegin] = []

    def __call__(self, msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.AdapterBegin):
            self.begins.append(msg)
            return [wire.Ack(update_id=msg.update_id, phase="adapter_begin",
                             transport=self.transport)]
        if isinstance(msg, wire.AdapterData):
            h = msg.handle
            try:
                self.parts.append(_read_shm(h) if isinstance(h, wire.ShmHandle) else b"")
            except FileNotFoundError:  # (the rank gave up first: an interrupt, a timeout)
                self.parts.append(b"")
            b = self.begins[-1]
            return [wire.Ack(update_id=msg.update_id, phase="adapter_data",
                             served_name=self.served or wire.served_name(b.lora_name,
                                                                         b.version))]
        return happy(msg)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(_raw(t)).hexdigest()


@pytest.mark.parametrize("transport", ["host", "device"])
def test_a_round_sends_the_part_with_its_rows_digests_and_offsets_and_frees_it(
        make_daemon: Callable[..., FakeDaemon], endpoint: str, transport: str) -> None:
    script = Adapterd(transport)
    daemon = make_daemon(script)
    tensors = _adapter()
    with _publisher(endpoint) as pub:
        stats = pub.publish_adapter("math", tensors, CONFIG, 3)
        assert isinstance(stats, AdapterStats)
        assert stats.served_name == "math@v3" and stats.update_id == NEXT_ID
        assert stats.transport == transport and stats.tensors == 4
        (begin,) = daemon.of_type(wire.AdapterBegin)
        assert (begin.update_id, begin.lora_name, begin.version) == (NEXT_ID, "math", 3)
        # PEFT's adapter_config.json form, target_modules sorted (a set in PEFT)
        assert begin.config_json == json.dumps(
            {**CONFIG, "target_modules": ["q_proj", "v_proj"]}, indent=2, sort_keys=True)
        assert [t.name for t in begin.tensors] == list(tensors)
        for t, (name, src) in zip(begin.tensors, tensors.items(), strict=True):
            assert t.dtype == str(src.dtype).split(".")[-1], name
            assert t.shape == list(src.shape) and (t.row_start, t.row_stop) == (0, src.shape[0])
            assert t.sha256 == _sha(src), name
        # the handle covers the part: each tensor's bytes at wire.part_offsets (256-aligned)
        (data,) = daemon.of_type(wire.AdapterData)
        assert data.update_id == NEXT_ID and isinstance(data.handle, wire.ShmHandle)
        offsets, total = wire.part_offsets(begin.tensors)
        assert offsets == [0, 256, 512, 768] and data.handle.nbytes == total == stats.nbytes
        (blob,) = script.parts
        for off, src in zip(offsets, tensors.values(), strict=True):
            assert blob[off : off + len(_raw(src))] == _raw(src)
        assert _no_segments() == []  # freed once the data's ack came
        # the next round (base or adapter) takes the next update id
        assert pub.publish_adapter("math", tensors, CONFIG, 4).update_id == NEXT_ID + 1
        assert daemon.of_type(wire.Abort) == []
    assert _no_segments() == []


def test_rows_declare_a_row_shard_and_an_empty_part_sends_no_handle(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    script = Adapterd()
    daemon = make_daemon(script)
    whole = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    name = f"{PREFIX}.q_proj.lora_B.weight"
    with _publisher(endpoint) as pub:
        pub.publish_adapter("math", {name: whole[6:]}, CONFIG, 1, rows={name: (6, (10, 4))})
        (t,) = daemon.of_type(wire.AdapterBegin)[0].tensors
        assert (t.shape, t.row_start, t.row_stop) == ([10, 4], 6, 10)
        assert t.sha256 == _sha(whole[6:]) and script.parts[0][: 64] == _raw(whole[6:])
        # a rank whose slot-mates hold everything sends an empty part, and no handle
        stats = pub.publish_adapter("math", {}, CONFIG, 2)
        assert daemon.of_type(wire.AdapterBegin)[1].tensors == []
        assert daemon.of_type(wire.AdapterData)[1].handle is None and stats.nbytes == 0
    assert _no_segments() == []


@pytest.mark.parametrize("phase", ["adapter_begin", "adapter_data"])
def test_an_error_reply_raises_it_and_frees_the_part(
        make_daemon: Callable[..., FakeDaemon], endpoint: str, phase: str) -> None:
    seen: list[bool] = []  # (was the segment there when the daemon got the data?)
    inner = Adapterd()

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        kind = "adapter_begin" if isinstance(msg, wire.AdapterBegin) else "adapter_data"
        if (isinstance(msg, wire.AdapterBegin | wire.AdapterData) and kind == phase
                and msg.update_id == NEXT_ID):  # (the first round only)
            if isinstance(msg, wire.AdapterData):
                seen.append(bool(_no_segments()))
            return [wire.Error(phase=phase, message="engine 0 refused the load (400)",
                               slot=[0, 2], update_id=msg.update_id)]
        return inner(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint) as pub:
        with pytest.raises(SlotsyncError) as ei:
            pub.publish_adapter("math", _adapter(), CONFIG, 1)
        e = ei.value
        assert not isinstance(e, SlotsyncTimeout)
        assert (e.phase, e.update_id, e.slot) == (phase, NEXT_ID, (0, 2))
        assert "engine 0 refused the load (400)" in str(e)
        assert seen == ([True] if phase == "adapter_data" else [])
        assert _no_segments() == [] and pub.update_id is None
        assert daemon.of_type(wire.Abort) == []  # (the daemon failed the round itself)
        # the failed round's id is not reused
        assert pub.publish_adapter("math", _adapter(), CONFIG, 1).update_id == NEXT_ID + 1
    assert _no_segments() == []


def test_no_reply_times_out_aborts_and_frees_the_part(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    inner = Adapterd()

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        return [] if isinstance(msg, wire.AdapterData) else inner(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint, timeout_s=0.5) as pub:
        with pytest.raises(SlotsyncTimeout) as ei:
            pub.publish_adapter("math", _adapter(), CONFIG, 1)
        assert ei.value.phase == "adapter_data" and ei.value.update_id == NEXT_ID
        assert "Ack(adapter_data) for update 7" in str(ei.value)
        assert _no_segments() == [] and pub.update_id is None
        _wait_for(lambda: daemon.of_type(wire.Abort))
        (abort,) = daemon.of_type(wire.Abort)
        assert abort.update_id == NEXT_ID and "SlotsyncTimeout" in abort.reason
    assert _no_segments() == []


def _wait_for(cond: Callable[[], object], timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_a_daemon_gone_mid_round_raises_daemon_gone_and_frees_the_part(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    inner = Adapterd()
    holder: list[FakeDaemon] = []

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.AdapterData):  # the daemon dies with the part in hand
            threading.Thread(target=holder[0].close, daemon=True).start()
            return []
        return inner(msg)

    holder.append(make_daemon(script))
    with _publisher(endpoint, timeout_s=30, liveness_s=1.0) as pub:
        with pytest.raises(SlotsyncError) as ei:
            pub.publish_adapter("math", _adapter(), CONFIG, 1)
        assert ei.value.code == DAEMON_GONE and ei.value.phase == "adapter_data"
        assert "lost the connection to slotsyncd" in str(ei.value)
        assert "Ack(adapter_data) for update 7" in str(ei.value)
        assert _no_segments() == [] and pub.update_id is None
    assert _no_segments() == []


def test_an_interrupt_while_waiting_aborts_and_frees_the_part(
        make_daemon: Callable[..., FakeDaemon], endpoint: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = make_daemon(Adapterd())
    with _publisher(endpoint) as pub:
        real = pub._waits.wait

        def wait(awaited):  # (Ctrl-C while the engines load)
            if awaited.phase == "adapter_data":
                assert _no_segments() != []  # (the part is alive until the answer)
                raise KeyboardInterrupt
            return real(awaited)

        monkeypatch.setattr(pub._waits, "wait", wait)
        with pytest.raises(KeyboardInterrupt):
            pub.publish_adapter("math", _adapter(), CONFIG, 1)
        assert _no_segments() == [] and pub.update_id is None
        _wait_for(lambda: daemon.of_type(wire.Abort))
        assert daemon.of_type(wire.Abort)[0].update_id == NEXT_ID
    assert _no_segments() == []


def _old_daemon_error(msg: wire.ToDaemon, frame: bytes) -> wire.Error:
    """What a slotsyncd from before issue 36 answers a registered rank's AdapterBegin: its
    decoder lacks the adapter messages (msgspec's own text), worded by the daemon's
    ``malformed.describe`` as ``SlotCoordinator.on_bad_message`` sends it."""
    from slotsync.daemon.core import malformed

    old = msgspec.msgpack.Decoder(wire.Register | wire.Begin | wire.Chunk | wire.Commit
                                  | wire.Abort | wire.Query | wire.Close)
    with pytest.raises(msgspec.ValidationError) as ei:
        old.decode(frame)
    err = wire.ProtocolError(f"bad message: {ei.value}", "adapter_begin", "type",
                             msg.update_id)  # type: ignore[union-attr]
    return wire.Error(malformed.phase_of(err), malformed.describe(1, err), [0, 2],
                      err.update_id, [], False)


def test_a_daemon_older_than_adapter_rounds_is_named(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.AdapterBegin):
            return [_old_daemon_error(msg, wire.encode(msg))]
        return happy(msg)

    make_daemon(script)
    with _publisher(endpoint) as pub:
        with pytest.raises(SlotsyncError) as ei:
            pub.publish_adapter("math", _adapter(), CONFIG, 1)
        e = ei.value
        assert e.code == ADAPTERS_UNSUPPORTED and e.phase == "adapter_begin"
        assert "does not know adapter rounds" in e.message and endpoint in e.message
        assert "Invalid value 'adapter_begin'" in e.message  # (what the daemon said)
        assert _no_segments() == [] and pub.update_id is None
    assert _no_segments() == []


def test_a_daemon_restart_before_the_begins_ack_registers_again_and_begins_once_more(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    inner = Adapterd()
    restarted = {"done": False}

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.AdapterBegin) and not restarted["done"]:
            restarted["done"] = True
            return [wire.Error("register", "adapter_begin from a connection that has not "
                               "registered", update_id=msg.update_id,
                               code=wire.NOT_REGISTERED)]
        if isinstance(msg, wire.Register) and restarted["done"]:
            return [wire.Registered(rank=msg.rank, slot_start=msg.slot_start,
                                    slot_size=msg.slot_size, next_update_id=20)]
        return inner(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint) as pub:
        stats = pub.publish_adapter("math", _adapter(), CONFIG, 1)
        assert stats.update_id == 20
        assert [b.update_id for b in daemon.of_type(wire.AdapterBegin)] == [NEXT_ID, 20]
        assert len(daemon.of_type(wire.Register)) == 2
        b0, b1 = daemon.of_type(wire.AdapterBegin)
        assert b0.tensors == b1.tensors  # (the same part, digests taken once)
    assert _no_segments() == []


def _bad_inputs() -> list[tuple[str, dict, str]]:
    """(id, publish_adapter keyword arguments, text of the error)."""
    a = _adapter()
    q = f"{PREFIX}.q_proj.lora_A.weight"
    return [
        ("adapter-name-in-name", {"tensors": {f"{PREFIX}.q_proj.lora_A.default.weight": a[q]}},
         "still holds the adapter name 'default'"),
        ("embedding-adapter-name", {"tensors": {"base_model.model.embed.lora_embedding_A.x":
                                                a[q]}}, "get_peft_model_state_dict"),
        ("dtype", {"tensors": {q: a[q].to(torch.complex64)}}, "is not supported"),
        ("meta", {"tensors": {q: torch.empty(4, 16, device="meta")}}, "meta device"),
        ("scalar", {"tensors": {q: torch.tensor(1.0)}}, "has no dims"),
        ("no-rows", {"tensors": {q: torch.empty(0, 16)}}, "has no rows"),
        ("duplicate", {"tensors": [(q, a[q]), (q, a[q])]}, "appears twice"),
        ("not-a-tensor", {"tensors": {q: [1.0]}}, "torch.Tensor"),
        ("rows-outside", {"tensors": {q: a[q]}, "rows": {q: (2, (5, 16))}}, "does not fit"),
        ("rows-dims", {"tensors": {q: a[q]}, "rows": {q: (0, (8, 15))}}, "does not fit"),
        ("rows-unknown", {"tensors": {q: a[q]}, "rows": {"other": (0, (4, 16))}},
         "not in tensors"),
        ("rows-form", {"tensors": {q: a[q]}, "rows": {q: 3}}, "(row_start, whole_shape)"),
        ("version-negative", {"version": -1}, "version must be >= 0"),
        ("version-huge", {"version": 1 << 63}, "below 2**63"),
        ("version-bool", {"version": True}, "version must be an int"),
        ("version-str", {"version": "3"}, "version must be an int"),
        ("config-no-r", {"config": {"target_modules": ["q_proj"]}}, "'r' must be a positive"),
        ("config-no-targets", {"config": {"r": 4}}, "target_modules"),
        ("config-not-json", {"config": "{r: 4"}, "config is not JSON"),
        ("config-object", {"config": {"r": 4, "target_modules": ["q"], "x": object()}},
         "config['x'] holds a object"),
        ("lora-name", {"lora_name": "math/v2"}, "lora_name 'math/v2' must be 1-64"),
        ("lora-name-type", {"lora_name": 3}, "lora_name must be a str"),
    ]


@pytest.mark.parametrize("kwargs,text", [c[1:] for c in _bad_inputs()],
                         ids=[c[0] for c in _bad_inputs()])
def test_bad_input_is_refused_before_anything_is_sent(
        make_daemon: Callable[..., FakeDaemon], endpoint: str, kwargs: dict,
        text: str) -> None:
    daemon = make_daemon(Adapterd())
    args = {"lora_name": "math", "tensors": _adapter(), "config": CONFIG, "version": 1, **kwargs}
    with _publisher(endpoint) as pub:
        with pytest.raises((ValueError, TypeError)) as ei:
            pub.publish_adapter(args.pop("lora_name"), args.pop("tensors"),
                                args.pop("config"), args.pop("version"), **args)
        assert text in str(ei.value)
        assert daemon.of_type(wire.AdapterBegin) == [] and pub.update_id is None
        assert _no_segments() == []


def test_a_part_over_the_cap_is_refused_naming_the_likely_mistake(
        make_daemon: Callable[..., FakeDaemon], endpoint: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = make_daemon(Adapterd())
    monkeypatch.setattr(adapter_inputs, "MAX_PART_BYTES", 100)
    with _publisher(endpoint) as pub, pytest.raises(ValueError, match="base model's state_dict"):
        pub.publish_adapter("math", _adapter(), CONFIG, 1)
    assert daemon.of_type(wire.AdapterBegin) == []


def test_a_begin_over_the_daemons_message_cap_is_refused_before_it_is_sent(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.Register):
            return [wire.Registered(rank=msg.rank, slot_start=msg.slot_start,
                                    slot_size=msg.slot_size, next_update_id=NEXT_ID,
                                    max_message_bytes=400)]
        return Adapterd()(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint) as pub, pytest.raises(ValueError, match="max_message_bytes of 400"):
        pub.publish_adapter("math", _adapter(), CONFIG, 1)
    assert daemon.of_type(wire.AdapterBegin) == [] and _no_segments() == []


def test_config_text_is_the_same_on_every_rank_whatever_its_form() -> None:
    text = adapter_inputs.config_text(CONFIG)
    assert json.loads(text)["target_modules"] == ["q_proj", "v_proj"]
    # the adapter_config.json text (target_modules in another order) gives the same text
    other = json.dumps({**CONFIG, "target_modules": ["v_proj", "q_proj"]})
    assert adapter_inputs.config_text(other) == text
    # enums are their values (PEFT's PeftType is a str enum; TaskType too)
    import enum

    class Kind(enum.Enum):
        LORA = "LORA"

    assert adapter_inputs.config_text({**CONFIG, "peft_type": Kind.LORA}) == text


def test_chunk_rows_is_torch_chunks_split() -> None:
    # (FSDP2's fully_shard and DTensor's Shard(0) cut dim 0 with torch.chunk)
    for dim0 in range(12):
        for world in range(1, 5):
            pieces = list(torch.arange(dim0).chunk(world)) if dim0 else []
            for i in range(world):
                start, stop = adapter_inputs.chunk_rows(dim0, world, i)
                want = pieces[i].tolist() if i < len(pieces) else []
                assert list(range(start, stop)) == want, (dim0, world, i)


@pytest.mark.parametrize("whole", [False, True], ids=["padded", "file"])
@pytest.mark.parametrize("transport,fail", [("device", False), ("device", True),
                                            ("host", False)])
def test_a_cuda_rank_packs_one_device_buffer_exports_it_and_gives_it_back_when_unacked(
        make_daemon: Callable[..., FakeDaemon], endpoint: str,
        monkeypatch: pytest.MonkeyPatch, transport: str, fail: bool, whole: bool) -> None:
    """The cuda transport's path on the CPU: the "device" buffer is a CPU tensor, its export
    a stand-in record (test_publisher.py's), as the unpacked tests do. "device": the part is
    exported from the packed buffer and the host copy unlinked before the data goes out; an
    export the daemon did not acknowledge is given back (an Error at the data), one it did
    is not; "host": the segment goes, the buffer is never exported. ``file``: tensors that
    fit a safetensors file (the host segment starts with its header: the "host" handle
    starts after it, the "device" export of the packed buffer at 0); ``padded``: they do
    not."""
    from slotsync.protocol.rank.adapters import part as adapter_part

    exported: list[bytes] = []
    released: list[int] = []
    collected: list[int] = []

    def export(buf: torch.Tensor) -> wire.CudaIpcHandle:
        exported.append(buf.numpy().tobytes())
        return test_publisher._stand_in_cuda_handle(buf.numel(), 5)

    monkeypatch.setattr(adapter_part, "cuda_ipc_handle", export)
    monkeypatch.setattr(adapter_part, "release_unconsumed",
                        lambda h: released.append(h.ref_counter_offset))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collected.append(1))
    inner = Adapterd(transport)
    segments_at_data: list[list[str]] = []

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.AdapterData):
            segments_at_data.append(_no_segments())
            if fail:
                return [wire.Error("adapter_data", "engine 0 died mid-load", [0, 2],
                                   msg.update_id)]
        return inner(msg)

    daemon = make_daemon(script)
    tensors = _whole_adapter() if whole else _adapter()
    with _publisher(endpoint) as pub:
        pub.transport = "cuda"  # (its device stays the CPU: the buffer is a CPU tensor)
        if fail:
            with pytest.raises(SlotsyncError, match="died mid-load"):
                pub.publish_adapter("math", tensors, CONFIG, 1)
        else:
            assert pub.publish_adapter("math", tensors, CONFIG, 1).transport == transport
        (data,) = daemon.of_type(wire.AdapterData)
        offsets, total = wire.part_offsets(daemon.of_type(wire.AdapterBegin)[0].tensors)
        if transport == "device":
            assert isinstance(data.handle, wire.CudaIpcHandle) and data.handle.nbytes == total
            (blob,) = exported
            assert segments_at_data == [[]]  # (the host copy went before the data)
            assert released == ([5] if fail else []) and collected == [1]
        else:
            assert isinstance(data.handle, wire.ShmHandle) and exported == released == []
            assert (data.handle.offset > 0) == whole and data.handle.nbytes == total
            (blob,) = inner.parts
            assert collected == []
        for off, src in zip(offsets, tensors.values(), strict=True):
            assert blob[off : off + len(_raw(src))] == _raw(src)
        assert _no_segments() == []
    assert _no_segments() == []


def _whole_adapter() -> dict[str, torch.Tensor]:
    """Whole tensors whose sizes are multiples of 256 bytes (but the last): a part the rank
    lays out as a safetensors file (``wire.adapter.file_header``)."""
    g = torch.Generator().manual_seed(4)
    return {
        f"{PREFIX}.q_proj.lora_A.weight": torch.randn(4, 32, generator=g).to(torch.bfloat16),
        f"{PREFIX}.q_proj.lora_B.weight": torch.randn(32, 4, generator=g).to(torch.bfloat16),
        f"{PREFIX}.v_proj.lora_A.weight": torch.randn(16, 4, generator=g).t(),  # 256 bytes
        f"{PREFIX}.v_proj.lora_B.weight": torch.randn(5, 3, generator=g),  # last: any size
    }


class SegmentProbe(Adapterd):
    """Adapterd that also looks at the whole segment at the AdapterData, while the rank
    waits for the ack: its bytes, its mode, and whether the kernel grants a read lease (no
    process holds it open for writing)."""

    def __init__(self, transport: str = "host") -> None:
        super().__init__(transport)
        self.seen: list[tuple[bytes, int, bool]] = []

    def __call__(self, msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.AdapterData) and isinstance(msg.handle, wire.ShmHandle):
            import fcntl
            import os
            import stat

            fd = os.open(f"/dev/shm/{msg.handle.segment}", os.O_RDONLY)
            try:
                try:
                    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
                    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
                    lease = True
                except OSError:
                    lease = False
                size = os.fstat(fd).st_size
                self.seen.append((os.pread(fd, size, 0),
                                  stat.S_IMODE(os.fstat(fd).st_mode), lease))
            finally:
                os.close(fd)
        return super().__call__(msg)


@pytest.mark.parametrize("transport", ["host", "device"])
def test_a_part_of_whole_tensors_is_a_safetensors_file_sealed_for_the_host_transport(
        make_daemon: Callable[..., FakeDaemon], endpoint: str, transport: str) -> None:
    """Whole tensors (the part of a rank holding the adapter alone): the segment is a
    complete safetensors file (the safetensors package reads the trainer's tensors back
    from it), the handle starts after its header (the tensors at ``part_offsets`` from
    there, as any daemon reads them) and the begin's digests are of those bytes. "host":
    sealed before the AdapterData -- mode 0444, and no process holds it open for writing
    (a read lease is granted), so the daemon may link it; "device" (shm: the engine maps
    it): not sealed. Nothing left in /dev/shm after the ack."""
    from safetensors.torch import load as st_load

    script = SegmentProbe(transport)
    daemon = make_daemon(script)
    tensors = _whole_adapter()
    with _publisher(endpoint) as pub:
        pub.publish_adapter("math", tensors, CONFIG, 3)
    (begin,) = daemon.of_type(wire.AdapterBegin)
    (data,) = daemon.of_type(wire.AdapterData)
    ((file, mode, lease),) = script.seen
    header_len = 8 + int.from_bytes(file[:8], "little")
    assert data.handle.offset == header_len and header_len % wire.ADAPTER_ALIGN == 0
    assert len(file) == header_len + data.handle.nbytes
    back = st_load(file)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(back[name], t), name
    assert [t.sha256 for t in begin.tensors] == [_sha(t) for t in tensors.values()]
    offsets, _ = wire.part_offsets(begin.tensors)
    (blob,) = script.parts
    for off, src in zip(offsets, tensors.values(), strict=True):
        assert blob[off : off + len(_raw(src))] == _raw(src)
    assert (mode, lease) == ((0o444, True) if transport == "host" else (0o600, False))
    assert _no_segments() == []


def test_a_part_in_rows_or_with_padding_is_laid_out_at_offset_0_unsealed(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    """A part that cannot be a safetensors file -- a tensor's rows only, or whole tensors
    that would need padding between them (``_adapter``: 128-byte tensors) -- is laid out at
    offset 0 of its segment as before, and not sealed (the daemon copies and hashes it)."""
    script = SegmentProbe()
    make_daemon(script)
    whole = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    name = f"{PREFIX}.q_proj.lora_B.weight"
    with _publisher(endpoint) as pub:
        pub.publish_adapter("math", {name: whole[32:]}, CONFIG, 1, rows={name: (32, (64, 8))})
        pub.publish_adapter("math", _adapter(), CONFIG, 2)
    for _file, mode, lease in script.seen:
        assert (mode, lease) == (0o600, False)
    assert script.seen[0][0] == _raw(whole[32:])
    assert _no_segments() == []

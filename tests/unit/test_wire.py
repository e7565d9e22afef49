"""The wire codec: round trips, validation on decode, UUID normalization, fuzzed input."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slotsync.protocol.wire import (
    PROTOCOL_VERSION,
    Ack,
    Begin,
    Chunk,
    ChunkMetaCache,
    Commit,
    CudaIpcHandle,
    Error,
    OutgoingChunk,
    ProtocolError,
    Register,
    ShmHandle,
    decode_from_daemon,
    decode_to_daemon,
    encode,
    logical_gpu_uuid,
    normalize_gpu_uuid,
)

UUID = "8a1e2c3d-4b5f-6789-abcd-ef0123456789"


def cuda_handle(**kw) -> CudaIpcHandle:
    f = dict(tensor_class="torch.Tensor", size=(4,), stride=(1,), storage_offset=0,
             storage_class="torch.storage.TypedStorage", dtype="bfloat16", device=0,
             ipc_handle=b"h" * 64, storage_size_bytes=8, storage_offset_bytes=0,
             requires_grad=False, ref_counter_handle=b"r" * 10, ref_counter_offset=0,
             event_handle=None, event_sync_required=True)
    f.update(kw)
    return CudaIpcHandle(**f)


def test_round_trip_every_message():
    msgs = [
        Register(PROTOCOL_VERSION, 1, UUID, 0, 2, "http://x:1", True, "cuda", "host", 7),
        Begin(3, "step-3"),
        Chunk(3, 0, ["w"], ["bfloat16"], [[4]], [8], [cuda_handle()]),
        Commit(3, 1),
    ]
    for m in msgs:
        assert decode_to_daemon(encode(m)) == m
    for m in [Ack(3, "chunk", 0), Error("chunk", "bad", [0, 2], 3, [1])]:
        assert decode_from_daemon(encode(m)) == m


def test_outgoing_chunk_is_a_chunk_on_the_wire_and_checked_on_decode():
    """The publisher's unchecked ``OutgoingChunk`` encodes to exactly a ``Chunk``'s bytes, so
    the daemon decodes (and checks) it as one; a bad one is refused there."""
    fields = dict(update_id=3, index=1, names=["a", "b"], dtype_names=["bfloat16", "int64"],
                  shapes=[[2, 2], [3]], tensor_sizes=[8, 24],
                  handles=[cuda_handle(size=(32,), storage_size_bytes=32)])
    assert encode(OutgoingChunk(**fields)) == encode(Chunk(**fields))
    assert decode_to_daemon(encode(OutgoingChunk(**fields))) == Chunk(**fields)
    bad = OutgoingChunk(**{**fields, "tensor_sizes": [8, 25]})  # no check when built
    with pytest.raises(ProtocolError, match="tensor_sizes says 25 bytes"):
        decode_to_daemon(encode(bad))


@pytest.mark.parametrize("raw,want", [
    ("GPU-8A1E2C3D-4B5F-6789-ABCD-EF0123456789", UUID),
    (UUID, UUID),
    ("  gpu-" + UUID + " ", UUID),
])
def test_gpu_uuid_normalized_to_torch_format(raw, want):
    assert normalize_gpu_uuid(raw) == want


def test_register_normalizes_uuid_and_rejects_garbage():
    r = Register(PROTOCOL_VERSION, 0, "GPU-" + UUID.upper(), 0, 1, "http://e:1", True, "cuda")
    assert decode_to_daemon(encode(r)).gpu_uuid == UUID
    bad = msgspec.msgpack.encode({"type": "register", "protocol_version": PROTOCOL_VERSION,
                                  "rank": 0, "gpu_uuid": "GPU-xyz", "slot_start": 0, "slot_size": 1,
                                  "engine_url": "http://e:1", "packed": True, "transport": "cuda"})
    with pytest.raises(ProtocolError, match="not a GPU UUID"):
        decode_to_daemon(bad)


def test_rank_outside_its_slot_rejected():
    bad = msgspec.msgpack.encode({"type": "register", "protocol_version": PROTOCOL_VERSION,
                                  "rank": 5, "gpu_uuid": UUID, "slot_start": 0, "slot_size": 4,
                                  "engine_url": "http://e:1", "packed": True, "transport": "cuda"})
    with pytest.raises(ProtocolError, match=r"rank 5 is outside its own slot \[0, 4\)"):
        decode_to_daemon(bad)


def test_chunk_validation_names_the_field():
    def enc(**kw):
        d = {"type": "chunk", "update_id": 0, "index": 0, "names": ["a"],
             "dtype_names": ["float32"], "shapes": [[2]], "tensor_sizes": [8],
             "handles": [["shm", "s", 0, 8]]}
        d.update(kw)
        return msgspec.msgpack.encode(d)

    decode_to_daemon(enc())
    with pytest.raises(ProtocolError, match="tensor_sizes says 4 bytes"):
        decode_to_daemon(enc(tensor_sizes=[4]))
    with pytest.raises(ProtocolError, match=r"Invalid enum value 'complex32' - at "
                                            r"`\$\.dtype_names\[0\]`"):
        decode_to_daemon(enc(dtype_names=["complex32"]))
    with pytest.raises(ProtocolError, match="shapes has 2 entries"):
        decode_to_daemon(enc(shapes=[[2], [2]]))
    with pytest.raises(ProtocolError, match=r"Expected `int`, got `str` - at `\$.update_id`"):
        decode_to_daemon(enc(update_id="x"))
    with pytest.raises(ProtocolError, match="unknown field"):
        decode_to_daemon(enc(surprise=1))
    with pytest.raises(ProtocolError, match="packed buffer handle covers 4 bytes"):
        decode_to_daemon(enc(names=["a", "b"], dtype_names=["float32"] * 2, shapes=[[2], [2]],
                             tensor_sizes=[8, 8],
                             handles=[["shm", "s", 0, 4]]))
    with pytest.raises(ProtocolError, match="bad shared-memory segment name"):
        decode_to_daemon(enc(handles=[["shm", "../etc", 0, 8]]))


def test_handle_records_are_arrays_on_the_wire():
    # Protocol version 2: a record is [tag, field 1, ..., field n] in declaration order.
    h = cuda_handle(event_handle=b"e" * 64)
    raw = msgspec.msgpack.decode(encode(h))
    assert raw == ["cuda", "torch.Tensor", [4], [1], 0, "torch.storage.TypedStorage",
                   "bfloat16", 0, b"h" * 64, 8, 0, False, b"r" * 10, 0, b"e" * 64, True]
    assert msgspec.msgpack.decode(encode(ShmHandle("seg", 4, 8))) == ["shm", "seg", 4, 8]
    assert PROTOCOL_VERSION == 2
    chunk = Chunk(3, 0, ["w"], ["bfloat16"], [[4]], [8], [h])
    assert decode_to_daemon(encode(chunk)) == chunk


def test_handle_record_rejects_bad_lengths_and_classes():
    raw = msgspec.msgpack.decode(encode(cuda_handle()))
    pos = {f: i + 1 for i, f in enumerate(CudaIpcHandle.__struct_fields__)}  # 0: the tag
    dec = msgspec.msgpack.Decoder(CudaIpcHandle)
    for key, value, text in [
        ("ipc_handle", b"", r"length >= 1 - at `\$\[8\]`"),
        ("ipc_handle", b"x" * 300, "length <= 256"),
        ("tensor_class", "os.system", r"Invalid enum value 'os.system' - at `\$\[1\]`"),
        ("dtype", "object", r"Invalid enum value 'object' - at `\$\[6\]`"),
        ("storage_offset", -1, r"Expected `int` >= 0 - at `\$\[4\]`"),
        ("ref_counter_offset", -8, r"Expected `int` >= 0 - at `\$\[13\]`"),
        ("stride", [1, 1], "size has 1 dims but stride has 2"),
    ]:
        bad = list(raw)
        bad[pos[key]] = value
        with pytest.raises(msgspec.ValidationError, match=text):
            dec.decode(msgspec.msgpack.encode(bad))
    with pytest.raises(msgspec.ValidationError, match="at least length 16, got 15"):
        dec.decode(msgspec.msgpack.encode(raw[:-1]))
    with pytest.raises(msgspec.ValidationError, match="at most length 15, got 16"):
        dec.decode(msgspec.msgpack.encode([*raw, 0]))  # (msgspec counts without the tag)


def test_bad_handle_field_named_in_the_daemons_error():
    # The daemon's ProtocolError names the record kind and field, not just the array position.
    def enc(handle: list) -> bytes:
        return msgspec.msgpack.encode({
            "type": "chunk", "update_id": 0, "index": 0, "names": ["a", "b"],
            "dtype_names": ["float32"] * 2, "shapes": [[2]] * 2, "tensor_sizes": [8] * 2,
            "handles": [msgspec.msgpack.decode(encode(cuda_handle())), handle]})

    good = msgspec.msgpack.decode(encode(cuda_handle()))
    for k, value, text in [
        (6, "object", r"'object' - at `\$\.handles\[1\]\[6\]` \(CudaIpcHandle field 'dtype'\)"),
        (4, -1, r">= 0 - at `\$\.handles\[1\]\[4\]` \(CudaIpcHandle field 'storage_offset'\)"),
        (10, -1, r"\(CudaIpcHandle field 'storage_offset_bytes'\)"),
        (0, "pickle", r"Invalid value 'pickle' .*\(the record's tag: one of \['cuda', 'shm'\]\)"),
    ]:
        bad = list(good)
        bad[k] = value
        with pytest.raises(ProtocolError, match=text):
            decode_to_daemon(enc(bad))
    with pytest.raises(ProtocolError, match=r"\(ShmHandle field 'offset'\)"):
        decode_to_daemon(enc(["shm", "seg", -4, 8]))
    old_style = {"type": "shm", "segment": "seg", "offset": 0, "nbytes": 8}  # version 1
    with pytest.raises(ProtocolError, match="handle records are arrays since protocol version 2"):
        decode_to_daemon(enc(old_style))  # type: ignore[arg-type]


def test_chunk_built_in_python_checks_dtype_and_sizes():
    # Decoding checks dtype names in C (Literal); a Chunk constructed directly still refuses.
    with pytest.raises(ValueError, match="tensor 'b': unsupported dtype 'complex32'"):
        Chunk(0, 0, ["a", "b"], ["float32", "complex32"], [[2], [2]], [8, 8],
              [ShmHandle("s", 0, 16)])
    with pytest.raises(ValueError, match=r"tensor 'b': tensor_sizes says 9 bytes but shape "
                                         r"\[2, 3\] of int8 is 6 bytes"):
        Chunk(0, 0, ["a", "b"], ["float32", "int8"], [[], [2, 3]], [4, 9],
              [ShmHandle("s", 0, 16)])
    Chunk(0, 0, ["a", "b"], ["float32", "int8"], [[], [2, 3]], [4, 6], [ShmHandle("s", 0, 16)])


def test_oversize_frame_refused_before_decoding():
    with pytest.raises(ProtocolError, match="exceeds the 1024-byte cap"):
        decode_to_daemon(b"\x00" * 2000, max_bytes=1024)


def test_logical_uuids_are_stable_and_valid():
    assert logical_gpu_uuid(3) == logical_gpu_uuid(3) != logical_gpu_uuid(4)
    assert normalize_gpu_uuid(logical_gpu_uuid(3)) == logical_gpu_uuid(3)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_never_crash_decoder(data):
    try:
        decode_to_daemon(data)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_truncated_and_mutated_valid_frames(data):
    frame = encode(Chunk(1, 0, ["a", "b"], ["float32", "int8"], [[2], [3]], [8, 3],
                         [ShmHandle("seg", 0, 11)]))
    cut = data.draw(st.integers(0, len(frame)))
    pos = data.draw(st.integers(0, len(frame) - 1))
    val = data.draw(st.integers(0, 255))
    mutated = bytearray(frame[:cut])
    if pos < len(mutated):
        mutated[pos] = val
    try:
        decode_to_daemon(bytes(mutated))
    except ProtocolError:
        pass


def _decode_or_error(frame: bytes, cache: ChunkMetaCache | None = None) -> object:
    try:
        return decode_to_daemon(frame, cache=cache)
    except ProtocolError as e:
        return f"ProtocolError: {e}"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_chunk_meta_cache_decodes_exactly_like_the_full_decode(data):
    """With a cache that holds a valid chunk's lists, any mutation of that chunk's frame
    decodes to the same message, or fails with the same error, as without the cache."""
    frame = encode(Chunk(1, 0, ["a", "b"], ["float32", "int8"], [[2], [3]], [8, 3],
                         [ShmHandle("seg", 0, 11)]))
    cache = ChunkMetaCache()
    decode_to_daemon(frame, cache=cache)
    pos = data.draw(st.integers(0, len(frame) - 1))
    val = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(pos + 1, len(frame)))
    mutated = bytearray(frame[:cut])
    mutated[pos] = val
    assert _decode_or_error(bytes(mutated), cache) == _decode_or_error(bytes(mutated))


def test_chunk_meta_cache_reuses_checked_lists_and_checks_the_rest():
    """A round re-sends the same chunk lists with new ids and handles: they come from the
    cache; other lists, and handles that do not fit the chunk, take the full decode."""
    cache = ChunkMetaCache()
    lists = dict(names=["a", "b"], dtype_names=["float32", "int8"], shapes=[[2], [3]],
                 tensor_sizes=[8, 3])
    first = decode_to_daemon(encode(Chunk(1, 0, **lists, handles=[ShmHandle("s", 0, 11)])),
                             cache=cache)
    again = Chunk(2, 5, **lists, handles=[ShmHandle("t", 64, 16)])
    got = decode_to_daemon(encode(again), cache=cache)
    assert got == again and cache.hits == 1
    assert got.names is first.names  # shared, already checked
    small = msgspec.msgpack.decode(encode(again))
    small["handles"] = [["shm", "t", 0, 4]]  # a buffer smaller than the chunk
    with pytest.raises(ProtocolError, match="packed buffer handle covers 4 bytes, chunk needs 11"):
        decode_to_daemon(msgspec.msgpack.encode(small), cache=cache)
    other = msgspec.msgpack.decode(encode(again))
    other["tensor_sizes"] = [8, 4]  # other lists: decoded and checked in full
    with pytest.raises(ProtocolError, match="tensor_sizes says 4 bytes"):
        decode_to_daemon(msgspec.msgpack.encode(other), cache=cache)
    assert cache.hits == 1 and len(cache) == 1


@pytest.mark.parametrize("url", ["file:///etc/passwd", "not a url", "ftp://x", ""])
def test_register_refuses_engine_urls_that_are_not_http_or_unix(url):
    bad = msgspec.msgpack.encode({"type": "register", "protocol_version": PROTOCOL_VERSION,
                                  "rank": 0, "gpu_uuid": UUID, "slot_start": 0, "slot_size": 1,
                                  "engine_url": url, "packed": True, "transport": "cuda"})
    with pytest.raises(ProtocolError):
        decode_to_daemon(bad)


def test_begin_manifest_is_optional_and_left_out_when_empty():
    """Issue 17: a Begin without a manifest encodes as before (a daemon that predates the
    field decodes it), one with a manifest round-trips, and a manifest that is not whole
    4-byte entries is refused naming the field."""
    plain = Begin(3, "v1")
    assert b"manifest" not in encode(plain)
    assert msgspec.msgpack.decode(encode(plain)) == {"type": "begin", "update_id": 3,
                                                      "weight_version": "v1"}
    with_manifest = Begin(3, "v1", manifest=b"\x01\x02\x03\x04" * 3)
    assert decode_to_daemon(encode(with_manifest)) == with_manifest
    bad = msgspec.msgpack.encode({"type": "begin", "update_id": 3, "weight_version": "v1",
                                  "manifest": b"\x01\x02\x03"})
    with pytest.raises(ProtocolError, match="manifest has 3 bytes"):
        decode_to_daemon(bad)


def test_draft_flags_are_omitted_when_false_and_kept_through_the_chunk_cache():
    """Issue 18: ``Begin.draft`` / ``Chunk.draft`` leave a round without a draft part encoded
    as before; a draft chunk whose lists the cache holds (the same names as a main chunk's)
    keeps its flag."""
    lists = dict(names=["a"], dtype_names=["float32"], shapes=[[2]], tensor_sizes=[8])
    main = Chunk(1, 0, **lists, handles=[ShmHandle("s", 0, 8)])
    assert b"draft" not in encode(main) and b"draft" not in encode(Begin(1, "v"))
    out = OutgoingChunk(1, 0, handles=[ShmHandle("s", 0, 8)], **lists)
    assert encode(out) == encode(main)
    draft = Chunk(1, 1, **lists, handles=[ShmHandle("s", 0, 8)], draft=True)
    assert decode_to_daemon(encode(Begin(1, "v", draft=True))).draft is True
    cache = ChunkMetaCache()
    assert decode_to_daemon(encode(main), cache=cache).draft is False
    got = decode_to_daemon(encode(draft), cache=cache)
    assert cache.hits == 1 and got.draft is True
    assert decode_to_daemon(encode(main), cache=cache).draft is False

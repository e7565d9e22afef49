"""The daemon's handwritten pickle equals what torch's own pickling of reduce_tensor args
gives (what vLLM unpickles), and the daemon module does not import torch."""

from __future__ import annotations

import base64
import pickle
import subprocess
import sys

import pytest

from slotsync.daemon.vllm.ipc_pickle import b64, pickle_packed, pickle_unpacked
from slotsync.protocol.wire import CudaIpcHandle, ShmHandle

torch = pytest.importorskip("torch")


def record(**kw) -> CudaIpcHandle:
    f = dict(tensor_class="torch.Tensor", size=(2, 3), stride=(3, 1), storage_offset=5,
             storage_class="torch.storage.TypedStorage", dtype="bfloat16", device=1,
             ipc_handle=bytes(range(64)), storage_size_bytes=2**33, storage_offset_bytes=512,
             requires_grad=False, ref_counter_handle=b"/torch_123_456", ref_counter_offset=3,
             event_handle=b"e" * 64, event_sync_required=True)
    f.update(kw)
    return CudaIpcHandle(**f)


def torch_args(h: CudaIpcHandle) -> tuple:
    cls = {"torch.Tensor": torch.Tensor, "torch.nn.parameter.Parameter": torch.nn.Parameter}
    st = {"torch.storage.TypedStorage": torch.storage.TypedStorage,
          "torch.storage.UntypedStorage": torch.storage.UntypedStorage}
    return (cls[h.tensor_class], torch.Size(h.size), tuple(h.stride), h.storage_offset,
            st[h.storage_class], getattr(torch, h.dtype), h.device, h.ipc_handle,
            h.storage_size_bytes, h.storage_offset_bytes, h.requires_grad, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle, h.event_sync_required)


def test_packed_equals_torch_pickle():
    a, b = record(), record(dtype="float32", event_handle=None, requires_grad=True,
                            tensor_class="torch.nn.parameter.Parameter")
    ours = pickle.loads(pickle_packed({"u0": a, "u1": b}))
    theirs = pickle.loads(pickle.dumps({"u0": torch_args(a), "u1": torch_args(b)}))
    assert ours == theirs
    assert type(ours["u0"][1]) is torch.Size and ours["u1"][0] is torch.nn.Parameter


def test_unpacked_one_dict_per_tensor():
    hs0 = [record(storage_offset=i) for i in range(3)]
    hs1 = [record(storage_offset=10 + i, device=0) for i in range(3)]
    ours = pickle.loads(base64.b64decode(b64(pickle_unpacked(["u0", "u1"], [hs0, hs1]))))
    assert ours == [{"u0": torch_args(hs0[i]), "u1": torch_args(hs1[i])} for i in range(3)]


def shm_args(segment: str, offset: int, nbytes: int, dtype=None, shape=None) -> tuple:
    """The 15-slot stand-in as torch would shape ``reduce_tensor(t)[1]`` of a CUDA tensor:
    a flat uint8 buffer of ``nbytes`` (packed) or the tensor's dtype and shape (unpacked)."""
    dtype = dtype or torch.uint8
    size = torch.Size(shape if shape is not None else [nbytes])
    stride = torch.empty(size, device="meta").stride()
    return (torch.Tensor, size, stride, 0, torch.storage.TypedStorage, dtype, 0,
            b"slotsync.shm:" + segment.encode(), nbytes, offset, False, b"", 0, None, False)


def test_shm_stand_in_is_a_cuda_shaped_15_tuple():
    got = pickle.loads(pickle_packed({"u": ShmHandle("seg", 4, 8)}))
    assert got == {"u": shm_args("seg", 4, 8)}
    args = got["u"]
    assert type(args[1]) is torch.Size and args[4] is torch.storage.TypedStorage
    assert args[5] is torch.uint8 and args[7] == b"slotsync.shm:seg"
    # what vLLM does with it before rebuilding (ipc_engine.receive_weights)
    list_args = list(args)
    list_args[6] = 3
    assert len(list_args) == 15


def test_shm_unpacked_carries_each_tensors_dtype_and_shape():
    hs = [ShmHandle("seg", 0, 24), ShmHandle("seg", 24, 4), ShmHandle("s2", 0, 2)]
    dts, shapes = ["float32", "bfloat16", "int8"], [[2, 3], [2], [1, 2]]
    got = pickle.loads(pickle_unpacked(["u0", "u1"], [hs, hs], dtype_names=dts, shapes=shapes))
    want = [shm_args(h.segment, h.offset, h.nbytes, getattr(torch, d), s)
            for h, d, s in zip(hs, dts, shapes, strict=True)]
    assert got == [{"u0": w, "u1": w} for w in want]
    assert got[0]["u0"][2] == (3, 1) and got[2]["u1"][5] is torch.int8
    with pytest.raises(ValueError, match="need the tensors' dtype_names and shapes"):
        pickle_unpacked(["u0"], [hs])
    with pytest.raises(ValueError, match="3 handles but 1 dtype_names"):
        pickle_unpacked(["u0"], [hs], dtype_names=["int8"], shapes=[[1]])
    with pytest.raises(ValueError, match="dtype outside the allow-list"):
        pickle_unpacked(["u0"], [hs[:1]], dtype_names=["complex64"], shapes=[[3]])
    with pytest.raises(TypeError, match="mix transports"):
        pickle_unpacked(["u0"], [[record(), hs[0]]])


def test_shm_stand_in_maps_through_the_engines_rebuild():
    """The engines' rebuild_cuda_tensor stand-in takes the tuple as vLLM passes it and
    aliases the segment: a later write to the segment shows in the tensor."""
    from multiprocessing import shared_memory

    from slotsync.engine.shm import rebuild_shm_tensor

    seg = shared_memory.SharedMemory(create=True, size=64)
    try:
        src = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        seg.buf[8:32] = src.numpy().tobytes()
        (d,) = pickle.loads(pickle_unpacked(["u"], [[ShmHandle(seg.name, 8, 24)]],
                                            dtype_names=["float32"], shapes=[[2, 3]]))
        list_args = list(d["u"])
        list_args[6] = None  # a CPU worker's device index
        t = rebuild_shm_tensor(*list_args)
        assert torch.equal(t, src) and t.dtype == torch.float32
        seg.buf[8:12] = torch.tensor([9.0]).numpy().tobytes()
        assert t[0, 0].item() == 9.0
        packed = pickle.loads(pickle_packed({"u": ShmHandle(seg.name, 8, 24)}))
        flat = rebuild_shm_tensor(*packed["u"])
        assert flat.dtype == torch.uint8 and flat.shape == (24,)
        too_big = list(list_args)
        too_big[1] = torch.Size([4, 3])
        too_big[2] = (3, 1)
        with pytest.raises(RuntimeError):
            rebuild_shm_tensor(*too_big)
        del t, flat
    finally:
        seg.close()
        seg.unlink()


def test_rebuild_cuda_tensor_accepts_the_args_signature():
    # The 15 positional fields line up with torch's rebuild function (names checked, no GPU).
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(params) == 15 and params[6] == "storage_device" and params[5] == "dtype"


def test_daemon_never_imports_torch():
    code = ("import sys, slotsync.daemon.service.server, slotsync.daemon.main, "
            "slotsync.daemon.vllm.ipc_pickle; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_unpickling_of_producer_input():
    # I6: the daemon and the wire codec never import pickle (so never load one); the only
    # pickle is the one the daemon writes opcode by opcode for vLLM.
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "src" / "slotsync"
    for path in [*sorted((root / "daemon").glob("*.py")),
                 *sorted((root / "protocol" / "wire").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name not in ("pickle", "cPickle", "dill") for a in node.names), path
            if isinstance(node, ast.ImportFrom):
                assert node.module not in ("pickle", "cPickle", "dill"), path


def test_unpacked_fast_path_equals_torch_pickle_for_every_variant():
    # Small values (one struct.pack per handle), values >= 2**31 (LONG1), no event handle,
    # Parameter / UntypedStorage, byte strings whose lengths change mid-rank, several layouts
    # repeated across tensors and ranks, and a rank whose layouts differ from rank 0's.
    variants = [
        dict(storage_size_bytes=4096),
        dict(storage_size_bytes=4096, event_handle=None),
        dict(storage_size_bytes=2**31, storage_offset_bytes=2**40),
        dict(storage_size_bytes=4096, ref_counter_offset=2**31),
        dict(storage_size_bytes=4096, device=2**31 - 1, requires_grad=True,
             event_sync_required=False),
        dict(storage_size_bytes=4096, tensor_class="torch.nn.parameter.Parameter",
             storage_class="torch.storage.UntypedStorage", dtype="float8_e4m3fn"),
        dict(storage_size_bytes=4096, ipc_handle=b"i" * 66, ref_counter_handle=b"/r" * 20),
        dict(storage_size_bytes=4096, event_handle=b"v" * 3),
        dict(storage_size_bytes=4096, size=(7,), stride=(1,), storage_offset=2**35),
        dict(storage_size_bytes=4096, size=(), stride=()),
    ]
    hs0 = [record(**v) for v in variants] + [record(**variants[0], storage_offset=9)]
    hs1 = [record(**{"device": 3, **v}) for v in reversed(variants)]
    hs1.append(record(storage_size_bytes=1))
    hs2 = [record(**variants[k % 2], size=(6,), stride=(1,)) for k in range(len(hs0))]
    uuids = ["u0", "u1", "u2"]
    ours = pickle_unpacked(uuids, [hs0, hs1, hs2])
    want = [{u: torch_args(hs[i]) for u, hs in zip(uuids, [hs0, hs1, hs2], strict=True)}
            for i in range(len(hs0))]
    assert pickle.loads(ours) == want
    got = pickle.loads(ours)
    assert got[5]["u0"][0] is torch.nn.Parameter
    assert got[1]["u0"][13] is None and got[0]["u0"][1] == torch.Size([2, 3])
    # Each distinct torch.Size / stride / UUID is built once (memo) and shared by the handles.
    assert type(got[0]["u1"][1]) is torch.Size and type(got[0]["u1"][2]) is tuple
    assert got[0]["u0"][1] is got[1]["u0"][1] is got[2]["u1"][1]  # (2, 3) in ranks 0 and 1
    assert got[0]["u0"][2] is got[10]["u0"][2]
    assert [next(iter(d)) for d in got[:2]] == ["u0", "u0"]
    assert next(iter(got[0])) is next(iter(got[1]))


def test_unpacked_repeated_handle_bytes_are_written_at_most_twice_per_rank():
    # A rank's IPC and ref-counter handles that repeat (tensors of one CUDA allocation; one
    # ref-counter file) come from the memo after their first use: inline once, built once
    # in the prelude. Repeats need not be consecutive, a value may change and come back,
    # another rank with the same value gets its own slot, and a 256-byte handle (BINBYTES,
    # not SHORT_BINBYTES) takes the same way. The objects equal torch's own pickle's.
    a, b, c, big = b"A" * 66, b"B" * 66, b"C" * 66, b"D" * 256
    ref0, ref1 = b"/torch_9_ref0", b"/torch_9_ref1"
    ipcs0 = [a, b, a, a, c, b, big, big]
    refs0 = [ref0, ref0, ref1, ref0, ref0, ref1, ref0, ref0]
    hs0 = [record(ipc_handle=i, ref_counter_handle=r, event_handle=bytes([k]) * 64,
                  storage_size_bytes=4096, device=0)
           for k, (i, r) in enumerate(zip(ipcs0, refs0, strict=True))]
    hs1 = [record(ipc_handle=bytes([k]) * 66, ref_counter_handle=ref0, event_handle=None,
                  storage_size_bytes=4096, device=7) for k in range(8)]
    ours = pickle_unpacked(["u0", "u1"], [hs0, hs1])
    got = pickle.loads(ours)
    assert got == [{"u0": torch_args(hs0[i]), "u1": torch_args(hs1[i])} for i in range(8)]
    for value, most in ((a, 2), (b, 2), (big, 2), (c, 1), (ref1, 2), (ref0, 4)):
        assert ours.count(value) == most, value[:8]
    assert got[2]["u0"][7] is got[3]["u0"][7] and got[4]["u1"][11] is got[7]["u1"][11]
    assert len(got[6]["u0"][7]) == 256
    # vLLM's own parse_update_info takes it (what /update_weights does with it)
    import os

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    ipc = pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
    engine = object.__new__(ipc.IPCWeightTransferEngine)
    engine.packed = False
    info = engine.parse_update_info({
        "names": [f"w{i}" for i in range(8)], "dtype_names": ["bfloat16"] * 8,
        "shapes": [[2, 3]] * 8, "ipc_handles_pickled": b64(ours)})
    assert info.ipc_handles == got


def test_unpacked_memo_beyond_256_slots():
    # More distinct shapes than 1-byte memo slots: LONG_BINPUT / LONG_BINGET.
    hs = [record(size=(k + 1,), stride=(k + 2,), storage_size_bytes=4096) for k in range(300)]
    got = pickle.loads(pickle_unpacked(["u0"], [hs]))
    assert got == [{"u0": torch_args(h)} for h in hs]
    assert got[299]["u0"][1] == torch.Size([300]) and got[299]["u0"][2] == (301,)


def test_unpacked_one_rank_shm_and_empty():
    hs = [ShmHandle("seg", 0, 8), ShmHandle("seg", 8, 4)]
    got = pickle.loads(pickle_unpacked(["u"], [hs], dtype_names=["uint8", "int32"],
                                       shapes=[[8], [1]]))
    assert got == [{"u": shm_args("seg", 0, 8)}, {"u": shm_args("seg", 8, 4, torch.int32, [1])}]
    assert pickle.loads(pickle_unpacked(["u0", "u1"], [[], []])) == []
    assert pickle.loads(pickle_unpacked([], [])) == []


def test_unpacked_refuses_bad_input():
    with pytest.raises(ValueError, match="2 UUIDs for 1 ranks"):
        pickle_unpacked(["a", "b"], [[record()]])
    with pytest.raises(ValueError, match="different numbers of handles"):
        pickle_unpacked(["a", "b"], [[record()], []])
    with pytest.raises(TypeError, match="not a handle record: str"):
        pickle_unpacked(["a"], [["not a handle"]])
    with pytest.raises(ValueError, match="dtype outside the allow-list"):
        pickle_unpacked(["a"], [[record(dtype="complex64")]])  # constructed, not decoded


def test_json_encoder_writes_pickle_bytes_as_standard_base64():
    # MergedChunk.update_info carries the raw pickle; msgspec's JSON must give b64()'s text.
    import json

    import msgspec

    for pk in (pickle_unpacked(["u0"], [[record(), record(event_handle=None)]]), b"",
               b"\xff", b"\xfb\xef", bytes(range(256)) * 7):
        assert json.loads(msgspec.json.encode({"p": pk}))["p"] == b64(pk)


def test_vllms_own_receive_path_maps_the_shm_stand_in():
    """vLLM's own parse_update_info (unpickling ipc_handles_pickled) and receive code, with
    the engines' CPU stand-in for rebuild_cuda_tensor / the GPU UUID lookup
    (slotsync.engine.cuda_standin), map the daemon's shared-memory tuples: unpacked through
    ipc_engine.rebuild_cuda_tensor, packed through PackedBufferImporter (which imports
    torch's rebuild_cuda_tensor lazily)."""
    import json
    import os
    from multiprocessing import shared_memory

    import msgspec

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    ipc = pytest.importorskip("vllm.distributed.weight_transfer.ipc_engine")
    from slotsync.daemon.vllm.merge import merge_chunk
    from slotsync.engine import cuda_standin
    from slotsync.protocol.wire import Chunk

    class Model:
        loaded: list = []

        def load_weights(self, weights):
            self.loaded = [(n, t.clone()) for n, t in weights]

    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([7, 8],
                                                                            dtype=torch.int16)
    seg = shared_memory.SharedMemory(create=True, size=64)
    cuda_standin.install(torch.device("cpu"), "u0")
    try:
        seg.buf[0:24] = a.numpy().tobytes()
        seg.buf[24:28] = b.numpy().tobytes()
        for packed in (False, True):
            hs = ([ShmHandle(seg.name, 0, 28)] if packed
                  else [ShmHandle(seg.name, 0, 24), ShmHandle(seg.name, 24, 4)])
            chunk = Chunk(1, 0, ["a", "b"], ["float32", "int16"], [[2, 3], [2]], [24, 4], hs)
            merged = merge_chunk(0, {0: chunk}, {0: "u0"}, packed=packed, transport="shm",
                                 world_size=1)
            info = json.loads(msgspec.json.encode(merged.update_info))
            engine = object.__new__(ipc.IPCWeightTransferEngine)
            engine.packed, engine.device = packed, torch.device("cpu")
            engine._packed_importer = ipc.PackedBufferImporter()
            engine.model = model = Model()
            engine.receive_weights(engine.parse_update_info(info))
            assert [n for n, _ in model.loaded] == ["a", "b"]
            assert torch.equal(model.loaded[0][1], a) and torch.equal(model.loaded[1][1], b)
            # a handle without this worker's UUID: vLLM's own error text
            bad = {**info, "ipc_handles_pickled": b64(pickle_unpacked(
                ["u9"], [hs], dtype_names=["float32", "int16"], shapes=[[2, 3], [2]])
                if not packed else pickle_packed({"u9": hs[0]}))}
            with pytest.raises(ValueError, match=r"IPC handle not found for GPU UUID u0\. "
                                                 r"Available UUIDs: \['u9'\]"):
                engine.receive_weights(engine.parse_update_info(bad))
    finally:
        cuda_standin.uninstall()
        seg.close()
        seg.unlink()
    assert torch.multiprocessing.reductions.rebuild_cuda_tensor.__module__ == \
        "torch.multiprocessing.reductions"

"""The daemon's handwritten pickle equals what torch's own pickling of reduce_tensor args
gives (what vLLM unpickles), and the daemon module does not import torch."""

from __future__ import annotations

import base64
import pickle
import subprocess
import sys

import pytest

from slotsync.daemon.vllm_pickle import b64, pickle_packed, pickle_unpacked
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


def test_shm_stand_in_is_plain_tuple():
    assert pickle.loads(pickle_packed({"u": ShmHandle("seg", 4, 8)})) == {
        "u": ("slotsync.shm", "seg", 4, 8)}


def test_rebuild_cuda_tensor_accepts_the_args_signature():
    # The 15 positional fields line up with torch's rebuild function (names checked, no GPU).
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor
    params = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert len(params) == 15 and params[6] == "storage_device" and params[5] == "dtype"


def test_daemon_never_imports_torch():
    code = ("import sys, slotsync.daemon.service, slotsync.daemon.main, "
            "slotsync.daemon.vllm_pickle; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_unpickling_of_producer_input():
    # I6: the daemon and the wire codec never import pickle (so never load one); the only
    # pickle is the one the daemon writes opcode by opcode for vLLM.
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in [*sorted((root / "daemon").glob("*.py")), root / "protocol" / "wire.py"]:
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


def test_unpacked_memo_beyond_256_slots():
    # More distinct shapes than 1-byte memo slots: LONG_BINPUT / LONG_BINGET.
    hs = [record(size=(k + 1,), stride=(k + 2,), storage_size_bytes=4096) for k in range(300)]
    got = pickle.loads(pickle_unpacked(["u0"], [hs]))
    assert got == [{"u0": torch_args(h)} for h in hs]
    assert got[299]["u0"][1] == torch.Size([300]) and got[299]["u0"][2] == (301,)


def test_unpacked_one_rank_shm_and_empty():
    hs = [ShmHandle("seg", 0, 8), ShmHandle("seg", 8, 4)]
    assert pickle.loads(pickle_unpacked(["u"], [hs])) == [
        {"u": ("slotsync.shm", "seg", 0, 8)}, {"u": ("slotsync.shm", "seg", 8, 4)}]
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

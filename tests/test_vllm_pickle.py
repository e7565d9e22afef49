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

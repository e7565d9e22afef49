"""The daemon's SGLang pickles (``slotsync.daemon.sglang.tensor_pickle``), loaded by SGLang's own
code.

What each test proves (docs/sglang-contract.md section 8, tests 1-4):

* ``test_packed_every_dtype``, ``test_unpacked_every_dtype``, ``test_empty_entries``,
  ``test_long1_shm_region``: the pickles of every dtype of ``wire.DTYPE_SIZES`` (packed,
  unpacked, the empty bucket; offsets and sizes of 2 GiB and more, LONG1), in slotsync's real
  shared-memory segments, go through SGLang's receive path -- msgspec's JSON base64,
  ``Base64Bytes._decode_value``, ``normalize_serialized_named_tensor_payload`` (unchanged, so
  PROTO first), ``MultiprocessingSerializer.deserialize`` (``SafeUnpickler``), SGLang's
  ``_rebuild_cuda_tensor_modified`` mapping the UUID to the device index (seen by the
  rebuild), ``FlattenedTensorBucket(...).reconstruct_tensors()`` -- and give the source
  tensors, byte for byte; the globals ``SafeUnpickler.find_class`` is asked for are in the
  contract's table 3.6. ``test_cuda_records_through_sglang``: the same for CUDA IPC records
  (LONG1 storage fields), with torch's rebuild replaced by a recorder: SGLang hands torch
  exactly the record's 15 arguments, argument 6 mapped to the device index.
* ``test_allow_list_drift``: every global the writer can emit, for every dtype, tensor and
  storage class and transport (read off the pickles with ``pickletools``), is in 0.5.23's and
  0.5.21's ``SafeUnpickler.ALLOWED_GLOBALS`` and admitted by 0.5.20's module prefixes and
  deny list, each parsed from ``common.py`` with ``ast`` (nothing imported).
* ``test_refuses_gpu_prefix``, ``test_refuses_misaligned``: the daemon refuses a
  ``GPU-``-prefixed UUID and a misaligned fp32 before sending, and the same bytes written
  without the check make SGLang's own code raise (so the checks are needed).
  ``test_alignment_counts_from_the_storage``, ``test_refuses_what_would_not_fit``,
  ``test_serialized_named_tensors_ranks``, ``test_check_uuid``: the other refusals, each
  naming the tensor or rank.
* Every SGLang test runs against 0.5.20 and 0.5.21 too (``sglang_code`` fixture).
* ``test_standin_installs_and_undoes``: ``slotsync.engine.sglang.standin`` makes SGLang's own
  UUID lookup see the faked GPUs, and undoing it gives torch back.
* ``test_daemon_module_does_not_import_torch``: design.md I6 for this module.

Cost: ~5.5 s for the file on an idle 2-core machine, ~12 s with both cores busy, most of it
importing SGLang 0.5.23 once (the first run also downloads two 28 MB wheels).

Older SGLang versions, decided here: the contract's section 9 runs each old version's code
in a subprocess with its unzipped wheel on ``PYTHONPATH`` (unzip 3.4 s, ~100 MB, and an
~8-11 s import of SGLang per version on a loaded 2-core machine): over this file's ~20 s
budget. The few functions that differ between versions are instead taken from each old
wheel's ``srt/utils/common.py`` (read with ``zipfile``, the wheel fetched once with
``pip download --no-deps`` into ``tests/data/sglang-wheels/``, sha256 pinned) and run here:
``SafeUnpickler`` (the one that differs: 0.5.20's prefix list, 0.5.21's exact list),
``normalize_serialized_named_tensor_payload``, ``MultiprocessingSerializer``. The rest of
the receive path -- ``patch_torch.py``, ``msgspec_utils.py`` and ``FlattenedTensorMetadata``
/ ``FlattenedTensorBucket`` of ``tensor_bucket.py`` -- is checked to be the same source as
the installed 0.5.23's (the fixture fails otherwise), so 0.5.23's modules stand in for them.
Without network (no wheel) the old versions skip, saying so; with
``SLOTSYNC_REQUIRE_SGLANG=1`` that, and a missing SGLang, fail instead.
"""

from __future__ import annotations
import __future__

import ast
import binascii
import hashlib
import io
import json
import math
import os
import pickle
import pickletools
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from slotsync.daemon.sglang import tensor_pickle as sglang_pickle
from slotsync.daemon.sglang.tensor_pickle import (
    PACKED_LOAD_FORMAT,
    WRITABLE_GLOBALS,
    SglangPayloadError,
    check_uuid,
    rank_entry_packed,
    rank_entry_unpacked,
    serialized_named_tensors,
)
from slotsync.protocol.wire import DTYPE_SIZES, Chunk, CudaIpcHandle, ShmHandle

torch = pytest.importorskip("torch")

UUIDS = ["6b6b7a3e-0000-4000-8000-000000000000", "6b6b7a3e-0000-4000-8000-000000000001"]
"""The faked visible GPUs 0 and 1 (torch's format)."""

TABLE_3_6 = {
    "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified",
    "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata",
    "torch.Tensor", "torch.nn.parameter.Parameter",
    "torch.storage.TypedStorage", "torch.storage.UntypedStorage", "torch.Size",
    *(f"torch.{d}" for d in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "int64",
        "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool")),
}
"""docs/sglang-contract.md table 3.6, written out: the only globals the daemon may write."""

OLD_WHEELS = {
    "0.5.20": "1573527042f4f6b4ead838302818595fc77fdc611dbcc2e40cd150fbc8f8513c",
    "0.5.21": "96c029f75dec99baa33a5db3d41b1bebefdd6bcfba3a2f7c807fe1cf49a87c20",
}
"""sha256 of ``sglang-<v>-cp311-cp311-manylinux_2_34_x86_64.whl`` (PyPI; the contract's
section 0 lists their prefixes)."""

WHEEL_DIR = Path(__file__).resolve().parents[1] / "data" / "sglang-wheels"
VERSIONS = ["0.5.23", "0.5.21", "0.5.20"]
SAME_SOURCE = ("sglang/srt/utils/patch_torch.py", "sglang/srt/utils/msgspec_utils.py")


def _unavailable(reason: str) -> None:
    if os.environ.get("SLOTSYNC_REQUIRE_SGLANG") == "1":
        pytest.fail(f"{reason} (SLOTSYNC_REQUIRE_SGLANG=1)")
    pytest.skip(reason)


# --------------------------------------------------------------------------------------------
# SGLang's code, per version
# --------------------------------------------------------------------------------------------


def _installed_sglang_dir() -> Path | None:
    """The installed ``sglang`` package's folder, found without importing it."""
    from slotsync.engine.sglang.scheduler_code import installed_root

    return installed_root()


def _wheel(version: str) -> Path:
    """The cached wheel of ``version`` (``pip download`` on first use, sha256 checked)."""
    path = WHEEL_DIR / f"sglang-{version}-cp311-cp311-manylinux_2_34_x86_64.whl"
    if not path.exists():
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=WHEEL_DIR, prefix=".download-")  # (parallel workers)
        try:
            got = subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                 "--only-binary=:all:", "--python-version", "3.11", "--platform",
                 "manylinux_2_34_x86_64", f"sglang=={version}", "-d", tmp],
                capture_output=True, text=True, timeout=300)
            if got.returncode:
                _unavailable(f"cannot download sglang {version}'s wheel: "
                             f"{got.stderr.strip()[-300:]}")
            os.replace(os.path.join(tmp, path.name), path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == OLD_WHEELS[version], f"{path} has sha256 {digest}"
    return path


def _source(version: str, member: str) -> str:
    """``member`` (``sglang/srt/...``) of SGLang ``version``: the installed one for 0.5.23,
    else read from the wheel."""
    if version == "0.5.23":
        root = _installed_sglang_dir()
        assert root is not None
        return (root.parent / member).read_text()
    with zipfile.ZipFile(_wheel(version)) as z:
        return z.read(member).decode()


def _top_level(source: str, filename: str) -> dict[str, ast.stmt]:
    """Top-level classes, functions and single-name assignments of a module, by name."""
    out: dict[str, ast.stmt] = {}
    for node in ast.parse(source, filename).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            out[node.name] = node
        elif (isinstance(node, ast.Assign) and len(node.targets) == 1
              and isinstance(node.targets[0], ast.Name)):
            out[node.targets[0].id] = node
    return out


COMMON_PARTS = ("SerializedTensorPayload", "_looks_like_pickle_payload",
                "normalize_serialized_named_tensor_payload", "_safe_load_torch_storage",
                "SafeUnpickler", "MultiprocessingSerializer")
"""What the old versions' receive path takes from their ``common.py``
(``_safe_load_torch_storage`` is 0.5.21+ only)."""


def _old_common(version: str) -> SimpleNamespace:
    """``COMMON_PARTS`` of ``version``'s ``srt/utils/common.py``, compiled from the wheel's
    source (line numbers kept) into a namespace holding the modules they use."""
    import typing
    from multiprocessing.reduction import ForkingPickler

    import pybase64

    filename = f"sglang-{version}/sglang/srt/utils/common.py"
    nodes = _top_level(_source(version, "sglang/srt/utils/common.py"), filename)
    missing = [n for n in COMMON_PARTS if n not in nodes and n != "_safe_load_torch_storage"]
    assert not missing, f"{filename} has no {missing}"
    module = ast.Module(body=[nodes[n] for n in COMMON_PARTS if n in nodes], type_ignores=[])
    ns: dict[str, Any] = {
        "__name__": f"sglang_{version.replace('.', '_')}_common", "pickle": pickle, "io": io,
        "binascii": binascii, "pybase64": pybase64, "torch": torch,
        "ForkingPickler": ForkingPickler, "Union": typing.Union, "List": list,
    }
    exec(compile(module, filename, "exec", flags=__future__.annotations.compiler_flag,
                 dont_inherit=True), ns)
    return SimpleNamespace(**{n: ns[n] for n in COMMON_PARTS if n in ns})


def _same_tensor_bucket(version: str) -> None:
    """``version``'s ``FlattenedTensorMetadata`` and ``FlattenedTensorBucket`` (but 0.5.23's
    added ``empty``) are 0.5.23's, and so are ``SAME_SOURCE``."""
    for member in SAME_SOURCE:
        assert _source(version, member) == _source("0.5.23", member), f"{member} differs"
    member = "sglang/srt/weight_sync/tensor_bucket.py"

    def parts(v: str) -> list[str]:
        nodes = _top_level(_source(v, member), member)
        bucket = nodes["FlattenedTensorBucket"]
        assert isinstance(bucket, ast.ClassDef)
        bucket.body = [b for b in bucket.body if getattr(b, "name", "") != "empty"]
        return [ast.dump(nodes[n]) for n in ("FlattenedTensorMetadata", "FlattenedTensorBucket")]

    assert parts(version) == parts("0.5.23"), f"{member} differs beyond 'empty'"


@pytest.fixture(scope="module")
def sglang_installed() -> Any:
    """SGLang 0.5.23's receive modules, imported (skips, or fails under
    ``SLOTSYNC_REQUIRE_SGLANG=1``, when SGLang does not import)."""
    try:
        from sglang.srt.utils import common, msgspec_utils, patch_torch
        from sglang.srt.weight_sync import tensor_bucket
    except Exception as e:  # noqa: BLE001 -- any import failure: SGLang is not usable here
        _unavailable(f"SGLang is not importable here ({type(e).__name__}: {e}); "
                     "docs/sglang-contract.md section 9 says how to install it")
    import sglang

    assert sglang.__version__ == "0.5.23", f"these tests read 0.5.23, not {sglang.__version__}"
    return SimpleNamespace(common=common, msgspec_utils=msgspec_utils, patch_torch=patch_torch,
                           tensor_bucket=tensor_bucket)


@pytest.fixture(scope="module")
def standin(sglang_installed: Any) -> Any:
    """slotsync's CPU stand-in installed: faked GPUs ``UUIDS``, SGLang's patch applied, the
    saved original rebuild mapping shared memory."""
    from slotsync.engine.sglang.standin import install_sglang_cpu_standin, installed

    install_sglang_cpu_standin(UUIDS)
    yield
    s = installed()  # (test_standin_installs_and_undoes installs its own again)
    if s is not None:
        s.uninstall()


@pytest.fixture(scope="module", params=VERSIONS)
def sglang_code(request: pytest.FixtureRequest, sglang_installed: Any, standin: Any) -> Any:
    """The receive path of one SGLang version: ``version``, ``Base64Bytes``, ``normalize``,
    ``MultiprocessingSerializer``, ``SafeUnpickler``, ``FlattenedTensorBucket``."""
    version = request.param
    s = sglang_installed
    if version == "0.5.23":
        common = s.common
    else:
        common = _old_common(version)
        _same_tensor_bucket(version)
    return SimpleNamespace(
        version=version, Base64Bytes=s.msgspec_utils.Base64Bytes,
        normalize=common.normalize_serialized_named_tensor_payload,
        MultiprocessingSerializer=common.MultiprocessingSerializer,
        SafeUnpickler=common.SafeUnpickler,
        FlattenedTensorBucket=s.tensor_bucket.FlattenedTensorBucket,
    )


@pytest.fixture
def seen(sglang_code: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """What the test's SGLang code saw: ``globals`` asked of ``SafeUnpickler.find_class``, and
    ``devices``, argument 6 as torch's (stand-in) rebuild received it."""
    from torch.multiprocessing import reductions

    from slotsync.engine.sglang.standin import rebuild_original

    out = SimpleNamespace(globals=set(), devices=[])
    find_class = sglang_code.SafeUnpickler.find_class

    def spy(self: Any, module: str, name: str) -> Any:
        out.globals.add(f"{module}.{name}")
        return find_class(self, module, name)

    def rebuild(*args: Any) -> Any:
        out.devices.append(args[6])
        return rebuild_original(*args)

    monkeypatch.setattr(sglang_code.SafeUnpickler, "find_class", spy)
    monkeypatch.setattr(reductions, "_rebuild_cuda_tensor_original", rebuild)
    return out


def sglang_receive(code: Any, entries: list[bytes], *, packed: bool) -> list[list[tuple]]:
    """Each TP rank's ``(name, tensor)`` list, as SGLang gets it from the HTTP body that the
    daemon's msgspec JSON encoder writes for ``entries``."""
    body = json.loads(msgspec.json.encode({"serialized_named_tensors": entries,
                                           "load_format": PACKED_LOAD_FORMAT if packed else None}))
    decoded = code.Base64Bytes._decode_value(body["serialized_named_tensors"])
    out = []
    for tp, raw in enumerate(decoded):
        data = code.normalize(raw)
        assert data == entries[tp] and data[:2] == b"\x80\x04"
        obj = code.MultiprocessingSerializer.deserialize(data)
        if packed:
            # model runner _update_weights_from_flattened_bucket (contract 3.2)
            obj = code.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"],
                                             metadata=obj["metadata"]).reconstruct_tensors()
        out.append(obj)
    return out


# --------------------------------------------------------------------------------------------
# tensors and shared memory
# --------------------------------------------------------------------------------------------


@pytest.fixture
def shm() -> Any:
    """slotsync's test segments (``shm_payloads.Segments``); afterwards none is left in
    /dev/shm."""
    from shm_payloads import Segments

    s = Segments()
    yield s
    names = [seg.name for seg in s.segs]
    s.close()
    assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]


SHAPES = [(3,), (2, 3), (5,), (2, 2, 2), (7,), (1, 3), (), (4, 1), (2, 5), (6,), (3, 3), (9,),
          (2,), (4,), (1,), (3, 2), (2, 2), (8,), (5, 1)]


def every_dtype(seed: int) -> dict[str, Any]:
    """One tensor of every ``wire.DTYPE_SIZES`` dtype (random bytes; bool 0/1), plus an empty
    float32 one; largest itemsize first, so that back to back every start is aligned."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for dtype, shape in sorted(zip(DTYPE_SIZES, SHAPES, strict=True),
                               key=lambda d: -DTYPE_SIZES[d[0]]):
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        data = torch.randint(0, 2 if dtype == "bool" else 256, (n,), dtype=torch.uint8,
                             generator=g)
        out[f"model.layers.{len(out)}.{dtype}.weight"] = (
            data.view(getattr(torch, dtype)).reshape(shape))
        if dtype == "float32":
            out["model.empty.weight"] = torch.empty(0, 4)
    return out


def dtype_of(t: Any) -> str:
    return str(t.dtype).split(".")[-1]


def raw(t: Any) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def lists(tensors: dict[str, Any]) -> dict[str, list]:
    return {"names": list(tensors), "dtype_names": [dtype_of(t) for t in tensors.values()],
            "shapes": [list(t.shape) for t in tensors.values()],
            "tensor_sizes": [t.numel() * t.element_size() for t in tensors.values()]}


def assert_same(got: list[tuple], want: dict[str, Any]) -> None:
    assert [n for n, _ in got] == list(want)
    for (name, t), w in zip(got, want.values(), strict=True):
        assert (t.dtype, t.shape, raw(t)) == (w.dtype, w.shape, raw(w)), name


def packed_chunk(shm: Any, tensors: dict[str, Any], offset: int) -> Chunk:
    """A packed chunk of ``tensors`` back to back at ``offset`` of a new segment."""
    data = b"".join(raw(t) for t in tensors.values())
    seg = shm.put(b"", offset + len(data))
    seg.buf[offset:offset + len(data)] = data
    return Chunk(update_id=1, index=0, handles=[ShmHandle(seg.name, offset, len(data))],
                 **lists(tensors))


def unpacked_chunk(shm: Any, tensors: dict[str, Any]) -> Chunk:
    """An unpacked chunk: every tensor in its own 8-aligned place of one new segment."""
    places, at = [], 0
    for t in tensors.values():
        places.append(at)
        at += -(-max(1, t.numel() * t.element_size()) // 8) * 8
    seg = shm.put(b"", at)
    handles = []
    for t, off in zip(tensors.values(), places, strict=True):
        data = raw(t)
        seg.buf[off:off + len(data)] = data
        handles.append(ShmHandle(seg.name, off, len(data)))
    return Chunk(update_id=1, index=0, handles=handles, **lists(tensors))


# --------------------------------------------------------------------------------------------
# 1. through SGLang's receive path
# --------------------------------------------------------------------------------------------


def test_packed_every_dtype(sglang_code: Any, seen: Any, shm: Any) -> None:
    sources = [every_dtype(0), every_dtype(1)]
    chunks = {4: packed_chunk(shm, sources[0], 0), 5: packed_chunk(shm, sources[1], 4096 + 8)}
    entries = serialized_named_tensors(chunks, {4: UUIDS[0], 5: UUIDS[1]}, packed=True)
    # one bucket's metadata is written once for both ranks: the same bytes as rank by rank
    assert entries == [
        rank_entry_packed(c.handles[0], u, c.names, c.dtype_names, c.shapes, c.tensor_sizes)
        for c, u in zip(chunks.values(), UUIDS, strict=True)]
    got = sglang_receive(sglang_code, entries, packed=True)
    for tensors, want in zip(got, sources, strict=True):
        assert_same(tensors, want)
    assert seen.devices == [0, 1]
    # the metadata and bytes are what SGLang's own producer (slime, miles) makes of the tensors
    ours = sglang_code.MultiprocessingSerializer.deserialize(entries[1])
    theirs = sglang_code.FlattenedTensorBucket(named_tensors=list(sources[1].items()))
    assert ours["metadata"] == theirs.get_metadata()
    assert raw(ours["flattened_tensor"]) == raw(theirs.get_flattened_tensor())
    assert seen.globals <= TABLE_3_6
    assert {f"torch.{d}" for d in DTYPE_SIZES} <= seen.globals  # every dtype was named


def test_unpacked_every_dtype(sglang_code: Any, seen: Any, shm: Any) -> None:
    sources = [every_dtype(2), every_dtype(3)]
    chunks = {0: unpacked_chunk(shm, sources[0]), 1: unpacked_chunk(shm, sources[1])}
    entries = serialized_named_tensors(chunks, dict(enumerate(UUIDS)), packed=False)
    got = sglang_receive(sglang_code, entries, packed=False)
    for tensors, want in zip(got, sources, strict=True):
        assert all(type(item) is tuple for item in tensors)
        assert_same(tensors, want)
    assert seen.devices == [0] * len(sources[0]) + [1] * len(sources[1])
    assert seen.globals <= TABLE_3_6


def test_empty_entries(sglang_code: Any, seen: Any) -> None:
    packed = rank_entry_packed(None, UUIDS[1], [], [], [], [])
    unpacked = rank_entry_unpacked([], UUIDS[0], [], [], [])
    assert sglang_receive(sglang_code, [packed], packed=True) == [[]]
    assert sglang_receive(sglang_code, [unpacked], packed=False) == [[]]
    obj = sglang_code.MultiprocessingSerializer.deserialize(packed)
    assert obj["metadata"] == [] and obj["flattened_tensor"].shape == (0,)
    assert obj["flattened_tensor"].dtype == torch.uint8
    assert seen.devices == [1, 1]  # (decoded twice)
    assert seen.globals <= TABLE_3_6


def test_long1_shm_region(sglang_code: Any, seen: Any, shm: Any) -> None:
    """A region over 2 GiB at an offset over 2 GiB of a (sparse) segment: the region's size
    and offset and the last tensors' start_idx / end_idx are LONG1."""
    gap = 2**31 + 64  # a uint8 tensor, never written: the segment stays sparse
    small = {"b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
             "c.weight": torch.arange(4, dtype=torch.bfloat16)}
    offset = 2**31 + 4096
    size = gap + sum(t.numel() * t.element_size() for t in small.values())
    seg = shm.put(b"", offset + size)
    tail = b"".join(raw(t) for t in small.values())
    seg.buf[offset + gap:offset + size] = tail
    names = ["a.gap", *small]
    entry = rank_entry_packed(
        ShmHandle(seg.name, offset, size), UUIDS[0], names, ["uint8", "float32", "bfloat16"],
        [[gap], [2, 3], [4]], [gap, 24, 8])
    assert "LONG1" in {op.name for op, _, _ in pickletools.genops(entry)}
    [got] = sglang_receive(sglang_code, [entry], packed=True)
    assert [n for n, _ in got] == names and got[0][1].shape == (gap,)
    assert_same(got[1:], small)
    assert seen.globals <= TABLE_3_6


def record(**kw: Any) -> CudaIpcHandle:
    f = dict(tensor_class="torch.Tensor", size=(64,), stride=(1,), storage_offset=2**31 + 1024,
             storage_class="torch.storage.TypedStorage", dtype="uint8", device=3,
             ipc_handle=bytes(range(64)), storage_size_bytes=2**33,
             storage_offset_bytes=2**31 + 512, requires_grad=False,
             ref_counter_handle=b"/torch_123_456", ref_counter_offset=3, event_handle=b"e" * 64,
             event_sync_required=True)
    f.update(kw)
    return CudaIpcHandle(**f)


def torch_args(h: CudaIpcHandle, device: int) -> tuple:
    """The 15 arguments torch's rebuild_cuda_tensor gets for ``h`` on ``device``."""
    cls = {"torch.Tensor": torch.Tensor, "torch.nn.parameter.Parameter": torch.nn.Parameter}
    st = {"torch.storage.TypedStorage": torch.storage.TypedStorage,
          "torch.storage.UntypedStorage": torch.storage.UntypedStorage}
    return (cls[h.tensor_class], torch.Size(h.size), tuple(h.stride), h.storage_offset,
            st[h.storage_class], getattr(torch, h.dtype), device, h.ipc_handle,
            h.storage_size_bytes, h.storage_offset_bytes, h.requires_grad, h.ref_counter_handle,
            h.ref_counter_offset, h.event_handle, h.event_sync_required)


def test_cuda_records_through_sglang(sglang_code: Any, seen: Any,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA IPC records (storage fields of 2 GiB and more): SGLang's unpickler and patch hand
    torch's rebuild exactly the record's arguments, with the UUID mapped to the index."""
    from torch.multiprocessing import reductions

    calls: list[tuple] = []

    def recorder(*args: Any) -> Any:  # torch's rebuild, minus the GPU
        calls.append(args)
        return torch.zeros(args[1], dtype=args[5])

    monkeypatch.setattr(reductions, "_rebuild_cuda_tensor_original", recorder)
    region = record()
    packed = rank_entry_packed(region, UUIDS[1], ["a", "b"], ["float32", "int8"],
                               [[4, 2], [5]], [32, 5])
    [got] = sglang_receive(sglang_code, [packed], packed=True)
    assert [(n, t.dtype, t.shape) for n, t in got] == [
        ("a", torch.float32, (4, 2)), ("b", torch.int8, (5,))]
    small = dict(storage_size_bytes=4096, storage_offset_bytes=512)  # BININT (struct path)
    handles = [record(dtype="bfloat16", size=(2, 3), stride=(3, 1), storage_offset=8,
                      tensor_class="torch.nn.parameter.Parameter", requires_grad=True,
                      storage_class="torch.storage.UntypedStorage", event_handle=None,
                      event_sync_required=False, **small),
               record(dtype="float64", size=(3,), stride=(1,), storage_offset=0),  # LONG1
               record(dtype="int32", size=(3, 2), stride=(1, 3), storage_offset=4, **small)]
    unpacked = rank_entry_unpacked(handles, UUIDS[0], ["p", "q", "r"],
                                   ["bfloat16", "float64", "int32"], [[2, 3], [3], [3, 2]])
    [got] = sglang_receive(sglang_code, [unpacked], packed=False)
    assert [n for n, _ in got] == ["p", "q", "r"]
    assert calls == [torch_args(region, 1), *(torch_args(h, 0) for h in handles)]
    assert seen.globals <= TABLE_3_6


def test_standin_installs_and_undoes(sglang_installed: Any) -> None:
    """``install_sglang_cpu_standin`` makes SGLang's own UUID lookup see ``UUIDS`` and maps
    the empty bucket on the CPU; undoing it gives torch back (and SGLang's patch, if the
    stand-in applied it: while applied, ForkingPickler cannot pickle a CPU tensor)."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    from slotsync.engine.sglang import standin as sglang_standin

    active = sglang_standin.installed()  # the module's, if a test installed it already
    if active is not None:
        active.uninstall()
    try:
        count, props = torch.cuda.device_count, torch.cuda.get_device_properties
        had_patch = hasattr(reductions, "_reduce_tensor_original")
        with pytest.raises(ValueError, match="distinct"):
            sglang_standin.install_sglang_cpu_standin([UUIDS[0], UUIDS[0]])
        with sglang_standin.install_sglang_cpu_standin(UUIDS) as s:
            assert sglang_standin.installed() is s
            device_from = sglang_installed.patch_torch._device_from_maybe_uuid
            assert [device_from(u) for u in UUIDS] == [0, 1] and device_from(1) == 1
            with pytest.raises(Exception, match="Invalid device_uuid=GPU-"):
                device_from("GPU-" + UUIDS[1])
            assert torch.cuda.get_device_properties(torch.device("cuda:1")).uuid == UUIDS[1]
            with pytest.raises(AssertionError, match="Invalid device id"):
                torch.cuda.get_device_properties(2)
            with pytest.raises(RuntimeError, match="installed already"):
                sglang_standin.install_sglang_cpu_standin(UUIDS)
            empty = reductions.rebuild_cuda_tensor(
                torch.Tensor, torch.Size([0]), (1,), 0, torch.storage.TypedStorage, torch.uint8,
                UUIDS[1], None, 0, 0, False, None, 0, None, None)
            assert empty.shape == (0,) and empty.device.type == "cpu"
            if not had_patch:
                with pytest.raises(IndexError):
                    ForkingPickler.dumps(torch.ones(2))
        s.uninstall()  # (idempotent)
        assert sglang_standin.installed() is None
        assert (torch.cuda.device_count, torch.cuda.get_device_properties) == (count, props)
        assert hasattr(reductions, "_reduce_tensor_original") == had_patch
        if not had_patch:
            assert reductions.rebuild_cuda_tensor.__module__ == "torch.multiprocessing.reductions"
            assert pickle.loads(ForkingPickler.dumps(torch.ones(2))).tolist() == [1.0, 1.0]
    finally:
        if active is not None:
            sglang_standin.install_sglang_cpu_standin(UUIDS)


# --------------------------------------------------------------------------------------------
# 2. allow-list drift (no import)
# --------------------------------------------------------------------------------------------


def writable_pickles() -> list[bytes]:
    """Pickles with every global the writer can emit: every dtype, tensor and storage class,
    both transports, packed, unpacked and empty."""
    dts = list(DTYPE_SIZES)
    shapes = [[2]] * len(dts)
    sizes = [2 * DTYPE_SIZES[d] for d in dts]
    names = [f"t{i}" for i in range(len(dts))]
    out = [rank_entry_packed(None, UUIDS[0], [], [], [], []),
           rank_entry_unpacked([], UUIDS[0], [], [], [])]
    for region in (ShmHandle("seg", 0, 2**20), record(size=(2**20,))):
        # one tensor per entry: every dtype at start 0 is aligned
        out += [rank_entry_packed(region, UUIDS[0], [n], [d], [s], [z])
                for n, d, s, z in zip(names, dts, shapes, sizes, strict=True)]
    out.append(rank_entry_unpacked([ShmHandle("seg", 0, z) for z in sizes], UUIDS[0], names,
                                   dts, shapes))
    for cls in ("torch.Tensor", "torch.nn.parameter.Parameter"):
        for storage in ("torch.storage.TypedStorage", "torch.storage.UntypedStorage"):
            hs = [record(tensor_class=cls, storage_class=storage, dtype=d, size=(2,),
                         storage_offset=0) for d in dts]
            out.append(rank_entry_unpacked(hs, UUIDS[0], names, dts, shapes))
    return out


def emitted_globals(pickles: list[bytes]) -> set[str]:
    """The globals the pickles name (``GLOBAL`` opcodes; checks no other opcode names code)."""
    out = set()
    for p in pickles:
        ops = list(pickletools.genops(p))
        assert (ops[0][0].name, ops[0][1]) == ("PROTO", 4)
        for op, arg, _ in ops:
            assert op.name not in ("STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4")
            if op.name == "GLOBAL":
                module, name = arg.split(" ")
                out.add(f"{module}.{name}")
    return out


def allow_list(version: str) -> Any:
    """``version``'s ``SafeUnpickler`` rule, parsed from its ``common.py`` source: a function
    of ``(module, name)``."""
    source = _source(version, "sglang/srt/utils/common.py")
    cls = _top_level(source, "common.py")["SafeUnpickler"]
    assert isinstance(cls, ast.ClassDef)
    wanted = ("ALLOWED_GLOBALS", "ALLOWED_MODULE_PREFIXES", "DENY_CLASSES")
    lists_ = {node.targets[0].id: ast.literal_eval(node.value) for node in cls.body
              if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
              and node.targets[0].id in wanted}
    if "ALLOWED_GLOBALS" in lists_:  # 0.5.21+: exact (module, name) pairs
        allowed = lists_["ALLOWED_GLOBALS"]
        assert len(allowed) >= 200
        return lambda module, name: (module, name) in allowed
    prefixes, deny = lists_["ALLOWED_MODULE_PREFIXES"], lists_["DENY_CLASSES"]  # 0.5.20
    return lambda module, name: ((module, name) not in deny
                                 and any((module + ".").startswith(p) for p in prefixes))


@pytest.mark.parametrize("version", VERSIONS)
def test_allow_list_drift(version: str) -> None:
    emitted = emitted_globals(writable_pickles())
    assert emitted == WRITABLE_GLOBALS == TABLE_3_6
    if version == "0.5.23" and _installed_sglang_dir() is None:
        _unavailable("SGLang is not installed (its common.py is read from the installed package)")
    admits = allow_list(version)
    refused = sorted(g for g in emitted if not admits(*g.rsplit(".", 1)))
    assert not refused, f"SGLang {version}'s SafeUnpickler would refuse {refused}"
    # (and the rule parsed is a real one: it refuses what SGLang refuses)
    assert not admits("builtins", "eval") and not admits("os", "system")


# --------------------------------------------------------------------------------------------
# 3. refusals SGLang would crash on
# --------------------------------------------------------------------------------------------


def test_check_uuid() -> None:
    assert check_uuid(UUIDS[0]) == ""
    assert "'GPU-' prefix" in check_uuid("GPU-" + UUIDS[0])
    assert "upper-case" in check_uuid(UUIDS[0].upper())
    assert "white space" in check_uuid(UUIDS[0] + " ")
    assert "not a GPU UUID" in check_uuid("gpu0")
    assert check_uuid(3) != ""  # type: ignore[arg-type]


def test_refuses_gpu_prefix(sglang_code: Any, seen: Any, shm: Any,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {"w": torch.arange(4, dtype=torch.float32)}
    chunk = packed_chunk(shm, tensors, 0)
    bad = "GPU-" + UUIDS[0]
    with pytest.raises(SglangPayloadError, match=r"rank 7 \(TP rank 0\).*'GPU-' prefix"):
        serialized_named_tensors({7: chunk}, {7: bad}, packed=True)
    for packed in (True, False):
        with pytest.raises(SglangPayloadError, match="GPU-"):
            (rank_entry_packed(chunk.handles[0], bad, **lists(tensors)) if packed else
             rank_entry_unpacked(chunk.handles, bad, **{k: v for k, v in lists(tensors).items()
                                                        if k != "tensor_sizes"}))
    # without the check, SGLang's own patch_torch raises in the scheduler (the server dies)
    monkeypatch.setattr(sglang_pickle, "check_uuid", lambda uuid: "")
    entry = rank_entry_packed(chunk.handles[0], bad, **lists(tensors))
    with pytest.raises(Exception, match="Invalid device_uuid=GPU-"):
        sglang_receive(sglang_code, [entry], packed=True)
    # (a well-formed UUID of a GPU the rank cannot see is refused the same way: only the
    # coordinator, which knows the slot's GPUs, can catch that one)
    entry = rank_entry_packed(chunk.handles[0], "ffffffff-0000-0000-0000-000000000000",
                              **lists(tensors))
    with pytest.raises(Exception, match="Invalid device_uuid=ffffffff"):
        sglang_receive(sglang_code, [entry], packed=True)


def test_refuses_misaligned(sglang_code: Any, seen: Any, shm: Any,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = {"b": torch.arange(3, dtype=torch.int8), "w": torch.arange(4, dtype=torch.float32)}
    chunk = packed_chunk(shm, tensors, 0)  # w starts at byte 3
    with pytest.raises(SglangPayloadError, match=r"rank 0 \(TP rank 0\), chunk 0: tensor 'w' "
                       r"\(float32\) starts at byte 3") as e:
        serialized_named_tensors({0: chunk}, {0: UUIDS[0]}, packed=True)
    assert (e.value.rank, e.value.tensor) == (0, "w")
    # without the check, SGLang's reconstruct_tensors raises in the scheduler
    monkeypatch.setattr(sglang_pickle, "_check_alignment", lambda *a: None)
    entry = rank_entry_packed(chunk.handles[0], UUIDS[0], **lists(tensors))
    with pytest.raises(RuntimeError, match="must be divisible by 4"):
        sglang_receive(sglang_code, [entry], packed=True)


def test_alignment_counts_from_the_storage() -> None:
    """Aligned inside the region is not enough: the region's own offset counts (shm: its
    segment offset; CUDA: its element offset in the storage, and the storage's offset in its
    IPC allocation)."""
    args = (["w"], ["float32"], [[4]], [16])
    rank_entry_packed(ShmHandle("s", 8, 16), UUIDS[0], *args)
    with pytest.raises(SglangPayloadError, match="byte 2 of its shared-memory segment"):
        rank_entry_packed(ShmHandle("s", 2, 16), UUIDS[0], *args)
    rank_entry_packed(record(size=(16,)), UUIDS[0], *args)
    with pytest.raises(SglangPayloadError, match="of the exported storage"):
        rank_entry_packed(record(size=(16,), storage_offset=2), UUIDS[0], *args)
    with pytest.raises(SglangPayloadError, match="of its CUDA allocation"):
        rank_entry_packed(record(size=(16,), storage_offset_bytes=6), UUIDS[0], *args)


def test_refuses_what_would_not_fit() -> None:
    with pytest.raises(SglangPayloadError, match="'w' ends at byte 16 of a packed region of 8"):
        rank_entry_packed(ShmHandle("s", 0, 8), UUIDS[0], ["w"], ["float32"], [[4]], [16])
    with pytest.raises(SglangPayloadError, match="flat uint8 region"):
        rank_entry_packed(record(dtype="float32", size=(4,)), UUIDS[0], ["w"], ["float32"],
                          [[4]], [16])
    with pytest.raises(SglangPayloadError, match="storage of 100 bytes"):
        rank_entry_packed(record(storage_offset=50, storage_size_bytes=100), UUIDS[0], ["w"],
                          ["float32"], [[4]], [16])
    with pytest.raises(SglangPayloadError, match="tensor_sizes says 15 bytes"):
        rank_entry_packed(ShmHandle("s", 0, 64), UUIDS[0], ["w"], ["float32"], [[4]], [15])
    with pytest.raises(SglangPayloadError, match="'w': its shared-memory region has 8 bytes"):
        rank_entry_unpacked([ShmHandle("s", 0, 8)], UUIDS[0], ["w"], ["float32"], [[4]])
    with pytest.raises(SglangPayloadError, match="'w': its CUDA handle is uint8"):
        rank_entry_unpacked([record()], UUIDS[0], ["w"], ["float32"], [[16]])
    with pytest.raises(SglangPayloadError, match="dtype 'complex64'"):
        rank_entry_unpacked([ShmHandle("s", 0, 8)], UUIDS[0], ["w"], ["complex64"], [[1]])


def test_serialized_named_tensors_ranks() -> None:
    chunk = Chunk(update_id=1, index=2, names=["w"], dtype_names=["uint8"], shapes=[[4]],
                  tensor_sizes=[4], handles=[ShmHandle("s", 0, 4)])
    two = Chunk(update_id=1, index=2, names=["w", "v"], dtype_names=["uint8", "uint8"],
                shapes=[[4], [4]], tensor_sizes=[4, 4],
                handles=[ShmHandle("s", 0, 4), ShmHandle("s", 4, 4)])
    with pytest.raises(SglangPayloadError, match=r"missing \[1\]"):
        serialized_named_tensors({0: chunk}, dict(enumerate(UUIDS)), packed=True)
    with pytest.raises(SglangPayloadError, match="not consecutive"):
        serialized_named_tensors({0: chunk, 2: chunk}, {0: UUIDS[0], 2: UUIDS[1]}, packed=True)
    with pytest.raises(SglangPayloadError, match="ranks 0 and 1 both name GPU"):
        serialized_named_tensors({0: chunk, 1: chunk}, {0: UUIDS[0], 1: UUIDS[0]}, packed=True)
    with pytest.raises(SglangPayloadError, match=r"rank 1 \(TP rank 1\), chunk 2: a packed "
                       "chunk carries one handle"):
        serialized_named_tensors({0: chunk, 1: two}, dict(enumerate(UUIDS)), packed=True)
    assert len(serialized_named_tensors({0: two, 1: two}, dict(enumerate(UUIDS)),
                                        packed=False)) == 2


def test_daemon_module_does_not_import_torch() -> None:
    code = ("import sys; import slotsync.daemon.sglang.tensor_pickle; "
            "print('torch' in sys.modules, 'sglang' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]

"""The daemon's SGLang adapter payloads (``slotsync.daemon.sglang.adapters`` /
``adapter_pickle``; issue 36 B), read by SGLang 0.5.23's own code.

What each test proves:

* ``test_load_body_goes_through_sglangs_receive_code`` (bucket: one holder; dict: two
  holders; TP 1 and 2): the body, JSON-encoded as the daemon's client sends it, validates
  as SGLang's ``LoadLoRAAdapterFromTensorsReqInput`` (cut from ``io_struct.py``, SGLang's
  ``Base64Bytes`` / pydantic schema), passes SGLang's
  ``normalize_serialized_named_tensor_payloads`` unchanged, and every TP rank's
  ``TpModelWorker.load_lora_adapter_from_tensors`` (SGLang's source, ``lora_code.receive``:
  ``SafeUnpickler``, ``_rebuild_cuda_tensor_modified`` over the shared-memory stand-in,
  ``FlattenedTensorBucket.reconstruct_tensors``, the ``expected_checksums`` check, which
  logs "adapter sync OK") hands its model runner every tensor, byte for byte, rebuilt on its
  holder's GPU; SGLang's ``LoRAConfig.from_dict`` reads the config.
* ``test_a_corrupted_byte_fails_sglangs_checksum_check``: one byte flipped after the digest:
  SGLang's own ``RuntimeError("[LORA-CHECK] rank0 adapter sync MISMATCH ...")`` naming the
  tensor (a scheduler exception: the server dies, adapters.py's docstring).
* ``test_a_list_of_pairs_would_be_all_missing``: why the dict form (``name in tensors``):
  the base-weight route's list of ``(name, tensor)`` makes SGLang's check report every
  tensor missing.
* ``test_one_real_ref_counter_per_cuda_handle``: CUDA IPC records through SGLang's
  ``SafeUnpickler`` and UUID lookup (torch's rebuild recorded): exactly one rebuild per
  handle in the whole body carries the rank's ref counter, the first of TP rank 0's entry;
  every other rebuild ``NO_REF_COUNTER``; views at the right element offsets.
* ``test_only_allow_listed_globals``: every global of the adapter pickles is in SGLang's
  ``SafeUnpickler.ALLOWED_GLOBALS``.
* ``test_refusals_name_what_to_change``: a split tensor, DoRA, no ``lora_alpha``, target
  modules, DP, attention DP, a misaligned part, a non-flat CUDA region, a GPU the engine
  does not see, a prefixed UUID, no TP rank -- each before any call.
* ``test_lora_limits`` / ``test_target_modules_as_sglang_normalizes_them``: the server-info
  fields are SGLang's ``ServerArgs`` fields; the mirror of ``get_normalized_target_modules``
  agrees with SGLang's (cut from ``lora/utils.py``).
* ``test_bodies_names_and_routes``: unload body, ``/v1/models`` reading, the daemon steps'
  SGLang requests.
* ``test_the_proof_rests_on_sglangs_code``: ``proving_body`` per version; SGLang's
  ``_is_skip_weight_check`` skips every name for ``[""]``; the source facts the module
  docstring rests on (no ``try`` around the checksum check, ``.cpu()`` copies in
  ``_process_weight``, ``all_gather_object`` in ``check_weights``, ``skip_tensor_list``
  since 0.5.21) -- a later SGLang that moves them fails here.
"""

from __future__ import annotations

import ast
import json
import logging
import pickletools
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

torch = pytest.importorskip("torch")

from lora_adapters import make_adapter, publish, sha256_of, split_plan  # noqa: E402

from slotsync.daemon.sglang import routes as sglang_routes  # noqa: E402
from slotsync.daemon.sglang.adapter_pickle import (  # noqa: E402
    NO_REF_COUNTER,
    TensorAt,
    bucket_entry,
    dict_entry,
)
from slotsync.daemon.sglang.adapters import (  # noqa: E402
    SGLANG_LORA_FLAGS,
    load_body,
    lora_limits,
    normalized_target_modules,
    proving_body,
    refusal,
    served_adapters,
    unload_body,
)
from slotsync.daemon.sglang.tensor_pickle import (  # noqa: E402
    SglangPayloadError,
    rank_entry_unpacked,
)
from slotsync.protocol.wire import CudaIpcHandle, ShmHandle  # noqa: E402

U = ["6b6b7a3e-0000-4000-8000-000000000000", "6b6b7a3e-0000-4000-8000-000000000001",
     "6b6b7a3e-0000-4000-8000-000000000002"]
UUID_OF = {0: U[0], 1: U[1]}
WHEELS = Path(__file__).resolve().parents[1] / "data" / "sglang-wheels"


@pytest.fixture(scope="module")
def sgl() -> SimpleNamespace:
    """SGLang 0.5.23's code: the structs and receive path (``lora_code``), its normalizer."""
    try:
        from pydantic import TypeAdapter
        from sglang.srt.utils.common import (
            SafeUnpickler,
            normalize_serialized_named_tensor_payloads,
        )

        from slotsync.engine.sglang import lora_code
    except Exception as e:  # noqa: BLE001 - SGLang not usable here
        pytest.skip(f"SGLang is not importable ({type(e).__name__}: {e})")
    s = lora_code.structs()
    return SimpleNamespace(code=lora_code, structs=s,
                           normalize=normalize_serialized_named_tensor_payloads,
                           adapter=TypeAdapter(s.LoadLoRAAdapterFromTensorsReqInput),
                           allowed=SafeUnpickler.ALLOWED_GLOBALS)


@pytest.fixture
def adapter() -> dict[str, torch.Tensor]:
    return make_adapter()


def _request(sgl: SimpleNamespace, body: dict[str, Any]) -> Any:
    """``body`` as SGLang's route receives it: msgspec JSON (bytes as base64), validated
    into its struct, the entries normalized by the tokenizer."""
    obj = sgl.adapter.validate_python(json.loads(msgspec.json.encode(body)))
    entries = sgl.normalize(obj.serialized_named_tensors)
    assert entries == body["serialized_named_tensors"]  # PROTO first: kept as they are
    obj.serialized_named_tensors = entries
    obj.lora_id = "id-1"
    return obj


def _receive(sgl: SimpleNamespace, obj: Any, tp: int) -> dict[str, torch.Tensor]:
    """SGLang's ``TpModelWorker.load_lora_adapter_from_tensors`` on TP rank ``tp``; the
    tensors it hands the model runner (copied, as ``LoRAAdapter`` keeps ``.cpu()``)."""
    got: dict[str, torch.Tensor] = {}

    def runner_load(ref: Any, tensors: dict, config_dict: dict, added: Any) -> str:
        got.update({n: t.clone() for n, t in tensors.items()})
        return "loaded"

    mod = sgl.code.receive(lambda: SimpleNamespace(tp_rank=tp))
    worker = SimpleNamespace(model_runner=SimpleNamespace(
        load_lora_adapter_from_tensors=runner_load))
    for name in sgl.code.TP_WORKER_METHODS:
        setattr(worker, name, getattr(mod, name).__get__(worker))
    assert worker.load_lora_adapter_from_tensors(obj) == "loaded"
    return got


@pytest.mark.sglang
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", ["bucket", "dict"])
def test_load_body_goes_through_sglangs_receive_code(sgl, adapter, tp, layout, caplog):
    from sglang.srt.lora.lora_config import LoRAConfig

    from slotsync.engine.sglang.standin import install_sglang_cpu_standin

    holder = 0 if layout == "bucket" else {n: i % 2 for i, n in enumerate(adapter)}
    pub = publish(adapter, holder, lead=512)
    try:
        body = load_body(pub.plan, pub.handles, UUID_OF, tp)
        assert body["load_format"] == ("flattened_bucket" if layout == "bucket" else None)
        assert body["lora_name"] == "math@v1" and body["pinned"] is False
        assert body["expected_checksums"] == {n: sha256_of(t) for n, t in adapter.items()}
        assert LoRAConfig.from_dict(body["config_dict"]).r == 4
        obj = _request(sgl, body)
        with install_sglang_cpu_standin(U) as standin, caplog.at_level(logging.INFO):
            for rank in range(tp):
                got = _receive(sgl, obj, rank)
                assert list(got) == list(adapter)
                for n, t in adapter.items():
                    assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
                    assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n
        rebuilt = standin.rebuilt_on
        if layout == "bucket":  # one flat region per TP rank, on holder 0's GPU
            assert rebuilt == {0: tp}
        else:  # each tensor on its holder's GPU
            assert rebuilt == {0: 14 * tp, 1: 14 * tp}
        assert sum(f"adapter sync OK: {len(adapter)}/{len(adapter)}" in r.getMessage()
                   for r in caplog.records) == tp
    finally:
        pub.close()


@pytest.mark.sglang
def test_a_corrupted_byte_fails_sglangs_checksum_check(sgl, adapter):
    from slotsync.engine.sglang.standin import install_sglang_cpu_standin

    name = list(adapter)[5]
    pub = publish(adapter, 0)
    try:
        obj = _request(sgl, load_body(pub.plan, pub.handles, UUID_OF, 1))
        pub.corrupt(name)
        with install_sglang_cpu_standin(U), pytest.raises(RuntimeError) as e:
            _receive(sgl, obj, 0)
        assert str(e.value) == (f"[LORA-CHECK] rank0 adapter sync MISMATCH of 28 expected: 1 "
                                f"value-diff ['{name}'], 0 missing [], 0 extra []")
    finally:
        pub.close()


@pytest.mark.sglang
def test_a_list_of_pairs_would_be_all_missing(sgl, adapter):
    from slotsync.engine.sglang.standin import install_sglang_cpu_standin

    pub = publish(adapter, 0)
    try:
        body = load_body(pub.plan, pub.handles, UUID_OF, 1)
        h = pub.handles[0]
        parts = [t.parts[0] for t in pub.plan.tensors]
        body["serialized_named_tensors"] = [rank_entry_unpacked(
            [ShmHandle(h.segment, h.offset + p.offset, p.nbytes) for p in parts], U[0],
            list(adapter), [t.dtype for t in pub.plan.tensors],
            [t.shape for t in pub.plan.tensors])]
        body["load_format"] = None
        with install_sglang_cpu_standin(U), pytest.raises(RuntimeError, match="28 missing"):
            _receive(sgl, _request(sgl, body), 0)
    finally:
        pub.close()


def _cuda(n: int, *, handle: bytes, counter: bytes, counter_offset: int,
          storage_offset: int = 0) -> CudaIpcHandle:
    return CudaIpcHandle("torch.Tensor", (n,), (1,), storage_offset, "torch.storage.TypedStorage",
                         "uint8", 0, handle, storage_offset + n + 1024, 512, False, counter,
                         counter_offset, b"e" * 66, True)


@pytest.mark.sglang
@pytest.mark.parametrize("layout", ["bucket", "dict"])
def test_one_real_ref_counter_per_cuda_handle(sgl, adapter, layout):
    from sglang.srt.utils.common import MultiprocessingSerializer
    from torch.multiprocessing import reductions

    from slotsync.engine.sglang.standin import install_sglang_cpu_standin

    holder = 0 if layout == "bucket" else {n: i % 2 for i, n in enumerate(adapter)}
    pub = publish(adapter, holder)  # (the plan's offsets; the memory is not read)
    pub.close()
    handles = {r: _cuda(h.nbytes, handle=bytes([65 + r]) * 66, counter=f"/torch_{r}".encode(),
                        counter_offset=7 + r, storage_offset=256 * r)
               for r, h in pub.handles.items()}
    body = load_body(pub.plan, handles, UUID_OF, 3, checksums=False)
    seen: list[tuple] = []

    def recorder(*args: Any) -> torch.Tensor:
        seen.append(args)
        return torch.zeros(tuple(args[1]), dtype=args[5])

    with install_sglang_cpu_standin(U):
        reductions._rebuild_cuda_tensor_original = recorder
        per_entry = []
        for entry in body["serialized_named_tensors"]:
            start = len(seen)
            MultiprocessingSerializer.deserialize(entry)
            per_entry.append(seen[start:])
    real = [(i, k) for i, calls in enumerate(per_entry) for k, a in enumerate(calls)
            if a[11] != NO_REF_COUNTER]
    holders = sorted(handles)
    assert len(real) == len(holders), real  # once per handle in the whole body
    assert all(i == 0 for i, _ in real), real  # in TP rank 0's entry
    for r in holders:
        mine = [(k, a) for k, a in enumerate(per_entry[0]) if a[7] == handles[r].ipc_handle]
        k, a = mine[0]
        assert (a[11], a[12]) == (handles[r].ref_counter_handle, 7 + r)  # its first rebuild
        assert all(b[11] == NO_REF_COUNTER and b[12] == 0 for _, b in mine[1:])
        assert a[6] == r  # SGLang's UUID lookup: the holder's GPU
    if layout == "dict":  # views at (storage_offset + part offset) / itemsize, in elements
        by_name = {t.name: t for t in pub.plan.tensors}
        for a, name in zip(per_entry[1], adapter, strict=True):
            p = by_name[name].parts[0]
            assert a[3] == (handles[p.rank].storage_offset + p.offset) // 2, name
            assert tuple(a[1]) == tuple(adapter[name].shape) and a[5] is torch.bfloat16


def _globals(entry: bytes) -> set[tuple[str, str]]:
    out = set()
    for op, arg, _ in pickletools.genops(entry):
        if op.name == "GLOBAL":
            mod, name = arg.split(" ", 1)
            out.add((mod, name))
        assert op.name != "STACK_GLOBAL"
    return out


@pytest.mark.sglang
def test_only_allow_listed_globals(sgl, adapter):
    bodies = []
    for holder in (0, {n: i % 2 for i, n in enumerate(adapter)}):
        pub = publish(adapter, holder)
        try:
            bodies.append(load_body(pub.plan, pub.handles, UUID_OF, 2))
        finally:
            pub.close()
    pub = publish(adapter, 0)
    pub.close()
    handles = {0: _cuda(1 << 20, handle=b"h" * 66, counter=b"/c", counter_offset=1)}
    bodies.append(load_body(pub.plan, handles, UUID_OF, 2))
    used = set().union(*(_globals(e) for b in bodies for e in b["serialized_named_tensors"]))
    assert used <= sgl.allowed, used - sgl.allowed
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in used


def test_refusals_name_what_to_change(adapter):
    split = split_plan(adapter, next(iter(adapter)))
    why = refusal(split)
    assert "is split over ranks 0 (rows 0-2), 1 (rows 2-4)" in why
    assert "publish each adapter tensor whole from one rank" in why
    with pytest.raises(SglangPayloadError, match="is split over ranks"):
        load_body(split, {}, UUID_OF, 2)

    def with_config(**cfg: Any) -> str:
        pub = publish(adapter, 0, cfg=cfg)
        pub.close()
        return refusal(pub.plan, {"lora_target_modules": ["q_proj", "v_proj"]})

    from lora_adapters import config
    assert "DoRA" in with_config(**config(use_dora=True))
    no_alpha = config()
    del no_alpha["lora_alpha"]
    assert "no 'lora_alpha'" in with_config(**no_alpha)
    assert "--lora-target-modules" in with_config(**config())  # o_proj, gate_up, down: missing
    assert with_config(**config(modules=("q_proj", "v_proj", "k_proj"))) == ""
    assert with_config(**config(modules="all-linear")) == ""  # SGLang: {"all"} fits
    pub = publish(adapter, 0)
    pub.close()
    assert "data-parallel replicas" in refusal(pub.plan, {"dp_size": 2})
    assert "--enable-dp-attention" in refusal(pub.plan, {"enable_dp_attention": True})
    assert refusal(pub.plan, {"lora_target_modules": ["all"]}) == ""
    # a part one byte off its alignment (the handle starts at byte 1 of its segment)
    pub = publish(adapter, 0, lead=1)
    try:
        with pytest.raises(SglangPayloadError, match="starts at byte 1 of its shared-memory "
                                                     "segment, not a multiple of its 2-byte"):
            load_body(pub.plan, pub.handles, UUID_OF, 2)
        with pytest.raises(SglangPayloadError, match="not one of the engine's GPUs"):
            load_body(pub.plan, pub.handles, UUID_OF, 2, engine_gpu_uuids=[U[1], U[2]])
        with pytest.raises(SglangPayloadError, match="'GPU-' prefix"):
            load_body(pub.plan, pub.handles, {0: "GPU-" + U[0]}, 2)
        with pytest.raises(SglangPayloadError, match="at least one TP rank"):
            load_body(pub.plan, pub.handles, UUID_OF, 0)
    finally:
        pub.close()
    flat = _cuda(64, handle=b"h" * 66, counter=b"/c", counter_offset=1)
    t = TensorAt("a", "bfloat16", (4, 4), 0, 0, 32)
    bad = msgspec.structs.replace(flat, dtype="float32", size=(16,))
    with pytest.raises(SglangPayloadError, match="must be a flat uint8 region"):
        bucket_entry(bad, U[0], [t], counted=True)
    with pytest.raises(SglangPayloadError, match="ends at byte 96 of a region of 64"):
        dict_entry({0: flat}, {0: U[0]}, [t._replace(offset=64)], counted=True)
    with pytest.raises(SglangPayloadError, match="sent no handle"):
        dict_entry({}, {0: U[0]}, [t], counted=True)


@pytest.mark.sglang
def test_lora_limits():
    info = {"enable_lora": True, "max_lora_rank": 32, "max_loaded_loras": 4,
            "max_loras_per_batch": 8, "lora_target_modules": ["all"]}
    lim = lora_limits(info)
    assert (lim.enabled, lim.max_loras, lim.max_lora_rank) == (True, 4, 32)
    assert lim.flag("enabled") == "--enable-lora"
    assert lim.flag("max_loras") == "--max-loaded-loras"
    assert lim.flag("max_lora_rank") == "--max-lora-rank"
    assert lora_limits({"enable_lora": None, "lora_paths": ["a=/p"]}).enabled  # SGLang's rule
    off = lora_limits({"enable_lora": False, "max_lora_rank": None})
    assert (off.enabled, off.max_loras, off.max_lora_rank) == (False, 0, 0)
    assert lora_limits(None).enabled is False
    import msgspec.structs as ms
    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in ms.fields(ServerArgs)}
    read = {"enable_lora", "lora_paths", "max_loaded_loras", "max_lora_rank",
            "lora_target_modules", "dp_size", "enable_dp_attention"}
    assert read <= fields, read - fields
    assert {flag.removeprefix("--").replace("-", "_") for _, flag in SGLANG_LORA_FLAGS} <= fields


@pytest.mark.sglang
def test_target_modules_as_sglang_normalizes_them(sgl):
    from slotsync.engine.sglang.lora_code import LORA_UTILS, TYPING, cut, root

    theirs = cut(root() / LORA_UTILS, ("get_normalized_target_modules",), None, TYPING,
                 "test_sglang_adapters._lora_utils").get_normalized_target_modules
    cases = [["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"],
             ["model.layers.0.self_attn.q_proj", "lm_head", "embed_tokens", "output"],
             ["q_a_proj", "kv_a_proj_with_mqa", "wq_b", "wk", "weights_proj", "x"], [], "all",
             "all-linear"]
    for case in cases:
        assert normalized_target_modules(case) == theirs(case), case
    for f in (normalized_target_modules, theirs):
        with pytest.raises(ValueError, match="Only 'all' or 'all-linear'"):
            f("q_proj")


def test_bodies_names_and_routes():
    assert unload_body("math@v3") == {"lora_name": "math@v3"}
    models = {"object": "list", "data": [
        {"id": "/m", "root": "/m", "parent": None},
        {"id": "math@v3", "root": "__tensor__", "parent": "/m"},
        {"id": "code@v1", "root": "__tensor__", "parent": "/m"}, {"bad": 1}, 7]}
    assert served_adapters(models) == {"math@v3", "code@v1"}
    assert served_adapters({"data": None}) == set() and served_adapters("x") == set()
    d = sglang_routes.Dialect("0.5.23")
    want = {"load_lora_adapter": ("POST", "/load_lora_adapter_from_tensors"),
            "unload_lora_adapter": ("POST", "/unload_lora_adapter"),
            "models": ("GET", "/v1/models"),
            "prove_adapter_copies": ("POST", "/weights_checker")}
    for step, (method, path) in want.items():
        [req] = sglang_routes.plan(step, {"x": 1}, d)
        assert (req.method, req.path) == (method, path)
        assert req.body == (None if method == "GET" else {"x": 1})
        assert (path in sglang_routes.ADMIN_OPTIONAL_PATHS) == (method == "POST")
    assert sglang_routes.answer("models", [models]) is models
    assert sglang_routes.answer("load_lora_adapter", [{"success": True}]) == {}


def _method(source: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(source)
    [c] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    [f] = [n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return f


@pytest.mark.sglang
def test_the_proof_rests_on_sglangs_code(sgl):
    from slotsync.engine.sglang.lora_code import TP_WORKER, WEIGHT_CHECKER, root

    assert proving_body(1, "0.5.23") is None
    assert proving_body(2, "0.5.23") == {"action": "checksum", "skip_tensor_list": [""],
                                         "selector": "target"}
    assert proving_body(4, "0.5.21")["skip_tensor_list"] == [""]
    assert proving_body(2, "0.5.20") == {"action": "checksum"}
    checker = sgl.code.checker()
    for name in ("model.layers.0.mlp.up_proj.weight", "lm_head.weight", "x"):
        assert checker._is_skip_weight_check(name, object(), [""])
        assert not checker._is_skip_weight_check(name, object(), None)
    assert "skip_tensor_list" in (root() / WEIGHT_CHECKER).read_text()
    r = root()
    # the checksum check raises outside any try (a mismatch kills the scheduler)
    load = _method((r / TP_WORKER).read_text(), "BaseTpWorker", "load_lora_adapter_from_tensors")
    assert not any(isinstance(n, ast.Try) for n in ast.walk(load))
    assert "[LORA-CHECK]" in ast.unparse(load) and "raise RuntimeError" in ast.unparse(load)
    # LoRAAdapter._process_weight keeps host copies (.cpu()) of what it keeps
    process = _method((r / "srt/lora/lora.py").read_text(), "LoRAAdapter", "_process_weight")
    assert ast.unparse(process).count("loaded_weight.cpu()") == 3
    # the weights checker ends in a collective over the TP group
    check = _method((r / "srt/managers/scheduler_components/weight_updater.py").read_text(),
                    "SchedulerWeightUpdaterManager", "check_weights")
    assert "all_gather_object" in ast.unparse(check)
    # skip_tensor_list: 0.5.21 has it, 0.5.20 not (the wheels, where fetched)
    for version, has in (("0.5.21", True), ("0.5.20", False)):
        wheel = WHEELS / f"sglang-{version}-cp311-cp311-manylinux_2_34_x86_64.whl"
        if not wheel.exists():
            continue
        with zipfile.ZipFile(wheel) as z:
            io = z.read("sglang/srt/managers/io_struct.py").decode()
        start = io.index("class CheckWeightsReqInput")
        assert ("skip_tensor_list" in io[start:io.index("class ", start + 10)]) == has

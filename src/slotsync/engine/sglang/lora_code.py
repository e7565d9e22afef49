"""SGLang's own LoRA-adapter code for the SGLang-code engine (``--impl sglang``; issue 36 B),
compiled from the installed SGLang's source, as ``scheduler_code.py`` does for the scheduler.

The modules that hold it do not import on CPU (``io_struct.py``, ``tp_worker.py``,
``tokenizer_control_mixin.py``, ``lora_manager.py``, ``mem_pool.py``, ``lora/utils.py`` pull in
torchvision or the whole runtime), so the functions and classes below are cut out of their
source with ``ast`` (line numbers kept: a traceback names SGLang's file and line), each file's
``from __future__ import annotations`` kept, and compiled into a module of their own
(registered in ``sys.modules``, so that msgspec and pydantic resolve the structs'
annotations) with the few globals they use. What is cut, per file (paths in the wheel):

==========================================  ====================================================
``srt/managers/io_struct.py``               ``BaseReq``, ``LoadLoRAAdapterFromTensorsReqInput``,
                                            ``UnloadLoRAAdapterReqInput``, ``LoRAUpdateOutput``,
                                            ``CheckWeightsReqInput`` (the request structs,
                                            validated through SGLang's own
                                            ``msgspec_struct_pydantic_core_schema`` and
                                            ``Base64Bytes``)
``srt/managers/tokenizer_control_mixin.py``  ``_merge_lora_update_results``,
                                            ``_lora_load_needs_cleanup`` and the tokenizer's
                                            ``load_lora_adapter_from_tensors``,
                                            ``unload_lora_adapter``,
                                            ``_unload_lora_adapter_locked`` (the registry, the
                                            pending unloads, the wait for running requests,
                                            the LRU eviction past ``--max-loaded-loras``)
``srt/managers/tp_worker.py``               ``deserialize_own_rank``,
                                            ``load_lora_adapter_from_tensors`` (the payload,
                                            the bucket, the ``expected_checksums`` check),
                                            ``unload_lora_adapter``
``srt/model_executor/model_runner.py``      ``load_lora_adapter_from_tensors``,
                                            ``unload_lora_adapter``
``srt/lora/lora_manager.py``                ``create_lora_update_result``,
                                            ``validate_new_adapter`` ("already loaded", rank
                                            and modules, DoRA, pins),
                                            ``load_lora_adapter_from_tensors``,
                                            ``_load_lora_adapter_from_tensors``,
                                            ``unload_lora_adapter``, ``_unload_lora_adapter``
``srt/lora/mem_pool.py``                    ``can_support``
``srt/lora/utils.py``                       ``get_normalized_target_modules``
``srt/utils/weight_checker.py``             ``_NON_PERSISTENT_BUFFER_PATTERNS``,
                                            ``_is_non_persistent_buffer_name``,
                                            ``_is_skip_weight_check``, ``overall_checksum``
==========================================  ====================================================

Imported as they are (they import on CPU): ``LoRARegistry`` / ``LoRARef``
(``srt/lora/lora_registry.py``), ``LoRAConfig`` (``srt/lora/lora_config.py``),
``MultiprocessingSerializer``, ``normalize_serialized_named_tensor_payloads``,
``monkey_patch_torch_reductions``, ``FlattenedTensorBucket`` and ``msgspec_utils``.

What stands in (``lora_rank.py``, ``lora_front.py``): the LoRA manager's
``load_lora_weights_from_tensors`` (``LoRAAdapter._process_weight`` keeps ``.cpu()`` of each
tensor: the stand-in keeps a host copy of each, ``.cpu()`` of a CUDA tensor; on the CPU
``.cpu()`` would return the shared memory itself), the memory pool's ``remove_lora`` (no GPU
pool: nothing to free), ``get_parallel()`` / ``get_lora()`` (the engine's TP rank and LoRA
flags), and the tokenizer's ``update_lora_adapter_communicator`` (the engine's scheduler).
Each part raises ``SglangCodeMissing`` where its files are not there: the shim
(``SLOTSYNC_SGLANG_SHIM``, ``tools/sglang_shim.py``) carries ``tp_worker.py``'s source for
:func:`receive` only (the GPU test); the engine's LoRA routes need an installed SGLang.
"""

from __future__ import annotations
import __future__

import ast
import logging
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slotsync.engine.sglang.scheduler_code import SglangCodeMissing, installed_root

IO_STRUCT = "srt/managers/io_struct.py"
TOKENIZER = "srt/managers/tokenizer_control_mixin.py"
TP_WORKER = "srt/managers/tp_worker.py"
MODEL_RUNNER = "srt/model_executor/model_runner.py"
LORA_MANAGER = "srt/lora/lora_manager.py"
MEM_POOL = "srt/lora/mem_pool.py"
LORA_UTILS = "srt/lora/utils.py"
WEIGHT_CHECKER = "srt/utils/weight_checker.py"

STRUCTS = ("BaseReq", "LoadLoRAAdapterFromTensorsReqInput", "UnloadLoRAAdapterReqInput",
           "LoRAUpdateOutput", "CheckWeightsReqInput")
TOKENIZER_FUNCS = ("_merge_lora_update_results", "_lora_load_needs_cleanup")
TOKENIZER_METHODS = ("load_lora_adapter_from_tensors", "unload_lora_adapter",
                     "_unload_lora_adapter_locked")
TP_WORKER_METHODS = ("deserialize_own_rank", "load_lora_adapter_from_tensors",
                     "unload_lora_adapter")
RUNNER_METHODS = ("load_lora_adapter_from_tensors", "unload_lora_adapter")
MANAGER_METHODS = ("create_lora_update_result", "validate_new_adapter",
                   "load_lora_adapter_from_tensors", "_load_lora_adapter_from_tensors",
                   "unload_lora_adapter", "_unload_lora_adapter")
CHECKER_NAMES = ("_NON_PERSISTENT_BUFFER_PATTERNS", "_is_non_persistent_buffer_name",
                 "_is_skip_weight_check", "overall_checksum")

log = logging.getLogger("sglang.srt.lora")

TYPING = {n: getattr(typing, n) for n in ("Optional", "Dict", "List", "Any", "Annotated",
                                           "Union", "Literal", "Tuple", "Set", "Iterable")}
"""The ``typing`` names SGLang's cut code reads (its annotations)."""


def _bound(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    return []


def cut(path: Path, names: Sequence[str], cls: str | None, globals_: dict[str, Any],
        module: str) -> types.ModuleType:
    """Compile ``names`` of the file at ``path`` -- methods of class ``cls``, or top-level
    definitions and assignments when ``cls`` is None -- into a new module named ``module``
    (registered in ``sys.modules``) holding ``globals_``; line numbers and the file's
    ``from __future__ import annotations`` kept.

    Raises:
        SglangCodeMissing: the file, the class or a name is not there, or a function carries
            a decorator (not read).
    """
    if not path.is_file():
        raise SglangCodeMissing(f"{path}: no such file (an SGLang without its LoRA code)")
    tree = ast.parse(path.read_text(), str(path))
    flags = 0
    if any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
           and any(a.name == "annotations" for a in n.names) for n in tree.body):
        flags = __future__.annotations.compiler_flag
    body = tree.body
    if cls is not None:
        found = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls]
        if not found:
            raise SglangCodeMissing(f"{path}: no class {cls}")
        body = found[0].body
    nodes: dict[str, ast.stmt] = {}
    for n in body:
        for name in _bound(n):
            if name in names:
                nodes[name] = n
    for name in names:
        if name not in nodes:
            raise SglangCodeMissing(f"{path}: no {cls + '.' if cls else ''}{name} (an SGLang "
                                    "release whose LoRA code was not read)")
        node = nodes[name]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.decorator_list:
            raise SglangCodeMissing(f"{path}: {name} is decorated (not read)")
    order = sorted({id(n): n for n in nodes.values()}.values(), key=lambda n: n.lineno)
    mod = types.ModuleType(module)
    mod.__dict__.update(globals_)
    mod.__dict__["__name__"] = module
    mod.__dict__["__file__"] = str(path)
    sys.modules[module] = mod
    code = compile(ast.Module(body=order, type_ignores=[]), str(path), "exec",
                   flags=flags, dont_inherit=True)
    exec(code, mod.__dict__)  # noqa: S102 - SGLang's own source
    return mod


def root() -> Path:
    """The installed SGLang's package folder (or the shim's).

    Raises:
        SglangCodeMissing: no sglang is importable.
    """
    r = installed_root()
    if r is None:
        raise SglangCodeMissing("no sglang package is importable")
    return r


_CACHE: dict[str, types.ModuleType] = {}


def _once(key: str, build: Any) -> types.ModuleType:
    mod = _CACHE.get(key)
    if mod is None:
        mod = _CACHE[key] = build()
    return mod


def structs() -> types.ModuleType:
    """SGLang's request structs (module docstring), validated with SGLang's own
    ``msgspec_struct_pydantic_core_schema`` and ``Base64Bytes``.

    Raises:
        SglangCodeMissing: as :func:`cut`.
    """
    def build() -> types.ModuleType:
        import msgspec
        from sglang.srt.lora.lora_registry import LoRARef
        from sglang.srt.utils.msgspec_utils import (
            Base64Bytes,
            msgspec_struct_pydantic_core_schema,
        )

        return cut(root() / IO_STRUCT, STRUCTS, None, {
            **TYPING, "msgspec": msgspec, "LoRARef": LoRARef, "Base64Bytes": Base64Bytes,
            "msgspec_struct_pydantic_core_schema": msgspec_struct_pydantic_core_schema,
        }, "slotsync.engine.sglang._sglang_io_struct")

    return _once("structs", build)


def tokenizer(get_lora: Any, get_parallel: Any) -> types.ModuleType:
    """The tokenizer's LoRA methods and their two helpers (module docstring), over
    ``get_lora()`` / ``get_parallel()`` (the engine's flags).

    Raises:
        SglangCodeMissing: as :func:`cut`.
    """
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

    s = structs()
    g = {"get_lora": get_lora, "get_parallel": get_parallel, "LoRARef": LoRARef,
         "logger": logging.getLogger("sglang.srt.managers.tokenizer_manager"),
         "normalize_serialized_named_tensor_payloads":
             normalize_serialized_named_tensor_payloads,
         "UnloadLoRAAdapterReqInput": s.UnloadLoRAAdapterReqInput,
         "LoRAUpdateOutput": s.LoRAUpdateOutput,
         "LoadLoRAAdapterFromTensorsReqOutput": s.LoRAUpdateOutput,
         "UnloadLoRAAdapterReqOutput": s.LoRAUpdateOutput}
    helpers = cut(root() / TOKENIZER, TOKENIZER_FUNCS, None, g,
                  "slotsync.engine.sglang._sglang_tokenizer_helpers")
    g.update({n: getattr(helpers, n) for n in TOKENIZER_FUNCS})
    return cut(root() / TOKENIZER, TOKENIZER_METHODS, "TokenizerControlMixin", g,
               "slotsync.engine.sglang._sglang_tokenizer_lora")


def rank(get_parallel: Any) -> dict[str, types.ModuleType]:
    """A TP rank's LoRA code (module docstring): ``"tp_worker"`` (``TpModelWorker``'s three
    methods), ``"runner"`` (``ModelRunner``'s two), ``"manager"`` (``LoRAManager``'s six),
    ``"mem_pool"`` (``can_support``), ``"utils"`` (``get_normalized_target_modules``).

    Raises:
        SglangCodeMissing: as :func:`cut`.
    """
    import torch
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.lora.lora_registry import LoRARef

    s = structs()
    r = root()
    common = {"torch": torch, "logger": log, "get_parallel": get_parallel,
              "LoRARef": LoRARef, "LoRAUpdateOutput": s.LoRAUpdateOutput, **TYPING}
    utils = cut(r / LORA_UTILS, ("get_normalized_target_modules",), None,
                common, "slotsync.engine.sglang._sglang_lora_utils")
    mem_pool = cut(r / MEM_POOL, ("can_support",), "LoRAMemoryPool", {
        **common, "LoRAConfig": LoRAConfig,
        "get_normalized_target_modules": utils.get_normalized_target_modules},
        "slotsync.engine.sglang._sglang_mem_pool")
    manager = cut(r / LORA_MANAGER, MANAGER_METHODS, "LoRAManager", {
        **common, "LoRAConfig": LoRAConfig,
        "get_available_gpu_memory": lambda *_a, **_k: 0.0},
        "slotsync.engine.sglang._sglang_lora_manager")
    runner = cut(r / MODEL_RUNNER, RUNNER_METHODS, "ModelRunner", common,
                 "slotsync.engine.sglang._sglang_model_runner")
    return {"tp_worker": receive(get_parallel), "runner": runner, "manager": manager,
            "mem_pool": mem_pool, "utils": utils}


def receive(get_parallel: Any) -> types.ModuleType:
    """``TpModelWorker``'s ``deserialize_own_rank``, ``load_lora_adapter_from_tensors`` and
    ``unload_lora_adapter`` (``srt/managers/tp_worker.py``) alone, over ``get_parallel()``:
    what needs only the receive path's modules (the shim's, with ``tp_worker.py``'s source:
    the GPU test, ``tools/sglang_shim.py``).

    Raises:
        SglangCodeMissing: as :func:`cut`.
    """
    import torch
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    return cut(root() / TP_WORKER, TP_WORKER_METHODS, "BaseTpWorker", {
        "torch": torch, "logger": log, "get_parallel": get_parallel,
        "FlattenedTensorBucket": FlattenedTensorBucket,
        "MultiprocessingSerializer": MultiprocessingSerializer,
        "monkey_patch_torch_reductions": monkey_patch_torch_reductions},
        "slotsync.engine.sglang._sglang_tp_worker")


def checker() -> types.ModuleType:
    """SGLang's skip rule and overall checksum of ``/weights_checker`` (module docstring).

    Raises:
        SglangCodeMissing: as :func:`cut`.
    """
    import hashlib

    return _once("checker", lambda: cut(
        root() / WEIGHT_CHECKER, CHECKER_NAMES, None, {**TYPING, "hashlib": hashlib},
        "slotsync.engine.sglang._sglang_weight_checker"))


def methods(mod: types.ModuleType, names: Sequence[str]) -> dict[str, Any]:
    """``{name: function}`` of ``mod`` (to make a class of them: the cut methods take
    ``self``)."""
    return {n: getattr(mod, n) for n in names}

"""Make SGLang's receive code importable where the sglang wheel cannot be installed.

``python tools/sglang_shim.py DEST`` builds, from the sglang installed in this interpreter
(0.5.23 in the project's ``.venv``: ``scripts/test`` installs it), the few SGLang modules a TP
rank's receive path runs (docs/sglang-contract.md 3.1-3.4: the tokenizer's
``normalize_serialized_named_tensor_payloads``, ``TpModelWorker.deserialize_own_rank`` =
``monkey_patch_torch_reductions()`` + ``MultiprocessingSerializer.deserialize`` =
``SafeUnpickler``, torch's CUDA rebuild through ``_rebuild_cuda_tensor_modified``, and the
model runner's ``FlattenedTensorBucket``), so that they run on the GPU machine, which has no
sglang and no network (issue 26 E):

=====================================================  ========================================
file in ``DEST``                                       what it is
=====================================================  ========================================
``sglang/srt/utils/patch_torch.py``                    copied unchanged
``sglang/srt/weight_sync/tensor_bucket.py``            copied unchanged
``sglang/srt/utils/msgspec_utils.py``,                 copied unchanged: the SGLang-code
``sglang/srt/utils/auth.py``                           engine's front validates bodies and
                                                       decides auth with them
                                                       (``Base64Bytes``,
                                                       ``msgspec_struct_pydantic_core_schema``,
                                                       ``decide_request_auth``; they need
                                                       msgspec and pydantic_core)
``sglang/srt/utils/common.py``                         **extracted**: the exact source of
                                                       ``SafeUnpickler``,
                                                       ``MultiprocessingSerializer``,
                                                       ``normalize_serialized_named_tensor_``
                                                       ``payload(s)``,
                                                       ``_looks_like_pickle_payload``,
                                                       ``ConcurrentCounter``,
                                                       ``SUPPORTED_LORA_TARGET_MODULES`` (the
                                                       LoRA code's), and of
                                                       ``is_npu``, ``is_musa``,
                                                       ``torch_release`` (what
                                                       ``patch_torch.py`` imports from it),
                                                       plus every top-level name these refer
                                                       to, found by ``symtable`` and cut out
                                                       of the real file by ``ast`` line range
                                                       (decorators included); each segment is
                                                       headed by its line range; only the
                                                       import statements those names come from
                                                       are kept, one name each
``sglang/srt/managers/tp_worker.py``                  copied unchanged, **never imported**:
                                                       its source is read by
                                                       ``slotsync.engine.sglang.lora_code.receive``
                                                       (``ast``), which compiles
                                                       ``TpModelWorker``'s LoRA receive methods
                                                       (``load_lora_adapter_from_tensors``:
                                                       the bucket, the checksum check) for the
                                                       adapter GPU test (issue 36)
``sglang/srt/managers/io_struct.py``,                  copied unchanged, **never imported**,
``.../managers/tokenizer_control_mixin.py``,           likewise: ``lora_code`` cuts the
``sglang/srt/model_executor/model_runner.py``,         SGLang-code engine's ``--enable-lora``
``sglang/srt/lora/lora_manager.py``,                   code out of them (the request structs,
``sglang/srt/lora/mem_pool.py``,                       the tokenizer's, runner's and
``sglang/srt/lora/utils.py``,                          ``LoRAManager``'s methods,
``sglang/srt/utils/weight_checker.py``                 ``can_support``, the target-module
                                                       names, the weights checker), so that the
                                                       engine serves adapters on the GPU
                                                       machine (``tests/gpu/test_gpu_adapters``)
``sglang/srt/lora/lora_registry.py``,                  copied unchanged: ``LoRARegistry`` /
``sglang/srt/lora/lora_config.py``,                    ``LoRARef`` (with the ``RWLock`` they
``sglang/srt/utils/aio_rwlock.py``                     take) and ``LoRAConfig`` (it imports
                                                       ``huggingface_hub``, which the GPU
                                                       machine has)
``sglang/__init__.py``, ``sglang/srt/__init__.py``,    package markers (the real
``sglang/srt/utils/__init__.py``,                      ``sglang/__init__.py`` imports the whole
``sglang/srt/weight_sync/__init__.py``,                front end, ``srt/utils/__init__.py``
``sglang/srt/lora/__init__.py``                        ``common`` and ``network``, i.e. zmq:
                                                       the shim's re-exports
                                                       ``ConcurrentCounter`` alone;
                                                       ``srt``, ``weight_sync`` and ``lora`` are
                                                       namespace packages in the wheel: regular
                                                       ones here, so nothing merges with an
                                                       installed sglang). ``sglang.__version__``
                                                       says which SGLang the copies come from
``pybase64.py``                                        the standard library's ``base64``
                                                       (``common.py``: ``import pybase64``;
                                                       same functions, same results)
=====================================================  ========================================

Why extract rather than copy ``common.py``: it imports numpy, orjson, psutil, requests,
triton, PIL, starlette and half of SGLang at module level (L84-114, 0.5.23;
docs/sglang-contract.md 9), none of which the receive path uses. The extraction fails (exit 1)
when a referenced name is neither a top-level definition nor an import of ``common.py`` nor a
builtin, so a later SGLang whose serializer needs something new is not silently mis-shimmed.

Then it imports the result in a fresh interpreter with ``PYTHONPATH=DEST`` (and this repository's
``src``) and checks that every ``sglang`` module loaded (and ``pybase64``) comes from ``DEST``
(an installed sglang is shadowed), and that pickles written by
``slotsync.daemon.sglang.tensor_pickle``
(a packed bucket of three dtypes, an unpacked list, an empty bucket) go through the shim's
``normalize_serialized_named_tensor_payloads``, ``MultiprocessingSerializer.deserialize``
(``SafeUnpickler``), ``_rebuild_cuda_tensor_modified`` (the UUID mapped to device index 0 by
SGLang's own lookup over a faked ``get_device_properties``; torch's original rebuild replaced
by a recorder that returns a CPU buffer, as no IPC handle can be opened there) and
``FlattenedTensorBucket.reconstruct_tensors``, and come out with the names, dtypes, shapes and
bytes written, and that ``lora_code.receive`` compiles ``TpModelWorker``'s LoRA methods from
the shim's ``tp_worker.py`` without importing it (``--no-check`` skips this).

Use it on the GPU machine: ``SLOTSYNC_SGLANG_SHIM=DEST python -m slotsync.engine --impl sglang
--device cuda ...`` (the engine puts ``DEST`` first on its workers' ``sys.path``);
tests/gpu/test_gpu_sglang.py does so with ``build/sglang-shim``. ``DEST`` is build output
(``build/`` is git-ignored).

Exit status: 0 on success, 1 when the extraction or the check fails, 2 when no sglang is
installed here.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import symtable
import sys
import textwrap
from pathlib import Path

COPIED = ("srt/utils/patch_torch.py", "srt/weight_sync/tensor_bucket.py",
          "srt/utils/msgspec_utils.py", "srt/utils/auth.py", "srt/lora/lora_registry.py",
          "srt/lora/lora_config.py", "srt/utils/aio_rwlock.py")
"""Copied unchanged (paths inside the sglang package). ``msgspec_utils.py`` and ``auth.py``
are the engine front's (``slotsync.engine.sglang.http``: SGLang's body validation and auth
decision; they import only the standard library, msgspec and pydantic_core); the last three
the LoRA front's and ranks' (``engine/sglang/lora_front.py``, ``lora_code.py``:
``LoRARegistry`` / ``LoRARef`` with the ``RWLock`` they take, ``LoRAConfig``, which imports
``huggingface_hub``)."""

SOURCE_ONLY = ("srt/managers/tp_worker.py", "srt/managers/io_struct.py",
               "srt/managers/tokenizer_control_mixin.py",
               "srt/model_executor/model_runner.py", "srt/lora/lora_manager.py",
               "srt/lora/mem_pool.py", "srt/lora/utils.py", "srt/utils/weight_checker.py")
"""Copied unchanged for their source only (``lora_code`` cuts functions, classes and methods
out of them with ``ast``: ``receive`` from ``tp_worker.py``, the SGLang-code engine's
``--enable-lora`` routes from all of them, issue 36); importing them would need the whole
runtime. No ``__init__.py`` is written beside ``managers`` and ``model_executor``, so nothing
imports those by accident (``srt/lora`` and ``srt/utils`` are packages for the copied
modules beside them: their source-only files fail to import, as they would on CPU)."""

ROOTS = ("SafeUnpickler", "MultiprocessingSerializer", "normalize_serialized_named_tensor_payload",
         "normalize_serialized_named_tensor_payloads", "_looks_like_pickle_payload",
         "ConcurrentCounter", "SUPPORTED_LORA_TARGET_MODULES")
"""The names of ``common.py`` the receive path calls (with what ``patch_torch.py`` imports
from ``common``, found in its source), and the LoRA code's: ``ConcurrentCounter``
(``lora_registry.py``: ``from sglang.srt.utils import ConcurrentCounter``, re-exported by the
shim's ``srt/utils/__init__.py``) and ``SUPPORTED_LORA_TARGET_MODULES``
(``--lora-target-modules all``, ``engine/sglang/lora_rank.py``)."""

STANDIN_MODULES = {"pybase64": "pybase64.py"}
"""Imports of the extracted code that get a stand-in module in ``DEST`` (name -> file)."""

MARKERS: dict[str, str] = {
    "sglang/srt/__init__.py": '"""slotsync shim: package marker (a namespace package in the '
                              'wheel)."""\n',
    "sglang/srt/utils/__init__.py": (
        '"""slotsync shim: package marker (the real one star-imports common and imports\n'
        'network, i.e. zmq); re-exports the one name of common.py that lora_registry.py\n'
        'imports from here."""\n\n'
        'from sglang.srt.utils.common import ConcurrentCounter  # noqa: F401\n'),
    "sglang/srt/lora/__init__.py": '"""slotsync shim: package marker (a namespace package in '
                                   'the wheel)."""\n',
    "sglang/srt/weight_sync/__init__.py": '"""slotsync shim: package marker (a namespace '
                                          'package in the wheel)."""\n',
    "pybase64.py": textwrap.dedent('''\
        """slotsync shim for pybase64 (sglang common.py: ``import pybase64``): the standard
        library's base64, which computes the same results (pybase64 is its SIMD twin)."""

        from base64 import b64decode, b64encode, standard_b64decode, standard_b64encode

        __all__ = ["b64decode", "b64encode", "standard_b64decode", "standard_b64encode"]
        '''),
}

CHECK = textwrap.dedent('''\
    import os, sys
    from types import SimpleNamespace
    dest = os.path.realpath(sys.argv[1])
    import torch
    from torch.multiprocessing import reductions
    from sglang.srt.utils.common import (MultiprocessingSerializer,
                                         normalize_serialized_named_tensor_payloads)
    from sglang.srt.utils import patch_torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    import sglang.srt.utils.auth, sglang.srt.utils.msgspec_utils
    from slotsync.daemon.sglang import tensor_pickle as sglang_pickle
    from slotsync.protocol.wire import CudaIpcHandle
    bad = [n for n, m in sys.modules.items()
           if (n == "sglang" or n.startswith("sglang.") or n == "pybase64")
           and not os.path.realpath(getattr(m, "__file__", "") or "").startswith(dest)]
    if bad:
        sys.exit(f"modules loaded from outside {dest}: {bad}")
    UUID = "6b6b7a3e-0000-4000-8000-000000000000"
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_properties = lambda i: SimpleNamespace(uuid=UUID)
    patch_torch.monkey_patch_torch_reductions()
    seen = []
    buf = torch.arange(64, dtype=torch.uint8)
    def original(*args):
        seen.append(args[6])
        if args[7] is None:
            return torch.empty(0, dtype=torch.uint8)
        return buf[: args[1][0]] if args[5] is torch.uint8 else buf[:8].view(args[5])
    reductions._rebuild_cuda_tensor_original = original
    def handle(nbytes, dtype="uint8", size=None):
        return CudaIpcHandle("torch.Tensor", size or (nbytes,), (1,), 0,
                             "torch.storage.TypedStorage", dtype, 0, b"h" * 66, 64, 0, False,
                             b"r" * 30, 0, b"e" * 66, True)
    names, dts, shapes, sizes = ["a", "b", "c"], ["bfloat16", "float32", "int8"], \\
        [(2, 3), (4,), (3,)], [12, 16, 3]
    packed = sglang_pickle.rank_entry_packed(handle(32), UUID, names, dts, shapes, sizes)
    unpacked = sglang_pickle.rank_entry_unpacked([handle(8, "float32", (2,))], UUID, ["w"],
                                                 ["float32"], [(2,)])
    empty = sglang_pickle.rank_entry_packed(None, UUID, [], [], [], [])
    entries = normalize_serialized_named_tensor_payloads([packed, unpacked, empty])
    assert entries == [packed, unpacked, empty], "normalization changed a pickle"
    d = MultiprocessingSerializer.deserialize(entries[0])
    got = FlattenedTensorBucket(flattened_tensor=d["flattened_tensor"],
                                metadata=d["metadata"]).reconstruct_tensors()
    starts = [0, 12, 28]
    for (n, t), name, dt, shape, start, size in zip(got, names, dts, shapes, starts, sizes):
        assert (n, t.dtype, tuple(t.shape)) == (name, getattr(torch, dt), shape), (n, t)
        assert torch.equal(t.flatten().view(torch.uint8), buf[start:start + size]), n
    [(n, t)] = MultiprocessingSerializer.deserialize(entries[1])
    assert n == "w" and torch.equal(t, buf[:8].view(torch.float32)), (n, t)
    e = MultiprocessingSerializer.deserialize(entries[2])
    assert e["metadata"] == [] and e["flattened_tensor"].numel() == 0, e
    assert seen == [0, 0, 0], f"torch's rebuild saw devices {seen}, not index 0"
    from slotsync.engine.sglang import lora_code
    receive = lora_code.receive(lambda: SimpleNamespace(tp_rank=0))
    assert receive.__file__.startswith(dest), receive.__file__
    assert "sglang.srt.managers.tp_worker" not in sys.modules
    # the SGLang-code engine's --enable-lora code (issue 36): front, structs, ranks, checker
    from sglang.srt.lora.lora_registry import LoRARegistry
    from sglang.srt.lora.lora_config import LoRAConfig
    parts = lora_code.rank(lambda: SimpleNamespace(tp_rank=0, dp_size=1))
    parts["tokenizer"] = lora_code.tokenizer(lambda: None, lambda: None)
    parts["checker"] = lora_code.checker()
    away = {k: m.__file__ for k, m in parts.items() if not m.__file__.startswith(dest)}
    assert not away, away
    bad = [n for n, m in sys.modules.items()
           if (n == "sglang" or n.startswith("sglang.") or n == "pybase64")
           and not os.path.realpath(getattr(m, "__file__", "") or "").startswith(dest)]
    if bad:
        sys.exit(f"modules loaded from outside {dest}: {bad}")
    print(patch_torch.__file__)
    ''')


def installed_sglang() -> Path:
    """The installed sglang package folder (found without importing it).

    Raises:
        SystemExit(2): no sglang installed in this interpreter.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        print("sglang_shim: no sglang package is installed in this interpreter "
              f"({sys.executable})", file=sys.stderr)
        raise SystemExit(2)
    return Path(next(iter(spec.submodule_search_locations)))


def sglang_version() -> str:
    """The installed sglang distribution's version."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _referenced(segment: str) -> set[str]:
    """Module-level names a top-level statement's source refers to (``symtable``: the names
    it loads at module level and its nested scopes' free globals; annotations are not
    evaluated under ``from __future__ import annotations``, as in ``common.py``)."""
    table = symtable.symtable("from __future__ import annotations\n" + segment, "<seg>", "exec")
    out: set[str] = set()

    def walk(t: symtable.SymbolTable) -> None:
        for s in t.get_symbols():
            if s.is_referenced() and (t.get_type() == "module" or s.is_global()):
                out.add(s.get_name())
        for child in t.get_children():
            walk(child)

    walk(table)
    out.discard("annotations")
    return out


def _bound_names(node: ast.stmt) -> list[str]:
    """Names a top-level definition or assignment binds (imports apart)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def extract(common_src: str, roots: list[str], origin: str) -> str:
    """The stand-in ``common.py``: the exact source of ``roots`` and of every top-level name
    they refer to, transitively, in source order, after the one-name import statements they
    need.

    Raises:
        ValueError: a referenced name is defined nowhere in ``common_src`` (nor a builtin), or
            ``common_src`` lacks ``from __future__ import annotations`` (the segments'
            annotations would then be evaluated, and need more names).
    """
    tree = ast.parse(common_src)
    lines = common_src.splitlines(keepends=True)
    defs: dict[str, ast.stmt] = {}
    imports: dict[str, tuple[ast.stmt, ast.alias]] = {}
    future = False
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            future = future or any(a.name == "annotations" for a in node.names)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for a in node.names:
                imports[(a.asname or a.name).split(".")[0]] = (node, a)
        else:
            for name in _bound_names(node):
                defs[name] = node
    if not future:
        raise ValueError(f"{origin} lacks 'from __future__ import annotations'")

    def segment(node: ast.stmt) -> tuple[int, int]:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return first, node.end_lineno or node.lineno

    needed_defs: dict[int, ast.stmt] = {}
    needed_imports: dict[tuple[int, str], tuple[ast.stmt, ast.alias]] = {}
    todo = list(roots)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in defs:
            node = defs[name]
            if id(node) not in needed_defs:
                needed_defs[id(node)] = node
                start, end = segment(node)
                todo += sorted(_referenced("".join(lines[start - 1:end])))
        elif name in imports:
            node, alias = imports[name]
            needed_imports[(node.lineno, alias.name)] = (node, alias)
        elif not hasattr(builtins, name):
            raise ValueError(f"{origin}: {name!r} is referenced but defined nowhere")
    out = [f'"""slotsync shim of sglang/srt/utils/common.py: {len(needed_defs)} top-level '
           f'definitions cut out of\n{origin}\nby tools/sglang_shim.py, each unchanged, headed '
           'by its line range there; the import\nstatements keep only the names those use."""'
           "\n\nfrom __future__ import annotations\n\n"]
    for (_, _), (node, alias) in sorted(needed_imports.items(), key=lambda kv: kv[0]):
        one = (ast.Import(names=[alias]) if isinstance(node, ast.Import)
               else ast.ImportFrom(module=node.module, names=[alias], level=node.level))
        out.append(ast.unparse(one) + "\n")
    for node in sorted(needed_defs.values(), key=lambda n: n.lineno):
        start, end = segment(node)
        out.append(f"\n\n# common.py L{start}-{end}\n" + "".join(lines[start - 1:end]))
    return "".join(out)


def patch_torch_imports(patch_src: str) -> list[str]:
    """The names ``patch_torch.py`` imports from ``sglang.srt.utils.common``."""
    return [a.name for node in ast.walk(ast.parse(patch_src))
            if isinstance(node, ast.ImportFrom) and node.module == "sglang.srt.utils.common"
            for a in node.names]


def build(dest: Path) -> list[Path]:
    """Write the shim into ``dest`` (replacing an earlier one); returns the files written.

    Raises:
        ValueError: as :func:`extract`.
    """
    src = installed_sglang()
    for stale in (dest / "sglang", dest / "pybase64.py"):
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    written: list[Path] = []
    digests = []
    for rel in (*COPIED, *SOURCE_ONLY):
        out = dest / "sglang" / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, out)
        digests.append(f"{rel} sha256={hashlib.sha256(out.read_bytes()).hexdigest()}")
        written.append(out)
    common = src / "srt" / "utils" / "common.py"
    roots = [*ROOTS, *patch_torch_imports((src / COPIED[0]).read_text())]
    out = dest / "sglang" / "srt" / "utils" / "common.py"
    out.write_text(extract(common.read_text(), roots, str(common)))
    digests.append(f"srt/utils/common.py (source) sha256="
                   f"{hashlib.sha256(common.read_bytes()).hexdigest()}")
    written.append(out)
    for rel, text in MARKERS.items():
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        written.append(out)
    version = sglang_version()
    init = dest / "sglang" / "__init__.py"
    init.write_text(
        '"""slotsync shim of SGLang: srt/utils/patch_torch.py and '
        'srt/weight_sync/tensor_bucket.py\n'
        f'copied unchanged from SGLang {version} at\n{src},\nsrt/utils/common.py cut out of '
        "its common.py, the rest stand-ins (tools/sglang_shim.py\nin slotsync).\n\n"
        + "\n".join(digests) + '\n"""\n\n'
        f'__version__ = "{version}+slotsync-shim"\n')
    written.append(init)
    return written


def check(dest: Path) -> str:
    """Import the shim in a fresh interpreter (``PYTHONPATH=dest:<repo>/src`` first) and run
    the pickle check (module docstring); returns the path of the ``patch_torch`` it loaded.

    Raises:
        RuntimeError: the import or the check failed (with the interpreter's output).
    """
    repo_src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(dest), str(repo_src), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-c", CHECK, str(dest)], capture_output=True,
                         text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"the shim does not import or check cleanly:\n{out.stderr[-4000:]}")
    return out.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python tools/sglang_shim.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path, help="folder to write (e.g. build/sglang-shim)")
    p.add_argument("--no-check", action="store_true",
                   help="do not import the result in a fresh interpreter")
    args = p.parse_args(argv)
    try:
        files = build(args.dest)
    except ValueError as e:
        print(f"sglang_shim: {e}", file=sys.stderr)
        return 1
    print(f"sglang_shim: wrote {len(files)} files into {args.dest} (SGLang {sglang_version()})")
    if not args.no_check:
        try:
            where = check(args.dest)
        except RuntimeError as e:
            print(f"sglang_shim: {e}", file=sys.stderr)
            return 1
        print(f"sglang_shim: checked: {where} imports with PYTHONPATH={args.dest}, and "
              "slotsync's pickles (packed, unpacked, empty) load through it; TpModelWorker's "
              "LoRA receive methods compile from its tp_worker.py, and the engine's "
              "--enable-lora code (LoRARegistry, LoRAConfig, the structs, the tokenizer's, "
              "runner's and LoRAManager's methods) from its files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

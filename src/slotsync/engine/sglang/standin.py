"""CPU stand-ins that let SGLang's own receive code load slotsync's shared-memory payloads.

SGLang (0.5.20-0.5.23) receives a weight update by unpickling each TP rank's entry after
``monkey_patch_torch_reductions()`` (``srt/utils/patch_torch.py``), which saves torch's
``reductions.rebuild_cuda_tensor`` as ``reductions._rebuild_cuda_tensor_original`` and puts
``_rebuild_cuda_tensor_modified`` in its place. That function maps argument 6, a GPU UUID
string, to the index of the visible device whose ``str(torch.cuda.get_device_properties(i).uuid)``
equals it (``_device_from_maybe_uuid``: ``torch.cuda.device_count()`` devices, else
"Invalid device_uuid"), then calls the saved original. On a machine without a GPU three things
stand in, and nothing else of SGLang's changes:

* ``torch.cuda.device_count()`` answers ``len(uuids)`` and ``torch.cuda.get_device_properties(i)``
  an object whose ``uuid`` is ``uuids[i]`` (``cuda_standin._UuidProps``): SGLang's own
  lookup then maps each of ``uuids`` to its index, and refuses anything else as it would;
* ``monkey_patch_torch_reductions()`` is called (SGLang's, so its modified rebuild is the one
  the pickles name);
* ``reductions._rebuild_cuda_tensor_original`` becomes :func:`rebuild_original`: a
  shared-memory stand-in tuple (``slotsync.daemon.sglang.tensor_pickle`` writes them like
  ``daemon/torch_pickle.py``'s) is mapped by ``slotsync.engine.shm.rebuild_shm_tensor`` (the tensor
  aliases ``/dev/shm/<segment>``); a tuple without storage (the empty bucket: handle ``None``
  or 0 bytes) goes to torch's original with the device replaced by ``"cpu"``, which is what
  torch does for it on a GPU, on the CPU; anything else goes to torch's original (which
  fails without CUDA, as it would).

Usage (an engine process installs it once and keeps it; a test undoes it)::

    from slotsync.engine.sglang.standin import install_sglang_cpu_standin

    install_sglang_cpu_standin(["6b6b7a3e-...", "..."])      # engine: for the process's life
    with install_sglang_cpu_standin(uuids):                  # test: undone at the end
        tensors = MultiprocessingSerializer.deserialize(entry)

Process-wide (it patches torch's modules), not thread-safe, one at a time. While installed,
``ForkingPickler`` cannot pickle CPU tensors (SGLang's ``_reduce_tensor_modified`` rewrites
argument 6 of a CUDA tensor's 15 arguments; a CPU tensor has 3: ``IndexError``); undoing the
stand-in undoes SGLang's patch too if the stand-in applied it. Imports torch and SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.multiprocessing import reductions

from slotsync.engine.cuda_standin import _device_index, _UuidProps
from slotsync.engine.shm import is_shm_args, rebuild_shm_tensor

_SAVED: dict[str, Any] = {}
"""What the installed stand-in replaced (empty: none installed)."""


def rebuild_original(*args: Any) -> torch.Tensor:
    """The stand-in for torch's ``rebuild_cuda_tensor`` behind SGLang's
    ``_rebuild_cuda_tensor_modified`` (same 15 arguments, argument 6 already a device index):
    see the module docstring.

    Raises:
        whatever ``rebuild_shm_tensor`` or torch's ``rebuild_cuda_tensor`` raise.
    """
    original = _SAVED["rebuild"]
    owner = _SAVED["owner"]
    owner.rebuilt_on[args[6]] = owner.rebuilt_on.get(args[6], 0) + 1
    if is_shm_args(args):
        return rebuild_shm_tensor(*args)
    if args[7] is None or args[8] == 0:  # torch: "storage points to nullptr"
        return original(*args[:6], "cpu", *args[7:])
    return original(*args)


class SglangCpuStandin:
    """The installed stand-in (:func:`install_sglang_cpu_standin`); ``uninstall()`` or the end
    of a ``with`` block puts back what it replaced."""

    def __init__(self, uuids: tuple[str, ...]) -> None:
        self.uuids = uuids
        self.rebuilt_on: dict[int, int] = {}
        """How many tensors SGLang's ``_rebuild_cuda_tensor_modified`` rebuilt on each device
        index (argument 6 after its UUID lookup): a TP rank's entry naming another rank's
        GPU is rebuilt there, and its copy goes peer to peer on a GPU host."""

    def uninstall(self) -> None:
        """Put back torch's ``device_count`` / ``get_device_properties`` and the saved
        original rebuild; undo SGLang's ``monkey_patch_torch_reductions`` if the stand-in
        applied it (so ``ForkingPickler`` pickles CPU tensors again). Idempotent."""
        if not _SAVED or _SAVED["owner"] is not self:
            return
        torch.cuda.device_count = _SAVED["device_count"]
        torch.cuda.get_device_properties = _SAVED["get_device_properties"]
        if _SAVED["patched"]:
            reductions.reduce_tensor = reductions._reduce_tensor_original  # type: ignore[attr-defined]
            reductions.rebuild_cuda_tensor = _SAVED["rebuild"]
            del reductions._reduce_tensor_original  # type: ignore[attr-defined]
            del reductions._rebuild_cuda_tensor_original  # type: ignore[attr-defined]
            reductions.init_reductions()
        else:
            reductions._rebuild_cuda_tensor_original = _SAVED["rebuild"]  # type: ignore[attr-defined]
        _SAVED.clear()

    def __enter__(self) -> SglangCpuStandin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def installed() -> SglangCpuStandin | None:
    """The stand-in installed in this process, or None."""
    return _SAVED.get("owner")


def install_sglang_cpu_standin(uuids: Sequence[str]) -> SglangCpuStandin:
    """Make this process look, to SGLang's receive code, like a machine whose visible GPUs
    ``0 .. len(uuids) - 1`` have the GPU UUIDs ``uuids`` (torch's format), and whose CUDA IPC
    rebuild maps slotsync's shared-memory stand-ins (module docstring). Installs at once;
    the returned object undoes it (``uninstall()``, or use the call as a context manager).

    Args:
        uuids: device ``i``'s UUID, in device-index order (an SGLang TP rank looks its own
            up among all of them, as on a GPU host).

    Raises:
        ValueError: no UUID, or the same UUID twice.
        RuntimeError: a stand-in is installed already.
        ImportError: SGLang is not importable.
    """
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    uuids = tuple(uuids)
    if not uuids or len(set(uuids)) != len(uuids):
        raise ValueError(f"need distinct GPU UUIDs, got {list(uuids)}")
    if _SAVED:
        raise RuntimeError("an SGLang CPU stand-in is installed already: uninstall it first")
    real_count = torch.cuda.device_count
    real_props = torch.cuda.get_device_properties

    def device_count() -> int:
        return len(uuids)

    def get_device_properties(device: Any = None) -> Any:
        i = _device_index(device)
        i = 0 if i is None else i
        if not 0 <= i < len(uuids):
            raise AssertionError("Invalid device id")  # torch's own words
        return _UuidProps(uuids[i])

    patched = not hasattr(reductions, "_reduce_tensor_original")
    monkey_patch_torch_reductions()
    standin = SglangCpuStandin(uuids)
    _SAVED.update(owner=standin, device_count=real_count, get_device_properties=real_props,
                  patched=patched, rebuild=reductions._rebuild_cuda_tensor_original)  # type: ignore[attr-defined]
    torch.cuda.device_count = device_count
    torch.cuda.get_device_properties = get_device_properties
    reductions._rebuild_cuda_tensor_original = rebuild_original  # type: ignore[attr-defined]
    return standin

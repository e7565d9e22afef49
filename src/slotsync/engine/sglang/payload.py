"""How an SGLang engine's TP rank reads its ``serialized_named_tensors`` entry and loads it:
the two payload parsers and the model runner's load step.

The two parsers, the only difference between the two SGLang engines:

* :class:`SglangCodeParser` (``--impl sglang``): SGLang's own code -- the tokenizer's
  ``normalize_serialized_named_tensor_payloads`` (``srt/utils/common.py`` L3129 (0.5.23)),
  then on each TP rank what ``TpModelWorker.deserialize_own_rank`` does (tp_worker.py L194-201
  (0.5.23) / L192 (0.5.21) / ``_deserialize_own_rank`` L212-219 (0.5.20), not importable on
  CPU: ``monkey_patch_torch_reductions()`` then ``MultiprocessingSerializer.deserialize(
  entries[tp_rank])``, i.e. ``SafeUnpickler``), with SGLang's ``FlattenedTensorBucket`` and
  ``FlattenedTensorMetadata`` (``srt/weight_sync/tensor_bucket.py``). The CUDA rebuild is
  SGLang's ``_rebuild_cuda_tensor_modified`` over slotsync's CPU stand-in
  (``slotsync.engine.sglang.standin.install_sglang_cpu_standin``, installed once per worker
  process), or on a GPU over torch's own ``rebuild_cuda_tensor`` (``worker.py``). Where no
  sglang is installed, ``SLOTSYNC_SGLANG_SHIM`` names the folder ``tools/sglang_shim.py``
  built (:func:`use_shim_path`).
* :class:`ReferenceParser` (``--impl sglang-reference``, no SGLang needed): a mirror of the
  normalization, an unpickler with slotsync's own exact allow-list (the globals of
  docs/sglang-contract.md table 3.6, no other), a mirror of ``_device_from_maybe_uuid``
  (``srt/utils/patch_torch.py`` L89-99) and of ``FlattenedTensorBucket.reconstruct_tensors``
  (tensor_bucket.py L118-135 / L90-107).

The load step (:func:`update_weights_from_tensor`) mirrors the model runner's
``WeightUpdater.update_weights_from_tensor`` (``srt/model_executor/model_runner_components/
weight_updater.py`` L343-381 (0.5.23) / L339 (0.5.21) / L320 (0.5.20); the module does not
import on CPU) and ``_update_weights_from_flattened_bucket`` (L383-413 / L375 / L356), over
:class:`SglangModel`, whose ``load_weights`` is what a model's does at its end:
``params_dict[name]`` (a ``KeyError`` for a name the model lacks) and
``default_weight_loader`` (``srt/model_loader/weight_utils.py`` L1574-1586: scalar fill, else
a shape ``assert`` and ``param.data.copy_``).

Every exception raised here is a scheduler exception in SGLang: the engine dies of it.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import pickle
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from slotsync.engine.shm import is_shm_args, rebuild_shm_tensor

SHIM_ENV = "SLOTSYNC_SGLANG_SHIM"
"""A folder ``python tools/sglang_shim.py DIR`` wrote: SGLang's receive code where no sglang
is installed (the GPU machine, issue 26 E); put first on ``sys.path`` by :func:`use_shim_path`."""


def use_shim_path() -> str | None:
    """Prepend ``$SLOTSYNC_SGLANG_SHIM`` to ``sys.path`` (once), if set; returns it. The
    engine's front calls it before importing SGLang's modules (its spawned CUDA ranks get
    its ``sys.path``, and call it again)."""
    d = os.environ.get(SHIM_ENV)
    if d and d not in sys.path:
        sys.path.insert(0, d)
    return d or None


class PayloadParser(Protocol):
    """What the two impls differ in (see the module docstring)."""

    name: str

    def normalize(self, entries: list[bytes]) -> list[bytes]:
        """The tokenizer's normalization of every entry (before the scheduler)."""

    def deserialize_own_rank(self, entries: Sequence[bytes], tp_rank: int) -> Any:
        """TP rank ``tp_rank`` unpickles entry ``tp_rank`` only."""

    def patch(self) -> None:
        """``monkey_patch_torch_reductions()`` (the model runner calls it again)."""

    def bucket(self, flattened_tensor: Any, metadata: list[Any]) -> Any:
        """``FlattenedTensorBucket(flattened_tensor=..., metadata=...)``."""

    def metadata(self, **fields: Any) -> Any:
        """``FlattenedTensorMetadata(**fields)``."""


class SglangCodeParser:
    """SGLang's own code (needs SGLang importable; the worker installs the CPU stand-in)."""

    name = "sglang"

    def __init__(self) -> None:
        from sglang.srt.utils.common import (
            MultiprocessingSerializer,
            normalize_serialized_named_tensor_payloads,
        )
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import (
            FlattenedTensorBucket,
            FlattenedTensorMetadata,
        )

        self._normalize = normalize_serialized_named_tensor_payloads
        self._serializer = MultiprocessingSerializer
        self._patch = monkey_patch_torch_reductions
        self._bucket = FlattenedTensorBucket
        self._metadata = FlattenedTensorMetadata

    def normalize(self, entries: list[bytes]) -> list[bytes]:
        return self._normalize(entries)

    def deserialize_own_rank(self, entries: Sequence[bytes], tp_rank: int) -> Any:
        self._patch()
        return self._serializer.deserialize(entries[tp_rank])

    def patch(self) -> None:
        self._patch()

    def bucket(self, flattened_tensor: Any, metadata: list[Any]) -> Any:
        return self._bucket(flattened_tensor=flattened_tensor, metadata=metadata)

    def metadata(self, **fields: Any) -> Any:
        return self._metadata(**fields)


# -- the reference parser --------------------------------------------------------------------


@dataclass
class FlattenedTensorMetadata:
    """Mirror of SGLang's ``FlattenedTensorMetadata`` (tensor_bucket.py L7-16, a plain
    dataclass in all three versions): ``start_idx`` / ``end_idx`` are byte offsets into the
    flattened uint8 tensor; ``numel`` is its byte count (not read)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Mirror of the reconstruction half of SGLang's ``FlattenedTensorBucket``."""

    def __init__(self, flattened_tensor: torch.Tensor,
                 metadata: list[FlattenedTensorMetadata]) -> None:
        if flattened_tensor is None or metadata is None:  # L75-80 (0.5.23)
            raise ValueError("Must provide either named_tensors or both flattened_tensor and "
                             "metadata")
        self.flattened_tensor = flattened_tensor
        self.metadata = metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``flattened_tensor[start_idx:end_idx].view(dtype).reshape(shape)`` per tensor;
        ``view`` raises for a start that is not a multiple of the dtype's size."""
        return [(m.name, self.flattened_tensor[m.start_idx:m.end_idx].view(m.dtype)
                 .reshape(m.shape)) for m in self.metadata]


_REBUILD_GLOBALS = (("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
                    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"))
"""The rebuild globals a producer may name (contract 3.4: SGLang's patched producers pickle
the first; after the patch the second resolves to it too)."""


def _dtype_globals() -> dict[tuple[str, str], Any]:
    from slotsync.protocol.wire import DTYPE_SIZES

    return {("torch", n): getattr(torch, n) for n in DTYPE_SIZES if hasattr(torch, n)}


class ReferenceParser:
    """slotsync's own parser (see the module docstring).

    Args:
        gpu_uuids: the GPU UUIDs the rank sees, in device-index order (the engine's).
    """

    name = "reference"

    def __init__(self, gpu_uuids: Sequence[str]) -> None:
        self.gpu_uuids = tuple(gpu_uuids)
        self.rebuilt_on: dict[int, int] = {}
        """How many tensors were rebuilt on each device index (``SglangCpuStandin``'s)."""
        self.allowed: dict[tuple[str, str], Any] = {
            **{g: self.rebuild for g in _REBUILD_GLOBALS},
            ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"):
                FlattenedTensorMetadata,
            ("torch", "Tensor"): torch.Tensor,
            ("torch.nn.parameter", "Parameter"): torch.nn.parameter.Parameter,
            ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
            ("torch.storage", "UntypedStorage"): torch.storage.UntypedStorage,
            ("torch", "Size"): torch.Size,
            **_dtype_globals(),
        }

    def normalize(self, entries: list[bytes]) -> list[bytes]:
        """Mirror of ``normalize_serialized_named_tensor_payload`` (common.py L3105-3126):
        bytes starting ``0x80, proto <= HIGHEST_PROTOCOL`` stay; other bytes are
        base64-decoded once more if they decode, else kept."""
        out = []
        for data in entries:
            if isinstance(data, str):
                out.append(base64.b64decode(data, validate=True))
                continue
            data = bytes(data)
            if len(data) >= 2 and data[0] == 0x80 and data[1] <= pickle.HIGHEST_PROTOCOL:
                out.append(data)
                continue
            try:
                out.append(base64.b64decode(data, validate=True))
            except (binascii.Error, ValueError):
                out.append(data)
        return out

    def deserialize_own_rank(self, entries: Sequence[bytes], tp_rank: int) -> Any:
        data = entries[tp_rank]
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        return _AllowListUnpickler(io.BytesIO(data), self.allowed).load()

    def patch(self) -> None:
        """Nothing to patch: the allow-list maps the rebuild globals itself."""

    def bucket(self, flattened_tensor: Any, metadata: list[Any]) -> FlattenedTensorBucket:
        return FlattenedTensorBucket(flattened_tensor, metadata)

    def metadata(self, **fields: Any) -> FlattenedTensorMetadata:
        return FlattenedTensorMetadata(**fields)

    def device_from_maybe_uuid(self, device: Any) -> int:
        """Mirror of ``_device_from_maybe_uuid`` over this engine's UUIDs."""
        if isinstance(device, int):
            return device
        if isinstance(device, str):
            for i, u in enumerate(self.gpu_uuids):
                if u == device:
                    return i
            raise Exception("Invalid device_uuid=" + device)  # SGLang's own exception type
        raise Exception(f"Unknown type: {device=}")

    def rebuild(self, *args: Any) -> torch.Tensor:
        """``_rebuild_cuda_tensor_modified`` over the CPU stand-in: argument 6 through
        :meth:`device_from_maybe_uuid`, then a shared-memory handle is mapped, a tuple
        without storage (an empty bucket) is an empty CPU tensor, anything else is refused
        (a real CUDA IPC handle cannot be opened on this engine)."""
        if len(args) != 15:
            raise TypeError(f"rebuild_cuda_tensor() takes 15 arguments ({len(args)} given)")
        args = (*args[:6], self.device_from_maybe_uuid(args[6]), *args[7:])
        self.rebuilt_on[args[6]] = self.rebuilt_on.get(args[6], 0) + 1
        if is_shm_args(args):
            return rebuild_shm_tensor(*args)
        if args[7] is None or args[8] == 0:
            storage = torch.UntypedStorage(0)
            t = torch._utils._rebuild_tensor(
                torch.storage.TypedStorage(wrap_storage=storage, dtype=args[5],
                                           _internal=True),
                int(args[3]), tuple(args[1]), tuple(args[2]))
            return t
        raise RuntimeError("a CUDA IPC handle cannot be opened by a CPU engine")


class _AllowListUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the exact globals of ``allowed``."""

    def __init__(self, file: io.BytesIO, allowed: dict[tuple[str, str], Any]) -> None:
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise RuntimeError(  # SGLang 0.5.21+'s words (common.py L3361-3370)
                f"Blocked unsafe global ({module}.{name}) during pickle deserialization"
            ) from None


# -- the model and the load step ---------------------------------------------------------------


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Mirror of SGLang's ``default_weight_loader`` (weight_utils.py L1574-1586)."""
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
    else:
        assert param.size() == loaded_weight.size(), (
            f"Attempted to load weight ({loaded_weight.size()}) "
            f"into parameter ({param.size()})"
        )
        param.data.copy_(loaded_weight)


class SglangModel:
    """One TP rank's copy of the model: the safetensors file's tensors by name (as SGLang's
    parameters, on the rank's device), with a model's ``load_weights`` end (see the module
    docstring).

    ``before_copy`` (tests only, issue 26 E): called before each weight copy into a parameter
    (the GPU garbage test queues ``torch.cuda._sleep`` there, on the copy stream, so that the
    copies finish late); None: nothing.
    """

    def __init__(self, tensors: dict[str, torch.Tensor],
                 before_copy: Callable[[], None] | None = None) -> None:
        self.params = tensors
        self.bytes_loaded = 0
        self.before_copy = before_copy

    def copy_in(self, param: torch.Tensor, tensor: torch.Tensor) -> None:
        """``before_copy``, then :func:`default_weight_loader` (counts the bytes)."""
        if self.before_copy is not None:
            self.before_copy()
        default_weight_loader(param, tensor)
        self.bytes_loaded += tensor.numel() * tensor.element_size()

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.params.items()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``param = params_dict[name]`` (``KeyError`` for an unknown name), then
        :func:`default_weight_loader`; returns the names loaded."""
        loaded = set()
        for name, tensor in weights:
            self.copy_in(self.params[name], tensor)
            loaded.add(name)
        return loaded


def update_weights_from_tensor(model: SglangModel, parser: PayloadParser, named_tensors: Any,
                               load_format: str | None,
                               device: torch.device) -> tuple[bool, str]:
    """The model runner's ``update_weights_from_tensor`` (module docstring): dispatch on
    ``load_format``; no custom loaders are configured.

    Raises:
        NotImplementedError: an unknown ``load_format`` (``Unknown load_format=...``).
        whatever the payload's reconstruction or ``load_weights`` raise.
    """
    parser.patch()
    if load_format == "flattened_bucket":
        return _update_weights_from_flattened_bucket(model, parser, named_tensors)
    named_tensors = [(name, tensor.to(device)) for name, tensor in named_tensors]
    if load_format == "direct":
        for name, tensor in named_tensors:  # _model_load_weights_direct (L436-439)
            model.copy_in(dict(model.named_parameters())[name], tensor)
    elif load_format is None:
        model.load_weights(named_tensors)
    else:
        raise NotImplementedError(f"Unknown load_format={load_format}")
    return True, "Success"


def _update_weights_from_flattened_bucket(model: SglangModel, parser: PayloadParser,
                                          flattened_tensor_bucket_dict: Any
                                          ) -> tuple[bool, str]:
    """Mirror of ``_update_weights_from_flattened_bucket``: copy each metadata into a new
    ``FlattenedTensorMetadata``, build the bucket, load ``reconstruct_tensors()``."""
    flattened_tensor = flattened_tensor_bucket_dict["flattened_tensor"]
    metadata = flattened_tensor_bucket_dict["metadata"]
    converted_metadata = [
        parser.metadata(name=meta.name, shape=meta.shape, dtype=meta.dtype,
                        start_idx=meta.start_idx, end_idx=meta.end_idx, numel=meta.numel)
        for meta in metadata]
    bucket = parser.bucket(flattened_tensor, converted_metadata)
    model.load_weights(bucket.reconstruct_tensors())
    return True, "Success"

"""The model a vLLM-code engine worker holds: a safetensors file as nested ``nn.Module``\\ s.

Each tensor name ``a.b.c`` becomes submodule ``a`` -> submodule ``b`` -> parameter ``c``
(``requires_grad=False``, as vLLM's parameters are), so the module tree is the checkpoint's
name tree and each innermost module is one "layer" for vLLM's layerwise reload
(``vllm.model_executor.model_loader.reload``: per-module ``load_numel`` accounting).

``load_weights`` does what vLLM's model classes do at the end of theirs (e.g. vLLM 0.32
``models/llama.py``): ``param = params_dict[name]``, then
``weight_loader = getattr(param, "weight_loader", default_weight_loader)`` and
``weight_loader(param, tensor)`` -- vLLM's own ``default_weight_loader`` (shape assert,
``param.data.copy_``) unless layerwise reload wrapped the parameter's loader. An unknown name
raises ``KeyError`` as those models do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn


class SafetensorsModel(nn.Module):
    """Parameters named as the checkpoint's tensors (see the module docstring).

    Args:
        tensors: ``{dotted name: tensor}``; each becomes a parameter (its storage is used
            as is: move it to the worker's device first).

    Raises:
        ValueError: an empty name component, or a name that is both a parameter and a
            module prefix of another name (``a.b`` and ``a.b.c``).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            *path, leaf = name.split(".")
            if not leaf or any(not p for p in path):
                raise ValueError(f"tensor name {name!r} has an empty component")
            mod: nn.Module = self
            for p in path:
                child = mod._modules.get(p)
                if child is None:
                    if p in mod._parameters:
                        raise ValueError(f"{name!r}: {p!r} is a parameter and a module")
                    child = nn.Module()
                    mod.add_module(p, child)
                mod = child
            if leaf in mod._modules or leaf in mod._parameters:
                raise ValueError(f"{name!r} is both a parameter and a module prefix")
            mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(name, tensor)`` pairs through each parameter's ``weight_loader`` (vLLM's
        ``default_weight_loader`` by default); returns the names loaded.

        The parameter dict is read anew at each call: between vLLM's
        ``initialize_layerwise_reload`` and ``finalize_layerwise_reload`` the module holds
        meta-device parameters with wrapped loaders in place of the kernel ones.

        Raises:
            KeyError: a name that is not a parameter.
            AssertionError: a shape mismatch (vLLM's ``default_weight_loader``).
        """
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            param = params[name]
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, tensor)
            loaded.add(name)
        return loaded


def load_model(path: str, device: torch.device) -> SafetensorsModel:
    """Build the model from safetensors file ``path`` with its tensors on ``device``, then
    record vLLM's layerwise-reload metadata as vLLM's loader does right after building a
    model (vLLM 0.32 ``model_loader/utils.py initialize_model``:
    ``record_metadata_for_reloading(model)``, inside ``with torch.device(target)``, so the
    layers are later materialized on ``device``).

    Raises:
        OSError, safetensors errors: the file cannot be read.
        ValueError: see :class:`SafetensorsModel`.
    """
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    tensors = load_file(path, device=str(device))
    with torch.device(device):
        model = SafetensorsModel(tensors)
        record_metadata_for_reloading(model)
    return model

"""What ``Publisher.publish_adapter`` sends is what vLLM 0.32 reads (issue 36 A), checked with
vLLM's own code: the names it accepts are those vLLM's ``parse_fine_tuned_lora_name``
(``vllm/lora/utils.py``) parses, the names it refuses vLLM refuses too; and two ranks' parts
(one whole tensor, one tensor split in rows over both ranks), put together as the daemon's
plan says and written as PEFT's folder, load through ``PEFTHelper.from_local_dir`` and
``LoRAModel.from_local_checkpoint`` (``vllm/lora/peft_helper.py``, ``lora_model.py``, what
the worker's LoRA manager calls) into the trainer's values.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import test_publisher
import torch
from test_publish_adapter import CONFIG, PREFIX, Adapterd, _adapter
from test_publisher import ENGINE, FakeDaemon, _no_segments

from slotsync.protocol import wire
from slotsync.protocol.rank.adapters.inputs import config_text, peft_name_problem
from slotsync.protocol.rank.publisher import Publisher

endpoint = test_publisher.endpoint  # (the fixtures)
make_daemon = test_publisher.make_daemon

pytestmark = pytest.mark.vllm


def _parses(name: str) -> bool:
    from vllm.lora.utils import parse_fine_tuned_lora_name

    try:
        parse_fine_tuned_lora_name(name)
    except ValueError:
        return False
    return True


def test_names_refused_for_an_adapter_name_are_those_vllm_cannot_parse() -> None:
    accepted = [*_adapter(), "base_model.model.model.embed_tokens.lora_embedding_A",
                "base_model.model.model.embed_tokens.lora_embedding_B"]
    refused = [f"{PREFIX}.q_proj.lora_A.default.weight", f"{PREFIX}.q_proj.lora_B.math.weight"]
    for name in accepted:
        assert peft_name_problem(name) == "" and _parses(name), name
    for name in refused:
        assert peft_name_problem(name) != "" and not _parses(name), name


def _tensor(parts: list[tuple[wire.AdapterTensor, bytes]]) -> torch.Tensor:
    """One tensor from its parts (row order), as the daemon puts it together."""
    parts.sort(key=lambda p: p[0].row_start)
    t = parts[0][0]
    raw = bytearray(b"".join(b for _, b in parts))
    dtype = getattr(torch, t.dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(t.shape).clone()


def test_two_ranks_parts_load_in_vllms_lora_model(
        make_daemon: Callable[..., FakeDaemon], endpoint: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    script = Adapterd()
    make_daemon(script)
    tensors = _adapter()
    names = list(tensors)
    split = names[1]  # q_proj.lora_B (16, 4): rows 0-9 on rank 0, 10-15 on rank 1
    parts = [
        {names[0]: tensors[names[0]], names[2]: tensors[names[2]], split: tensors[split][:10]},
        {split: tensors[split][10:], names[3]: tensors[names[3]]},
    ]
    rows = [{split: (0, (16, 4))}, {split: (10, (16, 4))}]
    for rank in (0, 1):
        with Publisher(endpoint, rank, (0, 2), ENGINE, transport="shm", timeout_s=10) as pub:
            assert pub.publish_adapter("math", parts[rank], CONFIG, 2,
                                       rows=rows[rank]).served_name == "math@v2"
    assert _no_segments() == []
    got: dict[str, list[tuple[wire.AdapterTensor, bytes]]] = {}
    for begin, blob in zip(script.begins, script.parts, strict=True):
        offsets, _ = wire.part_offsets(begin.tensors)
        for t, off in zip(begin.tensors, offsets, strict=True):
            got.setdefault(t.name, []).append((t, blob[off : off + t.nbytes]))
    assert sorted(got) == sorted(names) and len(got[split]) == 2
    folder = tmp_path / "math@v2"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(script.begins[0].config_json)
    save_file({name: _tensor(p) for name, p in got.items()},
              str(folder / "adapter_model.safetensors"))

    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=None)
    assert helper.r == 4 and sorted(helper.target_modules) == ["q_proj", "v_proj"]
    model = LoRAModel.from_local_checkpoint(str(folder), {"q_proj", "v_proj"}, helper,
                                            lora_model_id=1, device="cpu")
    for proj in ("q_proj", "v_proj"):
        layer = model.get_lora(f"model.layers.0.self_attn.{proj}")
        assert layer is not None, sorted(model.loras)
        assert torch.equal(layer.lora_a, tensors[f"{PREFIX}.{proj}.lora_A.weight"])
        assert torch.equal(layer.lora_b, tensors[f"{PREFIX}.{proj}.lora_B.weight"])


def test_names_refused_as_not_lora_tensors_are_those_vllm_cannot_load(tmp_path: Path) -> None:
    """``wire.adapter.lora_tensor_problem`` (the rank's and the daemon's rule) against vLLM's
    ``parse_fine_tuned_lora_name``: every name it accepts vLLM parses; every name it refuses
    vLLM refuses too, but a classification adapter's full ``score`` / ``classifier`` module
    (vLLM only; SGLang has none: refused on purpose) and a ``lora_A.weight`` of no module. A
    folder holding a base weight is what vLLM's worker refused with the trial's HTTP 500
    (``LoRAModel.from_local_checkpoint``)."""
    from safetensors.torch import save_file
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from slotsync.protocol.wire.adapter import lora_tensor_problem

    accepted = [*_adapter(), "base_model.model.model.embed_tokens.lora_embedding_A",
                "base_model.model.lm_head.lora_embedding_B",
                "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"]
    refused = [f"{PREFIX}.q_proj.weight", f"{PREFIX}.q_proj.bias",
               f"{PREFIX}.q_proj.lora_magnitude_vector", f"{PREFIX}.q_proj.lora_A.bias",
               "base_model.model.model.norm.weight", f"{PREFIX}.q_proj"]
    # (vLLM only: a classification adapter's modules; and a LoRA tensor of no module)
    vllm_only = ["base_model.model.score.weight", "base_model.model.classifier.bias",
                 "lora_A.weight"]
    for name in accepted:
        assert lora_tensor_problem(name) == "" and _parses(name), name
    for name in refused:
        assert lora_tensor_problem(name) != "" and not _parses(name), name
    for name in vllm_only:
        assert lora_tensor_problem(name) != "" and _parses(name), name
    folder = tmp_path / "math@v1"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(config_text(CONFIG))
    save_file({**{n: t.contiguous() for n, t in _adapter().items()},
               f"{PREFIX}.q_proj.weight": torch.zeros(16, 16)},
              str(folder / "adapter_model.safetensors"))
    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=None)
    with pytest.raises(ValueError, match="is unsupported LoRA weight"):
        LoRAModel.from_local_checkpoint(str(folder), {"q_proj", "v_proj"}, helper,
                                        lora_model_id=1, device="cpu")

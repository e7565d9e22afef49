"""vLLM's side of adapter rounds (issue 36 C, ``daemon/vllm/adapters.py``): the folder the
daemon writes reads back byte for byte with the ``safetensors`` package and with vLLM's own
``PEFTHelper.from_local_dir`` / ``LoRAModel.from_local_checkpoint`` (the worker's
``_load_adapter`` calls) for a tiny Llama made here; rows of two ranks are joined in order; a
part whose bytes differ from its rank's sha256 names the tensor and the rank and leaves no
folder, temp or final; ``lora_limits`` reads what vLLM's own ``/server_info`` handler writes;
``served_adapters`` what vLLM's own ``show_available_models`` lists; the bodies validate
with vLLM's request models; ``refusal`` agrees with vLLM's ``PEFTHelper`` on what it refuses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from lora_plans import (  # noqa: E402
    TINY_LLAMA,
    lora_tensors,
    peft_config,
    reader,
    sha,
    split_plan,
)

from slotsync.daemon.core.adapters.plan import LoraLimits  # noqa: E402
from slotsync.daemon.vllm import adapters  # noqa: E402
from slotsync.daemon.vllm.adapters import (  # noqa: E402
    AdapterDataError,
    load_body,
    lora_limits,
    refusal,
    served_adapters,
    unload_body,
    write_adapter_folder,
)


def _entries(root: Path) -> list[str]:
    return sorted(os.listdir(root))


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_folder_reads_back_with_safetensors(tmp_path: Path, ranks: int, dtype) -> None:
    """Every tensor reads back equal (bit for bit) with the safetensors package, with its
    dtype and whole shape, its rows joined from ``ranks`` ranks in order; the config file
    is the ranks' text; the folder is ``<root>/<served_name>`` and nothing else is left."""
    tensors = lora_tensors(r=8, seed=1, dtype=dtype)
    config = peft_config(r=8)
    plan, buffers, begins = split_plan(tensors, config, lora_name="math", version=3,
                                       ranks=ranks)
    if ranks == 2:  # (every tensor has >= 2 rows: each is split over both ranks)
        assert all(len(t.parts) == 2 for t in plan.tensors)
        assert {p.rank for t in plan.tensors for p in t.parts} == {0, 1}
    folder = write_adapter_folder(tmp_path, plan, reader(buffers))
    assert folder == tmp_path / "math@v3"
    assert _entries(tmp_path) == ["math@v3"]
    assert _entries(folder) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (folder / "adapter_config.json").read_text() == plan.config_json
    back = safetensors_torch.load_file(folder / "adapter_model.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), name
        assert sha(back[name]) == sha(t)
    raw = (folder / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "pt"}
    spelled = {"bfloat16": "BF16", "float32": "F32"}[str(dtype).split(".")[-1]]
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {spelled}
    assert len(raw) == 8 + n + plan.nbytes  # (no hole, nothing after the last tensor)


def test_mismatch_names_tensor_and_rank_and_leaves_nothing(tmp_path: Path) -> None:
    """A part whose bytes changed after its rank hashed them: ``AdapterDataError`` naming
    that tensor and that rank; neither the folder nor a temp folder is left in the root."""
    tensors = lora_tensors(r=8, seed=2)
    plan, buffers, _ = split_plan(tensors, peft_config(), ranks=2)
    victim = plan.tensors[5]
    part = next(p for p in victim.parts if p.rank == 1)
    bad = bytearray(buffers[1])
    bad[part.offset + 3] ^= 0xFF
    buffers = {**buffers, 1: bytes(bad)}
    with pytest.raises(AdapterDataError) as e:
        write_adapter_folder(tmp_path, plan, reader(buffers))
    assert e.value.tensor == victim.name and e.value.rank == 1
    assert victim.name in str(e.value) and "rank 1" in str(e.value)
    assert _entries(tmp_path) == []


def test_short_read_is_refused_and_an_existing_folder_is_replaced(tmp_path: Path) -> None:
    """A ``read`` that returns fewer bytes than the part is an ``AdapterDataError`` (nothing
    left). A folder of that name already there -- the kept folder of a version the engine
    lost, published again (``slotsync status``'s advice) -- is replaced by the new one, and
    nothing else is left (red before: ``FileExistsError`` "exists already", the round's
    ``adapter_files_failed``)."""
    plan, buffers, _ = split_plan(lora_tensors(r=8), peft_config(), ranks=1)
    with pytest.raises(AdapterDataError, match="read 10 bytes"):
        write_adapter_folder(tmp_path, plan, lambda r, o, n: buffers[r][o:o + 10])
    assert _entries(tmp_path) == []
    kept = tmp_path / plan.served_name
    kept.mkdir()
    (kept / adapters.TENSORS_FILE).write_bytes(b"the lost version's old bytes")
    (kept / "stale.txt").write_text("x")
    assert write_adapter_folder(tmp_path, plan, reader(buffers)) == kept
    assert _entries(tmp_path) == [plan.served_name]
    assert sorted(p.name for p in kept.iterdir()) == [adapters.CONFIG_FILE,
                                                      adapters.TENSORS_FILE]
    assert (kept / adapters.TENSORS_FILE).read_bytes().startswith(
        adapters.safetensors_header(plan))
    assert adapters.remove_adapter_folder(tmp_path, plan.served_name) is True
    assert adapters.remove_adapter_folder(tmp_path, plan.served_name) is False


def test_stale_temp_folders_are_removed(tmp_path: Path) -> None:
    """A temp folder of a daemon killed mid-write is removed by ``remove_stale_temp``;
    finished folders are kept."""
    (tmp_path / f"{adapters.TEMP_PREFIX}math@v2.abc").mkdir()
    (tmp_path / "math@v1").mkdir()
    assert adapters.remove_stale_temp(tmp_path) == [f"{adapters.TEMP_PREFIX}math@v2.abc"]
    assert _entries(tmp_path) == ["math@v1"]


def test_large_part_is_copied_in_slices(tmp_path: Path, monkeypatch) -> None:
    """A part larger than the copy slice is hashed and written slice by slice, and reads
    back equal."""
    monkeypatch.setattr(adapters, "COPY_SLICE", 1000)  # (bytes: many slices a part)
    tensors = lora_tensors(r=16, seed=3, dtype=torch.float32)
    plan, buffers, _ = split_plan(tensors, peft_config(r=16), ranks=2)
    assert max(p.nbytes for t in plan.tensors for p in t.parts) > 3000
    folder = write_adapter_folder(tmp_path, plan, reader(buffers))
    back = safetensors_torch.load_file(folder / "adapter_model.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


@pytest.mark.vllm
@pytest.mark.parametrize("how", ["copied", "linked"])
def test_vllm_reads_the_folder_as_its_worker_does(tmp_path: Path, how: str) -> None:
    """vLLM's own ``PEFTHelper.from_local_dir`` + ``validate_legal`` and
    ``LoRAModel.from_local_checkpoint`` (the calls of ``WorkerLoRAManager._load_adapter``)
    on the folder, the expected modules those of a tiny Llama made here: every module's
    ``lora_a`` / ``lora_b`` equal the trainer's tensors, rank and scaling from the config;
    a tensor of a module the model lacks is refused by vLLM as by ``from_local_checkpoint``.
    ``copied``: rows of two ranks joined; ``linked``: one rank's sealed segment, laid out by
    the rank's own ``AdapterPart`` (the header padded to 256 bytes), hard-linked as the file
    (``PartReader.take``) into a folder on /dev/shm."""
    tensors = lora_tensors(r=8, seed=4, dtype=torch.bfloat16)
    if how == "linked":
        import shutil
        import tempfile

        from test_adapter_link import Rank

        from slotsync.daemon.service.adapter_io import PartReader

        rank = Rank(tensors, config=peft_config(r=8, alpha=32))
        shm = Path(tempfile.mkdtemp(prefix="test-vllm-link-", dir="/dev/shm"))
        try:
            with PartReader({0: rank.handle}) as r:
                folder = write_adapter_folder(shm, rank.plan, r.read, r.take)
            assert r.taken == {0: ""}
            rank.free()
            _vllm_reads(folder, tensors)
        finally:
            rank.free()
            shutil.rmtree(shm, ignore_errors=True)
        return
    plan, buffers, _ = split_plan(tensors, peft_config(r=8, alpha=32), ranks=2)
    folder = write_adapter_folder(tmp_path, plan, reader(buffers))
    _vllm_reads(folder, tensors)


def _vllm_reads(folder: Path, tensors: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    expected = {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    helper = PEFTHelper.from_local_dir(str(folder), TINY_LLAMA["max_position_embeddings"])
    helper.validate_legal(LoRAConfig(max_lora_rank=8, max_loras=1))
    lora = LoRAModel.from_local_checkpoint(str(folder), expected, peft_helper=helper,
                                           lora_model_id=7, device="cpu",
                                           dtype=torch.bfloat16, model_vocab_size=256)
    assert lora.id == 7 and lora.rank == 8
    modules = {n.removeprefix("base_model.model.").rsplit(".", 2)[0] for n in tensors}
    assert set(lora.loras) == modules
    for module, w in lora.loras.items():
        a = tensors[f"base_model.model.{module}.lora_A.weight"]
        b = tensors[f"base_model.model.{module}.lora_B.weight"]
        assert torch.equal(w.lora_a, a) and torch.equal(w.lora_b, b), module
        assert w.scaling == 32 / 8
    with pytest.raises(ValueError, match="rank 8 is greater than max_lora_rank 1"):
        helper.validate_legal(LoRAConfig(max_lora_rank=1, max_loras=1))
    with pytest.raises(ValueError, match="expected target modules"):
        LoRAModel.from_local_checkpoint(str(folder), expected - {"down_proj"},
                                        peft_helper=helper, device="cpu")


# -- what a server can hold -------------------------------------------------------------


@pytest.mark.vllm
async def test_lora_limits_read_vllms_own_server_info(monkeypatch) -> None:
    """vLLM 0.32's ``show_server_info`` (config_format=json) on ``VllmConfig``\\ s with and
    without a ``LoRAConfig``, with runtime updating on and off: ``lora_limits`` reads the
    rank, and says which flag or variable is missing."""
    api = pytest.importorskip("vllm.entrypoints.serve.dev.server_info.api_router")
    from types import SimpleNamespace

    from vllm.config import LoRAConfig, VllmConfig

    monkeypatch.setattr(api, "_get_system_env_info_cached", dict)  # (collect_env: seconds)

    async def info(lora: LoRAConfig | None, runtime: str) -> dict:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", runtime)
        config = VllmConfig()
        config.lora_config = lora  # (VllmConfig(lora_config=...) wants a model config)
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(vllm_config=config)))
        return json.loads((await api.show_server_info(request, config_format="json")).body)

    on = lora_limits(await info(LoRAConfig(max_lora_rank=32, max_loras=4), "1"))
    assert on.enabled and on.max_lora_rank == 32 and on.max_loras == 0
    assert on.flag("max_lora_rank").startswith("--max-lora-rank")
    off = lora_limits(await info(None, "1"))
    assert not off.enabled
    assert off.flag("enabled") == "start the vLLM server with the flag --enable-lora"
    no_routes = lora_limits(await info(LoRAConfig(max_lora_rank=16), "0"))
    assert not no_routes.enabled and no_routes.max_lora_rank == 16
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in no_routes.flag("enabled")
    neither = lora_limits(await info(None, "0"))
    assert "--enable-lora" in neither.flag("enabled")
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in neither.flag("enabled")


def test_lora_limits_without_an_answer() -> None:
    """No ``/server_info`` (a 404: None) or a text config: not enabled, saying what to
    start vLLM with; a stand-in without ``vllm_env`` but with a ``lora_config`` is enabled."""
    for body in (None, {"vllm_config": "VllmConfig(...)"}, [], "x"):
        limits = lora_limits(body)
        assert not limits.enabled and "VLLM_SERVER_DEV_MODE=1" in limits.flag("enabled")
    limits = lora_limits({"vllm_config": {"lora_config": {"max_lora_rank": 64}}})
    assert limits == LoraLimits(True, 0, 64, limits.flags)


@pytest.mark.vllm
async def test_served_adapters_read_vllms_own_model_list() -> None:
    """vLLM's own ``OpenAIServingModels.show_available_models`` with two adapters loaded
    (its ``lora_requests``, as ``load_lora_adapter`` fills them): the base model is not an
    adapter, both adapters are."""
    from types import SimpleNamespace

    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.lora.request import LoRARequest

    client = SimpleNamespace(model_config=SimpleNamespace(max_model_len=128, model="/m"),
                             renderer=None, input_processor=None)
    models = OpenAIServingModels(client, [BaseModelPath(name="base", model_path="/m")])
    assert served_adapters((await models.show_available_models()).model_dump()) == set()
    for i, name in enumerate(("math@v1", "math@v2"), 1):
        models.lora_requests[name] = LoRARequest(name, i, f"/a/{name}")
    body = json.loads(json.dumps((await models.show_available_models()).model_dump()))
    assert served_adapters(body) == {"math@v1", "math@v2"}
    assert served_adapters(None) == set() and served_adapters({"data": [1]}) == set()


@pytest.mark.vllm
def test_bodies_validate_with_vllms_request_models(tmp_path: Path) -> None:
    """``load_body`` / ``unload_body`` are what vLLM's ``LoadLoRAAdapterRequest`` /
    ``UnloadLoRAAdapterRequest`` take: versioned name, absolute path, never in place."""
    from vllm.entrypoints.serve.lora.protocol import (
        LoadLoRAAdapterRequest,
        UnloadLoRAAdapterRequest,
    )

    got = LoadLoRAAdapterRequest(**load_body("math@v3", tmp_path / "math@v3"))
    assert got.lora_name == "math@v3" and got.lora_path == str(tmp_path / "math@v3")
    assert got.load_inplace is False and os.path.isabs(got.lora_path)
    assert UnloadLoRAAdapterRequest(**unload_body("math@v3")).lora_name == "math@v3"


CONFIGS = [
    peft_config(),
    peft_config(r=16),
    peft_config(rank_pattern={"q_proj": 32}),
    peft_config(bias="all"),
    peft_config(use_dora=True),
    peft_config(lora_bias=True),
    peft_config(modules_to_save=["lm_head"]),
    peft_config(modules_to_save=["score"]),
    {k: v for k, v in peft_config().items() if k != "lora_alpha"},
]


@pytest.mark.vllm
@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
def test_refusal_agrees_with_vllms_peft_helper(config: dict) -> None:
    """For each config: ``refusal`` is '' exactly when vLLM's ``PEFTHelper.from_dict`` and
    ``validate_legal`` (with ``--max-lora-rank 16``) accept it."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    try:
        PEFTHelper.from_dict(dict(config)).validate_legal(LoRAConfig(max_lora_rank=16))
        vllm_ok = True
    except ValueError:
        vllm_ok = False
    plan, _, _ = split_plan(lora_tensors(r=8), {**config, "r": config.get("r", 8)})
    plan = type(plan)(plan.lora_name, plan.version, plan.served_name, json.dumps(config),
                      plan.lora_rank, plan.tensors, plan.ranks)
    why = refusal(plan, LoraLimits(True, 0, 16, adapters.VLLM_LORA_FLAGS))
    assert (why == "") is vllm_ok, why
    if "rank_pattern" in config:
        assert "rank 32" in why and "--max-lora-rank" in why


def test_refusal_of_dtypes_safetensors_cannot_name() -> None:
    """An fp8 e8m0 tensor has no safetensors name vLLM reads back: refused before any
    call, and the header writer refuses it too."""
    plan, _, _ = split_plan(lora_tensors(r=8), peft_config())
    t = plan.tensors[0]
    odd = type(t)(t.name, "float8_e8m0fnu", (t.shape[0], t.shape[1] * 2), t.parts)
    plan = type(plan)(plan.lora_name, plan.version, plan.served_name, plan.config_json,
                      plan.lora_rank, (odd, *plan.tensors[1:]), plan.ranks)
    assert "float8_e8m0fnu" in refusal(plan)
    with pytest.raises(ValueError, match="float8_e8m0fnu"):
        adapters.safetensors_header(plan)


def test_load_error_texts_say_what_to_do() -> None:
    """The route missing (FastAPI's 404) says to set VLLM_ALLOW_RUNTIME_LORA_UPDATING=1;
    vLLM's own 404 (no folder) does not; LoRA off says --enable-lora."""
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in adapters.load_error_text(404, "Not Found")
    folder = adapters.load_error_text(404, "Loading lora x failed: No adapter found for /a")
    assert "VLLM_ALLOW" not in folder and "No adapter found" in folder
    assert "--enable-lora" in adapters.load_error_text(
        500, "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to "
        "enable LoRA.")

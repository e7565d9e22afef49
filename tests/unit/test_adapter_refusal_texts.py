"""Every adapter refusal says what to set, to which value, and where (issue 36's fresh-user
trial: a vLLM server without runtime adapter routes was refused with "does not serve LoRA
adapters: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in the server's environment (without it vLLM
has no /v1/load_lora_adapter)", a fact, not an instruction).

The texts are the daemon's own (``daemon/vllm/adapters.py``, ``daemon/sglang/adapters.py``
and the core's ``limits_refusal``), fed with what the engines' own code says: vLLM 0.32's
``show_server_info`` for the limits, its ``attach_router`` for the routes the variable adds,
its ``MaxLoRARanks`` and ``PEFTHelper.validate_legal`` for the rank a refusal names, and
SGLang's ``get_normalized_target_modules`` for the ``--lora-target-modules`` one names.

Red on the old code: the runtime-routes text was the fact above (the first tests), the rank
text "set --max-lora-rank (one of ...) to at least 12" (12 is not a value vLLM takes), and
the target-modules text named no modules."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from lora_plans import lora_tensors, peft_config, split_plan  # noqa: E402

from slotsync.daemon.core.adapters.gather import limits_refusal  # noqa: E402
from slotsync.daemon.sglang import adapters as sglang_adapters  # noqa: E402
from slotsync.daemon.vllm import adapters as vllm_adapters  # noqa: E402

URL = "http://e:1"
ROUTES_TEXT = ("start the vLLM server with the environment variable "
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM 0.32 "
               "vllm/entrypoints/serve/lora/api_router.py: the routes /v1/load_lora_adapter "
               "and /v1/unload_lora_adapter are attached only then)")


def plan(r: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"), version: int = 1):
    return split_plan(lora_tensors(r=r, targets=targets), peft_config(r=r, targets=targets),
                      version=version)[0]


async def vllm_server_info(monkeypatch, lora_rank: int | None, runtime: str) -> dict:
    """vLLM 0.32's own ``GET /server_info?config_format=json`` body for a server with (or,
    ``lora_rank`` None, without) ``--enable-lora --max-lora-rank lora_rank`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=runtime`` in its environment."""
    api = pytest.importorskip("vllm.entrypoints.serve.dev.server_info.api_router")
    from types import SimpleNamespace

    from vllm.config import LoRAConfig, VllmConfig

    monkeypatch.setattr(api, "_get_system_env_info_cached", dict)  # (collect_env: seconds)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", runtime)
    config = VllmConfig()
    config.lora_config = None if lora_rank is None else LoRAConfig(max_lora_rank=lora_rank)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(vllm_config=config)))
    return json.loads((await api.show_server_info(request, config_format="json")).body)


@pytest.mark.vllm
@pytest.mark.parametrize("runtime", ["0", "1"])
def test_vllm_attaches_the_adapter_routes_only_with_the_variable(monkeypatch, runtime):
    """What the text claims, in vLLM's own ``attach_router``."""
    router = pytest.importorskip("vllm.entrypoints.serve.lora.api_router")
    from fastapi import FastAPI

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", runtime)
    app = FastAPI()
    router.attach_router(app)
    paths = {getattr(r, "path", "") for r in app.routes}
    assert ({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths) == (runtime == "1")


@pytest.mark.vllm
async def test_a_server_without_the_routes_is_told_to_start_with_the_variable(monkeypatch):
    limits = vllm_adapters.lora_limits(await vllm_server_info(monkeypatch, 16, "0"))
    assert limits_refusal(plan(), limits, (), URL, "vLLM") == (
        f"engine {URL} (vLLM) does not serve LoRA adapters: {ROUTES_TEXT}")
    # and the load's own 404 (FastAPI's, the route missing) says the same
    assert ROUTES_TEXT in vllm_adapters.load_error_text(404, "Not Found")


@pytest.mark.vllm
@pytest.mark.parametrize("lora_rank, runtime, says", [
    (None, "1", ["start the vLLM server with the flag --enable-lora"]),
    (None, "0", ["start the vLLM server with the flag --enable-lora and the environment "
                 "variable VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"]),
])
async def test_lora_off_is_told_the_flag_and_the_variable(monkeypatch, lora_rank, runtime,
                                                          says):
    limits = vllm_adapters.lora_limits(await vllm_server_info(monkeypatch, lora_rank, runtime))
    text = limits_refusal(plan(), limits, (), URL, "vLLM")
    assert text.startswith(f"engine {URL} (vLLM) does not serve LoRA adapters: start the vLLM "
                           "server with "), text
    assert all(s in text for s in says), text


def test_no_server_info_names_every_variable_and_flag_to_start_with():
    text = limits_refusal(plan(), vllm_adapters.lora_limits(None), (), URL, "vLLM")
    assert ("start the vLLM server with the environment variables VLLM_SERVER_DEV_MODE=1 (for "
            "/server_info) and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1") in text, text
    assert text.endswith("and the flag --enable-lora"), text


@pytest.mark.vllm
@pytest.mark.parametrize("r, server_rank, value", [(12, 8, 16), (32, 16, 32), (300, 256, 320)])
async def test_a_rank_above_the_servers_names_a_max_lora_rank_vllm_takes(monkeypatch, r,
                                                                          server_rank, value):
    """The value named is one ``--max-lora-rank`` takes (``MaxLoRARanks``) and one under
    which vLLM's own ``PEFTHelper.validate_legal`` takes the adapter."""
    from vllm.config.lora import LoRAConfig, MaxLoRARanks
    from vllm.lora.peft_helper import PEFTHelper

    limits = vllm_adapters.lora_limits(await vllm_server_info(monkeypatch, server_rank, "1"))
    p = plan(r=r)
    text = vllm_adapters.refusal(p, limits)
    assert f"restart the vLLM server with --max-lora-rank {value}," in text, text
    assert value in MaxLoRARanks.__args__
    PEFTHelper.from_dict(json.loads(p.config_json)).validate_legal(
        LoRAConfig(max_lora_rank=value))  # (raises if the value named would not do)
    with pytest.raises(ValueError):
        PEFTHelper.from_dict(json.loads(p.config_json)).validate_legal(
            LoRAConfig(max_lora_rank=server_rank))


def test_a_rank_above_every_value_vllm_takes_says_so():
    from slotsync.daemon.core.adapters.plan import LoraLimits

    text = vllm_adapters.refusal(plan(r=600), LoraLimits(True, 0, 512))
    assert "vLLM 0.32 serves ranks up to --max-lora-rank 512: train the adapter at a lower " \
           "rank" in text, text


def test_sglang_refusals_name_the_flag_and_the_value():
    """SGLang's limits (``lora_limits`` of its flat ``/server_info``) through the core's
    ``limits_refusal``: LoRA off, the rank, the adapters it may hold."""
    def refused(info: dict, p=None, held=()) -> str:
        return limits_refusal(p or plan(), sglang_adapters.lora_limits(info), held, URL,
                              "SGLang")

    assert refused({"enable_lora": False}).endswith(
        "does not serve LoRA adapters: start it with --enable-lora")
    assert refused({"enable_lora": True, "max_lora_rank": 16}, plan(r=32)).endswith(
        "set --max-lora-rank to 32 or more")
    assert refused({"enable_lora": True, "max_loaded_loras": 1}, plan(version=2),
                   held=["math@v1"]).endswith(
        "set --max-loaded-loras to 2 or more")


@pytest.mark.sglang
def test_sglangs_target_modules_refusal_names_modules_sglang_takes():
    """The ``--lora-target-modules`` value named is one SGLang's own parser accepts (its
    ``SUPPORTED_LORA_TARGET_MODULES``, ``srt/arg_groups/fields/lora.py``'s choices) and,
    normalized by SGLang's own ``get_normalized_target_modules`` (``srt/lora/utils.py``),
    covers the adapter's modules and the served ones."""
    common = pytest.importorskip("sglang.srt.utils.common")
    from slotsync.engine.sglang.lora_code import LORA_UTILS, TYPING, cut, root

    normalized = cut(root() / LORA_UTILS, ("get_normalized_target_modules",), None, TYPING,
                     "test_adapter_refusal_texts._lora_utils").get_normalized_target_modules

    p = plan(targets=("q_proj", "o_proj"))
    text = sglang_adapters.refusal(p, {"lora_target_modules": ["q_proj", "k_proj", "v_proj"],
                                       "dp_size": 1})
    head, _, named = text.partition("restart it with --lora-target-modules ")
    modules = named.split(" (")[0].split()
    assert modules and set(modules) <= set(common.SUPPORTED_LORA_TARGET_MODULES), text
    assert normalized(modules) >= normalized(["q_proj", "o_proj", "k_proj", "v_proj"]), text
    assert text.endswith("or --lora-target-modules all"), text
    dp = sglang_adapters.refusal(p, {"dp_size": 2})
    assert "--dp-size 1" in dp, dp

"""What the SGLang engines say about themselves, I/O-free: their start options
(:class:`ServerConfig`) and the bodies of ``GET /model_info`` and ``GET /server_info``.

Paths are inside the SGLang wheel; "L<a> / L<b> / L<c>" is the line in 0.5.23 / 0.5.21 /
0.5.20 of ``srt/entrypoints/http_server.py`` (docs/sglang-contract.md). The routes are
``slotsync.engine.sglang.server``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slotsync.engine.sglang.state import SglangState, SglangVersion


@dataclass(frozen=True)
class LoraSettings:
    """The SGLang-code engine's LoRA flags, SGLang's names and defaults
    (``srt/arg_groups/fields/lora.py``; ``engine/sglang/lora_front.py`` serves them):
    ``enable_lora`` (``--enable-lora``), ``max_lora_rank``, ``lora_target_modules`` (names,
    or ``["all"]``), ``max_loras_per_batch`` (8), ``max_loaded_loras`` (None: no limit)."""

    enable_lora: bool | None = None
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None

    def server_args(self) -> dict[str, Any]:
        """The flat ``/server_info`` fields (``resolved_dict()``: the target modules a set,
        written as a list)."""
        return {"enable_lora": self.enable_lora, "max_lora_rank": self.max_lora_rank,
                "lora_target_modules": (None if self.lora_target_modules is None
                                        else sorted(self.lora_target_modules)),
                "lora_paths": None, "max_loras_per_batch": self.max_loras_per_batch,
                "max_loaded_loras": self.max_loaded_loras}


    def rank_settings(self) -> dict[str, Any] | None:
        """What each TP rank's ``lora_rank.LoraRank`` takes (None: LoRA off)."""
        if not self.enable_lora:
            return None
        return {"max_lora_rank": self.max_lora_rank,
                "target_modules": list(self.lora_target_modules or ()),
                "max_loras_per_batch": self.max_loras_per_batch}


def add_lora_args(g: Any) -> None:
    """SGLang's LoRA flags (``srt/arg_groups/fields/lora.py``) on the argparse group ``g``;
    ``--enable-lora`` and ``--max-lora-rank``, spelt as vLLM spells them, only where the parser
    does not have them already (``slotsync.engine.lora_flags``' group: one flag for every
    impl, read by ``lora_settings`` for the SGLang engines)."""
    have = set(getattr(g, "_option_string_actions", {}))  # (a group shares its parser's)
    if "--enable-lora" not in have:
        g.add_argument("--enable-lora", action="store_true", default=None,
                       help="SGLang's --enable-lora (--impl sglang: the LoRA routes; needs "
                       "--max-lora-rank and --lora-target-modules, as SGLang without "
                       "--lora-paths)")
    if "--max-lora-rank" not in have:
        g.add_argument("--max-lora-rank", type=int, default=None,
                       help="SGLang's --max-lora-rank")
    g.add_argument("--lora-target-modules", nargs="*", default=None,
                   help="SGLang's --lora-target-modules (names, or 'all')")
    g.add_argument("--max-loras-per-batch", type=int, default=8,
                   help="SGLang's --max-loras-per-batch (default 8)")
    g.add_argument("--max-loaded-loras", type=int, default=None,
                   help="SGLang's --max-loaded-loras (default: no limit)")


def lora_settings(args: Any) -> LoraSettings:
    """The :class:`LoraSettings` of parsed arguments (:func:`add_lora_args`).

    Raises:
        ValueError: SGLang's own refusals (``arg_groups/lora_hook.py``): no rank or target
            modules without ``--lora-paths``, ``all`` with other modules, fewer loaded than
            per batch.
    """
    if not args.enable_lora:
        return LoraSettings(max_loras_per_batch=args.max_loras_per_batch,
                            max_loaded_loras=args.max_loaded_loras)
    modules = tuple(args.lora_target_modules or ())
    if not (args.max_lora_rank and modules):
        raise ValueError("When no initial --lora-paths is provided, you need to specify both "
                         "--max-lora-rank and --lora-target-modules for LoRA initialization.")
    if "all" in modules and len(modules) != 1:
        raise ValueError("If 'all' is specified in --lora-target-modules, it should be the only "
                         "module specified.")
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        raise ValueError("max_loaded_loras should be greater than or equal to "
                         "max_loras_per_batch.")
    return LoraSettings(True, args.max_lora_rank, modules, args.max_loras_per_batch,
                        args.max_loaded_loras)


@dataclass(frozen=True)
class ServerConfig:
    """What ``python -m slotsync.engine`` was started with (``/server_info``'s fields).

    Attributes:
        impl: ``"sglang"`` or ``"sglang-reference"``.
        model_path: the safetensors file.
        tp_size: TP ranks (= workers).
        dp_size: ``--dp-size`` as given.
        pp_size: ``--pp-size``.
        enable_dp_attention: ``--enable-dp-attention``.
        weight_version: ``--weight-version`` (the version at start).
        api_key, admin_api_key: ``--api-key`` / ``--admin-api-key``, or None.
        host, port: where it listens (``port`` 0 with ``--uds``).
        launch_command: the command line.
        reported_version: the ``version`` ``/server_info`` reports ('' : the followed
            version's own; a test gives another to see the daemon refuse it).
        lora: the LoRA flags (:class:`LoraSettings`).
    """

    impl: str
    model_path: str
    tp_size: int
    dp_size: int = 1
    pp_size: int = 1
    enable_dp_attention: bool = False
    weight_version: str = "default"
    reported_version: str = ""
    api_key: str | None = None
    admin_api_key: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    launch_command: str = ""
    lora: LoraSettings = LoraSettings()


def model_info(config: ServerConfig, version: SglangVersion, weight_version: str
               ) -> dict[str, Any]:
    """``GET /model_info``'s body (L812 / L790 / L760): ``weight_version`` (the tokenizer's)
    and the model's fields."""
    path = config.model_path
    info: dict[str, Any] = {
        "model_path": path, "served_model_name": path, "tokenizer_path": path,
        "is_generation": True, "preferred_sampling_params": None,
        "weight_version": weight_version, "load_format": "auto",
        "reasoning_parser": None, "tool_call_parser": None,
    }
    if version.name != "0.5.20":
        info["disaggregation_mode"] = "null"
    info.update({"has_image_understanding": False, "has_audio_understanding": False,
                 "model_type": None, "architectures": None})
    return info


def server_args(config: ServerConfig, version: SglangVersion) -> dict[str, Any]:
    """The flat server arguments ``/server_info`` reports (the fields the contract names;
    ``resolved_dict()`` has ~550 more, none read by slotsync)."""
    c, v = config, version
    attention_dp = c.enable_dp_attention and c.dp_size > 1
    args: dict[str, Any] = {
        "model_path": c.model_path, "tokenizer_path": c.model_path,
        "served_model_name": c.model_path, "host": c.host, "port": c.port,
        "tp_size": c.tp_size, "pp_size": c.pp_size,
        "nnodes": 1, "node_rank": 0, "base_gpu_id": 0, "gpu_id_step": 1,
        "weight_version": c.weight_version, "speculative_algorithm": None,
        "load_format": "auto", "tokenizer_worker_num": 1, "device": "cuda",
        **c.lora.server_args(),
    }
    if v.dp_attention_resolves:  # --dp-size N --enable-dp-attention -> attn_dp_size N
        args["dp_size"] = 1 if attention_dp else c.dp_size
        args["attn_dp_size"] = c.dp_size if attention_dp else 1
        args["enable_dp_attention"] = attention_dp  # resolved_dict: attn_dp_size > 1
    else:
        args["dp_size"] = c.dp_size
        args["enable_dp_attention"] = c.enable_dp_attention
    return args


def internal_state(config: ServerConfig, version: SglangVersion, state: SglangState
                   ) -> dict[str, Any]:
    """One DP rank's ``internal_states`` entry of ``/server_info`` (the scheduler's answer:
    its weight version and pause flag)."""
    return {**server_args(config, version), "weight_version": state.scheduler_weight_version,
            "world_size": config.tp_size * config.pp_size * config.dp_size,
            "engine_paused": state.engine_paused}


def server_info(config: ServerConfig, version: SglangVersion, startup_time: dict[str, Any],
                internal: dict[str, Any]) -> dict[str, Any]:
    """``GET /server_info``'s body (L863 / L841 / L818): the flat server arguments,
    ``launch_command``, ``startup_time``, ``internal`` (:func:`internal_state`) once per DP
    rank, ``version`` and, 0.5.21+, ``"frontend": "python"``."""
    args = server_args(config, version)
    info = {**args, "launch_command": config.launch_command,
            "startup_time": startup_time,
            "internal_states": [internal] * args["dp_size"],
            "version": config.reported_version or version.name}
    if version.frontend_field:
        info["frontend"] = "python"
    info["kv_events"] = None
    return info

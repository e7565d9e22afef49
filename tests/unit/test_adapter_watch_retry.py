"""The idle watch and a vLLM engine that cannot take an adapter (issue 36's fresh-user trial;
``daemon/core/adapters/watch.py`` ``_watch_reload`` / ``_watch_limits``), through the I/O-free
slot table and the scripted engine of ``test_adapter_rounds``, whose vLLM load here fails as
vLLM 0.32's does when the server runs without ``--enable-lora`` (every worker: "LoRA is not
enabled", ``vllm/v1/worker/lora_model_runner_mixin.py`` ``add_lora``).

Red on the old code: the watch sent the load to such an engine (every worker failed; the
executor's replies then in doubt, and the next look found them "out of step: restart the
engine"), marked the version lost saying only the worker's error, and never tried it again
once the engine was restarted with LoRA (a lost version was never looked at again)."""

from __future__ import annotations

from test_adapter_rounds import LORA_INFO, LoraEngine
from test_adapter_watch import FOLDER, events, served_v1, states, tick

from slotsync.daemon.core.adapters import watch

RETRY_LOOKS = getattr(watch, "RETRY_LOOKS", 10)  # (absent on the old code: red by assertion)

NO_LORA = {"vllm_config": {"lora_config": None},
           "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}}
NO_RUNTIME = {"vllm_config": {"lora_config": {"max_lora_rank": 16, "max_loras": 2}},
              "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": False}}
NO_ENV = {"vllm_config": {"lora_config": {"max_lora_rank": 16, "max_loras": 2}}}
"""A ``server_info`` that does not say whether runtime updating is on (the load tells)."""
NOT_ENABLED = ("load_lora_adapter: HTTP 500: Worker failed with error 'LoRA is not enabled. "
               "Use --enable-lora to enable LoRA.'")


class RealisticLoraEngine(LoraEngine):
    """``LoraEngine`` whose load fails on every worker when its ``server_info`` has no
    ``lora_config`` (vLLM started without ``--enable-lora``)."""

    def answer(self, call):
        info = self.lora_info
        if (call.route == "load_lora_adapter" and isinstance(info, dict)
                and not (info.get("vllm_config") or {}).get("lora_config")):
            self.calls.append(call.route)
            self.bodies.append(call.body)
            return False, None, NOT_ENABLED
        return super().answer(call)


def harness():
    h = served_v1()
    h.engine.__class__ = RealisticLoraEngine
    return h


def loads(h) -> int:
    return h.engine.calls.count("load_lora_adapter")


def test_an_engine_restarted_without_lora_gets_no_load_and_the_version_is_lost_saying_why():
    h = harness()
    before = loads(h)
    h.engine.restart()
    h.engine.lora_info = NO_LORA
    assert tick(h) == ["models"]
    assert h.engine.calls[-1] == "server_info"  # (its LoRA limits, as a round's begin)
    assert loads(h) == before  # no load sent to an engine that cannot take it
    assert states(h) == [("math@v1", "lost")]
    (lost,) = events(h, "adapter_lost")
    assert "start the vLLM server with the flag --enable-lora" in lost["why"]
    assert FOLDER in lost["why"]
    assert h.coord.status()["adapters"][0]["error"] == lost["why"]
    assert not h.coord.engine.replies_suspect and not h.coord.engine.out_of_step
    tick(h)
    assert events(h, "engine_replies_out_of_step") == []


def test_runtime_updating_off_is_told_with_its_variable_and_no_load():
    h = harness()
    before = loads(h)
    h.engine.restart()
    h.engine.lora_info = NO_RUNTIME
    tick(h)
    assert loads(h) == before and states(h) == [("math@v1", "lost")]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in events(h, "adapter_lost")[0]["why"]


def test_a_routeless_engines_404_is_told_with_runtime_updating():
    h = harness()
    h.engine.restart()
    h.engine.lora_info = NO_ENV
    h.engine.fail[("load_lora_adapter", loads(h))] = "load_lora_adapter: HTTP 404: Not Found"
    tick(h)
    assert states(h) == [("math@v1", "lost")]
    why = events(h, "adapter_lost")[0]["why"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in why and "--enable-lora" in why, why


def test_a_lost_version_is_reloaded_once_the_engine_is_restarted_with_lora_without_hammering():
    h = harness()
    before = loads(h)
    h.engine.restart()
    h.engine.lora_info = NO_LORA
    tick(h)
    assert states(h) == [("math@v1", "lost")]
    h.engine.restart()
    h.engine.lora_info = LORA_INFO  # restarted again, with --enable-lora
    asked = h.engine.calls.count("server_info")
    for _ in range(RETRY_LOOKS - 1):  # (not tried again at every look)
        tick(h)
        assert states(h) == [("math@v1", "lost")]
    assert h.engine.calls.count("server_info") == asked and loads(h) == before
    for _ in range(2):  # (its try is due)
        tick(h)
    assert states(h) == [("math@v1", "served")]
    assert loads(h) == before + 1 and set(h.engine.loras) == {"math@v1"}
    assert h.engine.loras["math@v1"]["lora_path"] == FOLDER
    (reloaded,) = events(h, "adapter_reloaded")
    assert reloaded["served_name"] == "math@v1"
    assert h.coord.status()["adapters"][0]["error"] is None


def test_an_engine_found_down_then_answering_is_tried_at_its_first_look():
    """A refused connection meanwhile (the engine restarting) makes the next answer a
    likely new session: the lost version is tried then, not ``RETRY_LOOKS`` later."""
    h = harness()
    h.engine.restart()
    h.engine.lora_info = NO_LORA
    tick(h)
    assert states(h) == [("math@v1", "lost")]
    h.engine.fail[("models", h.engine.calls.count("models"))] = (
        "models: cannot reach http://engine:8000: Connection refused")
    tick(h)
    h.engine.restart()
    h.engine.lora_info = LORA_INFO
    tick(h)
    assert states(h) == [("math@v1", "served")]


def test_a_failing_load_is_tried_again_only_every_retry_looks():
    h = harness()
    h.engine.restart()
    h.engine.lora_info = LORA_INFO
    for n in range(3):  # (the folder cannot be read: each try fails)
        h.engine.fail[("load_lora_adapter", loads(h) + n)] = (
            "load_lora_adapter: HTTP 500: Worker failed with error 'no such folder'")
    before = loads(h)
    for _ in range(2 * RETRY_LOOKS):
        tick(h)
    assert states(h) == [("math@v1", "lost")]
    assert loads(h) - before == 2  # (once at the restart, once RETRY_LOOKS looks later)
    assert len(events(h, "adapter_lost")) == 1  # (said once: the same failure)


def test_the_same_version_published_again_over_a_lost_one_is_served_vllm_and_sglang():
    """What ``slotsync status`` advises for a lost version: publish it again. vLLM's folder
    is written again over the kept one (``write_adapter_folder`` replaces it:
    ``test_vllm_adapters``); SGLang loads it from the ranks' memory."""
    from test_adapter_rounds import whole_parts

    for kind in ("vllm", "sglang"):
        h = served_v1(kind)
        h.engine.__class__ = RealisticLoraEngine
        h.engine.restart()
        h.engine.lora_info = NO_LORA if kind == "vllm" else LORA_INFO
        tick(h)
        assert states(h) == [("math@v1", "lost")], kind
        h.engine.lora_info = LORA_INFO
        h.adapter_round(1, version=1, **({"parts": whole_parts()} if kind == "sglang" else {}))
        assert h.acks(0)[-1] == ("adapter_data", "math@v1"), kind
        assert states(h) == [("math@v1", "served")] and set(h.engine.loras) == {"math@v1"}
        assert h.coord.status()["adapters"][0]["error"] is None

"""The daemon's idle watch of the engines' adapters, end to end (issue 36 findings;
``daemon/core/adapters/watch.py``, ``daemon/service/adapter_watch.py``): two rank processes
calling ``Publisher.publish_adapter`` -> a real ``slotsyncd`` (``--adapter-watch-s 0.5``) ->
each engine family's engine running its own LoRA code (the reference engine and the vLLM-code
engine: vLLM 0.32's LoRA routers, ``OpenAIServingModels`` and worker LoRA manager; the
SGLang-code engine: SGLang 0.5.23's LoRA code on 2 TP ranks).

* an engine restarted between rounds, with no round after it: ``/status`` (polled) says the
  engine is unreachable while it is down -- the adapter still ``served``, not ``lost`` --
  then, vLLM, ``reloading`` (the watch's reload, held 2 s by the engine) and ``served``,
  the engine listing it and every worker holding the trainer's bytes again; SGLang,
  ``lost``, saying to publish it again;
* a restarted daemon (same ``adapter_dir``, the engine declared in its engine table) adopts
  what the engine lists from its folders at its start, with no round: ``/status`` shows the
  served version, the folders of the versions the engine does not list are removed, the
  listed one's is kept, and the engine restarted then gets the version again from that
  folder.

Red on the old code: nothing looked at an idle engine (``/status`` said ``served`` until the
next round; ``--adapter-watch-s`` did not exist), and a restarted daemon had no adapter in
``/status`` and left every folder it found.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from adapter_e2e import (  # noqa: E402
    KEY,
    adapters_of,
    assert_holds,
    assert_ok,
    folders,
    run_rounds,
    served,
    sglang_box,
    slot_folder,
    slot_status,
    unload_all,
    vllm_family_box,
)
from rank_pool import RankPool  # noqa: E402
from state_readers import wait_for  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402

pytestmark = pytest.mark.slow

WATCH = ["--adapter-watch-s", "0.5", "--engine-timeout-s", "10"]
RELOAD_HANG_S = 2.0  # the watch's reload held this long by the engine: /status shows it


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    p = RankPool(2)
    yield p
    p.close()


@pytest.fixture(scope="module", params=[
    pytest.param("reference", id="reference"),
    pytest.param("vllm", id="vllm-code", marks=pytest.mark.vllm)])
def vbox(request: pytest.FixtureRequest):
    b = vllm_family_box(request.param)
    yield b
    b.close()


@pytest.fixture
def veng(vbox):
    unload_all(vbox)
    yield vbox
    unload_all(vbox)


def down_then_up(d, box) -> None:
    """Kill the engine; once the watch found it gone, ``/status`` must say so and still show
    v1 served (an engine that does not answer is unreachable, not lost); start it again."""
    box.kill()
    assert wait_for(lambda: slot_status(d, KEY)["engine_unreachable"], 30), slot_status(d, KEY)
    assert adapters_of(d) == [("math@v1", "served")]
    box.start_again()


def load_fault_fired(box) -> bool:
    faults = box.stats().get("faults", [])
    return any(f["route"] == "load_lora_adapter" and f["fired"] for f in faults)


def test_vllm_family_engine_restarted_between_rounds_is_reloaded_with_no_round(pool, veng):
    with DaemonProcess(args=WATCH) as d:
        assert_ok(run_rounds(pool, d, veng, {"version": 1}), d, 1)
        rounds = slot_status(d, KEY)["adapter_rounds_succeeded"]
        seen: set[str] = set()  # (the states /status showed)

        def settled() -> bool:
            now = adapters_of(d)
            seen.update(state for _, state in now)
            return now == [("math@v1", "served")] and served(veng) == {"math@v1"}

        for _ in range(3):  # (the watch may look between the start and the fault: again)
            down_then_up(d, veng)
            veng.request("POST", "/_slotsync/fault", {
                "route": "load_lora_adapter", "status": 200, "hang_s": RELOAD_HANG_S})
            seen.clear()
            assert wait_for(settled, 60), (adapters_of(d), served(veng), d.log_tail(3000))
            if load_fault_fired(veng):
                break
        assert load_fault_fired(veng), "the watch always reloaded before the fault was set"
        assert "reloading" in seen, seen
        assert_holds(veng, "math@v1", "vllm", 1)  # (the trainer's bytes, read again)
        s = slot_status(d, KEY)
        assert s["engine_unreachable"] is None and s["adapter_rounds_succeeded"] == rounds
        assert s["adapter_watch_calls"].get("models", 0) >= 2, s["adapter_watch_calls"]
        log = d.log_tail(50000)
        assert "adapter_reloaded" in log and "adapter_lost" not in log, log
        assert folders(d) == ["math@v1"]


@pytest.fixture(scope="module")
def sbox():
    b = sglang_box()
    yield b
    b.close()


@pytest.fixture
def seng(sbox):
    unload_all(sbox)
    yield sbox
    unload_all(sbox)


@pytest.mark.sglang
def test_sglang_engine_restarted_between_rounds_shows_lost_with_no_round(pool, seng):
    with DaemonProcess(args=WATCH) as d:
        one = {"layout": "one", "holder": 0}
        assert_ok(run_rounds(pool, d, seng, {"version": 1, **one}), d, 1)
        down_then_up(d, seng)
        assert wait_for(lambda: adapters_of(d) == [("math@v1", "lost")], 60), adapters_of(d)
        (entry,) = slot_status(d, KEY)["adapters"]
        assert "publish version 1 of 'math' again" in entry["error"], entry
        assert "adapter_lost" in d.log_tail(20000)
        assert served(seng) == set()
        assert slot_status(d, KEY)["adapter_rounds_succeeded"] == 1  # (no round since)


def test_a_restarted_daemon_adopts_the_served_version_and_sweeps_the_rest(pool, veng,
                                                                           tmp_path: Path):
    """Daemon 1 loads v1 then v2 (v1's folder kept one version longer) and stops: both
    folders stay. A folder of a version the engine never held is put beside them. Daemon 2,
    same runtime dir, the engine declared in its table: with no round, ``/status`` shows v2
    served, v1's and the stray folder are removed, v2's kept; the engine restarted gets v2
    again from that folder."""
    rt = str(tmp_path / "rt")
    with DaemonProcess(runtime_dir=rt) as d1:
        assert_ok(run_rounds(pool, d1, veng, {"version": 1}, {"version": 2}), d1, 2)
        assert wait_for(lambda: served(veng) == {"math@v2"}, 30), served(veng)
        assert folders(d1) == ["math@v1", "math@v2"]
    slot = Path(rt) / "adapters" / f"slot-{KEY[0]}-{KEY[1]}"
    assert sorted(os.listdir(slot)) == ["math@v1", "math@v2"]  # (outlive the stop)
    (slot / "math@v9").mkdir()  # (a version no engine lists)
    table = tmp_path / "slotsyncd.toml"
    table.write_text(f'[[engines]]\nurl = "{veng.url}"\nslot_start = 0\nslot_size = 2\n')
    with DaemonProcess(runtime_dir=rt, args=[*WATCH, "--config", str(table)]) as d2:
        assert slot_folder(d2) == slot
        # (the daemon's own adapter_dir, as its start line says: the folders above are its)
        start = next(x for x in d2.log_tail(50000).splitlines() if " adapter_dir " in x)
        assert f"folder={slot.parent}" in start, start
        assert wait_for(lambda: adapters_of(d2) == [("math@v2", "served")], 30), (
            adapters_of(d2), d2.log_tail(3000))
        assert wait_for(lambda: folders(d2) == ["math@v2"], 30), folders(d2)
        # (the sweep's log line comes after its removals: polled, not read at once)
        assert wait_for(lambda: all(w in d2.log_tail(20000) for w in (
            "adapter_found", "adapter_folders_removed")), 30), d2.log_tail(20000)
        assert slot_status(d2, KEY)["adapter_rounds_succeeded"] == 0
        veng.kill()
        veng.start_again()
        assert wait_for(lambda: served(veng) == {"math@v2"}, 60), d2.log_tail(3000)
        assert_holds(veng, "math@v2", "vllm", 2)  # (read from the adopted folder)
        assert wait_for(lambda: adapters_of(d2) == [("math@v2", "served")], 30)
        assert "adapter_reloaded" in d2.log_tail(20000)

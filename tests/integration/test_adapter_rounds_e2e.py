"""Adapter rounds end to end with the real trainer API (issue 36): two rank processes calling
``Publisher.publish_adapter`` (``tests/adapter_trainer.py``) -> a real ``slotsyncd`` (a
subprocess) -> each engine family's engine, running the engines' own LoRA code:

* the vLLM family (``"host"`` transport: the daemon reads the ranks' shared-memory parts and
  writes the folder vLLM loads): the vLLM-code engine (vLLM 0.32's LoRA and models routers,
  ``OpenAIServingModels``, its ``LRUCacheWorkerLoRAManager`` reading the folder on each of 2
  workers, ``engine/vllm/lora.py``) and the reference engine (its stand-in of those);
  a tensor split in rows between the two ranks;
* the SGLang-code engine (``"device"``: the engine maps the ranks' memory; SGLang 0.5.23's
  ``load_lora_adapter_from_tensors`` with ``SafeUnpickler`` and its checksum check on 2 TP
  ranks): one rank holds the adapter, the other sends ``{}``.

What each test checks can fail: every worker's sha256 of each tensor *as the engine read it*
(``/_slotsync/lora``) against the trainer's tensors, the names the engine lists, the daemon's
``/status`` and folder, ``/dev/shm`` and the daemon's mappings. Engines are shared by the
module (adapters unloaded between tests); each test has its own daemon. Faults:
``tests/faults/test_adapter_faults.py``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from adapter_e2e import (  # noqa: E402
    KEY,
    VLLM_FAMILY,
    adapters_of,
    assert_holds,
    assert_nothing_left,
    assert_ok,
    folders,
    held_sums,
    lora_route_calls,
    lora_state,
    run_rounds,
    served,
    sglang_box,
    slot_folder,
    slot_status,
    start,
    unload_all,
    vllm_family_box,
)
from adapter_trainer import adapter_tensors  # noqa: E402
from rank_pool import RankPool  # noqa: E402
from state_readers import wait_for  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402

pytestmark = pytest.mark.slow

UNLOAD_HANG_S = 3.0  # the previous version's unload held this long: both are seen listed


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    p = RankPool(2)
    yield p
    p.close()


@pytest.fixture(scope="module", params=VLLM_FAMILY)
def vbox(request: pytest.FixtureRequest):
    b = vllm_family_box(request.param)
    yield b
    b.close()


@pytest.fixture
def veng(vbox):
    unload_all(vbox)
    yield vbox
    unload_all(vbox)


def test_vllm_family_two_ranks_rows_versions_replace_each_other(pool, veng):
    """v1, v2, v3 of ``math``, every tensor split in rows over ranks 0 and 1: each round's
    ack names ``math@vN`` (transport ``host``); every worker holds exactly the trainer's
    bytes of it (vLLM's ``LoRAModel`` as read from the daemon's folder); the previous
    version is unloaded only after the new one is served (v1's unload held 3 s by the
    engine: at the ack both are listed, then only the new one); ``/status`` shows the
    served version; the daemon's folder holds the served version and the one unloaded last
    (a request admitted before its unload may re-read it), no temp folder; v1's folder goes
    once v2 is unloaded; nothing in ``/dev/shm``, nothing mapped by the daemon."""
    with DaemonProcess() as d:
        t0 = time.time()
        run = run_rounds(pool, d, veng, {"version": 1})
        (r1,) = assert_ok(run, d, 1)
        assert (r1["served_name"], r1["transport"]) == ("math@v1", "host"), r1
        assert served(veng) == {"math@v1"}
        assert_holds(veng, "math@v1", "vllm", 1)
        assert_nothing_left(d, run)
        for v in (2, 3):
            if v == 2:
                veng.request("POST", "/_slotsync/fault", {
                    "route": "unload_lora_adapter", "status": 200, "hang_s": UNLOAD_HANG_S})
            run = run_rounds(pool, d, veng, {"version": v})
            assert [e["served_name"] for e in assert_ok(run, d, 1)] == [f"math@v{v}"]
            if v == 2:
                assert served(veng) == {"math@v1", "math@v2"}  # (v1's unload held)
            assert_holds(veng, f"math@v{v}", "vllm", v)
            assert_nothing_left(d, run)
            assert wait_for(lambda v=v: served(veng) == {f"math@v{v}"} and adapters_of(d) == [
                (f"math@v{v}", "served")], 30, 0.1), (served(veng), adapters_of(d))
        (entry,) = slot_status(d, (0, 2))["adapters"]
        assert entry["lora_name"] == "math" and entry["version"] == 3, entry
        assert t0 - 1 <= entry["loaded_at"] <= time.time() + 1 and entry["error"] is None
        assert entry["nbytes"] == sum(t.numel() * 4 for t in adapter_tensors("vllm", 3).values())
        assert folders(d) == ["math@v2", "math@v3"], folders(d)
        for v in (2, 3):
            assert sorted(p.name for p in (slot_folder(d) / f"math@v{v}").iterdir()) == [
                "adapter_config.json", "adapter_model.safetensors"]
        if veng.impl == "vllm":  # (vLLM's request keeps the path it re-reads)
            paths = {a["lora_name"]: a["lora_path"] for a in lora_state(veng)["adapters"]}
            assert paths == {"math@v3": str(slot_folder(d) / "math@v3")}, paths


@pytest.mark.sglang
def test_sglang_one_rank_holds_all_versions_replace_each_other(pool, seng):
    """v1 then v2 from rank 0 (rank 1 sends ``{}``), transport ``device``: each TP rank's
    copy has the trainer's sha256 of every tensor; v1 is unloaded after v2 is served (held
    3 s: both listed at the ack); ``/status`` shows v2 served; the daemon wrote no folder
    (SGLang reads the ranks' memory); nothing in ``/dev/shm``."""
    with DaemonProcess() as d:
        one = {"layout": "one", "holder": 0}
        run = run_rounds(pool, d, seng, {"version": 1, **one})
        (r1,) = assert_ok(run, d, 1)
        assert (r1["served_name"], r1["transport"]) == ("math@v1", "device"), r1
        assert served(seng) == {"math@v1"}
        assert_holds(seng, "math@v1", "sglang", 1)
        seng.request("POST", "/_slotsync/fault", {
            "route": "unload_lora_adapter", "status": 200, "hang_s": UNLOAD_HANG_S})
        run = run_rounds(pool, d, seng, {"version": 2, **one})
        assert [e["served_name"] for e in assert_ok(run, d, 1)] == ["math@v2"]
        assert served(seng) == {"math@v1", "math@v2"}
        assert_holds(seng, "math@v2", "sglang", 2)
        assert_nothing_left(d, run)
        # (v1 gone from both TP ranks too: SGLang answers the unload once TP rank 0 did)
        assert wait_for(lambda: served(seng) == {"math@v2"} and adapters_of(d) == [
            ("math@v2", "served")] and held_sums(seng, "math@v1") == [{}, {}], 30, 0.1), (
            served(seng), adapters_of(d))
        assert_holds(seng, "math@v2", "sglang", 2)
        assert folders(d) == []


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


def test_vllm_family_base_and_adapter_rounds_in_sequence(pool, veng):
    """The same ranks publish adapter v1, then base weights, then adapter v2: each round
    lands. The base round's finish empties every worker's adapter cache (vLLM's
    ``reset_lora_state``), yet v1 stays listed and its folder stays: a request of it reads
    the folder again and gets the trainer's bytes; the base weights are the trainer's."""
    from lora_plans import llama_weights
    from state_readers import engine_checksums

    from slotsync.engine.checksum import tensor_checksum

    with DaemonProcess() as d:
        run = run_rounds(pool, d, veng, {"version": 1}, {"kind": "base", "version": 1})
        assert [e["what"] for e in assert_ok(run, d, 2)] == ["adapter", "base"]
        assert served(veng) == {"math@v1"}
        assert held_sums(veng, "math@v1") == [{}, {}]  # (reset by the base finish)
        want = {n: tensor_checksum(t) for n, t in llama_weights(1)}
        for worker, sums in engine_checksums(veng).items():
            assert {n: sums.get(n) for n in want} == want, worker
        status, body = veng.request("POST", "/_slotsync/lora/use", {"lora_name": "math@v1"})
        assert status == 200, body  # (read again from the daemon's folder)
        assert_holds(veng, "math@v1", "vllm", 1)
        run = run_rounds(pool, d, veng, {"version": 2})
        assert [e["served_name"] for e in assert_ok(run, d, 1)] == ["math@v2"]
        assert_holds(veng, "math@v2", "vllm", 2)
        assert_nothing_left(d, run)


def test_vllm_family_restart_between_rounds_reloads_from_the_folder(pool, veng):
    """Base weights and v1 served; the engine is killed and started again (it holds no
    adapter). The next base round's probe finds a new session, and its ``Ack(commit)`` --
    the engine reported ready -- comes only after the daemon loaded v1 again from its
    folder: when the ranks' ``publish`` returns, v1 is listed and every worker holds the
    trainer's bytes. Killed and started again once more, the next adapter round (LoRA-only
    training: no base round) finds v1 missing from the engine's list, loads it again from
    its folder, then v2 beside it, then unloads v1. The idle watch is off here (it would
    reload v1 itself between the restart and the round: test_adapter_watch_e2e.py)."""
    with DaemonProcess(args=["--adapter-watch-s", "0"]) as d:
        run = run_rounds(pool, d, veng, {"kind": "base", "version": 1}, {"version": 1})
        assert_ok(run, d, 2)
        veng.kill()
        veng.start_again()
        assert served(veng) == set()
        assert_ok(run_rounds(pool, d, veng, {"kind": "base", "version": 2}), d, 1)
        assert served(veng) == {"math@v1"}, d.log_tail()  # (no wait: before the ack)
        assert_holds(veng, "math@v1", "vllm", 1)
        assert adapters_of(d) == [("math@v1", "served")]
        log = d.log_tail(20000)
        assert "engine_session_new" in log and log.count("adapter_reloaded") == 1, log
        veng.kill()
        veng.start_again()
        run = run_rounds(pool, d, veng, {"version": 2})
        assert [e["served_name"] for e in assert_ok(run, d, 1)] == ["math@v2"]
        assert_holds(veng, "math@v2", "vllm", 2)
        assert wait_for(lambda: served(veng) == {"math@v2"}, 30, 0.1), served(veng)
        assert lora_route_calls(veng) == {"load_lora_adapter": 2, "unload_lora_adapter": 1}
        assert d.log_tail(20000).count("adapter_reloaded") == 2
        assert folders(d) == ["math@v1", "math@v2"]


def test_vllm_family_restart_after_adapter_rounds_only_is_seen_by_the_next_base_round(
        pool, veng):
    """v1 served (no base round yet); the engine restarts; the next base round should not
    report the engine ready before v1 is loaded again from its folder."""
    with DaemonProcess() as d:
        assert_ok(run_rounds(pool, d, veng, {"version": 1}), d, 1)
        veng.kill()
        veng.start_again()
        assert_ok(run_rounds(pool, d, veng, {"kind": "base", "version": 2}), d, 1)
        assert served(veng) == {"math@v1"}


def test_vllm_family_one_rank_holding_all_is_linked_and_outlives_the_rank(pool, veng):
    """The daemon's ``adapter_dir`` on ``/dev/shm``'s tmpfs (the ranks' segments' filesystem):
    v1 all on rank 1 -> rank 1 lays its part out as the safetensors file and seals it, the
    daemon hard-links it as the version's ``adapter_model.safetensors`` (its log:
    ``adapter_file rank=1 how=linked``) and every worker holds exactly the trainer's bytes;
    once rank 1 freed its part the file has one link (the daemon's) and nothing of the
    ranks is in ``/dev/shm``. The engine killed and started again, the next base round
    loads v1 again from that file (the rank long gone) before its ack, every worker holding
    the trainer's bytes again. v2 in rows is copied (no ``adapter_file`` line)."""
    shm = Path(tempfile.mkdtemp(prefix="test-e2e-adapters-", dir="/dev/shm"))
    try:
        with DaemonProcess(args=["--adapter-dir", str(shm)]) as d:
            run = run_rounds(pool, d, veng, {"version": 1, "layout": "one", "holder": 1})
            assert_ok(run, d, 1)
            assert_holds(veng, "math@v1", "vllm", 1)
            (line,) = [x for x in d.log_tail(50000).splitlines() if " adapter_file " in x]
            assert "rank=1" in line and "how=linked" in line, line
            file = shm / f"slot-{KEY[0]}-{KEY[1]}" / "math@v1" / "adapter_model.safetensors"
            assert_nothing_left(d, run)
            assert file.stat().st_nlink == 1
            veng.kill()
            veng.start_again()
            assert_ok(run_rounds(pool, d, veng, {"kind": "base", "version": 1}), d, 1)
            assert served(veng) == {"math@v1"}, d.log_tail()
            assert_holds(veng, "math@v1", "vllm", 1)
            run = run_rounds(pool, d, veng, {"version": 2})
            assert_ok(run, d, 1)
            assert_holds(veng, "math@v2", "vllm", 2)
            assert d.log_tail(50000).count(" adapter_file ") == 1
            assert_nothing_left(d, run)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_the_default_adapter_dir_links_a_one_rank_adapter(pool, veng):
    """The daemon's own default ``adapter_dir`` (``/dev/shm/slotsyncd-<uid>/adapters-<key>``,
    ``daemon/service/adapter_root.py``; ``SLOTSYNC_ADAPTER_DIR=""`` keeps ``DaemonProcess``
    from giving it another): the start says ``link=true``, and v1 all on rank 1 is
    hard-linked there (``how=linked``; the old default, ``<runtime_dir>/adapters``, is on
    another filesystem, where every round is copied). At the stop only the served version's
    folder is left (an engine may read it again, as in any ``adapter_dir``): the test removes
    it, and the private folder with it. Red on the old code: no ``adapter_root`` module, and
    the old default's start line says ``link=false``."""
    import os

    from slotsync.daemon.service.adapter_root import resolve

    with DaemonProcess(env={"SLOTSYNC_ADAPTER_DIR": ""}) as d:
        root = resolve("", d.endpoint, d.runtime_dir)
        try:
            start = next(x for x in d.log_tail(50000).splitlines() if " adapter_dir " in x)
            assert f"folder={root.path}" in start and "link=true" in start, start
            assert root.path.startswith(f"/dev/shm/slotsyncd-{os.geteuid()}/adapters-")
            run = run_rounds(pool, d, veng, {"version": 1, "layout": "one", "holder": 1})
            assert_ok(run, d, 1)
            assert_holds(veng, "math@v1", "vllm", 1)
            (line,) = [x for x in d.log_tail(50000).splitlines() if " adapter_file " in x]
            assert "rank=1" in line and "how=linked" in line, line
            assert (Path(root.path) / f"slot-{KEY[0]}-{KEY[1]}" / "math@v1").is_dir()
            d.stop()
            slot = Path(root.path) / f"slot-{KEY[0]}-{KEY[1]}"
            assert os.listdir(root.path) == [slot.name] and os.listdir(slot) == ["math@v1"]
        finally:
            unload_all(veng)
            d.stop()
            shutil.rmtree(Path(root.path) / f"slot-{KEY[0]}-{KEY[1]}", ignore_errors=True)
            for folder in (root.path, root.private):  # (what the stop left: v1 was served)
                with contextlib.suppress(OSError):
                    os.rmdir(folder)


@pytest.mark.sglang
def test_sglang_base_rounds_between_and_a_restart_marks_the_adapter_lost(pool, seng):
    """Adapter v1 then base weights from the same ranks: both land, v1 stays listed and
    held. The engine is killed and started again: the next base round finds a new session;
    the daemon holds no copy of v1 (SGLang read the ranks' memory, freed since), so
    ``/status`` marks it ``lost`` saying to publish it again, the log says
    ``adapter_lost``, and the engine lists nothing. Publishing v1 again is taken (the same
    version: it was lost) and lands; v2 then replaces it."""
    with DaemonProcess() as d:
        one = {"layout": "one", "holder": 1}
        run = run_rounds(pool, d, seng, {"version": 1, **one}, {"kind": "base", "version": 1})
        assert [e["what"] for e in assert_ok(run, d, 2)] == ["adapter", "base"]
        assert served(seng) == {"math@v1"}
        assert_holds(seng, "math@v1", "sglang", 1)
        seng.kill()
        seng.start_again()
        assert_ok(run_rounds(pool, d, seng, {"kind": "base", "version": 2}), d, 1)
        (entry,) = slot_status(d, (0, 2))["adapters"]
        assert (entry["served_name"], entry["state"]) == ("math@v1", "lost"), entry
        assert "publish version 1 of 'math' again" in entry["error"], entry
        assert "adapter_lost" in d.log_tail(20000)
        assert served(seng) == set()
        run = run_rounds(pool, d, seng, {"version": 1, **one}, {"version": 2, **one})
        assert [e["served_name"] for e in assert_ok(run, d, 2)] == ["math@v1", "math@v2"]
        assert_holds(seng, "math@v2", "sglang", 2)
        assert wait_for(lambda: served(seng) == {"math@v2"} and adapters_of(d) == [
            ("math@v2", "served")], 30, 0.1), (served(seng), adapters_of(d))
        assert_nothing_left(d, run)


def test_a_rank_that_registers_after_the_other_began_joins_its_round(pool, veng):
    """Rank 1 registers and calls ``publish_adapter`` at once; rank 0 registers a second
    later, while the round rank 1 opened waits for its begin (ranks of one job start at
    different times): rank 0 is told that round's id at registration and joins it, as a
    rank registering during a base round's begins does. (Red before the fix: the round's
    begin had moved the slot's next update id on, rank 0's begin carried the next one and
    was refused as "a second round", and the round failed.)"""
    with DaemonProcess() as d:
        run = start(pool, d, veng, [[{"version": 1}]] * 2,
                    extra=[{"register_delay_s": 1.0}, {}])
        run.wait(60)
        (r0,) = assert_ok(run, d, 1)
        assert r0["served_name"] == "math@v1" and r0["update_id"] == 0, r0
        assert_holds(veng, "math@v1", "vllm", 1)

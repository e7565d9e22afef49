"""An engine replaced by one of the other kind at the same URL (issue 35 item 15): the daemon
tells the kind again instead of driving the new engine with the old one's routes ("vLLM
get_world_size failed: HTTP 404" until the daemon restarted).

The vLLM-kind engine is the reference engine (vLLM's routes; ``tests/engines.py``), the SGLang
one the SGLang-code engine (SGLang's own payload parser and auth rule in each TP rank,
``src/slotsync/engine/sglang/``). Trainer ranks in spawned processes
(``tests/spawned_ranks.py``), one round each time; no daemon restart in between."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from engines import EngineBox, port_free  # noqa: E402
from sglang_rounds import TP, assert_landed, ok_rounds, table  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402

from slotsync.daemon.launcher import DaemonProcess  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.sglang]


def _replace(box: EngineBox, impl: str) -> EngineBox:
    """Stop ``box``'s engine and start one of ``impl`` on the same port."""
    port = box.eng.port
    box.close()
    deadline = time.monotonic() + 30
    while not port_free(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    kw = {"sglang": {"sglang_version": "0.5.23"}} if impl == "sglang" else {}
    return EngineBox(TP, impl_name=impl, port=port, **kw)


def _round(d: DaemonProcess, box: EngineBox, k: int) -> None:
    ev = run_ranks(d, box.url, True, [{"rounds": 1, "first_round": k}] * TP)
    ok_rounds(ev, 1, box)
    assert box.weight_version() == f"v{k}"
    if box.is_sglang:
        assert_landed(box, k)


def _kind(d: DaemonProcess) -> str | None:
    return d.status()["slots"][0]["engine_kind"]


def test_an_engine_replaced_by_the_other_kind_is_told_again_and_after_slots_drop(tmp_path):
    """An engine table declaring the slot without a kind (a slot left by its ranks and taken
    by new ones keeps what the daemon knows of its engine, declared or not). A round on the
    vLLM-kind engine; SGLang at its port: the next round lands (the kind told again in its
    begin), ``/status`` says SGLang. A table declaring ``kind = "vllm"`` at that URL is
    refused naming the table, not as a failed vLLM route. The vLLM kind back at the port and
    ``slotsync slots drop``: the kind is unknown until the next round, which lands."""
    box = EngineBox(TP, impl_name="reference")
    try:
        with DaemonProcess(args=table(tmp_path, box.url)) as d:
            _round(d, box, 1)
            assert _kind(d) == "vllm"
            box = _replace(box, "sglang")
            _round(d, box, 2)
            assert _kind(d) == "sglang"
            assert "engine_kind_rechecked" in Path(d.log_path).read_text()
            (tmp_path / "declared").mkdir()
            with DaemonProcess(args=table(tmp_path / "declared", box.url, kind="vllm")) as d2:
                ev = run_ranks(d2, box.url, True, [{"rounds": 1, "first_round": 3}] * TP)
            for r in range(TP):
                (e,) = rounds(ev, r)
                assert e["status"] == "error", e
                assert "get_world_size failed" not in e["message"], e["message"]
                assert 'declare kind = "sglang"' in e["message"], e["message"]
            assert box.stats()["paused"] is False  # (refused before the pause)
            box = _replace(box, "reference")
            out = subprocess.run([sys.executable, "-m", "slotsync", "slots", "drop", "0",
                                  str(TP), "--url", d.status_url], capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert _kind(d) is None  # (asked again at the next begin)
            _round(d, box, 4)
            assert _kind(d) == "vllm"
    finally:
        box.close()

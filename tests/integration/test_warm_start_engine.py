"""Warm start end to end (issue 27 C, ``daemon/warm_start.py``): a real slotsyncd and the
vLLM-code engine (vLLM 0.32's own ``Worker.init_weight_transfer_engine`` behind vLLM's
router), trainer ranks in spawned processes that register, then wait before their first
publish. Once both registered, the engine is asked its version and initialised -- with no
pause -- and the first round asks neither again."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from engines import start_engine  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from state_readers import engine_stats  # noqa: E402

from slotsync.testing.processes import DaemonProcess  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

WAIT_S = 12.0  # the ranks' wait between registering and their first publish (generous: CI)


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


def _engine_calls(daemon: DaemonProcess) -> dict[str, int]:
    slots = daemon.status()["slots"]
    return dict(slots[0]["engine_calls"]) if slots else {}


def test_the_engine_is_initialised_once_the_ranks_registered_before_any_publish(daemon):
    with start_engine(2, impl_name="vllm") as eng:
        start_at = time.time() + WAIT_S
        registered: set[int] = set()
        before: dict = {}

        def on_event(e: dict) -> None:
            if e["event"] != "registered":
                return
            registered.add(e["rank"])
            if len(registered) < 2:
                return
            deadline = start_at - 2.0  # (the ranks publish at start_at)
            while time.time() < deadline:
                if _engine_calls(daemon).get("init_weight_transfer_engine"):
                    break
                time.sleep(0.05)
            before["calls"] = _engine_calls(daemon)
            before["stats"] = engine_stats(eng)

        ev = run_ranks(daemon, eng.url, True, [{"rounds": 2, "start_at": start_at}] * 2,
                       on_event=on_event)
        assert [e["status"] for e in rounds(ev, 0)] == ["ok", "ok"], ev
        calls, stats = before["calls"], before["stats"]
        # before any publish: asked and initialised, nothing that touches generation
        assert calls.get("version") == 1 and calls.get("server_info") == 1, calls
        assert calls.get("init_weight_transfer_engine") == 1, calls
        assert stats["pause_count"] == 0 and not stats["paused"], stats
        for route in ("pause", "start_weight_update", "weight_info", "is_sleeping"):
            assert calls.get(route, 0) == 0, calls
        # the two rounds asked neither again
        after = _engine_calls(daemon)
        assert after["version"] == 1 and after["init_weight_transfer_engine"] == 1, after
        assert after["start_weight_update"] == 2 and after["pause"] == 2, after
        assert daemon.status()["slots"][0]["engine_vllm_version"] is not None

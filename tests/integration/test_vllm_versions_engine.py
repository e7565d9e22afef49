"""vLLM version detection end to end (issue 18 D): a real slotsyncd, engines posing as other
vLLM versions (the reference engine's ``--vllm-version``), trainer ranks in spawned processes.

An unsupported or unknown version is refused in the begin, before the pause: each rank's
error names the version, the engine and the supported range, and the engine's own counters
show no ``/pause`` and no ``/start_weight_update``. A known version is asked once per engine
process; a restarted engine at the same URL is asked again. Against the vLLM-code engine the
version the daemon reports is the installed vllm's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from engines import EngineBox, start_engine  # noqa: E402
from spawned_ranks import rounds, run_ranks  # noqa: E402
from state_readers import engine_stats  # noqa: E402

from slotsync.cli.status import render_table  # noqa: E402
from slotsync.testing.processes import DaemonProcess  # noqa: E402

pytestmark = pytest.mark.slow

TWO_RANKS = [{"rounds": 1}, {"rounds": 1}]


def _never_paused(stats: dict) -> None:
    """The engine saw no call that touches generation or the weights."""
    counts = stats["route_counts"]
    assert stats["pause_count"] == 0 and stats["paused"] is False, stats
    for route in ("pause", "start_weight_update", "update_weights", "finish_weight_update"):
        assert counts.get(route, 0) == 0, counts


def _errors(ev: dict[int, list[dict]]) -> list[dict]:
    out = []
    for r in (0, 1):
        (e,) = rounds(ev, r)
        assert e["status"] == "error" and e["phase"] == "begin", e
        out.append(e)
    return out


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    with DaemonProcess() as d:
        yield d


@pytest.mark.parametrize(("version", "says"), [
    ("0.25.0", "0.25 takes `packed` in each update_info"),
    ("0.34.0", "is newer than slotsyncd knows"),
    ("garbage", "vLLM version 'garbage'"),
])
def test_engine_of_an_unsupported_vllm_is_refused_before_the_pause(daemon, version, says):
    with start_engine(2, impl_name="reference", vllm_version=version) as eng:
        ev = run_ranks(daemon, eng.url, True, TWO_RANKS)
        for e in _errors(ev):
            assert version in e["message"] and eng.url in e["message"], e
            assert "0.27-0.33" in e["message"] and says in e["message"], e
            assert "the engine was not paused" in e["message"], e
        _never_paused(engine_stats(eng))
        s = daemon.status()["slots"][0]
        assert s["engine_vllm_version"] == version and s["engine_paused"] is False, s
        assert s["engine_calls"].get("pause", 0) == 0, s["engine_calls"]


def test_server_without_a_version_route_is_refused_naming_what_came_back(daemon):
    with start_engine(2, impl_name="reference") as eng:
        eng.request("POST", "/_slotsync/fault", {"route": "version", "status": 404,
                                                 "message": "Not Found"})
        ev = run_ranks(daemon, eng.url, True, TWO_RANKS)
        for e in _errors(ev):
            assert "did not say its vLLM version: GET /version gave HTTP 404" in e["message"]
            assert "Not Found" in e["message"] and eng.url in e["message"], e
        _never_paused(engine_stats(eng))
        assert daemon.status()["slots"][0]["engine_vllm_version"] is None


def test_known_version_is_asked_once_and_shown_in_status(daemon):
    """The reference engine says 0.32.0 by default; two rounds cost one /version call."""
    with start_engine(2, impl_name="reference") as eng:
        ev = run_ranks(daemon, eng.url, True, [{"rounds": 2}, {"rounds": 2}])
        assert [e["status"] for e in rounds(ev, 0)] == ["ok", "ok"], ev
        assert engine_stats(eng)["route_counts"]["version"] == 1
        doc = daemon.status()
        assert doc["slots"][0]["engine_vllm_version"] == "0.32.0"
        assert f"{eng.url} (vLLM 0.32.0)" in render_table(doc)


def test_engine_restarted_with_another_version_is_asked_again(daemon):
    """Round 1 on vLLM 0.32.0; the engine restarts at the same URL as 0.25.0: the cached
    0.32.0 must not be used. Round 2 is refused before the pause of the new process."""
    box = EngineBox(2, impl_name="reference")
    try:
        ev = run_ranks(daemon, box.url, True, TWO_RANKS)
        assert rounds(ev, 0)[0]["status"] == "ok", ev
        box.kw["vllm_version"] = "0.25.0"
        box.start_again()
        ev = run_ranks(daemon, box.url, True, TWO_RANKS)
        for e in _errors(ev):
            assert "vLLM 0.25.0 at" in e["message"] and "0.27-0.33" in e["message"], e
        _never_paused(engine_stats(box.eng))
        assert daemon.status()["slots"][0]["engine_vllm_version"] == "0.25.0"
    finally:
        box.close()


@pytest.mark.vllm
def test_vllm_code_engine_reports_the_installed_vllms_version(daemon):
    import vllm

    with start_engine(2, impl_name="vllm") as eng:
        status, body = eng.request("GET", "/version")
        assert status == 200 and body == {"version": vllm.__version__}
        ev = run_ranks(daemon, eng.url, True, TWO_RANKS)
        assert rounds(ev, 0)[0]["status"] == "ok", ev
        s = daemon.status()["slots"][0]
        assert s["engine_vllm_version"] == vllm.__version__, s


@pytest.mark.parametrize(("body", "says"), [
    ("<html>vLLM?</html>", "not JSON: '<html>vLLM?</html>'"), ("", "not JSON: ''")])
async def test_client_refuses_a_version_answer_that_is_not_json(body, says):
    """A 200 whose body is not JSON (a proxy's page, an empty body) is an error naming what
    came back, not a None the daemon would have to guess about."""
    from aiohttp import web

    from slotsync.daemon.vllm.client import EngineError, VllmClient

    async def version(_request: web.Request) -> web.Response:
        return web.Response(text=body, content_type="text/html")

    app = web.Application()
    app.router.add_get("/version", version)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    c = VllmClient(f"http://127.0.0.1:{runner.addresses[0][1]}", timeout_s=5)
    try:
        with pytest.raises(EngineError) as ei:
            await c.call("version")
        assert ei.value.status == 200 and says in ei.value.message
        assert str(ei.value).startswith("version: HTTP 200: not JSON")
    finally:
        await c.close()
        await runner.cleanup()

"""vLLM version detection (issue 18 D): parsing ``GET /version``, the supported range, the
feature table and ``feature_missing``; the begin's version stages in the coordinator (asked
once, asked again after a restart, refused before the pause); docs/vllm-versions.md's table
is ``FEATURES``' rendering."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_coordinator import URL, EventLog, Harness

from slotsync.daemon.core.engine_session import EngineSession
from slotsync.daemon.core.registration import RankInfo
from slotsync.daemon.core.update import Update, begin_step
from slotsync.daemon.vllm import versions as vllm_versions
from slotsync.daemon.vllm.versions import (
    FEATURES,
    SUPPORTED_MAX,
    SUPPORTED_MIN,
    check_supported,
    feature_missing,
    features_markdown,
    parse,
)
from slotsync.protocol.wire import Error

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm-versions.md"


@pytest.mark.parametrize(("text", "minor"), [
    ("0.32.0", (0, 32)), ("0.33.0rc1", (0, 33)), ("0.32.1.dev12+gabc", (0, 32)),
    ("0.32.0+cpu", (0, 32)), ("0.27", (0, 27)), (" 0.30.2 ", (0, 30)), ("v0.29.1", (0, 29)),
    ("1.0.0.post1", (1, 0)),
])
def test_parse_reads_the_forms_vllm_writes(text: str, minor: tuple[int, int]) -> None:
    v = parse(text)
    assert v is not None and v.minor_key == minor and v.text == text


@pytest.mark.parametrize("text", ["garbage", "dev", "", "0", "0.x.1", "0.32.0 extra", "32"])
def test_parse_refuses_what_is_not_a_version(text: str) -> None:
    assert parse(text) is None


@pytest.mark.parametrize("text", ["0.27.0", "0.27.0rc1", "0.28.3", "0.32.0", "0.32.0+cpu",
                                  "0.32.1.dev12+gabc", "0.33.0rc1", "0.33.9"])
def test_every_build_of_the_supported_minors_is_supported(text: str) -> None:
    assert check_supported(text, URL) is None


def test_an_older_vllm_is_refused_naming_version_range_and_what_it_lacks() -> None:
    msg = check_supported("0.25.0", "http://10.0.0.1:8000")
    assert msg is not None
    assert msg.startswith("vLLM 0.25.0 at http://10.0.0.1:8000: ")
    assert "slotsyncd speaks the weight-transfer routes of vLLM 0.27-0.33" in msg
    assert "0.25 takes `packed` in each update_info (0.22-0.26)" in msg and "upgrade" in msg
    # 0.26.9 is still older; 0.20 lacks every required feature, each named
    assert "0.26 takes `packed`" in check_supported("0.26.9", URL)
    old = check_supported("0.20.1", URL)
    for f in FEATURES.values():
        if f.required:
            assert f.before in old


@pytest.mark.parametrize("text", ["0.34.0", "0.34.0rc1", "1.0.0"])
def test_a_newer_vllm_is_refused_as_unknown(text: str) -> None:
    msg = check_supported(text, URL)
    assert msg is not None and f"vLLM {text} at {URL} is newer than slotsyncd knows" in msg
    assert "0.27-0.33" in msg


@pytest.mark.parametrize("got", ["garbage", "dev", "", None, 32, {"v": 1}, ["0.32.0"]])
def test_what_is_not_a_version_is_refused_saying_what_came(got: object) -> None:
    msg = check_supported(got, URL)
    assert msg is not None and f"vLLM version {got!r} at {URL} is not a version" in msg
    assert "0.27-0.33" in msg


def test_version_of_reads_the_answer_or_returns_it_whole() -> None:
    assert vllm_versions.version_of({"version": "0.32.0"}) == "0.32.0"
    assert vllm_versions.version_of({"message": "ok"}) == {"message": "ok"}


def test_a_failed_version_call_names_what_came_back() -> None:
    msg = vllm_versions.answer_refusal("version: HTTP 404: Not Found", URL)
    assert msg.startswith(f"engine {URL} did not say its vLLM version: GET /version gave "
                          "HTTP 404: Not Found;") and "0.27-0.33" in msg


def test_the_feature_table_holds_the_first_versions_the_issue_names() -> None:
    first = {name: f.first for name, f in FEATURES.items()}
    assert first["start_finish_sessions"] == (0, 21)
    assert first["packed_in_init_info"] == (0, 27)
    assert first["draft_sessions"] == (0, 26)
    assert first["list_update_info"] == (0, 29) and "52497" in FEATURES["list_update_info"].source
    assert first["weight_checker"] == (0, 32)
    # where the first version cannot be read from code this project has, the row says so
    assert "checked in 0.32/0.33" in FEATURES["world_size_include_dp"].source
    # the supported minimum is where the last feature every round needs arrived
    assert max(f.first for f in FEATURES.values() if f.required) == SUPPORTED_MIN
    assert all(f.first <= SUPPORTED_MAX for f in FEATURES.values())


def test_feature_missing_says_why_or_none() -> None:
    msg = feature_missing("0.28.0", "list_update_info")
    assert msg is not None and "needs vLLM 0.29 or later" in msg and "vLLM 0.28.0" in msg
    assert "one update_info dict for every worker" in msg
    assert feature_missing("0.29.0", "list_update_info") is None
    assert feature_missing("0.33.0rc1", "list_update_info") is None
    assert "needs vLLM 0.26 or later" in feature_missing("0.25.0", "draft_sessions")
    assert feature_missing("0.26.0", "draft_sessions") is None
    assert feature_missing(parse("0.32.0+cpu"), "weight_checker") is None
    assert "needs vLLM 0.32" in feature_missing("0.31.1", "weight_checker")
    # an unknown version lacks every feature: never a guess
    assert "not known" in feature_missing(None, "draft_sessions")
    assert "not known" in feature_missing("garbage", "draft_sessions")
    with pytest.raises(KeyError):
        feature_missing("0.32.0", "no_such_feature")


def test_the_docs_table_is_the_feature_tables_rendering() -> None:
    table = features_markdown()
    assert table in DOC.read_text(), (
        "docs/vllm-versions.md's feature table differs from vllm_versions.FEATURES; paste "
        "features_markdown()'s output:\n" + table)


# -- the begin's version stages (update.begin_step) ------------------------------------------

def _ranks() -> dict[int, RankInfo]:
    return {r: RankInfo(r, b"id", f"GPU-{r}", "host", 1) for r in range(2)}


def _stages(engine: EngineSession, new_session_at_probe: bool = False) -> list[str]:
    """The begin stages one update sends until it waits for the ranks' begins."""
    u = Update(0, "v", 0.0, begun={0})
    names = []
    while (step := begin_step(u, engine, _ranks(), 2, False, URL)).stage is not None:
        names.append(step.stage.name)
        if step.stage.name == "probe":
            u.new_session = new_session_at_probe
        if step.stage.name == "version":
            engine.session_suspect = False  # (the probe clears it)
    return names


def test_version_stage_runs_only_when_the_version_is_unknown_refused_or_suspect() -> None:
    engine = EngineSession()
    assert _stages(engine) == ["version", "probe", "init"]  # first meeting
    engine.initialized = True
    engine.vllm_version = "0.32.0"
    assert _stages(engine) == ["probe"]  # known: no extra call
    engine.session_suspect = True
    assert _stages(engine) == ["version", "probe"]  # a restart suspected
    engine.version_refused = "refused"
    assert _stages(engine) == ["version", "probe"]  # refused: asked again
    engine.version_refused = ""
    # the probe finds a new session the begin had not asked about: asked after it
    assert _stages(engine, new_session_at_probe=True) == ["probe", "version_again"]
    engine.vllm_version = None  # ... and once only when the begin had asked already
    assert _stages(engine, new_session_at_probe=True) == ["version", "probe"]
    # an engine to initialise again (a failed round, a restart the probe could not see):
    # the process about to be initialised is asked, the cached version may be another's
    engine.vllm_version, engine.initialized = "0.32.0", False
    assert _stages(engine) == ["probe", "version_again", "init"]


def test_engine_restarted_while_idle_before_any_round_succeeded_is_asked_again() -> None:
    """A fresh-user trial found it: no round had succeeded (the old and the new process both
    report the checkpoint's weight version, so the probe sees no new session) and the
    engine restarted as 0.25.0 while the daemon's connection was idle (no reset seen). The
    engine had to be initialised again, and the process about to be initialised is asked:
    refused before the pause."""
    h = _harness("0.32.0")
    h.coord.engine.initialized = False  # (what a failed first round leaves, e.g. refused)
    h.coord.engine.vllm_version = "0.32.0"
    h.engine.vllm_version = "0.25.0"  # restarted while idle
    h.round(0, n_chunks=1)
    err = _first_error(h)
    assert isinstance(err, Error) and "vLLM 0.25.0 at" in err.message, err
    assert "pause" not in h.engine.calls and "init_weight_transfer_engine" not in h.engine.calls


# -- the coordinator: refused before the pause, cached, asked again after a restart ---------

def _first_error(h: Harness) -> Error:
    """The first Error rank 0 got (later messages of the round get 'already failed')."""
    return next(m for m in h.replies[0] if isinstance(m, Error))


def _harness(vllm_version: str) -> Harness:
    h = Harness()
    h.engine.vllm_version = vllm_version
    h.register_all()
    return h


@pytest.mark.parametrize("version", ["0.25.0", "0.34.0", "garbage"])
def test_unsupported_version_fails_the_begin_before_the_pause(version: str) -> None:
    h = _harness(version)
    h.round(0, n_chunks=1)
    err = _first_error(h)
    assert isinstance(err, Error) and err.phase == "begin", err
    assert version in err.message and "0.27-0.33" in err.message and URL in err.message
    assert h.engine.calls == ["version", "server_info"]  # (asked together) nothing else
    assert not h.engine.paused and h.coord.state.value == "idle"
    assert h.coord.status()["engine_vllm_version"] == version
    # refused: asked again at the next begin (an engine upgraded in place is taken)
    h.engine.vllm_version = "0.32.0"
    h.round(1, n_chunks=1)
    assert h.coord.last_outcome == "success" and h.engine.calls.count("version") == 2
    assert h.coord.status()["engine_vllm_version"] == "0.32.0"


def test_a_version_call_that_gives_no_version_is_refused_naming_what_came_back() -> None:
    h = Harness()
    h.engine.fail[("version", 0)] = "HTTP 404: Not Found"
    h.register_all()
    h.round(0, n_chunks=1)
    err = _first_error(h)
    assert isinstance(err, Error) and "GET /version gave HTTP 404: Not Found" in err.message
    assert h.engine.calls == ["version", "server_info"] and not h.engine.paused
    assert h.coord.engine.vllm_version is None


def test_a_version_call_without_an_answer_fails_like_any_unreachable_engine() -> None:
    h = Harness()
    h.engine.fail[("version", 0)] = "version: cannot reach http://engine:8000: refused"
    h.engine.fail[("server_info", 0)] = "server_info: cannot reach http://engine:8000: refused"
    h.register_all()
    h.round(0, n_chunks=1)
    err = _first_error(h)
    assert isinstance(err, Error) and "vLLM version failed: " in err.message
    assert "did not say" not in err.message
    assert h.engine.calls == ["version", "server_info"]


def test_engine_restarted_with_another_version_is_asked_again_and_refused() -> None:
    """The cached version must not outlive the process that reported it: a restart at the
    same URL (its weight version is its checkpoint's again) is a new session, whose version
    is asked before anything touches generation."""
    h = _harness("0.32.0")
    h.round(0, n_chunks=1)
    h.round(1, n_chunks=1)
    assert h.engine.calls.count("version") == 1  # cached: one call per engine process
    h.engine.restart()
    h.engine.vllm_version = "0.25.0"
    h.engine.calls.clear()
    h.round(2, n_chunks=1)
    err = _first_error(h)
    assert isinstance(err, Error) and "vLLM 0.25.0 at" in err.message
    assert h.engine.calls == ["get_world_size", "weight_info", "is_sleeping", "version",
                              "server_info"]
    assert not h.engine.paused and h.coord.status()["engine_vllm_version"] == "0.25.0"


def test_engine_restarted_with_another_supported_version_is_logged() -> None:
    h = EventLog()
    h.register_all()
    h.round(0, n_chunks=1)
    assert h.events == []  # the first version seen is no news
    h.engine.restart()
    h.engine.vllm_version = "0.33.0"
    h.round(1, n_chunks=1)
    assert h.coord.engine.vllm_version == "0.33.0" and h.coord.last_outcome == "success"
    changed = [e for e in h.events if e.event == "engine_vllm_version_changed"]
    assert len(changed) == 1 and not changed[0].warning
    assert changed[0].fields["vllm_version"] == "0.33.0"
    assert changed[0].fields["before"] == "0.32.0"


def test_engine_table_reload_forgets_the_version() -> None:
    engine = EngineSession(vllm_version="0.32.0", version_refused="x")
    engine.forget()
    assert engine.vllm_version is None and engine.version_refused == ""


# -- the engines' and the status command's side ----------------------------------------------

def test_slotsync_status_shows_the_engines_vllm_version() -> None:
    from slotsync.cli.status import render_table

    base = {"slot": [0, 2], "state": "idle", "ranks_expected": 2, "ranks_registered": [0, 1],
            "engine_url": "http://e:1"}
    lines = render_table({"slots": [{**base, "engine_vllm_version": "0.32.0"},
                                    {**base, "engine_vllm_version": None}]}).splitlines()
    assert "http://e:1 (vLLM 0.32.0)" in lines[2]
    assert "vLLM" not in lines[3] and "http://e:1" in lines[3]  # not asked yet


def test_engine_flag_poses_as_a_version_on_the_reference_engine_only(tmp_path) -> None:
    from slotsync.engine.__main__ import build_parser, main
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.engine.reference.server import EMULATED_VLLM_VERSION

    assert EMULATED_VLLM_VERSION == "0.32.0"
    assert build_parser().parse_args(["--vllm-version", "0.25.0"]).vllm_version == "0.25.0"
    assert build_parser().parse_args([]).vllm_version is None
    cmd = ReferenceEngine(start=False, vllm_version="garbage").command()
    assert cmd[cmd.index("--vllm-version") + 1] == "garbage"
    assert "--vllm-version" not in ReferenceEngine(start=False).command()
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"")
    with pytest.raises(SystemExit) as e:  # vLLM's code reports the installed vllm's own
        main(["--impl", "vllm", "--model", str(model), "--vllm-version", "0.25.0"])
    assert e.value.code == 2

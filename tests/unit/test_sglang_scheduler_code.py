"""The daemon's pause and flush requests (``daemon/sglang/routes.py`` ``plan``) against
SGLang's own scheduler code: ``SchedulerFlushWrapper`` and ``Scheduler.is_fully_idle`` /
``flush_cache`` / ``pause_generation`` of the installed SGLang, compiled from its source by
``slotsync.engine.sglang.scheduler_code`` (what the SGLang-code engine runs), with requests
running when the pause comes (issue 35 item 11). No process, no HTTP: the rules only.

* ``test_the_daemons_flush_succeeds_after_every_flushing_pause``: for each pause mode that
  flushes and each version, the daemon's ``/flush_cache`` request is answered at once with a
  flush by SGLang's code, the requests the pause kept still there.
* ``test_a_flush_that_waits_for_idle_times_out_after_a_retract_pause``: what the daemon sent
  before (``?timeout=30``): SGLang's wrapper defers it, its idle rule counts the retracted
  requests, and at the deadline it answers "Timed out waiting for idle state." -- the bug.
* ``test_the_engines_rules_are_sglangs``: the compiled functions are SGLang's (their code
  objects name SGLang's files), and the wrapper refuses a second deferred flush as SGLang
  does.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from slotsync.daemon.sglang.routes import Dialect, plan
from slotsync.engine.sglang import scheduler_code
from slotsync.engine.sglang.state import VERSIONS, SglangState

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def make():
    """``scheduler_code.load()`` of the installed SGLang (skipped, or failed under
    ``SLOTSYNC_REQUIRE_SGLANG=1`` by conftest's marker, without it)."""
    factory = scheduler_code.load()
    if factory is None:
        pytest.skip("SGLang's scheduler source is not installed")
    return factory


def _paused(make, version: str, mode: str, running: int) -> tuple[SglangState, object]:
    """An engine of ``version`` with ``running`` requests running, paused in ``mode`` as
    SGLang's tokenizer and scheduler do (``abort``: the tokenizer aborts them, the scheduler
    is never told)."""
    state = SglangState(VERSIONS[version])
    code = make(state)
    state.start_requests(running)
    state.tokenizer_pause(mode)
    if mode != "abort":
        code.pause(mode)
    return state, code


def _flush_timeout(version: str, mode: str) -> float | None:
    """The ``timeout`` of the daemon's ``/flush_cache`` after its pause (None: no flush)."""
    reqs = plan("pause", None, Dialect(version, mode))
    assert reqs[0].path == "/pause_generation" and reqs[0].body == {"mode": mode}
    if len(reqs) == 1:
        return None
    (flush,) = reqs[1:]
    url = urlsplit(flush.path)
    assert url.path == "/flush_cache"
    return float(parse_qs(url.query).get("timeout", ["0"])[0])


@pytest.mark.parametrize("version", ["0.5.23", "0.5.21", "0.5.20"])
@pytest.mark.parametrize("mode", ["retract", "abort", "in_place"])
def test_the_daemons_flush_succeeds_after_every_flushing_pause(make, version, mode):
    state, code = _paused(make, version, mode, running=3)
    timeout = _flush_timeout(version, mode)
    if mode == "retract":  # SGLang's pause moved them to the waiting queue
        assert (state.requests.running, state.requests.waiting) == (0, 3)
    if timeout is None:  # in_place (requests run), retract on 0.5.20 (the queue counts):
        assert mode == "in_place" or version == "0.5.20"
        assert code.flush(0.0, None) == (False, "")  # SGLang's code would refuse any flush
        return
    answers: list[tuple[bool, str]] = []
    got = code.flush(timeout, lambda ok, msg: answers.append((ok, msg)))
    assert got == (True, ""), (got, state.requests)
    assert state.counts["flush_count"] == 1 and not code.pending()
    kept = 3 if mode == "retract" else 0
    assert state.requests.waiting == kept and state.requests.aborted == 3 - kept


@pytest.mark.parametrize("version", ["0.5.23", "0.5.21"])
def test_a_flush_that_waits_for_idle_times_out_after_a_retract_pause(make, version):
    state, code = _paused(make, version, "retract", running=2)
    answers: list[tuple[bool, str]] = []
    assert code.flush(30.0, lambda ok, msg: answers.append((ok, msg))) is None  # deferred
    code.check_pending()
    assert code.pending() and not answers  # the waiting queue counts: never idle
    pending_req, _ = code.wrapper._pending
    code.wrapper._pending = (pending_req, 0.0)  # (its deadline, without waiting 30 s)
    code.check_pending()
    assert answers == [(False, "Timed out waiting for idle state.")]
    assert state.counts["flush_count"] == 0 and state.requests.waiting == 2


def test_the_engines_rules_are_sglangs(make):
    state = SglangState(VERSIONS["0.5.23"])
    code = make(state)
    files = {f.__code__.co_filename for f in code.view._compiled.values()}
    assert files == {code.source} and code.source.endswith("sglang/srt/managers/scheduler.py")
    wrapper_file = type(code.wrapper).handle.__code__.co_filename
    assert wrapper_file.endswith("scheduler_components/flush_wrapper.py"), wrapper_file
    state.start_requests(1)
    assert code.flush(5.0, lambda ok, msg: None) is None
    assert code.flush(5.0, lambda ok, msg: None) == (
        False, "Another flush_cache is already in progress.")

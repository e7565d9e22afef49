"""A warm parent for engine processes in tests (issue 24): ``python -m slotsync.engine``
forked from one process that has imported torch and vLLM once, instead of an interpreter
that imports them anew for every engine (vLLM's imports alone take ~15 s of CPU).

A :class:`Zygote` is a subprocess (``python -m slotsync.testing.zygote``) that imports
:data:`PRELOAD` and then, for each request on its Unix socket, forks a child that runs a
module as ``python -m`` would (``runpy``), with the request's argv, environment and log file;
the child's pid comes back at once and its exit status when it exits. The caller holds a
:class:`ForkedProcess`, which answers as much of ``subprocess.Popen`` as the engine launcher
uses (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``, ``returncode``).

Lifetimes: the zygote dies with the process that started it (``PR_SET_PDEATHSIG``) or when
that process closes its control connection (:meth:`Zygote.close`); each child dies with the
zygote the same way. So nothing outlives the test process.

Only tests use it (``slotsync.engine.launcher.use_zygote``, set by ``tests/conftest.py``): a
demo's engines must be its own children, to die with it.

A second kind, ``Zygote(kind="daemon")``, imports only :data:`PRELOAD_DAEMON` (what
``python -m slotsync.daemon`` imports; never torch) and forks the tests' daemons
(``slotsync.testing.processes.use_daemon_zygote``): a daemon then starts without its ~0.5 s
of imports, a few hundred times a run.
"""

from __future__ import annotations

import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO

PRELOAD = (
    "torch", "safetensors.torch", "aiohttp.web", "msgspec", "uvloop",
    "slotsync.engine.reference.server", "slotsync.engine.reference.worker", "slotsync.engine.pool",
    "slotsync.engine.vllm.worker", "slotsync.engine.sglang.server",
    "slotsync.engine.sglang.worker", "slotsync.engine.sglang.payload",
)
"""Imported by the zygote before it forks anything: what every engine and its workers
import."""
PRELOAD_VLLM = (
    "vllm.entrypoints.rl.online.api_router", "vllm.entrypoints.serve.dev.sleep.api_router",
    "vllm.entrypoints.serve.exception_handling.register", "vllm.entrypoints.launchers.launcher",
    "vllm.distributed.weight_transfer.ipc_engine", "vllm.v1.worker.gpu_worker",
    "vllm.config", "vllm.config.weight_transfer", "slotsync.engine.vllm.model",
    "slotsync.engine.vllm.server",
)
"""Also imported where vLLM is importable: what the vLLM-code engine imports."""
PRELOAD_SGLANG = ("pydantic", "sglang.srt.utils.msgspec_utils", "sglang.srt.utils.auth",
                  "sglang.srt.utils.common", "sglang.srt.utils.patch_torch",
                  "sglang.srt.weight_sync.tensor_bucket")
"""Also imported where SGLang is importable: what the SGLang-code engine imports
(``slotsync.engine.__main__.SGLANG_FRONT_IMPORTS``; ~0.2 s after vLLM's imports, which
already load transformers). The environment variables SGLang's import sets (cache folders)
stay in the zygote: each child gets its request's environment."""
PRELOAD_DAEMON = ("slotsync.daemon.main",)
"""What a ``kind="daemon"`` zygote imports: the daemon's own modules (no torch, no engine:
the daemon's import contracts hold in its children too)."""
KINDS = ("engine", "daemon")


class ZygoteError(RuntimeError):
    """The zygote did not start, or did not answer a request."""


class ForkedProcess:
    """A child of the zygote, seen like ``subprocess.Popen``.

    Attributes:
        pid: the child's pid.
        args: the argv it was asked to run.
        returncode: None while it runs; its exit status once :meth:`poll` or :meth:`wait`
            saw it exit (``-N`` for a death by signal ``N``, as ``Popen``).
        stdout: a file its starter reads the child's stdout from (``Popen``'s
            ``stdout=PIPE``), where the starter set one; else None.
    """

    def __init__(self, conn: socket.socket, pid: int, args: list[str]) -> None:
        self._conn = conn
        self._buf = b""
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.stdout: IO[str] | None = None

    def _read(self, timeout_s: float | None) -> None:
        self._conn.settimeout(timeout_s)
        try:
            while b"\n" not in self._buf:
                data = self._conn.recv(4096)
                if not data:  # the zygote is gone, and so is the child (PDEATHSIG)
                    self.returncode = -signal.SIGTERM
                    break
                self._buf += data
        except (TimeoutError, BlockingIOError):
            return
        if b"\n" in self._buf:
            self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["returncode"])
        self._conn.close()

    def poll(self) -> int | None:
        """The exit status, or None while the child runs."""
        if self.returncode is None:
            self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the child to exit (``timeout`` seconds at most) and return its status.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child unless it has been seen to exit."""
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The warm parent: started by :meth:`start` (or lazily by the first :meth:`spawn`), or,
    with ``attach``, another process's zygote reached at that socket path (several pytest-xdist
    workers share the controller's: its imports are paid once per run).

    Args:
        startup_timeout_s: bound on its imports, seconds.
        attach: the socket path of a zygote another process started (and will stop).
        kind: ``"engine"`` (torch, vLLM and SGLang preloaded: :data:`PRELOAD`) or
            ``"daemon"`` (the daemon's modules only: :data:`PRELOAD_DAEMON`).
    """

    def __init__(self, startup_timeout_s: float = 300.0, attach: str | None = None,
                 kind: str = "engine") -> None:
        if kind not in KINDS:
            raise ValueError(f"zygote kind {kind!r}: use one of {KINDS}")
        self.kind = kind
        self.startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._control: socket.socket | None = None
        self._attach = attach

    @property
    def path(self) -> str:
        if self._attach is not None:
            return self._attach
        assert self._dir is not None
        return os.path.join(self._dir, "zygote.sock")

    def start(self) -> str:
        """Start the zygote without waiting for its imports; returns its socket path, which
        appears once it accepts (:meth:`spawn` waits for it). Idempotent."""
        from slotsync.testing.processes import die_with_parent

        if self._attach is not None:
            return self._attach
        if self._proc is not None and self._proc.poll() is None:
            return self.path
        self._dir = tempfile.mkdtemp(prefix="slotsync-zygote-")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "slotsync.testing.zygote", self.path, self.kind],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self._dir, "zygote.log"), "wb"),  # noqa: SIM115
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=die_with_parent)
        return self.path

    def _wait_ready(self) -> None:
        """Wait for the socket (the zygote's imports done); own zygote: hold its control
        connection, whose close stops it."""
        deadline = time.monotonic() + self.startup_timeout_s
        while not os.path.exists(self.path):
            gone = self._proc is not None and self._proc.poll() is not None
            if gone or time.monotonic() > deadline:
                log = ""
                if self._dir is not None:
                    log = Path(self._dir, "zygote.log").read_text(errors="replace")[-3000:]
                self.close()
                raise ZygoteError(f"the engine zygote at {self.path} did not start:\n{log}")
            time.sleep(0.05)
        if self._attach is None and self._control is None:
            self._control = socket.socket(socket.AF_UNIX)
            self._control.connect(self.path)
            self._control.sendall(b'{"control": true}\n')

    def _start(self) -> None:
        self.start()
        self._wait_ready()

    def spawn(self, argv: Sequence[str], env: dict[str, str], log_path: str | os.PathLike[str],
              stdout_fd: int | None = None, cwd: str | None = None) -> ForkedProcess:
        """Fork a child running ``argv`` (``[python, "-m", module, *args]``) with environment
        ``env`` and stdout / stderr appended to ``log_path``; ``stdout_fd``: a file descriptor
        of this process (e.g. a pipe's write end) that becomes the child's stdout instead
        (passed over the socket, ``SCM_RIGHTS``; the caller closes its own copy); ``cwd``: the
        child's working folder (default: the zygote's, which is its starter's).

        Raises:
            ValueError: ``argv`` is not a ``python -m module`` command line.
            ZygoteError: the zygote did not start or answer.
        """
        argv = list(argv)
        if len(argv) < 3 or argv[1] != "-m":
            raise ValueError(f"the zygote runs 'python -m module ...' command lines, not {argv}")
        if self._attach is None and (self._proc is None or self._proc.poll() is not None):
            self.start()
        self._wait_ready()
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(self.path)
        request = json.dumps({"module": argv[2], "argv": argv[3:], "env": env,
                              "log": str(log_path), "cwd": cwd}).encode() + b"\n"
        if stdout_fd is None:
            conn.sendall(request)
        else:  # the fd rides on the request's first bytes
            sent = socket.send_fds(conn, [request], [stdout_fd])
            conn.sendall(request[sent:])
        conn.settimeout(30.0)
        buf = b""
        while b"\n" not in buf:
            data = conn.recv(4096)
            if not data:
                raise ZygoteError("the engine zygote closed the connection before forking")
            buf += data
        line, rest = buf.split(b"\n", 1)
        child = ForkedProcess(conn, int(json.loads(line)["pid"]), argv)
        child._buf = rest
        return child

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None,
            timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
        """``subprocess.run(argv, capture_output=True, text=True)`` for a ``python -m module``
        command line, the process forked from this zygote (a command-line tool that imports
        torch or vLLM starts without paying those imports again). Runs in this process's
        working folder, with ``env`` (default: this process's environment).

        Raises:
            subprocess.TimeoutExpired: it ran longer than ``timeout_s`` (it is killed).
            ValueError, ZygoteError: as :meth:`spawn`.
        """
        with tempfile.TemporaryDirectory(prefix="slotsync-zygote-run-") as tmp:
            out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            fd = os.open(out_path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                child = self.spawn(argv, dict(os.environ if env is None else env), err_path,
                                   stdout_fd=fd, cwd=os.getcwd())
            finally:
                os.close(fd)
            try:
                code = child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
                raise
            return subprocess.CompletedProcess(
                list(argv), code, Path(out_path).read_text(errors="replace"),
                Path(err_path).read_text(errors="replace"))

    def close(self) -> None:
        """Stop the zygote (its children get SIGTERM) and remove its folder; an attached one
        is left to its owner. Idempotent."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc.stderr is not None:
                self._proc.stderr.close()
            self._proc = None
        if self._dir is not None:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


# ------------------------------------------------------------------------------ the zygote


def _child(request: dict, listener: socket.socket, conns: list[socket.socket],
           fds: list[int], others: list[int]) -> None:
    """In the forked child: become ``python -m module argv`` and exit with its status
    (``fds``: the request's passed descriptors, ``[stdout]`` or none; ``others``: those of
    other requests not yet served, closed here: a pipe's reader must see EOF when its own
    child exits)."""
    import runpy

    from slotsync.testing.processes import die_with_parent

    code = 1
    try:
        die_with_parent()  # (the zygote)
        listener.close()
        for c in conns:
            c.close()
        for f in others:
            os.close(f)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        if fds:  # the caller's own stdout (a pipe it reads)
            os.dup2(fds[0], 1)
            for f in fds:
                os.close(f)
        if request.get("cwd"):
            os.chdir(request["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # (TMPDIR may differ)
        sys.argv = [request["module"], *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
        except BaseException:  # noqa: BLE001 - what python -m prints and exits 1 for
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _preload(kind: str) -> None:
    """Import what children of a ``kind`` zygote import (:data:`PRELOAD`, or
    :data:`PRELOAD_DAEMON`)."""
    if kind == "daemon":
        for module in PRELOAD_DAEMON:
            importlib.import_module(module)
        return
    for module in PRELOAD:
        importlib.import_module(module)
    try:
        importlib.import_module("vllm")
    except ImportError:
        pass
    else:
        for module in PRELOAD_VLLM:
            importlib.import_module(module)
    try:
        importlib.import_module("sglang")
    except Exception:  # noqa: BLE001 - not installed, or failing to initialise: not preloaded
        pass
    else:
        for module in PRELOAD_SGLANG:
            importlib.import_module(module)


def serve(path: str, kind: str = "engine") -> None:
    """The zygote's loop: import what ``kind`` preloads, listen on ``path``, fork per request,
    report each child's exit on its request's connection; exit when the control connection
    closes."""
    from slotsync.testing.processes import die_with_parent

    die_with_parent()
    _preload(kind)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the path appears once it accepts
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    conns: list[socket.socket] = []
    control: socket.socket | None = None
    pending: dict[socket.socket, bytes] = {}
    passed: dict[socket.socket, list[int]] = {}  # descriptors a request brought
    while True:
        for key, _ in sel.select(timeout=0.05):
            sock = key.fileobj
            if sock is listener:
                c, _ = listener.accept()
                conns.append(c)
                pending[c] = b""
                sel.register(c, selectors.EVENT_READ)
                continue
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
            if fds:
                passed.setdefault(sock, []).extend(fds)
            if not data:
                sel.unregister(sock)
                conns.remove(sock)
                pending.pop(sock, None)
                for f in passed.pop(sock, []):
                    os.close(f)
                if sock is control:
                    return  # the owner is done: exit; the children follow (PDEATHSIG)
                continue
            if sock not in pending:
                continue
            pending[sock] += data
            if b"\n" not in pending[sock]:
                continue
            request = json.loads(pending.pop(sock).split(b"\n", 1)[0])
            if request.get("control"):
                control = sock
                continue
            sel.unregister(sock)
            fds = passed.pop(sock, [])
            pid = os.fork()
            if pid == 0:
                _child(request, listener, conns, fds,
                       [f for fs in passed.values() for f in fs])
            for f in fds:  # (the child has them now)
                os.close(f)
            children[pid] = sock
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock = children.pop(pid, None)
            if sock is None:
                continue
            try:
                sock.sendall(json.dumps(
                    {"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            sock.close()
            conns.remove(sock)


if __name__ == "__main__":
    serve(sys.argv[1], *sys.argv[2:3])

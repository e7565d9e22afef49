"""End-of-run leak check (issue 24 C): a test run leaves nothing behind in the temp folder,
``/dev/shm``, the process table or the network namespaces, and the run fails naming what it
left.

Loaded by ``conftest.py`` (``pytest_plugins``). In the process that runs the session (the
xdist controller, or pytest itself without ``-n``):

* at start: every process of the run is marked by an environment variable,
  ``SLOTSYNC_TEST_RUN=<token>``, which all it starts inherit (rank processes, engines,
  daemons, their workers, xdist's workers); the temp folder is redirected (``TMPDIR`` and
  ``tempfile.tempdir``) to a fresh ``<tmp>/sst-<token>/``, and ``/dev/shm`` is
  listed;
* at the end, after xdist's workers are down: network namespaces named for the run
  (``sst-<token>-*``, ``tests/netns.py``'s "nodes", with what still ran in them),
  processes still carrying the token (waited for
  up to :data:`GRACE_S` seconds, then killed), anything in the run's temp folder but
  :data:`OWN_ENTRIES`, our ``/dev/shm`` entries (:data:`SHM_PREFIX`) made during the run
  that no process outside the run holds open or mapped, and the folders made during the run
  in the daemons' own ``/dev/shm/slotsyncd-<uid>/`` (:data:`DAEMON_SHM`: a daemon's default
  ``adapter_dir``, which tests replace with a folder of their own) but those of a live daemon
  outside the run (:func:`_live_daemon_keys`) are each named, removed, and fail the run
  (exit status 1). The run's temp folder is then removed.

``SLOTSYNC_LEAK_CHECK=0`` turns the check off (e.g. when stopping a run by hand).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

RUN_ENV = "SLOTSYNC_TEST_RUN"
GRACE_S = float(os.environ.get("SLOTSYNC_LEAK_GRACE_S", "20"))
"""How long processes of the run may take to exit after the last test, seconds."""
SHM_DIR = Path("/dev/shm")
NETNS_DIR = Path("/run/netns")  # where `ip netns add NAME` keeps a namespace
NETNS_PREFIX = "sst-"  # the run's namespaces: sst-<token>-... (tests/netns.py)
SHM_PREFIX = "slotsync-"  # what the run's processes name their /dev/shm segments
DAEMON_SHM = SHM_DIR / f"slotsyncd-{os.geteuid()}"
"""The daemons' private folder of this uid, holding each one's default ``adapter_dir``
(``adapters-<key>``; ``slotsync/daemon/service/adapter_root.py``)."""
BASETEMP = "pt"  # pytest's --basetemp, in the run's folder (unless given)
OWN_ENTRIES = (BASETEMP, "pytest-of-", "torchinductor_")
"""Temp-folder entries that are not leaks: pytest's ``tmp_path`` folders and the compile
cache torch makes when vLLM is imported; removed with the run's folder."""

_state: dict = {}


def _enabled(config: pytest.Config) -> bool:
    if os.environ.get("SLOTSYNC_LEAK_CHECK", "1") in ("0", ""):
        return False
    if hasattr(config, "workerinput"):  # an xdist worker: the controller checks
        return False
    return not config.option.collectonly


def pytest_configure(config: pytest.Config) -> None:
    if not _enabled(config) or RUN_ENV in os.environ:
        return  # (a nested pytest run inside a test is checked by the outer run)
    import multiprocessing.util

    # multiprocessing's own temp folder for this process stays where it was: it removes it
    # at exit, after this check (pymp-*)
    multiprocessing.util.get_temp_dir()
    token = secrets.token_hex(4)
    root = Path(tempfile.gettempdir()) / f"sst-{token}"  # (short: Unix socket paths)
    root.mkdir()
    _state.update(token=token, root=root, shm=_shm_names(), old_tmpdir=os.environ.get("TMPDIR"),
                  daemon=_daemon_folders())
    if not config.option.basetemp:  # tmp_path under it, short: Unix socket paths in tests
        config.option.basetemp = str(root / BASETEMP)
    os.environ[RUN_ENV] = token
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = str(root)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _state:
        return
    leaks = _leaked_namespaces(_state["token"])
    leaks += _leaked_processes(_state["token"])
    leaks += _leaked_files(_state["root"])
    leaks += _leaked_shm(_state["shm"], _state["token"])
    leaks += _leaked_daemon_folders(_state["daemon"], _state["token"])
    shutil.rmtree(_state["root"], ignore_errors=True)
    tempfile.tempdir = None
    if _state["old_tmpdir"] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = _state["old_tmpdir"]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.line("")  # (after pytest's progress dots, which end no line)
    if leaks:
        if reporter is not None:
            reporter.write_sep("=", "leak check: the run left these behind (now removed)",
                               red=True)
            for line in leaks:
                reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif reporter is not None:
        reporter.write_line("leak check: nothing left in the temp folder, /dev/shm, the "
                            "process table or the network namespaces")


# ------------------------------------------------------------------------------ readers


def _pids_of_run(token: str) -> list[tuple[int, str]]:
    """``(pid, command line)`` of every live process but this one whose environment carries
    the run's token."""
    want = f"{RUN_ENV}={token}".encode()
    me = os.getpid()
    mine = _own_helpers()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me or int(name) in mine:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if want not in env:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie: exited, its parent has not reaped it yet
        except OSError:
            continue
        out.append((int(name), cmd))
    return out


def _own_helpers() -> set[int]:
    """This process's multiprocessing resource tracker, which lives as long as it does."""
    from multiprocessing import resource_tracker

    pid = getattr(resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


def _leaked_processes(token: str) -> list[str]:
    """Processes of the run still alive :data:`GRACE_S` after the end, named, then
    SIGKILLed."""
    deadline = time.monotonic() + GRACE_S
    left = _pids_of_run(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _pids_of_run(token)
    lines = []
    for pid, cmd in left:
        lines.append(f"process {pid} still running {GRACE_S:.0f} s after the run: {cmd[:200]}")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return lines


def namespaces_of(token: str) -> list[str]:
    """The network namespaces (``ip netns``) of the run: names starting ``sst-<token>-``."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(f"{NETNS_PREFIX}{token}-"))


def remove_namespace(name: str, grace_s: float = 3.0) -> list[tuple[int, str]]:
    """SIGKILL every process in network namespace ``name`` (never this one), wait up to
    ``grace_s`` seconds for them to go, then delete it (``ip netns del``: its interfaces go
    with it). Returns ``(pid, command line)`` of the processes found. Errors are swallowed:
    this runs at cleanup."""
    found = []
    for pid in _pids_in_namespace(name):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
        found.append((pid, cmd))
    deadline = time.monotonic() + grace_s
    while found and _pids_in_namespace(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
    return found


def _pids_in_namespace(name: str) -> list[int]:
    try:
        r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True,
                           check=False, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _leaked_namespaces(token: str) -> list[str]:
    """Network namespaces of the run still there at the end, named (with the processes
    that ran in them), then removed."""
    lines = []
    for name in namespaces_of(token):
        procs = remove_namespace(name)
        held = "; ".join(f"{pid} {cmd[:120]}" for pid, cmd in procs)
        lines.append(f"network namespace {name}" + (f" (processes killed: {held})"
                                                     if held else ""))
    return lines


def _leaked_files(root: Path) -> list[str]:
    """Entries of the run's temp folder but :data:`OWN_ENTRIES`."""
    try:
        entries = sorted(p for p in root.iterdir()
                         if p.name != BASETEMP and not p.name.startswith(OWN_ENTRIES[1:]))
    except FileNotFoundError:
        return []
    return [f"temp folder: {p.name}{'/' if p.is_dir() else ''} (in {root.parent})"
            for p in entries]


def _shm_names() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _held_outside_run(names: set[str], token: str) -> set[str]:
    """Those of ``names`` (``/dev/shm`` entries) that a live process outside the run holds
    open or mapped (another test run, or anything else on the machine)."""
    want = f"{RUN_ENV}={token}".encode()
    held: set[str] = set()
    paths = {str(SHM_DIR / n): n for n in names}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    continue
            targets = []
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as f:
                targets += [line.split(None, 5)[-1].strip() for line in f if "/dev/shm/" in line]
        except OSError:
            continue
        for t in targets:
            t = t.removesuffix(" (deleted)")
            if t in paths:
                held.add(paths[t])
    return held


def _leaked_shm(before: set[str], token: str) -> list[str]:
    """Our ``/dev/shm`` entries (``slotsync-*``: the publishers' segments) made during the
    run and held by no process outside it, named, then unlinked.

    Only ours: other entries (multiprocessing's ``sem.mp-*`` semaphores, torch's segments)
    cannot be told apart from another program's, whose live ones glibc maps under another
    name (``sem.XXXXXX (deleted)``); removing them broke a test run beside this one (issue
    24's fresh-user trial)."""
    new = {n for n in _shm_names() - before if n.startswith(SHM_PREFIX)}
    if not new:
        return []
    new -= _held_outside_run(new, token)
    lines = []
    for name in sorted(new):
        lines.append(f"/dev/shm/{name}")
        try:
            (SHM_DIR / name).unlink()
        except OSError:
            pass
    return lines


def _daemon_folders() -> set[str] | None:
    """The entries of :data:`DAEMON_SHM`; None when it is not there."""
    try:
        return set(os.listdir(DAEMON_SHM))
    except OSError:
        return None


def _endpoint_key(endpoint: str) -> str:
    """``adapters-<key>``'s key of a daemon's endpoint (``adapter_root.endpoint_key``; not
    imported: this plugin runs before the package may be importable)."""
    return hashlib.sha256(endpoint.encode()).hexdigest()[:12]


def _sockets_outside_run(token: str) -> set[str]:
    """The inodes (``socket:[N]``) of the sockets that live processes outside the run (not
    carrying its token, not this one) hold."""
    want = f"{RUN_ENV}={token}".encode()
    me, out = str(os.getpid()), set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    continue
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                t = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if t.startswith("socket:["):
                out.add(t[8:-1])
    return out


def _live_daemon_keys(token: str) -> set[str]:
    """The ``adapters-<key>`` keys of daemons alive outside the run: every endpoint that a
    process outside it is bound to -- a Unix socket's path (``ipc://PATH``, from
    ``/proc/net/unix``) or a listening TCP port (``tcp://HOST:PORT`` for the usual spellings
    of HOST, from ``/proc/net/tcp``/``tcp6``). Another run's daemon, or a real one on this
    machine, may make its default ``adapter_dir`` while this run goes on: it is not this
    run's to remove (the fresh-user trial of issue 36 found a live daemon's folder gone)."""
    held = _sockets_outside_run(token)
    endpoints: set[str] = set()
    try:
        with open("/proc/net/unix") as f:
            for line in list(f)[1:]:
                cols = line.split()
                if len(cols) >= 8 and cols[6] in held:
                    endpoints.add(f"ipc://{cols[7]}")
    except OSError:
        pass
    hosts = {"*", "0.0.0.0", "127.0.0.1", "localhost", "[::]", "[::1]", "::", "::1",
             socket.gethostname(), socket.getfqdn()}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in list(f)[1:]]
        except OSError:
            continue
        for cols in rows:
            if len(cols) >= 10 and cols[3] == "0A" and cols[9] in held:  # (LISTEN)
                port = int(cols[1].rsplit(":", 1)[1], 16)
                endpoints |= {f"tcp://{h}:{port}" for h in hosts}
    return {_endpoint_key(e) for e in endpoints}


def _leaked_daemon_folders(before: set[str] | None, token: str = "") -> list[str]:
    """The folders made in :data:`DAEMON_SHM` during the run (a daemon started with its
    default ``adapter_dir`` and left what it wrote there) but those of a live daemon outside
    the run (:func:`_live_daemon_keys`), named, then removed; and :data:`DAEMON_SHM` itself
    only when the run made it and it is empty (another daemon's folder in it keeps it)."""
    now = _daemon_folders()
    if now is None:
        return []
    new = sorted(now - (before or set()))
    live = _live_daemon_keys(token) if new else set()
    lines = []
    for name in new:
        if name.startswith("adapters-") and name[len("adapters-"):] in live:
            continue  # (a live daemon's own, made while this run went on)
        lines.append(f"{DAEMON_SHM / name} (a daemon's default adapter_dir: give the test's "
                     "daemon an adapter_dir of its own)")
        shutil.rmtree(DAEMON_SHM / name, ignore_errors=True)
    if before is None:
        try:
            DAEMON_SHM.rmdir()  # (only when empty)
        except OSError:
            pass
    return lines

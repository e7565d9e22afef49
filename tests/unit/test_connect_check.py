"""check_endpoint: the true reason a rank cannot reach slotsyncd, within the timeout (issue 15 C).

The permission tests need a uid that the folders and socket refuse. Run as a normal user,
they chmod their own files; run as root (who can open anything, and whom check_endpoint
therefore does not check), they run the check in a subprocess that drops to ``nobody``.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest
import zmq

from slotsync.protocol.errors import SlotsyncError
from slotsync.protocol.rank.connect_check import check_endpoint

BOUND_S = 5.0  # "well within 1 s", loosely: the machine running the tests may be loaded
ROOT = os.geteuid() == 0
as_root_only = pytest.mark.skipif(not ROOT, reason="needs root (chown to another user)")


def timed_check(endpoint: str, **kw) -> SlotsyncError | None:
    """check_endpoint's error (or None), asserting it came back within BOUND_S."""
    t0 = time.monotonic()
    try:
        check_endpoint(endpoint, **kw)
        err = None
    except SlotsyncError as e:
        err = e
    assert time.monotonic() - t0 < BOUND_S
    return err


def _name(table, i: int) -> str:
    try:
        return table(i)[0]
    except KeyError:
        return str(i)


def owner_group(p: str) -> str:
    st = os.stat(p)
    return f"{_name(pwd.getpwuid, st.st_uid)}:{_name(grp.getgrgid, st.st_gid)}"


_AS_NOBODY = r"""
import json, os, sys, time
from slotsync.protocol.rank.connect_check import check_endpoint
from slotsync.protocol.errors import SlotsyncError
uid, gid = int(sys.argv[2]), int(sys.argv[3])
try:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
except OSError as e:
    print(json.dumps({"cannot_drop": str(e)}))
    sys.exit(0)
t0 = time.monotonic()
try:
    check_endpoint(sys.argv[1])
    out = {"ok": True}
except SlotsyncError as e:
    out = {"code": e.code, "phase": e.phase, "message": e.message}
out["elapsed"] = time.monotonic() - t0
print(json.dumps(out))
"""


def check_as_refused_user(endpoint: str) -> dict:
    """Run check_endpoint as a uid the test's chmods refuse: this one, or ``nobody`` when root.

    Returns ``{"ok": True}`` or ``{"code", "phase", "message"}``.
    """
    if not ROOT:
        err = timed_check(endpoint)
        return {"ok": True} if err is None else \
            {"code": err.code, "phase": err.phase, "message": err.message}
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("running as root and there is no user 'nobody' to drop to")
    r = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, endpoint, str(nobody.pw_uid), str(nobody.pw_gid)],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "cannot_drop" in out:
        pytest.skip(f"running as root and cannot drop to nobody: {out['cannot_drop']}")
    assert out.pop("elapsed") < BOUND_S
    return out


@pytest.fixture
def open_dir():
    """A folder every user can reach (pytest's tmp_path may sit below a 0700 folder)."""
    d = tempfile.mkdtemp(prefix="slotsync-cc-")
    os.chmod(d, 0o755)
    probe = d
    while probe != os.path.dirname(probe):
        if not os.stat(probe).st_mode & stat.S_IXOTH:
            shutil.rmtree(d)
            pytest.skip(f"{probe} is not searchable by other users")
        probe = os.path.dirname(probe)
    yield d
    for root, dirs, _files in os.walk(d):  # undo the tests' chmod 000 before removing
        for x in dirs:
            os.chmod(os.path.join(root, x), 0o700)
    os.chmod(d, 0o700)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def listeners():
    socks: list[socket.socket] = []

    def listen(path: str, backlog: int = 8) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        socks.append(s)
        s.bind(path)
        s.listen(backlog)
        return s

    yield listen
    for s in socks:
        s.close()


def test_missing_socket(tmp_path):
    path = tmp_path / "slotsyncd.sock"
    err = timed_check(f"ipc://{path}")
    assert err is not None and err.code == "no_socket" and err.phase == "connect"
    assert err.message.startswith(f"no socket at {path}: is slotsyncd running?")
    assert "`slotsync status`" in err.message
    assert f"runtime dir is {tmp_path}" in err.message
    assert "does not exist" not in err.message  # the folder is there


def test_missing_folder_names_the_first_missing_component(tmp_path):
    path = tmp_path / "run" / "slotsync" / "slotsyncd.sock"
    err = timed_check(f"ipc://{path}")
    assert err is not None and err.code == "no_socket"
    assert err.message.startswith(f"no socket at {path}: is slotsyncd running?")
    assert f"folder {tmp_path / 'run'} does not exist" in err.message


def test_a_file_where_a_folder_should_be(tmp_path):
    (tmp_path / "run").write_text("")
    err = timed_check(f"ipc://{tmp_path / 'run' / 'slotsyncd.sock'}")
    assert err is not None and err.code == "no_socket"
    assert f"{tmp_path / 'run'} is a regular file, not a folder" in err.message


def test_stale_socket_nothing_listens(tmp_path):
    path = tmp_path / "slotsyncd.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))  # what a SIGKILLed daemon leaves: the file, with no listener
    s.close()
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    err = timed_check(f"ipc://{path}")
    assert err is not None and err.code == "not_listening"
    assert err.message.startswith(
        f"socket {path} exists but nothing listens on it: slotsyncd is not running")
    assert "start slotsyncd, it removes the stale file" in err.message


def test_regular_file_at_the_path(tmp_path):
    path = tmp_path / "slotsyncd.sock"
    path.write_text("not a socket")
    err = timed_check(f"ipc://{path}")
    assert err is not None and err.code == "not_a_socket"
    assert f"{path} is a regular file, not a socket" in err.message


def test_folder_at_the_path(tmp_path):
    err = timed_check(f"ipc://{tmp_path}")
    assert err is not None and err.code == "not_a_socket"
    assert f"{tmp_path} is a folder, not a socket" in err.message
    assert str(tmp_path / "slotsyncd.sock") in err.message


def test_live_socket_passes_quickly(tmp_path, listeners):
    path = tmp_path / "slotsyncd.sock"
    srv = listeners(str(path))
    t0 = time.monotonic()
    assert check_endpoint(f"ipc://{path}", timeout_s=1.0) is None
    assert time.monotonic() - t0 < BOUND_S
    # The probe connected, sent nothing and closed.
    srv.settimeout(BOUND_S)
    conn, _ = srv.accept()
    conn.settimeout(BOUND_S)
    assert conn.recv(16) == b""
    conn.close()


def test_live_socket_with_full_backlog_passes(tmp_path, listeners):
    """A daemon too busy to accept is alive: no error (ZeroMQ's connect retries)."""
    path = str(tmp_path / "slotsyncd.sock")
    listeners(path, 0)
    clients = []
    try:
        for _ in range(64):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            clients.append(c)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                break
        else:
            pytest.skip("the listen backlog never filled")
        assert timed_check(f"ipc://{path}", timeout_s=0.5) is None
    finally:
        for c in clients:
            c.close()


def test_zeromq_daemon_socket_tolerates_the_probe(tmp_path):
    """Against a real ZeroMQ ROUTER (as slotsyncd binds): no error, and the socket still works."""
    endpoint = f"ipc://{tmp_path / 'slotsyncd.sock'}"
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        assert timed_check(endpoint) is None
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send(b"hello")
        assert router.poll(int(BOUND_S * 1000))
        assert router.recv_multipart()[-1] == b"hello"
    finally:
        ctx.destroy(linger=0)  # (closes what a failed assertion left open: term() would hang)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets: Linux")
def test_abstract_socket(listeners):
    name = f"slotsync-cc-test-{os.getpid()}-{time.monotonic_ns()}"
    err = timed_check(f"ipc://@{name}")
    assert err is not None and err.code == "not_listening"
    assert f"@{name}" in err.message and "nothing listens on it" in err.message
    listeners("\0" + name)
    assert timed_check(f"ipc://@{name}") is None


def test_path_too_long_for_a_unix_socket(tmp_path):
    path = str(tmp_path / ("x" * 120) / "slotsyncd.sock")
    err = timed_check(f"ipc://{path}")
    assert err is not None and err.code == "bad_path" and "at most 107" in err.message


def test_tcp_and_other_transports_are_not_checked():
    for endpoint in ("tcp://127.0.0.1:1", "tcp://no-such-host.invalid:5555", "inproc://x"):
        assert timed_check(endpoint) is None


def test_timeout_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="timeout_s"):
        check_endpoint(f"ipc://{tmp_path}/s", timeout_s=0)


def _denied_prefix(sock: str) -> str:
    return f"cannot open {sock} as uid "


def test_folder_mode_000_names_the_folder(open_dir, listeners):
    run = os.path.join(open_dir, "run")
    os.mkdir(run)
    sock = os.path.join(run, "slotsyncd.sock")
    listeners(sock)
    os.chmod(run, 0o000)
    out = check_as_refused_user(f"ipc://{sock}")
    assert out.get("code") == "permission", out
    msg = out["message"]
    assert msg.startswith(_denied_prefix(sock))
    assert f"its folder {run} is d--------- (0000) {owner_group(run)};" in msg
    assert "`allow_uids`" in msg
    assert "chmod g+x" in msg  # the group cannot search it either


@as_root_only
@pytest.mark.parametrize(("mode", "shown", "fix"), [
    (0o700, "drwx------ (0700)", "chmod g+x"),
    (0o770, "drwxrwx--- (0770)", "add the user to group "),
])
def test_folder_of_another_user(open_dir, listeners, mode, shown, fix):
    run = os.path.join(open_dir, "run")
    os.mkdir(run)
    sock = os.path.join(run, "slotsyncd.sock")
    listeners(sock)
    os.chmod(run, mode)  # root:root: nobody is neither the owner nor in the group
    out = check_as_refused_user(f"ipc://{sock}")
    assert out.get("code") == "permission", out
    msg = out["message"]
    assert msg.startswith(_denied_prefix(sock) + f"{pwd.getpwnam('nobody').pw_uid} (nobody)")
    assert f"its folder {run} is {shown} {owner_group(run)};" in msg
    group = owner_group(run).split(":")[1]
    assert fix + (group if fix.startswith("add") else "") in msg


def test_socket_not_writable_names_the_socket(open_dir, listeners):
    sock = os.path.join(open_dir, "slotsyncd.sock")
    listeners(sock)
    mode = 0o770 if ROOT else 0o555  # root: as the daemon leaves it; else: no w for anyone
    os.chmod(sock, mode)
    out = check_as_refused_user(f"ipc://{sock}")
    assert out.get("code") == "permission", out
    msg = out["message"]
    assert msg.startswith(_denied_prefix(sock))
    assert f": it is {stat.filemode(os.stat(sock).st_mode)} ({mode:04o}) {owner_group(sock)};" \
        in msg
    group = owner_group(sock).split(":")[1]
    assert (f"add the user to group {group}" if ROOT else "chmod g+w") in msg


def test_root_skips_permission_checks(open_dir, listeners):
    if not ROOT:
        pytest.skip("only root may open a folder of mode 000")
    run = os.path.join(open_dir, "run")
    os.mkdir(run)
    sock = os.path.join(run, "slotsyncd.sock")
    listeners(sock)
    os.chmod(sock, 0o000)
    os.chmod(run, 0o000)
    assert timed_check(f"ipc://{sock}") is None


def test_connect_eacces_gives_the_permission_message(tmp_path, listeners, monkeypatch):
    """An EACCES from connect itself (an ACL, a security module) names the socket's mode."""
    sock = str(tmp_path / "slotsyncd.sock")
    listeners(sock)

    def refuse(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    err = timed_check(f"ipc://{sock}")
    assert err is not None and err.code == "permission"
    assert err.message.startswith(_denied_prefix(sock))
    assert f"it is {stat.filemode(os.stat(sock).st_mode)}" in err.message

"""Who may talk to the daemon: peer uid/gid checked through ZAP (SO_PEERCRED), the socket's
directory permissions, loopback status server, a Unix-socket engine URL."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from slotsync.daemon.launcher import DaemonProcess
from slotsync.daemon.service.config import Config
from slotsync.daemon.service.peer_auth import decide, parse_peer

NOBODY = 65534

CLIENT = textwrap.dedent("""
    import os, sys, zmq
    from slotsync.protocol import wire
    # everything that reads files happens before dropping to the other user
    frame = wire.encode(wire.Register(wire.PROTOCOL_VERSION, 0, wire.logical_gpu_uuid(0), 0, 1,
                                      "http://127.0.0.1:1", True, "shm"))
    ctx = zmq.Context(); s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
    os.setgroups([]); os.setgid({gid}); os.setuid({uid})
    s.connect(sys.argv[1])
    s.send(frame)
    if s.poll(3000):
        print(type(wire.decode_from_daemon(s.recv())).__name__)
    else:
        print("no reply")
""")


def test_decide_unit():
    assert parse_peer("localhost:1000:1000:42") == (1000, 1000, 42)
    assert parse_peer("127.0.0.1:5555") is None
    assert decide("localhost:1000:50:42", {1000}, set())[0]
    assert decide("localhost:7:50:42", {1000}, {50})[0]  # by group
    ok, why = decide("localhost:7:8:42", {1000}, {50})
    assert not ok and "uid 7 gid 8 pid 42 is not allowed" in why
    assert not decide("127.0.0.1:5555", {0}, {0})[0]  # no credentials: refused


def test_default_allow_list_is_own_uid_gid_and_root():
    uids, gids = Config().allowed_ids()
    assert uids == {os.getuid(), 0} and gids == {os.getgid()}
    uids, gids = Config(allow_uids="1000, 1001", allow_gids="50").allowed_ids()
    assert uids == {1000, 1001, 0} and gids == {50}


@pytest.fixture
def open_dir():
    """A folder every user can reach (pytest's tmp_path parents are 0700)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="slotsync-sec-", dir="/tmp")
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run_as(uid: int, gid: int, endpoint: str) -> str:
    code = CLIENT.format(uid=uid, gid=gid)
    out = subprocess.run([sys.executable, "-c", code, endpoint], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_process_of_another_user_is_refused_and_logged(open_dir):
    # the other user can reach the socket file: this tests the ZAP check, not the filesystem
    with DaemonProcess(runtime_dir=open_dir) as d:
        sock = d.endpoint[len("ipc://"):]
        os.chmod(sock, 0o777)
        assert _run_as(NOBODY, NOBODY, d.endpoint) == "no reply"
        assert "peer_refused" in d.log_tail() and f"uid {NOBODY}" in d.log_tail()
        assert d.status()["ranks_connected"] == 0
        assert _run_as(0, 0, d.endpoint) == "Registered"  # the daemon's own user gets in


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_allow_list_admits_a_configured_group(open_dir):
    with DaemonProcess(runtime_dir=open_dir, args=["--allow-gids", str(NOBODY)]) as d:
        os.chmod(d.endpoint[len("ipc://"):], 0o777)
        assert _run_as(NOBODY, NOBODY, d.endpoint) == "Registered"


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_socket_directory_is_closed_to_others(open_dir):
    from pathlib import Path

    rt = Path(open_dir) / "rt"
    with DaemonProcess(runtime_dir=str(rt)) as d:
        mode = stat.S_IMODE(os.stat(rt).st_mode)
        assert mode & 0o007 == 0, oct(mode)  # no access for "other"
        sock_mode = stat.S_IMODE(os.stat(d.endpoint[len("ipc://"):]).st_mode)
        assert sock_mode == 0o770, oct(sock_mode)  # the group (trainer ranks) may connect
        assert _run_as(NOBODY, NOBODY, d.endpoint) == "no reply"


def test_status_server_binds_loopback_by_default():
    assert Config().status_host == "127.0.0.1"


@pytest.fixture
def uds_engine(tmp_path):
    """A reference engine (2 cpu workers) serving on a Unix socket, like `vllm serve --uds`."""
    pytest.importorskip("torch")
    import time

    path = str(tmp_path / "engine.sock")
    log = open(tmp_path / "engine.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "slotsync.engine", "--workers", "2",
                             "--uds", path], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while b"serving unix://" not in (tmp_path / "engine.log").read_bytes():
        assert proc.poll() is None and time.monotonic() < deadline, \
            (tmp_path / "engine.log").read_text()
        time.sleep(0.2)
    yield f"unix://{path}"
    proc.terminate()
    proc.wait(20)
    log.close()


@pytest.mark.slow
def test_engine_behind_a_unix_socket(uds_engine):
    import asyncio

    from spawned_ranks import rounds, run_ranks

    from slotsync.daemon.vllm.client import VllmClient

    async def world_size():
        c = VllmClient(uds_engine, timeout_s=10)
        try:
            return await c.call("get_world_size")
        finally:
            await c.close()

    assert asyncio.run(world_size())["world_size"] == 2  # (+ the reference's gpu_uuids)
    with DaemonProcess() as d:
        ev = run_ranks(d, uds_engine, True, [{"rounds": 2}, {"rounds": 2}])
        for r in range(2):
            assert [e["status"] for e in rounds(ev, r)] == ["ok", "ok"], ev
        assert d.status()["slots"][0]["last_version"] == "v2"


PUBLISHER_AS_OTHER_USER = textwrap.dedent("""
    import os, sys, time
    import torch  # noqa: F401  (imports read files: before dropping privileges)
    from slotsync.protocol.errors import SlotsyncError
    from slotsync.protocol.rank.publisher import Publisher
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    pub = Publisher(sys.argv[1], 0, (0, 1), "http://127.0.0.1:1", transport="shm",
                    timeout_s=30)
    t0 = time.monotonic()
    try:
        pub.register()
        print("registered")
    except SlotsyncError as e:
        print(f"{time.monotonic() - t0:.1f} {e}")
    pub.close()
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_refused_publisher_gets_a_clear_error_not_a_timeout(open_dir):
    pytest.importorskip("torch")
    with DaemonProcess(runtime_dir=open_dir) as d:
        os.chmod(d.endpoint[len("ipc://"):], 0o777)
        out = subprocess.run([sys.executable, "-c", PUBLISHER_AS_OTHER_USER, d.endpoint],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        seconds, _, text = out.stdout.strip().partition(" ")
        assert float(seconds) < 10  # told at once, not after timeout_s (30 s)
        assert "refused this process (uid 65534" in text and "allow_uids" in text

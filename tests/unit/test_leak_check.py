"""The end-of-run leak check (``tests/leak_check.py``, issue 24 C) fails a run that leaves a
file in the temp folder, a ``/dev/shm`` entry, a process or a network namespace of the run
behind, naming each, and removes them; a clean run passes. Each case is a pytest run of its
own (``pytester``)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS_DIR = Path(__file__).resolve().parents[1]

LEAKY = '''
import os, subprocess, tempfile

def test_leaves_things_behind():
    open(os.path.join(tempfile.gettempdir(), "left-behind.txt"), "w").close()
    open("/dev/shm/{shm}", "w").close()
    open("/dev/shm/{other}", "w").close()  # not ours: another program's, e.g. a semaphore
    subprocess.Popen(["sleep", "300"], start_new_session=True)
'''


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str):
    monkeypatch.delenv("SLOTSYNC_TEST_RUN", raising=False)  # an outer run's own check
    monkeypatch.setenv("SLOTSYNC_LEAK_GRACE_S", "1")
    monkeypatch.setenv("SLOTSYNC_LEAK_CHECK", "1")
    monkeypatch.setenv("PYTHONPATH", f"{TESTS_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest_subprocess("-p", "leak_check", "-p", "no:cacheprovider")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_run_that_leaves_things_behind_fails_naming_each(pytester, monkeypatch):
    shm = f"slotsync-leak-check-test-{secrets.token_hex(4)}"
    other = f"sem.leak-check-test-{secrets.token_hex(4)}"
    try:
        result = _run(pytester, monkeypatch, LEAKY.format(shm=shm, other=other))
        # another program's /dev/shm entry is neither named nor removed (the trial found a
        # run unlinking the live semaphores of a run beside it)
        assert other not in result.stdout.str()
        assert os.path.exists(f"/dev/shm/{other}")
    finally:
        for name in (shm, other):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
    out = result.stdout.str()
    assert result.ret == 1, out
    assert "leak check: the run left these behind (now removed)" in out
    assert "temp folder: left-behind.txt" in out
    assert f"/dev/shm/{shm}" in out
    assert "sleep 300" in out and "still running" in out
    assert not os.path.exists(f"/dev/shm/{shm}")  # removed


LEAKY_ADAPTERS = '''
import os

def test_leaves_a_default_adapter_dir_behind():
    os.makedirs("/dev/shm/slotsyncd-{uid}/adapters-{key}/slot-0-2/math@v1")
'''


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_daemons_default_adapter_dir_left_behind_fails_naming_it(pytester, monkeypatch):
    """A daemon started with its default ``adapter_dir`` leaves its served versions' folders
    in ``/dev/shm/slotsyncd-<uid>/`` at its stop (issue 36): a test's daemon must get a
    folder of its own, and the check names one that did not."""
    key = f"leakcheck{secrets.token_hex(4)}"
    private = Path(f"/dev/shm/slotsyncd-{os.geteuid()}")
    had = private.exists()
    try:
        result = _run(pytester, monkeypatch, LEAKY_ADAPTERS.format(uid=os.geteuid(), key=key))
    finally:
        import shutil

        shutil.rmtree(private / f"adapters-{key}", ignore_errors=True)
        if not had and private.exists() and not any(private.iterdir()):
            private.rmdir()
    out = result.stdout.str()
    assert result.ret == 1, out
    assert f"{private}/adapters-{key} (a daemon's default adapter_dir" in out, out
    assert not (private / f"adapters-{key}").exists()  # removed
    assert had or not private.exists()  # (made by the run: removed once empty)


LIVE_AND_LEAKY = '''
import os

def test_a_live_daemon_makes_its_folder_and_a_test_leaks_one():
    os.makedirs("/dev/shm/slotsyncd-{uid}/adapters-{live}/slot-0-2/math@v8")
    os.makedirs("/dev/shm/slotsyncd-{uid}/adapters-{key}/slot-0-2/math@v1")
'''

BOUND = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen()\n"
    "print('bound', flush=True); time.sleep(300)\n")


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_live_daemons_folder_made_during_the_run_is_neither_named_nor_removed(
        pytester, monkeypatch, tmp_path):
    """Another daemon, alive outside the run (here a process bound to the Unix socket of
    its endpoint), made its default ``adapter_dir`` while the run went on: the check leaves
    it and ``slotsyncd-<uid>`` alone, and still names and removes the run's own (red
    before: both removed, then ``slotsyncd-<uid>`` with them -- the fresh-user trial's live
    daemon lost its folder)."""
    from slotsync.daemon.service.adapter_root import endpoint_key

    sock = tmp_path / "d.sock"
    live = endpoint_key(f"ipc://{sock}")
    key = f"leakcheck{secrets.token_hex(4)}"
    private = Path(f"/dev/shm/slotsyncd-{os.geteuid()}")
    had = private.exists()
    daemon = subprocess.Popen([sys.executable, "-c", BOUND, str(sock)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert daemon.stdout.readline().strip() == "bound"
        result = _run(pytester, monkeypatch, LIVE_AND_LEAKY.format(
            uid=os.geteuid(), live=live, key=key))
        out = result.stdout.str()
        assert result.ret == 1, out
        assert f"{private}/adapters-{key} (a daemon's default adapter_dir" in out, out
        assert not (private / f"adapters-{key}").exists()  # the run's own: removed
        assert f"adapters-{live}" not in out, out
        assert (private / f"adapters-{live}" / "slot-0-2" / "math@v8").is_dir()  # kept
    finally:
        daemon.kill()
        daemon.wait()
        daemon.stdout.close()
        shutil.rmtree(private / f"adapters-{live}", ignore_errors=True)
        shutil.rmtree(private / f"adapters-{key}", ignore_errors=True)
        if not had and private.exists() and not any(private.iterdir()):
            private.rmdir()


def test_a_clean_run_passes_and_says_so(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "def test_nothing():\n    assert True\n")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert ("leak check: nothing left in the temp folder, /dev/shm, the process table or the "
            "network namespaces") in out


LEAKY_NETNS = '''
import os, subprocess

def test_leaves_a_network_namespace_behind():
    name = "sst-" + os.environ["SLOTSYNC_TEST_RUN"] + "-leaktest-n0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.Popen(["ip", "netns", "exec", name, "sleep", "301"], start_new_session=True)
'''


def _may_make_namespaces() -> str:
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    name = f"sst-leakprobe-{secrets.token_hex(4)}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add is not permitted here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


def test_a_network_namespace_of_the_run_left_behind_fails_naming_it(pytester, monkeypatch):
    """A namespace named for the run (``sst-<token>-...``, tests/netns.py's nodes) still
    there at the end: named with what ran in it, its processes killed, the namespace
    deleted."""
    why = _may_make_namespaces()
    if why:
        pytest.skip(why)
    result = _run(pytester, monkeypatch, LEAKY_NETNS)
    out = result.stdout.str()
    m = re.search(r"network namespace (sst-[0-9a-f]+-leaktest-n0)", out)
    if m and os.path.exists(f"/run/netns/{m.group(1)}"):  # (never left behind by this test)
        subprocess.run(["ip", "netns", "del", m.group(1)], capture_output=True)
    assert result.ret == 1, out
    assert m, out
    assert "processes killed:" in out and "sleep 301" in out, out
    assert not os.path.exists(f"/run/netns/{m.group(1)}")

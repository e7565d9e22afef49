"""A SIGKILLed demo's folder and shared memory are removed at the next demo's start, never a
live demo's (issue 24 C; ``slotsync.demo.leftovers``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from slotsync.demo import leftovers as dl


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _demo_folder(tmp_path, name: str, owner: str | None, ranks: list[int] = ()):
    folder = tmp_path / f"{dl.DEMO_FOLDER_PREFIX}{name}"
    folder.mkdir()
    (folder / "engine0.log").write_text("log")
    if owner is not None:
        (folder / dl.OWNER_FILE).write_text(owner)
    if ranks:
        dl.record_rank_pids(str(folder), list(ranks))
    return folder


def test_a_killed_demos_folder_and_its_dead_ranks_segments_are_removed(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    dead_demo, dead_rank, live_rank = _dead_pid(), _dead_pid(), os.getpid()
    for name in (f"slotsync-{dead_rank}-r0-0", f"slotsync-{dead_rank}-r0-1",
                 f"slotsync-{live_rank}-r1-0", "other-segment"):
        (shm / name).write_bytes(b"x")
    stale = _demo_folder(tmp_path, "killed", f"{dead_demo} -\n", [dead_rank, live_rank])

    assert dl.remove_stale_demo_folders(str(tmp_path), str(shm)) == [str(stale)]
    assert not stale.exists()
    # a live rank unlinks its own segments; nothing that is not the dead rank's is touched
    assert sorted(os.listdir(shm)) == ["other-segment", f"slotsync-{live_rank}-r1-0"]


def test_a_live_demos_folder_and_one_still_starting_are_kept(tmp_path):
    live = tmp_path / f"{dl.DEMO_FOLDER_PREFIX}live"
    live.mkdir()
    dl.write_owner(str(live))  # this process: alive
    starting = _demo_folder(tmp_path, "starting", None)  # no pid file yet
    garbled = _demo_folder(tmp_path, "garbled", "not a pid")
    other = tmp_path / "slotsync-test-model-x"  # not a demo's folder
    other.mkdir()
    (other / dl.OWNER_FILE).write_text(f"{_dead_pid()} -\n")

    assert dl.remove_stale_demo_folders(str(tmp_path), str(tmp_path)) == []
    assert live.is_dir() and starting.is_dir() and garbled.is_dir() and other.is_dir()
    assert dl.read_owner(str(live)) == (os.getpid(), dl.process_start_time(os.getpid()))


def test_a_reused_pid_does_not_keep_a_dead_demos_folder(tmp_path):
    """The pid file holds the demo's start time too: a live process that got the dead demo's
    pid (this one, with another start time) is not taken for the demo."""
    me = os.getpid()
    start = dl.process_start_time(me)
    if start is None:
        pytest.skip("no /proc: a reused pid cannot be told apart")
    reused = _demo_folder(tmp_path, "reused", f"{me} {start + 1}\n")
    assert dl.remove_stale_demo_folders(str(tmp_path), str(tmp_path)) == [str(reused)]
    assert dl.process_alive(me, start) and not dl.process_alive(me, start + 1)
    assert not dl.process_alive(_dead_pid()) and not dl.process_alive(0)

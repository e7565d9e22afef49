"""Why Python's ``resource_tracker`` prints "There appear to be 1 leaked shared_memory objects
to clean up at shutdown" after a SIGKILLed rank, though nothing is left in ``/dev/shm``
(issue 36, the fresh-user trial; docs/lora.md section 8): the warning *is* the cleanup.

A rank's segments (``protocol/rank/shm_segment.py``: an adapter part's, a base round's) are
made with ``multiprocessing.shared_memory.SharedMemory(create=True)``, which registers each
with the process's resource tracker (a helper process it starts; CPython 3.11
``multiprocessing/resource_tracker.py``); ``ShmSegment.close_and_unlink`` unregisters it. A
rank killed by SIGKILL unlinks nothing; its tracker sees its pipe close, warns about every
name still registered, and unlinks each (``resource_tracker.main``'s ``finally``). A segment
not registered (what silencing the warning would take: ``resource_tracker.unregister``, or
Python 3.13's ``track=False``) stays in ``/dev/shm`` after the SIGKILL, memory lost until
someone removes it by name. So slotsync keeps the registration, and the docs say what the
warning means.

Not red on main: the behaviour is unchanged; the test backs the docs' text.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

RANK = """
import sys, time
from multiprocessing import resource_tracker
from slotsync.protocol.rank.shm_segment import ShmSegment
seg = ShmSegment(4096, rank=1)
if sys.argv[1] == "untracked":
    resource_tracker.unregister("/" + seg.name, "shared_memory")
print(seg.name, flush=True)
time.sleep(600)  # (until the test's SIGKILL)
"""


@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "untracked"])
def test_a_sigkilled_ranks_segment_is_unlinked_by_the_tracker_whose_warning_that_is(
        tracked: bool) -> None:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", RANK, "tracked" if tracked else "untracked"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    path = None
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name.startswith("slotsync-"), proc.communicate(timeout=60)
        path = Path("/dev/shm", name)
        assert path.exists()
        proc.send_signal(signal.SIGKILL)
        # (returns once every holder of the pipes closed them: the rank, then its tracker)
        _, err = proc.communicate(timeout=60)
        if tracked:
            assert "leaked shared_memory objects to clean up at shutdown" in err, err
            assert not path.exists()  # the warning's cleanup: nothing is left
        else:
            assert "resource_tracker" not in err, err
            assert path.exists()  # no tracker to unlink it: the memory stays
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if path is not None:
            path.unlink(missing_ok=True)

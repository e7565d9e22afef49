"""The end-of-run leak check (``tests/leak_check.py``, issue 24 C) fails a run that leaves a
file in the temp folder, a ``/dev/shm`` entry or a process behind, naming each, and removes
them; a clean run passes. Each case is a pytest run of its own (``pytester``)."""

from __future__ import annotations

import os
import secrets
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


def test_a_clean_run_passes_and_says_so(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, "def test_nothing():\n    assert True\n")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert "leak check: nothing left in the temp folder, /dev/shm or the process table" in out

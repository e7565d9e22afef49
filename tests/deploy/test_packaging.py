"""Both installs work: the editable install in use, and a built wheel installed on its own,
also when run from the repository root (src layout: src/slotsync/{protocol,daemon,engine,bench}).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_editable_install_imports_the_src_tree():
    import slotsync.daemon.core.coordinator as c
    import slotsync.engine.reference.server as s
    import slotsync.protocol.wire as w

    assert Path(w.__file__).parent == ROOT / "src" / "slotsync" / "protocol" / "wire"
    assert Path(c.__file__).parent == ROOT / "src" / "slotsync" / "daemon" / "core"
    assert Path(s.__file__).parent == ROOT / "src" / "slotsync" / "engine" / "reference"
    assert not (ROOT / "slotsync").exists()  # (nothing at the root can shadow an install)


@pytest.mark.slow
def test_wheel_installs_and_runs(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist), str(ROOT)], check=True)
    (wheel,) = dist.glob("slotsync-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for want in ("slotsync/protocol/wire/__init__.py", "slotsync/daemon/service/server.py",
                 "slotsync/engine/reference/worker.py", "slotsync/cli/__init__.py",
                 "slotsync/testing/processes.py", "slotsync/testing/ranks.py"):
        assert want in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry).decode()
    assert "slotsyncd = slotsync.daemon.main:main" in text
    assert "slotsync = slotsync.cli:main" in text
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import slotsync.daemon.service.server, slotsync.protocol.wire, sys; "
            "print(slotsync.protocol.wire.__file__); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=tmp_path, check=True).stdout.split()
    assert out[0].startswith(str(target)) and out[1] == "False"
    helptext = subprocess.run([sys.executable, "-m", "slotsync.daemon", "--help"],
                              capture_output=True, text=True, env=env, cwd=tmp_path,
                              check=True).stdout
    assert "--chunk-timeout-s" in helptext
    # From the repository root too (issue 16: the root's slotsync/ folder shadowed the
    # installed package, "No module named slotsync.daemon"): python -m puts the cwd first.
    for module, flag in (("slotsync.daemon", "--chunk-timeout-s"),
                         ("slotsync.engine", "--workers"), ("slotsync", "demo")):
        run = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                             text=True, env=env, cwd=ROOT)
        assert run.returncode == 0 and flag in run.stdout, (module, run.stderr[-500:])
    # ... and the console scripts pip wrote for that install (``slotsync --help``).
    for script, flag in (("slotsync", "demo"), ("slotsyncd", "--chunk-timeout-s")):
        run = subprocess.run([str(target / "bin" / script), "--help"], capture_output=True,
                             text=True, env=env, cwd=ROOT)
        assert run.returncode == 0 and flag in run.stdout, (script, run.stderr[-500:])

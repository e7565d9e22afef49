"""``slotsyncd --version`` and ``slotsync --version`` (issue 24 E): the installed package's
version, exit status 0."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

import slotsync
from slotsync import cli
from slotsync.daemon import main as daemon_main


def _installed_version() -> str:
    try:
        return metadata.version("slotsync")
    except metadata.PackageNotFoundError:
        return slotsync.UNKNOWN_VERSION


@pytest.mark.parametrize("command,main", [("slotsyncd", daemon_main.main),
                                          ("slotsync", cli.main)])
def test_version_flag_prints_the_package_version_and_exits_0(command, main, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code in (0, None)
    assert capsys.readouterr().out == f"{command} {_installed_version()}\n"


def test_version_comes_from_package_metadata_with_a_fallback(monkeypatch):
    assert slotsync.__version__ == _installed_version()

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert slotsync.package_version() == slotsync.UNKNOWN_VERSION


def test_slotsyncd_version_as_a_command():
    """The daemon's entry point as a process: ``--version`` before any configuration is read
    (``--config`` of a missing file does not matter)."""
    out = subprocess.run([sys.executable, "-m", "slotsync.daemon", "--version", "--config",
                          "/nonexistent.toml"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"slotsyncd {_installed_version()}\n"

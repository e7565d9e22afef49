"""The default ``adapter_dir`` (issue 36 finding: the old default, ``<runtime_dir>/adapters``,
is on another tmpfs than the ranks' segments, so the daemon copied and hashed every round an
adapter one rank holds whole instead of hard-linking it; ``daemon/service/adapter_root.py``).

The default is ``/dev/shm/slotsyncd-<uid>/adapters-<key>``. ``/dev/shm`` is world-writable,
so the private folder's rules are tested on a temporary folder standing for it (mode 1777, a
parameter or the module's ``SHM_DIR``), never on the real ``/dev/shm``: a name another user
took first (a symbolic link, a folder of another owner -- ``os.chown`` as root), a folder its
group may write, and a fine one. Only the first test looks at the real ``/dev/shm``, creating
nothing.

Red on the old code: ``Config().adapter_path()`` was ``<runtime_dir>/adapters`` (the first
test), and ``adapter_root`` did not exist (the others)."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path

import pytest

from slotsync.daemon.service.config import Config, load_config

UID = os.geteuid()


def _on_dev_shm_fs(path: str) -> bool:
    """Whether ``path`` (which need not exist) lies on /dev/shm's filesystem, through the
    deepest of its folders that exists."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return os.stat(probe).st_dev == os.stat("/dev/shm").st_dev


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_the_default_is_on_dev_shms_filesystem_one_folder_per_daemon(tmp_path: Path) -> None:
    from slotsync.daemon.service.folders import filesystem_type

    if filesystem_type("/dev/shm") != "tmpfs" or not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not a tmpfs this uid can write")
    one = Config(runtime_dir=str(tmp_path / "a")).adapter_path()
    two = Config(runtime_dir=str(tmp_path / "b")).adapter_path()
    assert _on_dev_shm_fs(one) and _on_dev_shm_fs(two), (one, two)  # (red: <runtime>/adapters)
    assert os.path.dirname(one) == f"/dev/shm/slotsyncd-{UID}" == os.path.dirname(two)
    assert one != two  # two daemons of one user: two folders
    assert Config(runtime_dir=str(tmp_path / "a")).adapter_path() == one  # (and at a restart)
    assert Config(socket=str(tmp_path / "a" / "slotsyncd.sock")).adapter_path() == one
    # set in the configuration: as given
    assert Config(adapter_dir=str(tmp_path / "x")).adapter_path() == str(tmp_path / "x")


# ------------------------------------------------------------- a folder standing for /dev/shm


def tmpfs(_path: str) -> str:
    return "tmpfs"


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A world-writable sticky folder standing for /dev/shm."""
    d = tmp_path / "shm"
    d.mkdir()
    d.chmod(0o1777)
    return d


def test_the_default_falls_back_to_the_runtime_dir_saying_why(tmp_path: Path, shm: Path) -> None:
    from slotsync.daemon.service.adapter_root import resolve

    rt = str(tmp_path / "rt")
    gone = resolve("", "ipc:///x.sock", rt, str(tmp_path / "none"), UID, tmpfs)
    assert gone.path == f"{rt}/adapters" and not gone.private
    assert gone.fallback == f"{tmp_path / 'none'} is not there"
    disk = resolve("", "ipc:///x.sock", rt, str(shm), UID, lambda p: "ext4")
    assert disk.path == f"{rt}/adapters" and disk.fallback == f"{shm} is not a tmpfs (ext4)"
    ok = resolve("", "ipc:///x.sock", rt, str(shm), UID, tmpfs)
    assert ok.private == f"{shm}/slotsyncd-{UID}" and not ok.fallback
    assert ok.path.startswith(f"{ok.private}/adapters-") and len(Path(ok.path).name) == 21


def _squat(shm: Path, how: str) -> Path:
    """``shm/slotsyncd-<uid>`` taken first, ``how``."""
    private = shm / f"slotsyncd-{UID}"
    if how == "symlink":
        (shm / "elsewhere").mkdir(exist_ok=True)
        private.symlink_to(shm / "elsewhere")
    elif how == "file":
        private.write_text("")
    elif how == "other owner":
        private.mkdir(mode=0o700)
        os.chown(private, UID + 4242, -1)
    elif how == "group-writable":
        private.mkdir()
        private.chmod(0o770)
    return private


SQUATTED = [
    ("symlink", "is a symbolic link", "rm "),
    ("file", "is not a folder", "rm "),
    pytest.param("other owner", f"is owned by uid {UID + 4242}, not by the daemon's uid {UID}",
                 "as root: rm -r", marks=pytest.mark.skipif(
                     UID != 0, reason="os.chown to another uid needs root")),
    ("group-writable", "is writable by its group or others (mode 0770)", "chmod go-w"),
]


@pytest.mark.parametrize("how, wrong, fix", SQUATTED)
def test_a_private_folder_someone_else_could_have_made_is_refused(shm: Path, how: str,
                                                                  wrong: str, fix: str) -> None:
    from slotsync.daemon.service.adapter_root import (
        AdapterDirError,
        make_private,
        private_problem,
        resolve,
    )

    private = _squat(shm, how)
    root = resolve("", "ipc:///x.sock", "/rt", str(shm), UID, tmpfs)
    why = private_problem(root.private, UID)
    assert why.startswith(f"{private} {wrong}") and fix in why, why
    assert "set adapter_dir" in why or how == "group-writable"
    with pytest.raises(AdapterDirError) as e:
        make_private(root, UID)
    assert str(e.value) == why
    assert not (shm / "elsewhere" / Path(root.path).name).exists()  # (no link followed)
    assert not Path(root.path).exists()


@pytest.mark.parametrize("mode", [None, 0o700, 0o750])
def test_a_fine_private_folder_is_made_or_kept_and_goes_at_the_stop(shm: Path, mode) -> None:
    """Made 0700 when absent; an existing one of the daemon's uid that no one else can write
    (0700, or 0750 for an engine of the daemon's group) is kept as it is. At the stop the
    folders go when empty; a version an engine holds keeps them."""
    from slotsync.daemon.service.adapter_io import AdapterIO
    from slotsync.daemon.service.adapter_root import private_problem, resolve

    if mode is not None:
        (shm / f"slotsyncd-{UID}").mkdir()
        (shm / f"slotsyncd-{UID}").chmod(mode)
    root = resolve("", "ipc:///x.sock", "/rt", str(shm), UID, tmpfs)
    assert private_problem(root.private, UID) == ""
    io = AdapterIO(root.path, private=root.private)
    io.prepare()
    assert stat.S_IMODE(os.stat(root.private).st_mode) == (mode or 0o700)
    assert stat.S_IMODE(os.stat(root.path).st_mode) == 0o700
    held = io.slot_root((0, 2)) / "math@v3"  # (what an engine still holds stays)
    held.mkdir(parents=True)
    io.written.add(str(held))
    assert io.close({str(held)}) == [] and held.is_dir()
    io = AdapterIO(root.path, private=root.private)  # (the next daemon's)
    io.prepare()
    io.written.add(str(held))
    assert io.close(set()) == [str(held)]
    assert not os.path.lexists(root.private) and os.listdir(shm) == []


def test_the_daemon_refuses_to_start_naming_the_path_what_is_wrong_and_the_fix(
        tmp_path: Path, shm: Path, monkeypatch, capsys) -> None:
    """``load_config`` (``--check-config`` and every start) refuses a squatted default; a
    name taken after that check is refused by ``Daemon.start``'s own check (exit status 1,
    ``refusing_to_start`` logged), before anything is bound."""
    from slotsync.daemon.service import adapter_root
    from slotsync.daemon.service.server import Daemon

    monkeypatch.setattr(adapter_root, "SHM_DIR", str(shm))
    monkeypatch.setattr(adapter_root, "filesystem_type", tmpfs)
    rt = str(tmp_path / "rt")
    cfg, _ = load_config(["--runtime-dir", rt, "--status-port", "-1"], environ={})
    path = cfg.adapter_path()
    assert path.startswith(f"{shm}/slotsyncd-{UID}/adapters-")
    private = _squat(shm, "symlink")
    with pytest.raises(SystemExit) as e:
        load_config(["--runtime-dir", rt, "--status-port", "-1", "--check-config"], environ={})
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert (f"adapter_dir {path!r}: {private} is a symbolic link (to {str(shm / 'elsewhere')!r})"
            in err), err
    assert f"rm {private}" in err and "set adapter_dir to another folder" in err, err
    # taken between the check and the start
    private.unlink()
    logs: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = logs.append  # type: ignore[method-assign]
    logging.getLogger("slotsync.daemon").addHandler(handler)
    try:
        cfg, _ = load_config(["--runtime-dir", rt, "--status-port", "-1"], environ={})
        _squat(shm, "symlink")
        assert asyncio.run(Daemon(cfg).serve()) == 1
    finally:
        logging.getLogger("slotsync.daemon").removeHandler(handler)
    (refused,) = [r for r in logs if r.getMessage() == "refusing_to_start"]
    assert "is a symbolic link" in refused.slotsync_fields["reason"]
    assert os.listdir(shm / "elsewhere") == []

"""``slotsync keys`` (issue 25 B/F): makes each node's CURVE key pair with
``peer_keys.make_keys``, says where each file goes, never overwrites, refuses bad names."""

from __future__ import annotations

import stat

import pytest

from slotsync import cli
from slotsync.daemon.node_links.peer_keys import load_keys


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["keys", *argv])
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_makes_a_key_pair_the_daemon_loads_and_says_where_each_file_goes(tmp_path, capsys):
    folder = tmp_path / "keys"  # made when missing
    code, out, err = _run(["node0", "node1", "--dir", str(folder)], capsys)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == str(folder / "node0.key")
    assert lines[1] == str(folder / "node0.key_secret")
    assert "node0.key into the peer_public_keys folder of every node" in lines[2]
    assert "node0.key_secret stays on node0 only" in lines[2]
    assert f'curve_secret_key = "{folder / "node0.key_secret"}"' in lines[2]
    assert lines[3:5] == [str(folder / "node1.key"), str(folder / "node1.key_secret")]
    assert len(lines) == 6
    assert stat.S_IMODE((folder / "node0.key_secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((folder / "node0.key").stat().st_mode) == 0o644
    # What the daemon reads: node0's pair, and the folder's public keys by node name.
    keys = load_keys(str(folder / "node0.key_secret"), str(folder))
    assert sorted(keys.peers.values()) == ["node0", "node1"]
    assert keys.key_of("node0") == keys.public and keys.secret
    assert keys.key_of("node1") != keys.public


def test_existing_files_are_never_overwritten_and_nothing_else_is_made(tmp_path, capsys):
    assert _run(["node0", "--dir", str(tmp_path)], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, out, err = _run(["node2", "node0", "--dir", str(tmp_path)], capsys)
    assert code == 1 and out == ""
    assert str(tmp_path / "node0.key") in err and "exist already" in err
    assert "nothing was written" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no node2 files
    # Only the secret half left behind: still refused, still untouched.
    (tmp_path / "node0.key").unlink()
    code, _, err = _run(["node0", "--dir", str(tmp_path)], capsys)
    assert code == 1 and str(tmp_path / "node0.key_secret") in err
    assert (tmp_path / "node0.key_secret").read_bytes() == before["node0.key_secret"]
    assert not (tmp_path / "node0.key").exists()


@pytest.mark.parametrize("name", ["../etc", "_node", ".hidden", "a/b", "node 1", "x" * 256])
def test_bad_node_names_are_refused_before_any_file(tmp_path, capsys, name):
    code, out, err = _run(["node0", name, "--dir", str(tmp_path)], capsys)
    assert code == 2 and out == ""
    assert "is not a node name" in err and repr(name) in err
    assert list(tmp_path.iterdir()) == []


def test_a_node_named_twice_is_refused(tmp_path, capsys):
    code, _, err = _run(["node0", "node0", "--dir", str(tmp_path)], capsys)
    assert code == 2 and "named twice" in err
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_cannot_be_made_is_named(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, out, err = _run(["node0", "--dir", str(blocker / "keys")], capsys)
    assert code == 1 and out == ""
    assert f"cannot write into {str(blocker / 'keys')!r}" in err


def test_default_folder_is_the_current_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = _run(["node0"], capsys)
    assert code == 0 and out.splitlines()[:2] == ["node0.key", "node0.key_secret"]
    assert (tmp_path / "node0.key").exists() and (tmp_path / "node0.key_secret").exists()
    assert f'curve_secret_key = "{tmp_path / "node0.key_secret"}"' in out


def test_an_unknown_option_is_named_and_no_node_is_asked_for(tmp_path, capsys, monkeypatch):
    """Issue 35 (fresh-user trial): `slotsync keys -x` said "the following arguments are
    required: NODE" instead of naming the unknown option."""
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(["-x"], capsys)
    assert code == 2 and "unrecognized arguments: -x" in err, err
    code, _, err = _run([], capsys)
    assert code == 2 and "name at least one NODE" in err, err
    assert list(tmp_path.iterdir()) == []

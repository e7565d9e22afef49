"""The engines' API keys (issue 35 item 14): the key files of the engine table (refused as ssh
refuses a private key file, never printed), which key each request carries (vLLM: the API
key; SGLang: per route, read from SGLang's own ``http_server.py``), and a 401 / 403 named as
what it is wherever it comes back -- also in kind and version detection."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sglang_auth import sglang_route_levels  # noqa: E402 (tests/)

from slotsync.daemon.core.actions import EngineCall, UpdateEnded
from slotsync.daemon.core.update import Timeouts
from slotsync.daemon.engine_http import NO_KEYS, EngineKeys, key_refusal
from slotsync.daemon.families import SlotTable
from slotsync.daemon.service.config import load_config, read_config_file
from slotsync.daemon.service.engine_keys import read_engine_keys, read_key_file
from slotsync.daemon.sglang import routes as sglang_routes
from slotsync.daemon.sglang.client import SglangClient
from slotsync.daemon.vllm.client import VllmClient
from slotsync.protocol.wire import Begin, Commit

URL = "http://127.0.0.1:30000"


def key_file(folder: Path, name: str, text: str, mode: int = 0o600) -> Path:
    p = folder / name
    p.write_text(text)
    p.chmod(mode)
    return p


def write_table(folder: Path, **files: Path) -> Path:
    extra = "".join(f'{k} = "{v}"\n' for k, v in files.items())
    cfg = folder / "slotsyncd.toml"
    cfg.write_text(f'[[engines]]\nurl = "{URL}"\nslot_start = 0\nslot_size = 2\n{extra}')
    return cfg


# ------------------------------------------------------------------ key files


def test_a_key_file_is_read_at_check_config_and_never_printed(tmp_path, capsys):
    k = key_file(tmp_path, "engine.key", "s3cret-api\n")
    a = key_file(tmp_path, "engine.admin", "s3cret-admin")
    cfg, check = load_config(["--config", str(write_table(tmp_path, api_key_file=k,
                                                          admin_api_key_file=a)),
                              "--runtime-dir", str(tmp_path / "run"), "--check-config"])
    assert check
    text = json.dumps(cfg.describe()) + repr(cfg)
    assert str(k) in text and str(a) in text
    assert "s3cret" not in text
    keys = read_engine_keys(cfg.engines)
    assert keys == {URL: EngineKeys("s3cret-api", "s3cret-admin", str(k), str(a))}
    assert "s3cret" not in repr(keys)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_a_key_file_others_may_read_is_refused_as_ssh_refuses_a_private_key(tmp_path, mode,
                                                                               capsys):
    k = key_file(tmp_path, "engine.key", "s3cret", mode)
    with pytest.raises(SystemExit):
        load_config(["--config", str(write_table(tmp_path, api_key_file=k)),
                     "--runtime-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert f"permissions {mode:04o} are too open" in err and f"chmod 600 {k}" in err, err
    assert "s3cret" not in err


def test_a_key_file_of_another_owner_readable_by_the_daemons_group_is_taken(tmp_path):
    """``0640 root:slotsync`` with the daemon running as slotsync: ssh takes it too (its
    check is for a file the user owns); world-readable is refused whoever owns it. (Here the
    daemon is root and the file another user's.)"""
    if os.getuid() != 0:
        pytest.skip("needs root, to give the file to another owner")
    k = key_file(tmp_path, "engine.key", "s3cret", 0o640)
    os.chown(k, 65534, 65534)
    assert read_key_file(str(k), "api_key_file", URL) == "s3cret"
    k.chmod(0o644)
    with pytest.raises(ValueError, match="too open"):
        read_key_file(str(k), "api_key_file", URL)


@pytest.mark.parametrize("text, why", [
    ("", "the file is empty"), ("\n  \n", "the file is empty"),
    ("two words", "holds a blank"), ("line1\nline2\n", "holds a blank"),
    ("k\u00e9y", "not printable ASCII"), ("x" * 5000, "longer than 4096 bytes")])
def test_a_key_file_that_is_not_one_key_on_one_line_is_refused(tmp_path, text, why):
    k = key_file(tmp_path, "engine.key", text)
    with pytest.raises(ValueError, match=why) as ei:
        read_key_file(str(k), "api_key_file", URL)
    assert "api_key_file" in str(ei.value) and URL in str(ei.value)


def test_missing_relative_and_folder_paths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read it: No such file"):
        read_key_file(str(tmp_path / "nope"), "api_key_file", URL)
    with pytest.raises(ValueError, match="absolute path"):
        read_key_file("engine.key", "api_key_file", URL)
    with pytest.raises(ValueError, match="not a regular file"):
        read_key_file(str(tmp_path), "api_key_file", URL)


def test_an_admin_key_for_a_declared_vllm_engine_is_refused(tmp_path):
    a = key_file(tmp_path, "engine.admin", "s3cret")
    cfg = read_config_file(write_table(tmp_path, admin_api_key_file=a))
    object.__setattr__(cfg.engines[0], "kind", "vllm")
    with pytest.raises(ValueError, match="vLLM has no admin key"):
        read_engine_keys(cfg.engines)


def test_the_key_files_must_be_strings(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'[[engines]]\nurl = "{URL}"\nslot_start = 0\nslot_size = 2\n'
                   "api_key_file = 7\n")
    with pytest.raises(ValueError, match="paths"):
        read_config_file(cfg)


# ------------------------------------------------------------------ which key, which route


def daemon_paths() -> set[str]:
    """Every path the daemon's SGLang client requests, any step, version or pause mode."""
    paths = set()
    for version in ("0.5.20", "0.5.21", "0.5.23"):
        for mode in sglang_routes.PAUSE_MODES:
            for step in ("version", "get_world_size", "weight_info", "pause",
                         "finish_recover", "start_weight_update", "update_weights",
                         "finish_weight_update", "resume", "prove_copies",
                         "load_lora_adapter", "unload_lora_adapter", "models",
                         "prove_adapter_copies"):
                body = {"weight_version": "v1"} if step == "finish_weight_update" else {}
                for req in sglang_routes.plan(step, body,
                                              sglang_routes.Dialect(version, mode)):
                    paths.add(req.path.split("?")[0])
    return paths


def test_the_admin_optional_routes_are_sglangs_own():
    """SGLang 0.5.23's ``decide_request_auth``: an ``ADMIN_OPTIONAL`` route takes the admin
    key when the server has one, a ``NORMAL`` one the API key: the daemon's table of which
    path is which is SGLang's, for every path it requests (and the SGLang engines' too)."""
    from slotsync.engine.sglang.state import ADMIN_OPTIONAL_ROUTES

    levels = sglang_route_levels()
    paths = daemon_paths()
    assert paths >= {"/server_info", "/model_info", "/pause_generation", "/flush_cache",
                     "/update_weights_from_tensor", "/continue_generation"}
    for p in sorted(paths):
        assert p in levels, f"SGLang has no route {p}"
        assert (p in sglang_routes.ADMIN_OPTIONAL_PATHS) == (levels[p] == "admin_optional"), p
        assert (p in ADMIN_OPTIONAL_ROUTES) == (levels[p] == "admin_optional"), p
    assert sglang_routes.ADMIN_OPTIONAL_PATHS <= paths


async def test_which_key_each_request_carries():
    both = EngineKeys("api", "admin", "/k/api", "/k/admin")
    s = SglangClient(URL, keys=both)
    v = VllmClient(URL, keys=both)
    try:
        assert s.key_for("/pause_generation") == ("admin", "admin_api_key_file")
        assert s.key_for("/server_info") == ("api", "api_key_file")
        assert v.key_for("/pause") == ("api", "api_key_file")  # (vLLM has no admin key)
        s.keys = EngineKeys("api", "", "/k/api", "")
        assert s.key_for("/pause_generation") == ("api", "api_key_file")
        s.keys = EngineKeys("", "admin", "", "/k/admin")
        assert s.key_for("/server_info") == ("", "")
        s.keys = NO_KEYS
        assert s.key_for("/pause_generation") == ("", "")
    finally:
        await s.close()
        await v.close()


def test_the_refusals_name_what_to_set_and_never_a_key():
    none = key_refusal(URL, 401, "/version", "", "")
    assert none.startswith(f"engine {URL} refused the daemon's API key (HTTP 401")
    assert "sent none" in none and "set api_key_file" in none
    wrong = key_refusal(URL, 401, "/pause_generation", "admin_api_key_file", "/k/admin")
    assert "wrong key" in wrong and "/k/admin" in wrong and "--admin-api-key" in wrong
    assert "HTTP 403 Forbidden" in key_refusal(URL, 403, "/x", "api_key_file", "/k/api")


# ------------------------------------------------------------------ named in detection


@pytest.mark.parametrize("seen", [None, "sglang"], ids=["fresh", "seen-sglang"])
def test_a_401_in_kind_detection_is_named_as_a_refused_key_not_a_missing_version(seen):
    """A daemon meets an SGLang server started with --api-key: its ``/version`` and
    ``/server_info`` answer 401 -- on a fresh daemon, or on one that had seen SGLang there
    (the version step asked again after a reset connection). The begin fails saying so, not
    "did not say its vLLM version", nor as a kind the table never declared."""
    table = SlotTable(Timeouts(10, 10, 10))
    from test_coordinator import chunk, ident, reg

    out = [a for r in range(2) for a in table.on_message(ident(r), reg(r, 0, 2, url=URL), 0.0)]
    if seen:
        engine = table.coordinator((0, 2)).engine
        engine.kind, engine.sglang_version, engine.session_suspect = seen, "0.5.23", True
    for r in range(2):
        out += table.on_message(ident(r), Begin(0, "v0"), 0.0)
    for r in range(2):
        out += table.on_message(ident(r), chunk(0, 0, r), 0.0)
    for r in range(2):
        out += table.on_message(ident(r), Commit(0, 1), 0.0)
    calls = [a for a in out if isinstance(a, EngineCall)]
    assert sorted(c.route for c in calls) == ["server_info", "version"]
    c = table.coordinator((0, 2))
    ended: list[UpdateEnded] = []
    for call in calls:
        path = "/version" if call.route == "version" and not seen else "/server_info"
        if seen and call.route == "server_info":  # (SGLang's client: no request, None)
            out = c.on_engine_result(call.call_id, True, None, "", 0.0)
        else:
            err = f"{call.route}: HTTP 401: " + key_refusal(URL, 401, path, "", "")
            out = c.on_engine_result(call.call_id, False, None, err, 0.0)
        ended += [a for a in out if isinstance(a, UpdateEnded)]
    (e,) = ended
    assert "refused the daemon's API key (HTTP 401" in e.error, e.error
    assert "set api_key_file" in e.error and "did not say its vLLM version" not in e.error
    assert "declared" not in e.error

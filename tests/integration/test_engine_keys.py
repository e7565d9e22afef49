"""Engines started with API keys (issue 35 item 14): the daemon sends the keys the engine table's
files hold, as each engine's own auth code wants them, and names a refusal as a refused key.

* SGLang's own ``add_api_key_middleware`` and ``auth_level`` (``srt/utils/auth.py``, which
  imports on CPU) guarding the routes the daemon asks, in this process
  (``tests/sglang_auth.py``): the daemon's SGLang client through every step, for each key
  layout a server can have;
* the SGLang-code engine (``--api-key`` / ``--admin-api-key``, its front deciding with
  SGLang's ``decide_request_auth``) driven by a daemon with key files: rounds land; no key,
  a wrong key, a key file replaced at SIGHUP;
* the vLLM-code engine with vLLM's own ``AuthenticationMiddleware`` (``VLLM_API_KEY``, as
  ``vllm serve --api-key`` attaches it): it guards ``/v1`` only, the weight routes stay open,
  and a daemon with or without the key syncs.
"""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from slotsync.testing.ports import free_port

STEPS = [("version", None), ("get_world_size", None), ("weight_info", None), ("pause", None),
         ("start_weight_update", None), ("update_weights", {"serialized_named_tensors": []}),
         ("finish_weight_update", {"weight_version": "v1"}), ("resume", None)]
"""The daemon's steps of one round, each one or more SGLang requests (abort pause: with the
flush)."""

OK = ("", "")
CASES = [
    # server's --api-key, --admin-api-key; the daemon's keys (api, admin; '' for none); the
    # step refused, and what its error says ("" for none)
    ("k1", None, ("k1", ""), OK),
    (None, "a1", ("", "a1"), OK),
    ("k1", "a1", ("k1", "a1"), OK),
    ("k1", None, ("", ""), ("version", "sent none; the server wants one: set api_key_file")),
    (None, "a1", ("", ""), ("pause", "sent none; the server wants one: set "
                                     "admin_api_key_file")),
    ("k1", "a1", ("k1", ""), ("pause", "takes only the admin key: set admin_api_key_file")),
    ("k1", "a1", ("k2", "a1"), ("version", "wrong key: the key in api_key_file (/f/api)")),
    ("k1", "a1", ("k1", "a2"), ("pause", "wrong key: the key in admin_api_key_file "
                                         "(/f/admin)")),
]


@pytest.mark.parametrize("api_key, admin_api_key, keys, refused", CASES)
@pytest.mark.filterwarnings("ignore:ORJSONResponse is deprecated")  # (SGLang's middleware)
async def test_the_sglang_client_against_sglangs_own_auth_middleware(api_key, admin_api_key,
                                                                     keys, refused):
    pytest.importorskip("sglang.srt.utils.auth")
    uvicorn = pytest.importorskip("uvicorn")
    from sglang_auth import guarded_app

    from slotsync.daemon.engine_http import EngineError, EngineKeys
    from slotsync.daemon.sglang.client import SglangClient
    from slotsync.daemon.sglang.routes import Dialect

    port = free_port("127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(guarded_app(api_key, admin_api_key),
                                           host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    keys = EngineKeys(*keys, "/f/api" if keys[0] else "", "/f/admin" if keys[1] else "")
    client = SglangClient(f"http://127.0.0.1:{port}", timeout_s=10, keys=keys)
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        step_refused, words = refused
        for step, body in STEPS:
            try:
                await client.call(step, body, Dialect("0.5.23", "abort"))
            except EngineError as e:
                assert step == step_refused, (step, str(e))
                assert e.status == 401, str(e)
                assert "refused the daemon's API key (HTTP 401 Unauthorized" in str(e)
                assert words in str(e), str(e)
                for secret in ("k1", "k2", "a1", "a2"):
                    assert secret not in str(e).replace(f"{port}", "")
                break
            assert step != step_refused, f"{step} was not refused"
        else:
            assert step_refused == "", f"nothing was refused, expected {step_refused}"
    finally:
        await client.close()
        server.should_exit = True
        await task


# ------------------------------------------------------------------ daemon and engines


def _key(tmp_path: Path, name: str, key: str) -> Path:
    p = tmp_path / name
    p.write_text(key + "\n")
    p.chmod(0o600)
    return p


@pytest.mark.slow
@pytest.mark.sglang
def test_a_daemon_with_key_files_syncs_an_sglang_engine_started_with_keys(tmp_path):
    """SGLang-code engine with ``--api-key`` and ``--admin-api-key``. A daemon without keys:
    the round fails naming the refused key (on a fresh daemon: not "did not say its vLLM
    version"). With the key files: rounds land; no key is in the daemon's log or command
    line; a wrong admin key read at SIGHUP fails the next round as a wrong key, the right one
    read at the next SIGHUP lets the round after land."""
    pytest.importorskip("torch")
    from sglang_rounds import TP, assert_landed, ok_rounds, sglang_box, table
    from spawned_ranks import rounds, run_ranks

    from slotsync.daemon.launcher import DaemonProcess

    box = sglang_box("0.5.23", api_key="api-0123", admin_api_key="admin-4567")
    try:
        (tmp_path / "nokeys").mkdir()
        with DaemonProcess(args=table(tmp_path / "nokeys", box.url)) as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1, "first_round": 4}] * TP)
            for r in range(TP):
                (e,) = rounds(ev, r)
                assert e["status"] == "error", e
                assert "did not say its vLLM version" not in e["message"], e["message"]
                assert "refused the daemon's API key (HTTP 401" in e["message"], e["message"]
                assert "set api_key_file" in e["message"], e["message"]
        api = _key(tmp_path, "engine.key", "api-0123")
        admin = _key(tmp_path, "engine.admin-key", "admin-4567")
        with DaemonProcess(args=table(tmp_path, box.url, api_key_file=str(api),
                                      admin_api_key_file=str(admin))) as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * TP)
            ok_rounds(ev, 1, box)
            assert_landed(box, 1)
            admin.write_text("admin-wrong\n")
            d.proc.send_signal(signal.SIGHUP)
            _wait_for(d, "API keys read again")
            ev = run_ranks(d, box.url, True, [{"rounds": 1, "first_round": 2}] * TP)
            for r in range(TP):
                (e,) = rounds(ev, r)
                assert e["status"] == "error", e
                assert "refused the daemon's API key (HTTP 401" in e["message"], e["message"]
                assert f"wrong key: the key in admin_api_key_file ({admin})" in e["message"]
            assert box.stats()["paused"] is False  # (the pause itself was refused)
            admin.write_text("admin-4567\n")
            d.proc.send_signal(signal.SIGHUP)
            _wait_for(d, "API keys read again", count=2)
            ev = run_ranks(d, box.url, True, [{"rounds": 1, "first_round": 3}] * TP)
            ok_rounds(ev, 1, box)
            assert_landed(box, 3)
            log = Path(d.log_path).read_text()
            assert "api-0123" not in log and "admin-4567" not in log
            assert "api-0123" not in " ".join(d.proc.args)
    finally:
        box.close()


def _wait_for(d, text: str, count: int = 1, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Path(d.log_path).read_text().count(text) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in the daemon's log: {d.log_tail()}")


def _status(url: str, key: str | None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.slow
@pytest.mark.vllm
def test_vllms_own_api_key_middleware_guards_v1_only_and_the_daemon_syncs(tmp_path):
    """vLLM 0.32's ``--api-key`` (``AuthenticationMiddleware``, here through ``VLLM_API_KEY``
    as ``vllm serve`` reads it) answers 401 on ``/v1`` without the key and leaves the
    weight-transfer routes open; a daemon with ``api_key_file`` (the key on every request)
    syncs the engine."""
    pytest.importorskip("torch")
    from engines import EngineBox
    from spawned_ranks import run_ranks
    from trainer_script import make_tensors

    from slotsync.daemon.launcher import DaemonProcess
    from slotsync.engine.checksum import tensor_checksum

    box = EngineBox(2, impl_name="vllm", env={"VLLM_API_KEY": "vllm-key-89"})
    try:
        assert _status(box.url + "/v1/models", None) == 401  # (vLLM's middleware)
        assert _status(box.url + "/v1/models", "wrong") == 401
        assert _status(box.url + "/v1/models", "vllm-key-89") == 200  # (passed it: vLLM's list)
        for path in ("/version", "/get_world_size", "/is_paused", "/weight_info"):
            assert _status(box.url + path, None) == 200, path  # (not guarded)
        key = _key(tmp_path, "engine.key", "vllm-key-89")
        cfg = tmp_path / "t.toml"
        cfg.write_text(f'[[engines]]\nurl = "{box.url}"\nslot_start = 0\nslot_size = 2\n'
                       f'api_key_file = "{key}"\n')
        with DaemonProcess(args=["--config", str(cfg)]) as d:
            ev = run_ranks(d, box.url, True, [{"rounds": 1}] * 2)
            assert [e["status"] for e in ev[0] if e["event"] == "round"] == ["ok"], ev
        assert box.weight_version() == "v1"
        want = {n: tensor_checksum(t) for n, t in make_tensors(1)}
        for sums in box.checksums().values():
            assert {n: sums.get(n) for n in want} == want
    finally:
        box.close()

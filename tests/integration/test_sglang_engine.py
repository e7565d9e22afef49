"""The SGLang engines (``python -m slotsync.engine --impl sglang | sglang-reference``) against
SGLang's contract (docs/sglang-contract.md sections 1, 2, 3, 6), driven over plain HTTP with
payloads written by a test-only writer (``tests/sglang_payloads.py``) over shared memory.

Each (impl, version) pair runs one 2-rank engine (TP=2) for the whole module, restarted only
after a test killed it (``EngineBox.reset``): ``sglang`` parses payloads with SGLang's own
code (``SafeUnpickler``, ``patch_torch``, ``FlattenedTensorBucket``) and validates bodies with
SGLang's own ``msgspec_struct_pydantic_core_schema``; ``sglang-reference`` with slotsync's
mirror. Tests of what differs per version run on each version; the deaths a scheduler
exception causes run on 0.5.23 (the rule is the same in all three).

What each test holds:

* ``test_packed_and_unpacked_loads_land``: packed and unpacked chunks land on every rank
  (checksums), each rank reads only its own entry (extra entries ignored, an empty bucket
  loads nothing, another visible GPU's UUID accepted), ``weight_version`` reaches
  ``/model_info``; the received tensors are freed in the call on 0.5.20, on the release
  after the barrier on 0.5.21+;
* ``test_session_rules_and_their_400s``: the three session 400s (0.5.21+), the 404s and the
  session-less load of 0.5.20, ``selector="draft"`` loading nothing, an update of empty
  lists, ``post_load_weights`` only after a session that loaded nothing;
* ``test_pause_modes_and_the_writer_lock``: ``abort`` (default) / ``retract`` /
  ``in_place``, requests held while paused, a weight call waiting for running requests,
  ``update_weight_version``'s abort default;
* ``test_flush_per_version``: ``/flush_cache``'s texts, ``timeout`` and "already in
  progress", the retract flush refused on 0.5.20 only, 0.5.23's soft 400 after an update
  (weights loaded, versions split);
* ``test_failed_flush_after_an_update_kills_the_engine``: 0.5.20 / 0.5.21's ``assert``;
* ``test_server_info_model_info_and_no_vllm_routes``: the keys per version, 404s for
  ``/version`` and vLLM's routes, a 405;
* ``test_bodies_are_validated_as_sglang_does``: SGLang's 400 ``ErrorResponse`` texts,
  unknown fields ignored, lax coercion;
* ``test_dp_replicas_refused_with_a_500_and_auth`` / ``test_attention_dp_passes``: the DP
  assertion (bare 500, connection closed), attention DP resolved on 0.5.23, the API key;
* ``test_scheduler_exception_kills_the_engine`` (8 causes) and
  ``test_a_rank_raising_kills_the_engine``: connection reset, front and ranks gone, a new
  ``startup_time`` and the initial version after a restart;
* ``test_faults``, ``test_engine_box_helpers_answer_for_every_impl``, ``test_cli_refusals``,
  ``test_zz_nothing_left_behind`` (no process, no ``/dev/shm`` segment left).

Cost: ~30 s on 2 cores (11 s of it the engine zygote's imports, paid once per run; each
engine, and each restart after a death, ~0.2 s forked from it).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pydantic")

from engines import EngineBox, model_file  # noqa: E402
from sglang_payloads import (  # noqa: E402
    Segments,
    empty_entry,
    global_entry,
    packed_entry,
    unpacked_entry,
    update_body,
)

from slotsync.engine.checksum import tensor_checksum  # noqa: E402
from slotsync.engine.sglang.state import (  # noqa: E402
    FLUSH_REFUSED,
    NO_SESSION,
    SESSION_OPEN,
    SESSION_REQUIRED,
)
from slotsync.protocol.wire import logical_gpu_uuid  # noqa: E402
from slotsync.testing.procfs import shm_segments  # noqa: E402

UP = "model.layers.0.mlp.up_proj.weight"
NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"
UUIDS = [logical_gpu_uuid(0), logical_gpu_uuid(1)]
VERSIONS = ("0.5.23", "0.5.21", "0.5.20")
IMPLS = ("sglang", "sglang-reference")


def configs(pairs: list[tuple[str, str]], name: str = "config") -> pytest.MarkDecorator:
    """Parametrize ``name`` over (impl, version) pairs; the ``sglang`` impl's cases carry the
    ``sglang`` marker (skipped, or failed under ``SLOTSYNC_REQUIRE_SGLANG``, without SGLang)."""
    return pytest.mark.parametrize(name, [
        pytest.param((i, v), id=f"{i}-{v}",
                     marks=[pytest.mark.sglang] if i == "sglang" else [])
        for i, v in pairs])


ALL = configs([(i, v) for i in IMPLS for v in VERSIONS])
LATEST = configs([(i, "0.5.23") for i in IMPLS])


def model(seed: int) -> dict[str, torch.Tensor]:
    """The model's three tensors (fp32, bf16, int32), values from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return {UP: torch.randn(4, 3, generator=g),
            NORM: torch.randn(5, generator=g).to(torch.bfloat16),
            EMBED: torch.randint(-100, 100, (2, 2, 2), generator=g).to(torch.int32)}


def sums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {n: tensor_checksum(t) for n, t in tensors.items()}


# --------------------------------------------------------------------------------------------
# engines
# --------------------------------------------------------------------------------------------


class Engines:
    """One ``EngineBox`` per (impl, version, options), started on first use, kept for the
    module; every pid seen is remembered for the final leak check."""

    def __init__(self) -> None:
        self.boxes: dict[tuple, EngineBox] = {}
        self.pids: set[int] = set()

    def get(self, impl: str, version: str, workers: int = 2, **options: Any) -> EngineBox:
        key = (impl, version, workers, tuple(sorted(options.items())))
        box = self.boxes.get(key)
        if box is None:
            box = EngineBox(workers, impl_name=impl, model=model_file(list(model(0).items())),
                            sglang={"sglang_version": version, **options})
            self.boxes[key] = box
        box.reset()  # (restarts an engine a test killed)
        self.remember(box)
        return box

    def remember(self, box: EngineBox) -> None:
        s = box.stats()
        self.pids.add(s["pid"])
        self.pids.update(w["pid"] for w in s["workers"])

    def close(self) -> None:
        for box in self.boxes.values():
            box.close()
        self.boxes.clear()


_engines = Engines()


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    yield _engines
    _engines.close()


@pytest.fixture
def eng(engines: Engines, config: tuple[str, str]) -> EngineBox:
    return engines.get(*config)


@pytest.fixture
def segs() -> Iterator[Segments]:
    s = Segments()
    yield s
    s.close()


def call(box: EngineBox, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One call on a fresh connection."""
    return box.request(method, path, body)


def ok(box: EngineBox, method: str, path: str, body: Any = None) -> Any:
    status, got = call(box, method, path, body)
    assert status == 200, (path, status, got)
    return got


def version_of(box: EngineBox) -> str:
    return box.eng.sglang["sglang_version"]


def begin(box: EngineBox) -> None:
    if version_of(box) != "0.5.20":
        assert ok(box, "POST", "/begin_weight_update", {}) == {"success": True,
                                                               "message": "Success"}


def end(box: EngineBox) -> None:
    if version_of(box) != "0.5.20":
        ok(box, "POST", "/end_weight_update", {})


def packed(tensors: dict[str, torch.Tensor], segs: Segments, **fields: Any) -> dict:
    return update_body([packed_entry(tensors, u, segs, rank=r) for r, u in enumerate(UUIDS)],
                       "flattened_bucket", **fields)


def raw_call(box: EngineBox, method: str, path: str, body: Any) -> tuple[int, bytes, bool]:
    """One call on a raw connection: (status, body, whether the server closed the
    connection after it)."""
    conn = http.client.HTTPConnection("127.0.0.1", box.eng.port, timeout=30)
    try:
        conn.request(method, path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json",
                              **box.eng.auth_header(path)})
        resp = conn.getresponse()
        data = resp.read()
        try:
            conn.request("GET", "/model_info", headers=box.eng.auth_header("/model_info"))
            conn.getresponse().read()
            closed = False
        except (ConnectionError, http.client.HTTPException):
            closed = True
        return resp.status, data, closed
    finally:
        conn.close()


def expect_death(box: EngineBox, method: str, path: str, body: Any) -> None:
    """The call's connection is reset and the engine -- front and every rank -- exits, as
    SGLang's server does after a scheduler exception (SIGKILL of itself)."""
    stats = box.stats()
    pids = [w["pid"] for w in stats["workers"]]
    conn = http.client.HTTPConnection("127.0.0.1", box.eng.port, timeout=30)
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        conn.request(method, path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        conn.getresponse().read()
    conn.close()
    assert box.eng.proc.wait(10) == -9, box.eng.log_tail()
    assert "Scheduler hit an exception" in box.eng.log_tail(20000)
    for pid in pids:  # every rank killed and reaped
        assert not Path(f"/proc/{pid}").exists(), pid


# --------------------------------------------------------------------------------------------
# loads
# --------------------------------------------------------------------------------------------


@ALL
def test_packed_and_unpacked_loads_land(eng: EngineBox, segs: Segments) -> None:
    """A packed chunk (``flattened_bucket``) and an unpacked one (``load_format`` null) land
    on every rank; each rank reads only its own entry (different values per rank, extra
    entries ignored, an empty bucket loads nothing, another visible GPU's UUID is accepted);
    ``weight_version`` reaches ``/model_info``."""
    v = version_of(eng)
    before = {w["index"]: w for w in eng.stats()["workers"]}
    begin(eng)
    a, b = model(1), model(2)
    body = update_body([packed_entry(a, UUIDS[0], segs), packed_entry(b, UUIDS[1], segs),
                        b"\x80\x04N."], "flattened_bucket", weight_version="v1")
    assert ok(eng, "POST", "/update_weights_from_tensor", body) == {
        "success": True, "message": "Success Weight version updated to v1."}
    assert eng.checksums() == {"tp0": sums(a), "tp1": sums(b)}
    assert eng.weight_version() == "v1"
    c = model(3)  # unpacked; rank 1 names rank 0's GPU (visible to it: SGLang accepts it)
    body = update_body([unpacked_entry(c, UUIDS[0], segs), unpacked_entry(c, UUIDS[0], segs)])
    assert ok(eng, "POST", "/update_weights_from_tensor", body)["success"]
    assert eng.checksums() == {"tp0": sums(c), "tp1": sums(c)}
    d = {UP: model(4)[UP]}  # rank 0 loads one tensor, rank 1 an empty bucket
    body = update_body([packed_entry(d, UUIDS[0], segs), empty_entry(UUIDS[1])],
                       "flattened_bucket")
    assert ok(eng, "POST", "/update_weights_from_tensor", body)["success"]
    assert eng.checksums() == {"tp0": {**sums(c), **sums(d)}, "tp1": sums(c)}
    end(eng)
    s = eng.stats()
    assert s["impl"] == eng.impl and s["sglang_version"] == v
    assert s["helpers"] == ("sglang" if eng.impl == "sglang" else "mirror")
    nbytes = sum(t.numel() * t.element_size() for t in a.values())
    for w in s["workers"]:
        was = before[w["index"]]
        assert w["parser"] == ("sglang" if eng.impl == "sglang" else "reference")
        assert w["update_count"] - was["update_count"] == 3 and w["held_tensors"] == 0
        assert w["load_calls"] - was["load_calls"] == 3
        assert w["bytes_loaded"] - was["bytes_loaded"] == (
            2 * nbytes + (w["index"] == 0) * d[UP].numel() * 4)
        # where the received tensors die (contract 5.2): 0.5.20 before the barrier, in the
        # call; 0.5.21+ after it, on the front's release once every rank answered
        assert w["release_count"] - was["release_count"] == (0 if v == "0.5.20" else 3)
    assert s["weight_version"] == s["scheduler_weight_version"] == "v1"


@ALL
def test_session_rules_and_their_400s(eng: EngineBox, segs: Segments) -> None:
    """0.5.21+: an update outside a session is refused before any rank reads it; a second
    begin and an end without a session are refused; 0.5.20 has no session routes (404) and
    loads without one."""
    t = model(5)
    if version_of(eng) == "0.5.20":
        for route in ("/begin_weight_update", "/end_weight_update"):
            assert call(eng, "POST", route, {}) == (404, {"detail": "Not Found"})
        assert ok(eng, "POST", "/update_weights_from_tensor", packed(t, segs))["success"]
        assert eng.checksums()["tp1"] == sums(t)
        return
    before = [w["load_calls"] for w in eng.stats()["workers"]]
    assert call(eng, "POST", "/update_weights_from_tensor", packed(t, segs)) == (
        400, {"success": False, "message": SESSION_REQUIRED})
    assert [w["load_calls"] for w in eng.stats()["workers"]] == before
    assert call(eng, "POST", "/end_weight_update", {}) == (
        400, {"success": False, "message": NO_SESSION})
    begin(eng)
    assert eng.stats()["session_open"] and all(w["active"] for w in eng.stats()["workers"])
    assert call(eng, "POST", "/begin_weight_update", {"selector": "target"}) == (
        400, {"success": False, "message": SESSION_OPEN})
    # selector "draft" without a draft model: no runner selected, nothing loaded, a success
    held = eng.checksums()
    assert ok(eng, "POST", "/update_weights_from_tensor",
              packed(t, segs, selector="draft"))["success"]
    assert eng.checksums() == held
    # an update that loads nothing (the daemon's proving call: the pickle of [] per rank)
    assert ok(eng, "POST", "/update_weights_from_tensor", update_body(
        [b"\x80\x04]."] * 2, None, flush_cache=False)) == {"success": True,
                                                           "message": "Success"}
    assert eng.checksums() == held
    post_load = eng.stats()["workers"][0]["post_load_count"]
    end(eng)  # the session "loaded weights": no post_load_weights
    begin(eng)
    end(eng)  # nothing loaded: post_load_weights runs (weight_updater.py L330)
    s = eng.stats()
    assert not s["session_open"] and not any(w["active"] for w in s["workers"])
    assert s["workers"][0]["post_load_count"] == post_load + 1


# --------------------------------------------------------------------------------------------
# pause, flush, versions
# --------------------------------------------------------------------------------------------


def requests(box: EngineBox, **body: Any) -> dict[str, int]:
    return ok(box, "POST", "/_slotsync/requests", body)


def pause(box: EngineBox, mode: str | None) -> None:
    body = {} if mode is None else {"mode": mode}
    assert ok(box, "POST", "/pause_generation", body) == {
        "message": "Generation paused successfully.", "status": "ok"}


def cont(box: EngineBox) -> None:
    assert ok(box, "POST", "/continue_generation", {}) == {
        "message": "Generation continued successfully.", "status": "ok"}


@LATEST
def test_pause_modes_and_the_writer_lock(eng: EngineBox, segs: Segments) -> None:
    """``abort`` (the default) aborts every request and never pauses the scheduler;
    ``retract`` moves running requests to the waiting queue; ``in_place`` leaves them
    running; a request arriving while paused waits in the tokenizer; an update while not
    paused waits for the running requests (``model_update_lock``)."""
    aborted = requests(eng, start=3)["aborted"]
    pause(eng, None)
    s = eng.stats()
    assert s["paused"] and not s["engine_paused"] and s["pause_mode"] == "abort"
    assert s["requests"]["aborted"] == aborted + 3 and s["requests"]["running"] == 0
    assert eng.is_paused()
    assert requests(eng, start=1)["held"] == 1
    cont(eng)
    assert not eng.is_paused() and requests(eng)["running"] == 1
    pause(eng, "retract")
    r = requests(eng, start=2)
    assert (r["running"], r["waiting"], r["held"]) == (0, 1, 2)
    assert call(eng, "POST", "/_slotsync/requests", {"finish": None})[0] == 409
    cont(eng)
    assert requests(eng)["running"] == 3
    pause(eng, "in_place")
    assert requests(eng)["running"] == 3 and eng.stats()["engine_paused"]
    cont(eng)
    # not paused: the update waits for the writer lock until no request runs
    done: list[tuple[int, Any]] = []
    t = model(6)
    body = packed(t, segs)
    begin_thread = threading.Thread(
        target=lambda: done.append(call(eng, "POST", "/begin_weight_update", {})))
    begin_thread.start()
    time.sleep(0.4)
    assert not done and not eng.stats()["session_open"]
    requests(eng, finish=None)
    begin_thread.join(10)
    assert done == [(200, {"success": True, "message": "Success"})]
    assert ok(eng, "POST", "/update_weights_from_tensor", body)["success"]
    end(eng)
    # update_weight_version aborts every request by default; not when told so
    requests(eng, start=2)
    assert ok(eng, "POST", "/update_weight_version",
              {"new_version": "w1", "abort_all_requests": False}) == {
        "success": True, "message": "Weight version updated to w1", "new_version": "w1"}
    assert requests(eng)["running"] == 2
    ok(eng, "POST", "/update_weight_version", {"new_version": "w2"})
    assert requests(eng)["running"] == 0 and eng.weight_version() == "w2"


@ALL
def test_flush_per_version(eng: EngineBox, segs: Segments) -> None:
    """``/flush_cache`` is refused while a request runs; after a ``retract`` pause the
    waiting requests block it on 0.5.20 only; ``timeout`` waits for idle. On 0.5.23 a
    refused flush after an update is a 400 with the weights loaded (``/model_info`` keeps
    the old version, the scheduler has the new one)."""
    v = version_of(eng)
    assert call(eng, "POST", "/flush_cache") == (200, (
        "Cache flushed.\nPlease check backend logs for more details. (When there are running "
        "or waiting requests, the operation will not be performed.)\n"))
    requests(eng, start=1)
    assert call(eng, "GET", "/flush_cache") == (400, "Flush cache failed.\n")
    assert call(eng, "POST", "/flush_cache?timeout=0.2") == (
        400, "Timed out waiting for idle state.")
    pause(eng, "retract")
    status, _ = call(eng, "POST", "/flush_cache")
    assert status == (400 if v == "0.5.20" else 200)
    cont(eng)
    waiter: list[tuple[int, Any]] = []
    th = threading.Thread(target=lambda: waiter.append(
        call(eng, "POST", "/flush_cache?timeout=20")))
    th.start()
    time.sleep(0.3)
    assert not waiter and eng.stats()["flush_pending"]
    assert call(eng, "POST", "/flush_cache?timeout=1")[1] == (
        "Another flush_cache is already in progress.")
    requests(eng, finish=None)
    th.join(10)
    assert waiter and waiter[0][0] == 200
    status, body = call(eng, "POST", "/flush_cache?timeout=-1")
    assert status == 400 and "greater_than_equal" in body["message"]
    if v != "0.5.23":
        return
    begin(eng)
    requests(eng, start=1)
    pause(eng, "in_place")
    t = model(7)
    assert call(eng, "POST", "/update_weights_from_tensor",
                packed(t, segs, weight_version="v7")) == (
        400, {"success": False, "message": FLUSH_REFUSED})
    assert eng.checksums()["tp0"] == sums(t)  # loaded all the same
    s = eng.stats()
    assert s["weight_version"] != "v7" and s["scheduler_weight_version"] == "v7"
    assert ok(eng, "POST", "/update_weights_from_tensor",
              packed(t, segs, flush_cache=False))["success"]
    end(eng)


@configs([(i, v) for i in IMPLS for v in ("0.5.21", "0.5.20")])
def test_failed_flush_after_an_update_kills_the_engine(eng: EngineBox,
                                                       segs: Segments) -> None:
    """0.5.20 / 0.5.21: ``assert flush_cache_success`` in the scheduler: the server dies."""
    begin(eng)
    requests(eng, start=1)
    pause(eng, "in_place")
    expect_death(eng, "POST", "/update_weights_from_tensor", packed(model(8), segs))


@ALL
def test_server_info_model_info_and_no_vllm_routes(eng: EngineBox) -> None:
    """``/server_info`` is flat server args plus ``version``, ``startup_time`` (per start),
    ``internal_states``, ``frontend`` from 0.5.21 and ``attn_dp_size`` in 0.5.23; SGLang has
    no ``/version`` and none of vLLM's routes."""
    v = version_of(eng)
    info = ok(eng, "GET", "/server_info")
    assert info["version"] == v
    assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (2, 1, 1)
    assert info["enable_dp_attention"] is False and info["tokenizer_worker_num"] == 1
    assert info["weight_version"] == "default"
    assert ("frontend" in info) == (v != "0.5.20") and info.get("frontend", "python") == "python"
    assert ("attn_dp_size" in info) == (v == "0.5.23")
    assert isinstance(info["startup_time"], dict) and info["startup_time"]["load_weight"] > 0
    assert len(info["internal_states"]) == 1
    assert ok(eng, "GET", "/model_info")["weight_version"] == eng.stats()["weight_version"]
    for method, path in [("GET", "/version"), ("GET", "/get_world_size"),
                         ("POST", "/update_weights"), ("GET", "/is_paused"),
                         ("POST", "/pause")]:
        assert call(eng, method, path) == (404, {"detail": "Not Found"}), path
    assert call(eng, "GET", "/update_weights_from_tensor") == (
        405, {"detail": "Method Not Allowed"})


@LATEST
def test_bodies_are_validated_as_sglang_does(eng: EngineBox, segs: Segments) -> None:
    """Validation errors are SGLang's 400 ``ErrorResponse`` (FastAPI's text of pydantic's
    errors); unknown fields are ignored; lax coercions apply."""
    status, body = call(eng, "POST", "/pause_generation", {"mode": "both"})
    assert status == 400 and set(body) == {"object", "message", "type", "param", "code"}
    assert (body["object"], body["type"], body["code"]) == ("error", "Bad Request", 400)
    assert "literal_error" in body["message"]
    assert "'abort', 'retract' or 'in_place'" in body["message"]
    status, body = call(eng, "POST", "/update_weights_from_tensor",
                        {"serialized_named_tensors": ["not base64!"]})
    assert status == 400 and "Expected base64-encoded bytes" in body["message"]
    status, body = call(eng, "POST", "/update_weights_from_tensor", {})
    assert status == 400 and "'missing'" in body["message"]
    assert "serialized_named_tensors" in body["message"]
    status, body = call(eng, "POST", "/pause_generation")  # no body at all
    assert status == 400 and "('body',)" in body["message"]
    status, body = call(eng, "POST", "/update_weight_version", {"new_version": 3})
    assert status == 400 and "string_type" in body["message"]
    begin(eng)
    t = model(9)
    got = ok(eng, "POST", "/update_weights_from_tensor",
             packed(t, segs, flush_cache="yes", disable_draft_model=True, extra=1))
    assert got["success"] and eng.checksums()["tp1"] == sums(t)
    status, body = call(eng, "POST", "/update_weights_from_tensor",
                        packed(t, segs, selector="both"))
    assert status == 400 and "literal_error" in body["message"]
    end(eng)


# --------------------------------------------------------------------------------------------
# DP, auth
# --------------------------------------------------------------------------------------------


def raw_status(box: EngineBox, method: str, path: str, key: str | None) -> int:
    """The status of one call made with ``key`` as the bearer token (None: no header)."""
    conn = http.client.HTTPConnection("127.0.0.1", box.eng.port, timeout=30)
    try:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=b"{}" if method == "POST" else None, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


@configs([("sglang", "0.5.23"), ("sglang-reference", "0.5.21")], "impl_version")
def test_dp_replicas_refused_with_a_500_and_auth(engines: Engines, segs: Segments,
                                                 impl_version: tuple[str, str]) -> None:
    """``dp_size > 1`` without attention DP: the route's assertion escapes (a bare 500,
    connection closed). Keys (SGLang's ``decide_request_auth``): the weight routes want the
    admin key when one is set, else the API key; the others the API key; ``/health`` none
    (the second case has both keys)."""
    impl, version = impl_version
    keys = {"api_key": "k1"} if impl == "sglang" else {"api_key": "k1", "admin_api_key": "a1"}
    box = engines.get(impl, version, workers=1, dp_size=2, **keys)
    info = ok(box, "GET", "/server_info")
    assert (info["dp_size"], info["enable_dp_attention"]) == (2, False)
    begin(box)
    body = update_body([packed_entry(model(1), UUIDS[0], segs)], "flattened_bucket")
    status, text, closed = raw_call(box, "POST", "/update_weights_from_tensor", body)
    assert (status, text, closed) == (500, b"Internal Server Error", True)
    end(box)
    admin = keys.get("admin_api_key", "k1")
    for method, path, good in [("GET", "/model_info", "k1"), ("GET", "/version", "k1"),
                               ("POST", "/flush_cache", admin),
                               ("POST", "/continue_generation", admin)]:
        assert raw_status(box, method, path, None) == 401, path
        assert raw_status(box, method, path, "wrong") == 401, path
        assert raw_status(box, method, path, good) in (200, 404), path
        if admin != "k1":  # with both keys, each route takes its own only
            assert raw_status(box, method, path, "a1" if good == "k1" else "k1") == 401
    assert raw_status(box, "GET", "/health", None) == 200  # (after SGLang's 1 s wait)


@configs([("sglang-reference", "0.5.23"), ("sglang", "0.5.20")], "impl_version")
def test_attention_dp_passes(engines: Engines, segs: Segments,
                             impl_version: tuple[str, str]) -> None:
    """``--dp-size 2 --enable-dp-attention`` passes the route's check in every version;
    0.5.23 reports it resolved (``dp_size`` 1, ``attn_dp_size`` 2)."""
    impl, version = impl_version
    box = engines.get(impl, version, workers=1, dp_size=2, enable_dp_attention=True)
    info = ok(box, "GET", "/server_info")
    want = (1, 2, True) if version == "0.5.23" else (2, None, True)
    assert (info["dp_size"], info.get("attn_dp_size"), info["enable_dp_attention"]) == want
    begin(box)
    t = model(10)
    body = update_body([packed_entry(t, UUIDS[0], segs)], "flattened_bucket")
    assert ok(box, "POST", "/update_weights_from_tensor", body)["success"]
    end(box)
    assert box.checksums() == {"tp0": sums(t)}


# --------------------------------------------------------------------------------------------
# what kills SGLang kills the engine
# --------------------------------------------------------------------------------------------


def _misaligned(segs: Segments) -> dict:
    t = {NORM: model(1)[NORM], UP: model(1)[UP]}  # fp32 at byte 10: not a multiple of 4
    return update_body([packed_entry(t, u, segs, align=1) for u in UUIDS], "flattened_bucket")


DEATHS = {
    "unknown-uuid": lambda segs: update_body(
        [packed_entry(model(1), UUIDS[0], segs),
         packed_entry(model(1), "ffffffff-0000-0000-0000-000000000000", segs)],
        "flattened_bucket"),
    "gpu-prefix": lambda segs: update_body(
        [packed_entry(model(1), "GPU-" + u, segs) for u in UUIDS], "flattened_bucket"),
    "misaligned-bucket": _misaligned,
    "unknown-name": lambda segs: packed({"model.nope.weight": model(1)[UP]}, segs),
    "too-few-entries": lambda segs: update_body([packed_entry(model(1), UUIDS[0], segs)],
                                                "flattened_bucket"),
    "refused-global": lambda segs: update_body([global_entry("builtins", "print")] * 2),
    "unknown-load-format": lambda segs: update_body(
        [unpacked_entry(model(1), u, segs) for u in UUIDS], "safetensors"),
    "shape-mismatch": lambda segs: packed({UP: torch.zeros(3, 4)[:2]}, segs),
}


@pytest.mark.parametrize("cause", list(DEATHS))
@LATEST
def test_scheduler_exception_kills_the_engine(eng: EngineBox, segs: Segments,
                                              cause: str) -> None:
    """Each chunk SGLang's scheduler raises on (docs/sglang-contract.md 2.7) resets the
    call's connection and ends the engine: front and ranks exit; a restarted engine reports
    a new ``startup_time`` and the initial weight version."""
    started = ok(eng, "GET", "/server_info")["startup_time"]
    begin(eng)
    expect_death(eng, "POST", "/update_weights_from_tensor", DEATHS[cause](segs))
    eng.start_again()
    info = ok(eng, "GET", "/server_info")
    assert info["startup_time"] != started
    assert eng.weight_version() == "default"


@LATEST
def test_faults(eng: EngineBox, segs: Segments) -> None:
    """``/_slotsync/fault``: a 400 instead of the update (nothing loaded), a slow call, a
    failed pause (a bare 500), and ``exit`` (the engine dies on the call)."""
    begin(eng)
    before = eng.checksums()
    ok(eng, "POST", "/_slotsync/fault", {"route": "update_weights_from_tensor", "status": 400,
                                         "message": "no"})
    assert call(eng, "POST", "/update_weights_from_tensor", packed(model(11), segs)) == (
        400, {"success": False, "message": "no"})
    assert eng.checksums() == before
    ok(eng, "POST", "/_slotsync/fault", {"route": "end_weight_update", "hang_s": 0.5,
                                         "status": 200})
    t0 = time.monotonic()
    end(eng)
    assert time.monotonic() - t0 >= 0.5
    ok(eng, "POST", "/_slotsync/fault", {"route": "pause_generation", "status": 500})
    assert call(eng, "POST", "/pause_generation", {}) == (500, "Internal Server Error")
    ok(eng, "POST", "/_slotsync/fault", {"route": "update_weight_version", "status": 400,
                                         "message": "no"})
    assert call(eng, "POST", "/update_weight_version", {"new_version": "x"}) == (
        400, {"success": False, "message": "Failed to update weight version: no"})
    faults = eng.stats()["faults"]
    assert all(f["fired"] == 1 for f in faults) and "exit" in faults[0]
    ok(eng, "POST", "/_slotsync/fault", {"route": "continue_generation", "exit": True})
    expect_death(eng, "POST", "/continue_generation", {})


@LATEST
def test_a_rank_raising_kills_the_engine(eng: EngineBox, segs: Segments) -> None:
    """A ``workers: [1]`` fault raises inside rank 1's load: a scheduler exception."""
    begin(eng)
    ok(eng, "POST", "/_slotsync/fault", {"route": "update_weights_from_tensor",
                                         "workers": [1], "message": "rank 1 broke"})
    expect_death(eng, "POST", "/update_weights_from_tensor", packed(model(12), segs))
    assert "TP rank 1: RuntimeError: rank 1 broke" in eng.eng.log_tail(20000)


# --------------------------------------------------------------------------------------------
# EngineBox's questions, asked of every impl
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "sglang-reference"])
def test_engine_box_helpers_answer_for_every_impl(engines: Engines, impl: str) -> None:
    """``EngineBox.stats`` / ``checksums`` / ``weight_version`` / ``is_paused`` ask each impl
    through its own routes and answer in one shape (vLLM's contract: ``/weight_checker``,
    ``/weight_info``, ``/is_paused``, as the vLLM-code engine answers them too -- not started
    here, ~7 s; the SGLang engines': ``/_slotsync/checksums``, ``/model_info``,
    ``/_slotsync/stats``)."""
    if impl == "sglang-reference":
        box = engines.get(impl, "0.5.23", weight_version="w0")
    else:
        box = EngineBox(2, impl_name=impl, model=model_file(list(model(0).items())))
    try:
        assert box.weight_version() == ("w0" if box.is_sglang else "default")
        assert box.is_paused() is False
        assert isinstance(box.stats()["paused"], bool) and len(box.stats()["workers"]) == 2
        got = box.checksums()
        assert len(got) == 2 and all(s == sums(model(0)) for s in got.values())
        if box.is_sglang:
            assert set(got) == {"tp0", "tp1"}
            assert ok(box, "GET", "/server_info")["weight_version"] == "w0"
            pause(box, "retract")
        else:
            ok(box, "POST", "/pause")
        assert box.is_paused() is True
        box.reset()
        assert box.is_paused() is False
    finally:
        if not box.is_sglang:
            box.close()


# --------------------------------------------------------------------------------------------
# the command line, and what is left behind
# --------------------------------------------------------------------------------------------


def test_cli_refusals(tmp_path: Path) -> None:
    """Options of one engine kind are refused with another (argparse: exit 2); ``--impl
    sglang`` exits 2 saying so when SGLang cannot be imported."""
    from slotsync.engine.__main__ import main

    m = str(model_file(list(model(0).items())))
    for argv in (["--sglang-version", "0.5.21"], ["--impl", "sglang", "--model", m,
                                                   "--draft-model", m],
                 ["--impl", "sglang-reference"], ["--impl", "vllm", "--model", m,
                                                  "--api-key", "k"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
    stub = tmp_path / "stub" / "sglang"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('no SGLang here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "slotsync.engine", "--impl", "sglang",
                           "--model", m], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--impl sglang needs sglang.srt.utils.msgspec_utils" in proc.stderr
    assert "no SGLang here" in proc.stderr


def test_zz_nothing_left_behind(engines: Engines) -> None:
    """Last: every engine of the module stopped leaves no process (front or rank) and no
    shared-memory segment of this process."""
    for box in engines.boxes.values():
        if box.alive():
            engines.remember(box)
    pids = set(engines.pids)
    assert pids
    engines.close()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []
    assert shm_segments([os.getpid()]) == []

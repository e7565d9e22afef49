"""LoRA adapters on the SGLang-code engine (``--impl sglang --enable-lora``; issue 36 B), driven
end to end by the daemon's own SGLang code: ``daemon/sglang/adapters.py`` writes the bodies,
``SglangClient`` sends them (``routes.py``'s steps), over adapters a test lays out in shared
memory as slot ranks do (``tests/lora_adapters.py``). The engine runs SGLang 0.5.23's own
code (``engine/sglang/lora_code.py``): the request structs, the tokenizer's LoRA methods over
SGLang's ``LoRARegistry``, ``TpModelWorker.load_lora_adapter_from_tensors`` on each TP rank
(``SafeUnpickler``, the bucket, the checksum check), ``LoRAManager``'s validation.

* ``test_versions_load_beside_each_other_then_the_old_one_goes``: v1 (a bucket: one holder)
  then v2 (a dict: two holders) load, each proved on both TP ranks by the weights checker
  (which hashes nothing), their tensors' sha256 equal on both ranks; ``/v1/models`` lists
  them; the same name again is SGLang's 400 "already loaded"; v1 unloads and v2 stays; an
  unknown name's unload is a 400.
* ``test_unload_waits_for_the_requests_using_it``: sglang#32238's rule in SGLang's own
  registry: the name is unregistered at once (a new request naming it is refused), the
  unload answers only once the running request finished, and a load meanwhile waits for it
  (``lora_update_lock``).
* ``test_lora_off_and_a_refused_load``: an engine without ``--enable-lora``: SGLang's 400
  ("Please set `--enable-lora`"), ``lora_limits`` says disabled; a load the engine answers
  400 (an injected fault) leaves the served adapters as they were.
* ``test_a_hand_made_bucket_loads``: the route over plain HTTP with a payload written by the
  test-only writer (``tests/sglang_payloads.py``: tensors back to back, as SGLang's own
  producers pack), not the daemon's: each TP rank's copies have the tensors' sha256.
* ``test_the_engine_dies_mid_load`` / ``test_a_checksum_mismatch_kills_the_engine``: an
  exception on TP rank 1 after rank 0 answered, and a byte changed after the digest (SGLang's
  ``[LORA-CHECK]`` ``RuntimeError``): the engine is gone, as SGLang's server dies of a
  scheduler exception.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from adapter_e2e import SGLANG_UUIDS as UUIDS  # noqa: E402
from adapter_e2e import lora_state, sglang_box  # noqa: E402
from engines import EngineBox  # noqa: E402
from lora_adapters import make_adapter, publish, sha256_of  # noqa: E402
from state_readers import wait_for  # noqa: E402

from slotsync.daemon.engine_http import EngineError  # noqa: E402
from slotsync.daemon.sglang.adapters import (  # noqa: E402
    load_body,
    lora_limits,
    proving_body,
    served_adapters,
    unload_body,
)
from slotsync.daemon.sglang.client import SglangClient  # noqa: E402

pytestmark = pytest.mark.sglang

UUID_OF = {0: UUIDS[0], 1: UUIDS[1]}


@pytest.fixture(scope="module")
def box() -> Iterator[EngineBox]:
    b = sglang_box()
    yield b
    b.close()


@pytest.fixture
def lora(box: EngineBox) -> Iterator[EngineBox]:
    box.reset()
    yield box
    box.reset()


def steps(box: EngineBox, *calls: tuple[str, Any]) -> list[Any]:
    """The daemon's steps ``(route, body)`` on the engine, in order, through
    ``SglangClient``; an ``EngineError`` is returned in place of the answer."""
    async def run() -> list[Any]:
        c = SglangClient(box.url, timeout_s=60.0)
        out: list[Any] = []
        try:
            for route, body in calls:
                try:
                    out.append(await c.call(route, body))
                except EngineError as e:
                    out.append(e)
        finally:
            await c.close()
        return out

    return asyncio.run(run())


def test_versions_load_beside_each_other_then_the_old_one_goes(lora):
    info = steps(lora, ("version", None))[0]
    lim = lora_limits(info)
    assert (lim.enabled, lim.max_lora_rank, lim.max_loras) == (True, 8, 0)
    v1 = make_adapter(1)
    v2 = make_adapter(2)
    p1 = publish(v1, 0, version=1)
    p2 = publish(v2, {n: i % 2 for i, n in enumerate(v2)}, version=2)
    try:
        b1 = load_body(p1.plan, p1.handles, UUID_OF, 2)
        b2 = load_body(p2.plan, p2.handles, UUID_OF, 2)
        assert (b1["load_format"], b2["load_format"]) == ("flattened_bucket", None)
        prove = proving_body(2, "0.5.23")
        got = steps(lora, ("load_lora_adapter", b1), ("prove_adapter_copies", prove),
                    ("models", None), ("load_lora_adapter", b1),
                    ("load_lora_adapter", b2), ("prove_adapter_copies", prove),
                    ("models", None), ("unload_lora_adapter", unload_body("math@v1")),
                    ("models", None), ("unload_lora_adapter", unload_body("nope@v1")))
        assert got[0] == {} and got[1] == {}
        assert served_adapters(got[2]) == {"math@v1"}
        assert isinstance(got[3], EngineError) and got[3].status == 400, got[3]
        assert "Failed to load LoRA adapter math@v1 because it is already loaded" in str(got[3])
        assert got[4] == {} and got[5] == {}
        assert served_adapters(got[6]) == {"math@v1", "math@v2"}
        assert got[7] == {} and served_adapters(got[8]) == {"math@v2"}
        assert isinstance(got[9], EngineError) and got[9].status == 400
        assert "LoRA with name nope@v1 does not exist" in str(got[9])
        state = lora_state(lora)
        want = {n: sha256_of(t) for n, t in v2.items()}
        assert state["ranks"] == {"tp0": {"math@v2": want}, "tp1": {"math@v2": want}}
        assert state["hashed"] == [0, 0]  # the proving calls hashed no weight
        assert state["adapters"] == ["math@v2"] and state["pending_unloads"] == []
    finally:
        steps(lora, ("unload_lora_adapter", unload_body("math@v2")))
        p1.close()
        p2.close()


def test_unload_waits_for_the_requests_using_it(lora):
    p1 = publish(make_adapter(1), 0, version=1)
    p2 = publish(make_adapter(2), 0, version=2)
    try:
        assert steps(lora, ("load_lora_adapter",
                            load_body(p1.plan, p1.handles, UUID_OF, 2))) == [{}]
        status, got = lora.request("POST", "/_slotsync/lora_requests", {"start": "math@v1"})
        assert status == 200, got
        rid = got["rid"]
        done: dict[str, Any] = {}

        def run(key: str, route: str, body: Any) -> None:
            done[key] = steps(lora, (route, body))[0]

        unload = threading.Thread(target=run, args=("unload", "unload_lora_adapter",
                                                    unload_body("math@v1")))
        unload.start()
        assert wait_for(lambda: lora_state(lora)["pending_unloads"] == ["math@v1"], 60), (
            "timed out waiting for the unload")
        assert lora_state(lora)["adapters"] == []  # unregistered at once
        status, got = lora.request("POST", "/_slotsync/lora_requests", {"start": "math@v1"})
        assert status == 400 and "not loaded" in got["detail"], got
        load = threading.Thread(target=run, args=(
            "load", "load_lora_adapter", load_body(p2.plan, p2.handles, UUID_OF, 2)))
        load.start()
        time.sleep(0.5)  # (no bound asserted: both are still held, whatever the load)
        assert "unload" not in done and "load" not in done
        assert lora_state(lora)["pending_unloads"] == ["math@v1"]
        status, _ = lora.request("POST", "/_slotsync/lora_requests", {"finish": rid})
        assert status == 200
        unload.join(60)
        load.join(60)
        assert done == {"unload": {}, "load": {}}, done
        state = lora_state(lora)
        assert state["adapters"] == ["math@v2"] and state["pending_unloads"] == []
        assert set(state["ranks"]["tp1"]) == {"math@v2"}
    finally:
        steps(lora, ("unload_lora_adapter", unload_body("math@v2")))
        p1.close()
        p2.close()


def test_lora_off_and_a_refused_load(lora, fresh_sgl):
    pub = publish(make_adapter(3), 0, version=3)
    try:
        body = load_body(pub.plan, pub.handles, UUID_OF, 2)
        info, got, models = steps(fresh_sgl, ("version", None), ("load_lora_adapter", body),
                                  ("models", None))
        assert lora_limits(info).enabled is False
        assert isinstance(got, EngineError) and got.status == 400
        assert "LoRA is not enabled. Please set `--enable-lora` to enable LoRA." in str(got)
        assert served_adapters(models) == set()
        status, _ = lora.request("POST", "/_slotsync/fault", {
            "route": "load_lora_adapter_from_tensors", "status": 400,
            "message": "refused for the test"})
        assert status == 200
        got, models, again = steps(lora, ("load_lora_adapter", body), ("models", None),
                                   ("load_lora_adapter", body))
        assert isinstance(got, EngineError) and got.status == 400
        assert "refused for the test" in str(got)
        assert served_adapters(models) == set() and again == {}
    finally:
        steps(lora, ("unload_lora_adapter", unload_body("math@v3")))
        pub.close()


def test_a_hand_made_bucket_loads(lora):
    from lora_adapters import config
    from sglang_payloads import Segments, packed_entry, update_body

    tensors = make_adapter(6)
    segs = Segments()
    try:
        entries = [packed_entry(tensors, u, segs, rank=r, align=2)
                   for r, u in enumerate(UUIDS)]
        body = {"lora_name": "hand@v1", "config_dict": config(),
                "expected_checksums": {n: sha256_of(t) for n, t in tensors.items()},
                **update_body(entries, "flattened_bucket")}
        status, got = lora.request("POST", "/load_lora_adapter_from_tensors", body)
        assert status == 200 and got["success"] is True, got
        assert got["loaded_adapters"] == {"hand@v1": "__tensor__"}
        want = {n: sha256_of(t) for n, t in tensors.items()}
        assert lora_state(lora)["ranks"] == {"tp0": {"hand@v1": want}, "tp1": {"hand@v1": want}}
        status, got = lora.request("POST", "/unload_lora_adapter", {"lora_name": "hand@v1"})
        assert status == 200 and got["success"] is True, got
    finally:
        segs.close()


def test_the_engine_dies_mid_load(lora):
    pub = publish(make_adapter(4), 0, version=4)
    try:
        lora.request("POST", "/_slotsync/fault", {"route": "load_lora_adapter_from_tensors",
                                                  "workers": [1]})
        steps(lora, ("load_lora_adapter", load_body(pub.plan, pub.handles, UUID_OF, 2)))
        assert wait_for(lambda: not lora.alive(), 60), "timed out waiting for the engine to die"
    finally:
        pub.close()


def test_a_checksum_mismatch_kills_the_engine(lora):
    pub = publish(make_adapter(5), 0, version=5)
    try:
        body = load_body(pub.plan, pub.handles, UUID_OF, 2)
        pub.corrupt(next(iter(pub.tensors)))
        [got] = steps(lora, ("load_lora_adapter", body))
        assert isinstance(got, EngineError) and got.status == 0, got  # connection reset
        assert wait_for(lambda: not lora.alive(), 60), "timed out waiting for the engine to die"
    finally:
        pub.close()

"""Adapter rounds from ranks through a real slotsyncd into the SGLang-code engine (issue 36
B/D; ``--impl sglang`` with ``--enable-lora``: SGLang 0.5.23's own request structs,
``LoRARegistry``, ``TpModelWorker.load_lora_adapter_from_tensors`` with ``SafeUnpickler`` and
its checksum check on each of 2 TP ranks). Two hand-made ranks hand their parts over as
``transport="device"`` (the shared-memory stand-in of CUDA IPC: the engine maps them), by
the wire: ``AdapterBegin``, ``Ack(adapter_begin, transport="device")``, ``AdapterData``,
``Ack(adapter_data, served_name)`` -- which comes only after the call proving both TP ranks'
copies. Red on the old code: the daemon answered ``AdapterBegin`` with nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from adapter_e2e import SGLANG_UUIDS as UUIDS  # noqa: E402
from adapter_e2e import lora_state, sglang_box  # noqa: E402
from engines import EngineBox  # noqa: E402
from in_process_daemon import Rank, running_daemon, until  # noqa: E402
from lora_adapters import begin_tensors, config, make_adapter, publish, sha256_of  # noqa: E402

from slotsync.daemon.service.config import EngineEntry  # noqa: E402
from slotsync.protocol import wire  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def box() -> Iterator[EngineBox]:
    b = sglang_box()
    yield b
    b.close()


def adapter_round(links: list[Rank], update_id: int, version: int,
                  holder: dict[str, int]) -> tuple[list[Any], dict[str, str]]:
    """One round from both ranks (``holder``: tensor -> its rank); returns each rank's last
    reply and the adapter's tensors' sha256. The parts are freed after the reply."""
    tensors = make_adapter(version)
    pub = publish(tensors, holder, version=version)
    try:
        for r, link in enumerate(links):
            mine = {n: t for n, t in tensors.items() if holder[n] == r}
            link.send(wire.AdapterBegin(update_id, "math", version, json.dumps(config()),
                                        begin_tensors(mine)))
        acks = [link.recv(60) for link in links]
        if not all(isinstance(a, wire.Ack) for a in acks):
            return acks, {}
        assert [(a.phase, a.transport) for a in acks] == [("adapter_begin", "device")] * 2
        for r, link in enumerate(links):
            link.send(wire.AdapterData(update_id, pub.handles.get(r)))
        return [link.recv(60) for link in links], {n: sha256_of(t) for n, t in tensors.items()}
    finally:
        pub.close()


async def test_versions_go_from_the_ranks_memory_into_every_tp_rank(tmp_path, box):
    engine = EngineEntry(box.url, 0, 2, tuple(UUIDS), kind="sglang")
    async with running_daemon(tmp_path, engines=[engine]) as rig:
        d = rig.d
        links: list[Rank] = []
        names = list(make_adapter(0))

        def rounds() -> list[Any]:
            links.extend(rig.register(r, size=2, url=box.url) for r in (0, 1))
            assert all(isinstance(x.reply, wire.Registered) for x in links)
            one = adapter_round(links, 0, 1, {n: 0 for n in names})  # (a bucket: one holder)
            two = adapter_round(links, 1, 2, {n: i % 2 for i, n in enumerate(names)})
            return [one, two]

        (first, _), (second, sha2) = await asyncio.to_thread(rounds)
        assert [getattr(a, "served_name", a) for a in first] == ["math@v1"] * 2
        assert [getattr(a, "served_name", a) for a in second] == ["math@v2"] * 2
        # (v1's unload follows the acks; SGLang unregisters the name at once, then its TP
        # ranks unload it, then the daemon reads the answer: wait for all three)
        await until(lambda: lora_state(box)["adapters"] == ["math@v2"] and [
            a["state"] for a in d.status()["slots"][0]["adapters"]] == ["served"] and all(
            set(held) == {"math@v2"} for held in lora_state(box)["ranks"].values()),
            30.0, why=lambda: (lora_state(box), d.status()["slots"]), every_s=0.05)
        state = lora_state(box)
        assert state["ranks"] == {"tp0": {"math@v2": sha2}, "tp1": {"math@v2": sha2}}
        assert state["hashed"] == [0, 0]  # (the proving calls hashed no weight)
        # (the engine drops v1 before the daemon reads the unload's reply: poll the daemon too)
        await until(lambda: len(d.status()["slots"][0]["adapters"]) <= 1, 30.0,
                    why=lambda: d.status()["slots"][0]["adapters"], every_s=0.05)
        (s,) = d.status()["slots"]
        assert [(a["served_name"], a["state"]) for a in s["adapters"]] == [
            ("math@v2", "served")]
        assert s["engine_kind"] == "sglang" and s["engine_calls"]["prove_adapter_copies"] == 2
        # a version SGLang cannot take from these ranks: a tensor split over them, refused
        # before any engine call, naming what to do
        calls = dict(s["engine_calls"])
        parts = {0: [], 1: []}
        t = make_adapter(3)[names[0]]
        for r, rows in ((0, (0, 2)), (1, (2, 4))):
            parts[r] = [wire.AdapterTensor(names[0], "bfloat16", list(t.shape), *rows,
                                           "0" * 64)]

        def split() -> list[Any]:
            for r, link in enumerate(links):
                link.send(wire.AdapterBegin(2, "math", 3, json.dumps(config()), parts[r]))
            return [link.recv(60) for link in links]

        for err in await asyncio.to_thread(split):
            assert isinstance(err, wire.Error) and err.phase == "adapter_begin", err
            assert "is split over ranks" in err.message and "math@v2 stays served" in err.message
        assert d.status()["slots"][0]["engine_calls"] == calls

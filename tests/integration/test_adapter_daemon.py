"""Adapter rounds against a real slotsyncd (issue 36 C/D): an in-process ``Daemon``, two
hand-made ranks that put their parts in POSIX shared memory and speak the wire by hand
(``AdapterBegin``, ``Ack(adapter_begin, transport="host")``, ``AdapterData``,
``Ack(adapter_data, served_name)``), and a stand-in of vLLM's LoRA routes in the test's event
loop (``/v1/load_lora_adapter`` reads the folder the daemon wrote with safetensors, as
``LoRAModel.from_local_checkpoint`` does, and checks every tensor against the ranks' bytes).
The reference engine's LoRA routes are the vLLM helper's; once they are on main these rounds
run against it too (the lead's merge). Red on the old code: the daemon answered
``AdapterBegin`` with nothing (no route in the slot table)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from adapter_ranks import A, B, laid_out, two_rank_parts
from aiohttp import web
from fake_http_engine import serving
from in_process_daemon import DaemonRig, Rank, running_daemon, until
from prometheus_client import generate_latest
from safetensors import safe_open

from slotsync.protocol import wire

LORA_CONFIG = {"max_lora_rank": 16, "max_loras": 4, "max_cpu_loras": 4}


class LoraEngine:
    """vLLM 0.32's routes the daemon asks in an adapter round (dev mode, runtime LoRA
    updating on): ``loras`` name -> the folder it was loaded from; ``fail`` the next load's
    (status, message)."""

    def __init__(self, expect: dict[str, dict[str, bytes]]) -> None:
        self.expect = expect  # served name -> tensor name -> its whole bytes
        self.loras: dict[str, str] = {}
        self.requests: list[str] = []
        self.fail: tuple[int, str] | None = None
        self.slow_s = 0.0  # the next load takes this long (and then registers the name)
        # vLLM's OpenAIServingModels takes lora_resolver_lock[lora_name] in load and unload:
        # an unload of a name waits for its load to end
        self.locks: dict[str, asyncio.Lock] = {}

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        self.requests.append(path)
        if path == "/get_world_size":
            return web.json_response({"world_size": 2})
        if path == "/version":
            return web.json_response({"version": "0.32.0"})
        if path == "/server_info":
            return web.json_response({"vllm_config": {"lora_config": LORA_CONFIG},
                                      "vllm_env": {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": True}})
        if path == "/v1/models":
            return web.json_response({"object": "list", "data": [
                {"id": "base", "parent": None}, *({"id": n, "parent": "base", "root": p}
                                                   for n, p in self.loras.items())]})
        body = await request.json()
        name = body["lora_name"]
        async with self.locks.setdefault(name, asyncio.Lock()):
            return await self.lora_route(path, name, body)

    async def lora_route(self, path: str, name: str, body: dict) -> web.Response:
        if path == "/v1/load_lora_adapter" and self.slow_s:
            slow, self.slow_s = self.slow_s, 0.0
            await asyncio.sleep(slow)  # (the daemon gave up meanwhile; vLLM goes on)
        if path == "/v1/load_lora_adapter":
            if self.fail is not None:
                (status, message), self.fail = self.fail, None
                return web.json_response({"error": {"message": message}}, status=status)
            if name in self.loras:
                return web.json_response({"error": {"message": f"The lora adapter '{name}' "
                                                    "has already been loaded."}}, status=400)
            self.check_folder(name, body["lora_path"])
            self.loras[name] = body["lora_path"]
            return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            if self.loras.pop(name, None) is None:
                return web.json_response({"error": {"message": f"The lora adapter '{name}' "
                                                    "cannot be found."}}, status=404)
            return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
        return web.json_response({"error": {"message": "Not Found"}}, status=404)

    def check_folder(self, name: str, folder: str) -> None:
        """What vLLM's worker reads (``PEFTHelper.from_local_dir``: adapter_config.json;
        ``LoRAModel.from_local_checkpoint``: adapter_model.safetensors), checked here."""
        config = json.loads(Path(folder, "adapter_config.json").read_text())
        assert config["r"] == 4 and config["target_modules"] == ["q_proj", "v_proj"]
        with safe_open(str(Path(folder, "adapter_model.safetensors")), "np") as f:
            assert set(f.keys()) == set(self.expect[name])
            for t in f.keys():
                got = f.get_tensor(t)
                assert got.dtype == np.float32 and got.tobytes() == self.expect[name][t], t


def expected(version: int) -> dict[str, bytes]:
    parts = two_rank_parts(version)
    return {A: parts[0][0][1], B: parts[0][1][1] + parts[1][0][1]}


class ShmRank(Rank):
    """A rank of slot [0, 2) that hands its adapter parts over through a POSIX shared-memory
    segment; registered with engine ``url`` on ``rig``'s daemon, closed with it."""

    def __init__(self, rig: DaemonRig, rank: int, url: str) -> None:
        super().__init__(rig.ctx, rig.d.endpoint, rank, size=2, url=url)
        assert isinstance(self.reply, wire.Registered), self.reply
        self.segments: list[str] = []
        rig.ranks.append(self)

    def data(self, update_id: int, version: int) -> wire.AdapterData:
        payload = laid_out(two_rank_parts(version)[self.rank])
        name = f"slotsync-test-lora-{os.getpid()}-{self.rank}-{update_id}"
        Path("/dev/shm", name).write_bytes(payload)
        self.segments.append(name)
        return wire.AdapterData(update_id, wire.ShmHandle(name, 0, len(payload)))

    def close(self) -> None:
        for name in self.segments:  # (freed after the daemon's reply, as a rank does)
            Path("/dev/shm", name).unlink(missing_ok=True)
        super().close()


def adapter_round(ranks: list[ShmRank], update_id: int, version: int) -> list[object]:
    """One round from both ranks; returns each rank's last reply (an Ack or an Error)."""
    parts = two_rank_parts(version)
    for r in ranks:
        r.send(wire.AdapterBegin(update_id, "math", version, json.dumps(
            {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}),
            [t for t, _ in parts[r.rank]]))
    acks = [r.recv() for r in ranks]
    if not all(isinstance(a, wire.Ack) for a in acks):
        return acks
    assert all(a.phase == "adapter_begin" and a.transport == "host" for a in acks), acks
    for r in ranks:
        r.send(r.data(update_id, version))
    return [r.recv() for r in ranks]


def first_round(rig: DaemonRig, url: str, ranks: list[ShmRank]) -> list[object]:
    """Ranks 0 and 1 register (kept in ``ranks``) and publish v1 in update 0; returns their
    last replies (blocking: run it in a thread)."""
    ranks.extend(ShmRank(rig, r, url) for r in (0, 1))
    return adapter_round(ranks, 0, 1)


@asynccontextmanager
async def stand_in_and_daemon(tmp_path: Path, versions: tuple[int, ...], **config: object
                              ) -> AsyncIterator[tuple[LoraEngine, DaemonRig, str]]:
    """The stand-in of vLLM's LoRA routes expecting ``math@v<version>`` of ``versions``
    (served on this loop), and an in-process daemon (``running_daemon(tmp_path,
    **config)``): ``(engine, rig, engine_url)``; both stopped after the block."""
    engine = LoraEngine({f"math@v{v}": expected(v) for v in versions})
    async with (serving(engine.handle, path="/{route:.*}") as url,
                running_daemon(tmp_path, **config) as rig):
        yield engine, rig, url


async def test_vllm_rounds_write_load_replace_and_keep_only_the_folders_an_engine_needs(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="slotsync.daemon")
    async with stand_in_and_daemon(tmp_path, (1, 2, 3)) as (engine, rig, url):
        d = rig.d
        root = Path(d.config.adapter_path())
        assert root == tmp_path / "rt" / "adapters" and (root.stat().st_mode & 0o777) == 0o700
        ranks: list[ShmRank] = []

        def rounds() -> list[list[object]]:
            return [first_round(rig, url, ranks), adapter_round(ranks, 1, 2)]

        t0 = time.time()
        first, second = await asyncio.to_thread(rounds)
        for reply in first + second:
            assert isinstance(reply, wire.Ack) and reply.phase == "adapter_data", reply
        assert [r.served_name for r in first + second] == ["math@v1"] * 2 + ["math@v2"] * 2
        slot = root / "slot-0-2"
        umask = os.umask(0)
        os.umask(umask)
        # (an engine of another user reads it once adapter_dir's own mode lets it enter)
        assert stat.S_IMODE(slot.stat().st_mode) == 0o755 & ~umask
        assert stat.S_IMODE((slot / "math@v2").stat().st_mode) == 0o755
        await until(lambda: len(engine.loras) == 1)  # (v1's unload follows the acks)
        assert engine.loras == {"math@v2": str(slot / "math@v2")}  # v1 unloaded after v2
        assert engine.requests.count("/v1/unload_lora_adapter") == 1
        assert (slot / "math@v1").is_dir()  # kept one round more (a running request)

        def entries() -> list[dict]:
            (s,) = d.status()["slots"]
            return s["adapters"]

        # (the engine drops v1 before it answers the unload; v1's entry, "unloading", goes
        # when that answer reaches the daemon: a loaded machine runs the test's poll between)
        await until(lambda: [e["served_name"] for e in entries()] == ["math@v2"],
                    why=lambda: f"the daemon's adapters: {entries()}")
        (s,) = d.status()["slots"]
        (entry,) = s["adapters"]
        assert entry["served_name"] == "math@v2" and entry["state"] == "served"
        assert t0 - 1 <= entry["loaded_at"] <= time.time() + 1  # unix seconds
        assert entry["nbytes"] == 4 * 16 * 4 + 16 * 4 * 4 and s["adapter_round"] is None
        loaded = [r.slotsync_fields for r in caplog.records if r.getMessage() == "adapter_loaded"]
        assert [f["served_name"] for f in loaded] == ["math@v1", "math@v2"], loaded
        assert all(f["seconds"] >= f["load_s"] >= 0 for f in loaded)
        # a load vLLM refuses: the error names it and the version still served; the failed
        # version's folder goes, nothing else changes
        engine.fail = (500, "LoRA rank 4 is greater than max_lora_rank 2")
        third = await asyncio.to_thread(adapter_round, ranks, 2, 3)
        for err in third:
            assert isinstance(err, wire.Error) and err.phase == "adapter_data", err
            assert "max_lora_rank 2" in err.message and "(math@v2 stays served)" in err.message
        assert set(engine.loras) == {"math@v2"}
        # (removed off the event loop)
        await until(lambda: not (slot / "math@v3").exists(), 5.0, every_s=0.05,
                    why=lambda: f"{slot / 'math@v3'} is still there")
        # the rounds' ends in Prometheus (the executor hands every SlotEvent to Metrics)
        text = generate_latest(d.metrics.registry).decode()
        assert 'slotsync_adapter_loads_total{outcome="success"} 2.0' in text, text
        assert 'slotsync_adapter_loads_total{outcome="failed"} 1.0' in text
        assert 'slotsync_adapter_served_version{lora_name="math",slot="[0,2)"} 2.0' in text
    # at the stop: the served version's folder stays (vLLM reads it again after every
    # base-weight finish), and so does the one unloaded last (a request admitted before its
    # unload may still read it); the failed version's is gone
    assert sorted(p.name for p in (root / "slot-0-2").iterdir()) == ["math@v1", "math@v2"]


async def test_a_restarted_engine_gets_its_adapter_again_before_the_next_ack(tmp_path):
    async with stand_in_and_daemon(tmp_path, (1, 2)) as (engine, rig, url):
        ranks: list[ShmRank] = []
        replies = await asyncio.to_thread(first_round, rig, url, ranks)
        assert all(isinstance(a, wire.Ack) for a in replies)
        engine.loras.clear()  # a new vLLM process at the URL: it lists no adapter
        engine.requests.clear()
        replies = await asyncio.to_thread(adapter_round, ranks, 1, 2)
        assert [getattr(r, "served_name", r) for r in replies] == ["math@v2"] * 2
        await until(lambda: len(engine.loras) == 1)
        loads = [p for p in engine.requests if p.endswith("load_lora_adapter")]
        assert loads == ["/v1/load_lora_adapter"] * 2 + ["/v1/unload_lora_adapter"]
        assert set(engine.loras) == {"math@v2"}  # v1 loaded again from its folder, replaced


async def test_a_load_past_its_deadline_is_undone_and_the_previous_version_stays(tmp_path):
    """adapter_load_timeout_s 1: the load of v2 takes 3 s and registers v2 after the daemon
    gave up; the daemon's unload of v2 waits for it (vLLM's per-name lock) and removes it:
    the engine never keeps a version the ranks were told failed."""
    async with stand_in_and_daemon(tmp_path, (1, 2), adapter_load_timeout_s=1.0) as (
            engine, rig, url):
        d = rig.d
        ranks: list[ShmRank] = []
        replies = await asyncio.to_thread(first_round, rig, url, ranks)
        assert all(isinstance(a, wire.Ack) for a in replies)
        engine.slow_s = 3.0
        t0 = time.monotonic()
        for err in await asyncio.to_thread(adapter_round, ranks, 1, 2):
            assert isinstance(err, wire.Error) and err.phase == "adapter_data", err
            assert "no answer within 1 s (adapter_load_timeout_s)" in err.message
            # (no answer: what it serves is the engine's next answer's to tell)
            assert "what it serves is checked at its next answer; it served math@v1 before " \
                "this round" in err.message and "stays served" not in err.message
        assert time.monotonic() - t0 >= 3.0  # (the errors waited for the unload of v2)
        assert engine.loras == {"math@v1": str(Path(d.config.adapter_path(), "slot-0-2",
                                                    "math@v1"))}
        (s,) = d.status()["slots"]
        assert [(a["served_name"], a["state"]) for a in s["adapters"]] == [("math@v1",
                                                                          "served")]
        assert "no answer within 1 s" in s["adapter_last_error"]

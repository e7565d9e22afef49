"""``slotsync demo``'s trainer ranks: the rank process (``rank_main``, spawned once per rank:
loads the model, perturbs it each round, publishes it, reports the checksums to the demo; with
``--lora`` it publishes adapter versions instead, ``slotsync.demo.lora.rank_rounds``), its
sender (slotsync's ``Publisher``, or vLLM's trainer API with ``--backend vllm-api``), the
demo's end of the ranks' pipes (``RankResults``) and their stop (``stop_ranks``).

Standard library only at import; torch, safetensors and vLLM are imported in the rank process.
"""

from __future__ import annotations

import queue
import time
import traceback

from slotsync.demo.config import DemoConfig


def _perturb(named: list, round_index: int) -> None:
    """Add deterministic noise to every floating tensor (same on every rank)."""
    import torch

    for i, (_, t) in enumerate(named):
        if t.is_floating_point():
            g = torch.Generator(device="cpu").manual_seed(1_000_003 * round_index + i)
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32) * 1e-3
            t.add_(noise.to(device=t.device, dtype=t.dtype))


def rank_main(rank: int, cfg: DemoConfig, endpoints: list[str], engine_urls: list[str],
               init_file: str, uuids: list[str] | None, results) -> None:
    """One trainer rank (spawned process). Stopped with SIGTERM, also when the demo dies
    outright (``die_with_parent``), it unwinds: the publisher aborts its update and unlinks
    its shared memory. ``results`` is the write end of this rank's pipe to the demo;
    ``endpoints``: each node's daemon (``--nodes``; ranks are split evenly, in order), the
    rank publishes to its own node's."""
    import signal

    # Ctrl-C reaches the whole process group: the demo stops its ranks (SIGTERM); a rank
    # interrupted while importing torch printed "Process SpawnProcess-N: Traceback"
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from slotsync.testing.processes import die_with_parent
    from slotsync.testing.vllm_notices import hide_triton_notice_if_asked

    def _term(_sig: int, _frame: object) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, _term)
    die_with_parent()
    hide_triton_notice_if_asked()  # before --backend vllm-api imports vLLM: the demo showed it
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from slotsync.engine.checksum import tensor_checksum
    from slotsync.protocol.rank.groups import new_slot_groups
    from slotsync.protocol.topology import SlotTopology

    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=cfg.ranks)
        per = cfg.gpus_per_engine or cfg.ranks
        # (the slots and their groups; with --nodes 2 the one slot spans both nodes' daemons,
        # which is the daemons' tables' business, not the ranks')
        topo = SlotTopology(world_size=cfg.ranks, gpus_per_node=cfg.ranks, gpus_per_engine=per)
        slot = topo.slot_of(rank)
        engine_url = engine_urls[slot.start // per]
        group = new_slot_groups(topo, rank)
        if cfg.device == "cuda":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        endpoint = endpoints[rank * len(endpoints) // cfg.ranks]  # its node's daemon
        if cfg.lora:  # adapter rounds (the base model stays the engine's)
            from slotsync.demo.lora import rank_rounds

            with _sender(cfg, rank, slot, endpoint, engine_url, dev,
                         uuids[rank] if uuids else None, []) as sender:
                rank_rounds(cfg, rank, slot, sender.pub, group, topo.is_coordinator(rank),
                            results)
            dist.destroy_process_group()
            results.send(("done", rank))
            return
        weights = load_file(str(cfg.model), device=str(dev))
        named = sorted(weights.items())
        sender = _sender(cfg, rank, slot, endpoint, engine_url, dev,
                         uuids[rank] if uuids else None, named)
        with sender:
            for k in range(1, cfg.rounds + 1):
                _perturb(named, k)
                version = f"demo-round-{k}"
                stats = sender.publish(named, version)
                dist.barrier(group=group)
                if topo.is_coordinator(rank):
                    want = {n: tensor_checksum(t) for n, t in named}
                    results.send(("round", k, version, stats.chunks, stats.bytes, stats.seconds,
                                 want, slot.start))
                dist.barrier(group=group)
        dist.destroy_process_group()
        results.send(("done", rank))
    except BaseException as e:  # report every failure to the parent, then exit non-zero
        try:
            results.send(("error", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:  # the demo is gone
            pass
        raise SystemExit(1) from None


class RankResults:
    """The demo's read ends of its ranks' pipes, read as one queue (``get``).

    Pipes rather than a ``multiprocessing.Queue``: a queue's semaphores belong to the demo
    process, so a SIGKILLed demo left them to multiprocessing's resource tracker, which
    warned "There appear to be 3 leaked semaphore objects to clean up at shutdown".
    """

    def __init__(self, readers: list) -> None:
        self.open = list(readers)
        self.ready: list = []

    def get(self, timeout: float):  # noqa: ANN201 - a rank's message tuple
        """The next message of any rank; raises ``queue.Empty`` after ``timeout`` seconds
        without one (also once every rank's pipe is closed)."""
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout
        while True:
            while self.ready:
                conn = self.ready.pop(0)
                try:
                    return conn.recv()
                except (EOFError, OSError):  # that rank exited: no more from it
                    self.open.remove(conn)
                    conn.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            if not self.open:  # every rank has exited: nothing more will come
                time.sleep(left)
                raise queue.Empty
            self.ready = list(wait(self.open, timeout=left))

    def close(self) -> None:
        """Close every read end still open."""
        for conn in self.open:
            conn.close()
        self.open = []


def stop_ranks(procs: list, wait_s: float = 0.0, grace_s: float = 10.0) -> None:
    """Wait up to ``wait_s`` seconds in all for the rank processes to exit by themselves,
    SIGTERM those still running (they unwind: abort the update, unlink their shared memory),
    and SIGKILL any still running ``grace_s`` seconds later. Idempotent."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        if p.pid is not None:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for sig in ("terminate", "kill"):
        running = [p for p in procs if p.pid is not None and p.is_alive()]
        for p in running:
            getattr(p, sig)()
        deadline = time.monotonic() + grace_s
        for p in running:
            p.join(timeout=max(0.0, deadline - time.monotonic()))


class _ApiSender:
    """A rank's sender through vLLM's trainer API: ``WeightTransferTrainerFactory.trainer_init``
    with ``SlotsyncTrainerInitInfo`` over a ``ModuleSource`` of the rank's weights (the
    module's parameters are the same tensors, so perturbing them changes what it sends)."""

    def __init__(self, cfg: DemoConfig, rank: int, slot: object, endpoint: str,
                 engine_url: str, dev: object, gpu_uuid: str | None, named: list) -> None:
        from vllm.distributed.weight_transfer import (
            HTTPVLLMWeightSyncClient,
            ModuleSource,
            WeightTransferTrainerFactory,
        )

        from slotsync.engine.vllm.model import SafetensorsModel
        from slotsync.integrations.vllm import SlotsyncTrainerInitInfo

        info = SlotsyncTrainerInitInfo(
            rank=rank, packed=cfg.packed, packed_buffer_size_bytes=cfg.staging_bytes,
            endpoint=endpoint, slot=slot, device=dev, gpu_uuid=gpu_uuid,
            timeout_s=cfg.timeout_s)  # type: ignore[arg-type]
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=HTTPVLLMWeightSyncClient(engine_url),
            source=ModuleSource(SafetensorsModel(dict(named))))

    def publish(self, _named: list, version: str):  # noqa: ANN201 - PublishStats
        return self.engine.send_weights(weight_version=version)

    def __enter__(self) -> _ApiSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.shutdown()


class _PublisherSender:
    """A rank's registered ``Publisher`` (``--backend publisher``)."""

    def __init__(self, pub) -> None:  # noqa: ANN001 - Publisher
        self.pub = pub
        pub.register()

    def publish(self, named: list, version: str):  # noqa: ANN201 - PublishStats
        return self.pub.publish(named, version)

    def __enter__(self) -> _PublisherSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pub.close()


def _sender(cfg: DemoConfig, rank: int, slot, endpoint: str, engine_url: str, dev,
            gpu_uuid: str | None, named: list) -> _ApiSender | _PublisherSender:
    """The rank's sender for ``cfg.backend`` (registered with the daemon)."""
    if cfg.backend == "vllm-api":
        return _ApiSender(cfg, rank, slot, endpoint, engine_url, dev, gpu_uuid, named)
    from slotsync.testing.ranks import rank_publisher

    pub = rank_publisher(endpoint, rank, slot, engine_url, device=dev, packed=cfg.packed,
                         gpu_uuid=gpu_uuid, staging_bytes=cfg.staging_bytes,
                         timeout_s=cfg.timeout_s)
    try:
        return _PublisherSender(pub)
    except BaseException:
        pub.close()
        raise

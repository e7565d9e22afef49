"""Where ``slotsync bench lora``'s time goes, each step measured alone in the bench's process
with the code that runs it in the real path (the rank's copy and hashing come from
``AdapterStats`` of the run itself):

* ``rank copy`` and ``rank digests``: the rank's own ``protocol/rank/adapters/part.py``
  ``AdapterPart.fill`` of the whole adapter on the shm transport (a fresh POSIX shared-memory
  segment, the tensors copied in at ``wire.part_offsets`` while threads take each tensor's
  sha256; its ``copy_s`` and ``digest_s``), the segment unlinked after;
* ``sha256``: ``hashlib.sha256`` over the adapter's bytes, once -- what the rank does to take
  its digests and the daemon does again when it copies the parts into the folder (not when
  it links one rank's segment);
* ``daemon write``: the daemon's own ``daemon/vllm/adapters.py`` ``write_adapter_folder`` of
  the adapter as one rank's part, copied (read from memory as the daemon reads a mapped
  segment, each part's sha256 checked by threads while it is written, the safetensors file
  and ``adapter_config.json`` written into a temp folder, then renamed) into a folder on the
  daemon's adapter filesystem: the path of a round whose tensors are split over ranks;
* ``daemon link``: the same call as the daemon runs it for a round one rank holds whole:
  that rank's segment, laid out and sealed by the rank's own ``AdapterPart`` (``fill``,
  ``handle("host")``), hard-linked as the file (``daemon/service/adapter_io.py``
  ``PartReader.take``: its checks, the read lease) into the same folder;
* ``engine read``: the folder read as vLLM 0.32's ``LoRAModel.from_local_checkpoint`` reads it
  (``safetensors.safe_open``, every tensor's ``get_tensor``);
* ``engine checksums``: the test engines' sha256 of every tensor as read (their test-only
  ``/_slotsync/lora`` instrumentation, ``engine/reference/lora.py`` and
  ``engine/vllm/lora.py``): part of both paths' engine time here, not of vLLM's.

Each figure is the median of ``repeats`` runs, seconds.
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def one_rank_plan(tensors: dict[str, Any], config_json: str, r: int) -> tuple[Any, bytes]:
    """The ``AdapterPlan`` the daemon builds when one rank holds ``tensors`` whole, and that
    rank's part as its handle carries it (``wire.part_offsets``)."""
    import torch

    from slotsync.daemon.core.adapters.plan import AdapterPart, AdapterPlan, AdapterTensorPlan
    from slotsync.protocol.wire import AdapterTensor, part_offsets, served_name

    raw = {n: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
           for n, t in tensors.items()}
    wire_tensors = [AdapterTensor(n, str(t.dtype).removeprefix("torch."), list(t.shape), 0,
                                  t.shape[0], hashlib.sha256(raw[n]).hexdigest())
                    for n, t in tensors.items()]
    offsets, total = part_offsets(wire_tensors)
    buf = bytearray(total)
    plans = []
    for off, w in zip(offsets, wire_tensors, strict=True):
        buf[off:off + w.nbytes] = raw[w.name].tobytes()
        plans.append(AdapterTensorPlan(w.name, w.dtype, tuple(w.shape), (
            AdapterPart(0, off, w.nbytes, 0, w.shape[0], w.sha256),)))
    plan = AdapterPlan("profile", 1, served_name("profile", 1), config_json, r, tuple(plans),
                       (0,))
    return plan, bytes(buf)


def _link_s(parts: list[Any], root: Path, repeats: int) -> float:
    """Median seconds of the daemon's ``write_adapter_folder`` linking one rank's sealed
    segment of ``parts`` (the rank's ``part_tensors``) into ``root``.

    Raises:
        RuntimeError: the daemon did not link it (says why).
    """
    import json

    import torch

    from slotsync.daemon.core.adapters.gather import gather
    from slotsync.daemon.service.adapter_io import PartReader
    from slotsync.daemon.vllm.adapters import write_adapter_folder
    from slotsync.protocol import wire
    from slotsync.protocol.rank.adapters.part import AdapterPart

    part = AdapterPart(parts, rank=0, transport="shm", device=torch.device("cpu"), owned=[])
    try:
        digests = part.fill()
        plan = gather({0: wire.AdapterBegin(
            update_id=0, lora_name="profile", version=2,
            config_json=json.dumps({"r": 8, "target_modules": ["q_proj"]}),
            tensors=[wire.AdapterTensor(t.name, t.dtype, list(t.shape), 0, t.shape[0], d)
                     for t, d in zip(parts, digests, strict=True)])})
        handle = part.handle("host")
        times = []
        for _ in range(repeats):
            shutil.rmtree(root / plan.served_name, ignore_errors=True)
            t0 = time.perf_counter()
            with PartReader({0: handle}) as reader:
                write_adapter_folder(root, plan, reader.read, reader.take)
            times.append(time.perf_counter() - t0)
            if reader.taken != {0: ""}:
                raise RuntimeError(f"the daemon did not link the part: {reader.taken}")
        shutil.rmtree(root / plan.served_name, ignore_errors=True)
        return statistics.median(times)
    finally:
        part.free()


def _median_s(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile(tensors: dict[str, Any], config_json: str, r: int, daemon_root: Path,
            repeats: int = 3) -> dict[str, float]:
    """The steps of the module docstring, seconds: ``{"rank_copy", "rank_digests", "sha256",
    "daemon_write", "daemon_link", "engine_read", "engine_checksums"}``. ``daemon_root``: a
    folder on the filesystem the daemon writes its adapters to (a temp folder is made and
    removed inside it)."""
    import torch
    from safetensors import safe_open

    from slotsync.daemon.vllm.adapters import write_adapter_folder
    from slotsync.engine.checksum import tensor_checksum
    from slotsync.protocol.rank.adapters.inputs import part_tensors
    from slotsync.protocol.rank.adapters.part import AdapterPart
    from slotsync.protocol.topology import EngineSlot

    plan, part = one_rank_plan(tensors, config_json, r)
    cpu = torch.device("cpu")
    parts = part_tensors(tensors, None, rank=0, slot=EngineSlot(0, 1), transport="shm",
                         device=cpu)
    fills = []
    for _ in range(repeats):
        p = AdapterPart(parts, rank=0, transport="shm", device=cpu, owned=[])
        try:
            p.fill()
            fills.append((p.copy_s, p.digest_s))
        finally:
            p.free()

    view = memoryview(part)

    def read(_rank: int, offset: int, nbytes: int) -> memoryview:
        return view[offset:offset + nbytes]

    root = Path(tempfile.mkdtemp(prefix="slotsync-bench-lora-profile-", dir=daemon_root))
    try:
        out = {"rank_copy": statistics.median(c for c, _ in fills),
               "rank_digests": statistics.median(d for _, d in fills),
               "sha256": _median_s(lambda: hashlib.sha256(part).hexdigest(), repeats)}

        def write() -> None:
            shutil.rmtree(root / plan.served_name, ignore_errors=True)
            write_adapter_folder(root, plan, read)

        out["daemon_write"] = _median_s(write, repeats)
        out["daemon_link"] = _link_s(parts, root, repeats)
        file = str(root / plan.served_name / "adapter_model.safetensors")
        read_back: dict[str, Any] = {}

        def engine_read() -> None:
            with safe_open(file, framework="pt") as f:
                read_back.update({n: f.get_tensor(n) for n in f.keys()})

        out["engine_read"] = _median_s(engine_read, repeats)
        out["engine_checksums"] = _median_s(
            lambda: [tensor_checksum(t) for t in read_back.values()], repeats)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)

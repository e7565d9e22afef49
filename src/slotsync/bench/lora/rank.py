"""A trainer rank of ``slotsync bench lora`` (a spawned process): both paths, interleaved.

Every rank makes the same adapter (``adapter.adapter_tensors``, seed 0) on its device and
keeps its rows of it (``adapter.rank_rows``: the whole adapter with one rank). Each repetition
runs both paths, ``slotsync`` then ``disk`` on even repetitions and the other way round on odd
ones, so that drift hits both; all ranks start each path together (a barrier):

* ``slotsync``: ``Publisher.publish_adapter("bench", part, config, version)`` on every rank,
  version ``1, 2, ...``; each rank stamps the call's start and return with ``time.monotonic``
  (``CLOCK_MONOTONIC``: one clock for every process of the machine) and sends them with its
  ``AdapterStats`` (copy, digest, begin wait, data wait).
* ``disk``: rank 0 alone, holding the whole adapter (as after a gather, which is not counted:
  the disk path's favour), saves it as PEFT's ``save_pretrained`` does
  (``adapter.save_like_peft``) into a new folder under the disk folder, then ``POST
  /v1/load_lora_adapter`` to the engine (what TRL and verl do); stamps before the save, after
  it, and at the answer. The name is then unloaded and the folder removed, not timed.

At the end rank 0 sends the sha256 of every tensor (``engine.checksum.tensor_checksum``), so
that the run can check the engine holds the last version as sent.

Messages to the run (the write end of a pipe): ``("slotsync", rep, rank, t0, t1, stats
dict)``, ``("disk", rep, t0, t_saved, t1)``, ``("want", {tensor: sha256})``, ``("done",
rank)`` or ``("error", rank, text)``.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from slotsync.bench.lora.adapter import adapter_tensors, peft_config, rank_rows, save_like_peft

LORA_NAME = "bench"


def post(url: str, path: str, body: dict[str, Any], timeout_s: float) -> tuple[int, str]:
    """``POST url+path`` with a JSON body: (status, the answer's text)."""
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def order(rep: int) -> tuple[str, str]:
    """The paths of repetition ``rep``, in the order they run (A/B, then B/A)."""
    return ("slotsync", "disk") if rep % 2 == 0 else ("disk", "slotsync")


def rank_main(rank: int, ranks: int, shapes: Any, device: str, endpoint: str,
              engine_url: str, disk_dir: str, reps: int, timeout_s: float, barrier: Any,
              conn: Any) -> None:
    """One rank (module docstring); ``shapes``: an ``adapter.Shapes``; ``device``: ``"cpu"``
    or ``"cuda"`` (the rank's tensors on ``cuda:<rank>``)."""
    import signal

    from slotsync.testing.processes import die_with_parent

    def _term(_sig: int, _frame: object) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the run stops its ranks)
    signal.signal(signal.SIGTERM, _term)
    die_with_parent()
    try:
        _run(rank, ranks, shapes, device, endpoint, engine_url, disk_dir, reps, timeout_s,
             barrier, conn)
        conn.send(("done", rank))
    except BaseException as e:  # (reported, then a non-zero exit)
        try:
            conn.send(("error", rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except OSError:
            pass
        barrier.abort()
        raise SystemExit(1) from None


def _run(rank: int, ranks: int, shapes: Any, device: str, endpoint: str, engine_url: str,
         disk_dir: str, reps: int, timeout_s: float, barrier: Any, conn: Any) -> None:
    import torch

    from slotsync.engine.checksum import tensor_checksum
    from slotsync.testing.ranks import rank_publisher

    dev = torch.device("cuda", rank % torch.cuda.device_count()) if device == "cuda" else (
        torch.device("cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tensors = adapter_tensors(shapes, 0, dev)
    part, rows = rank_rows(tensors, rank, ranks)
    config = peft_config(shapes)
    pub = rank_publisher(endpoint, rank, (0, ranks), engine_url, device=dev,
                         timeout_s=timeout_s)
    version = 0
    with pub:
        pub.register()
        for rep in range(reps):
            for path in order(rep):
                barrier.wait(timeout_s)
                if path == "slotsync":
                    version += 1
                    t0 = time.monotonic()
                    stats = pub.publish_adapter(LORA_NAME, part, config, version, rows=rows)
                    t1 = time.monotonic()
                    conn.send(("slotsync", rep, rank, t0, t1, asdict(stats)))
                elif rank == 0:
                    conn.send(("disk", rep, *_disk_round(tensors, config, Path(disk_dir),
                                                         engine_url, rep, timeout_s)))
                barrier.wait(timeout_s)
    if rank == 0:
        conn.send(("want", {n: tensor_checksum(t) for n, t in tensors.items()}))


def _disk_round(tensors: dict[str, Any], config: str, root: Path, engine_url: str, rep: int,
                timeout_s: float) -> tuple[float, float, float]:
    """One disk-path load (module docstring): ``(t0, t_saved, t1)``.

    Raises:
        RuntimeError: the engine refused the load or the unload.
    """
    name = f"disk-{rep}"
    folder = root / name
    t0 = time.monotonic()
    save_like_peft(folder, tensors, config)
    t_saved = time.monotonic()
    status, text = post(engine_url, "/v1/load_lora_adapter",
                        {"lora_name": name, "lora_path": str(folder)}, timeout_s)
    t1 = time.monotonic()
    if status != 200:
        raise RuntimeError(f"the disk path's load of {folder} answered {status}: {text}")
    status, text = post(engine_url, "/v1/unload_lora_adapter", {"lora_name": name}, timeout_s)
    if status != 200:
        raise RuntimeError(f"the disk path's unload of {name} answered {status}: {text}")
    shutil.rmtree(folder, ignore_errors=True)
    return t0, t_saved, t1

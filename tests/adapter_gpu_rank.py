"""A trainer rank of the adapter GPU test (``tests/gpu/test_gpu_adapters.py``; issue 36): the
real ``Publisher.publish_adapter`` on ``cuda:0``, through a real slotsyncd, one round per
command (spawned: :func:`adapter_rank` runs in a process of its own, commands and answers
over queues).

Each round builds the whole adapter (:func:`adapter`: Qwen3-8B's shapes, ``sglang_lora_gpu``'s
layout, random bf16 from a CUDA generator seeded with the version, so every rank builds the
same tensors) and publishes this rank's part of it (``layout``):

* ``"one"``: rank 0 holds every tensor, the others an empty part;
* ``"spread"``: whole tensors, round-robin over the ranks;
* ``"rows"``: every tensor split in rows over the ranks (``rows=``).

Around the call it measures what the rank's GPU holds beyond its tensors
(``torch.cuda.memory_allocated()``, after ``torch.cuda.ipc_collect()``): right after the call
returns (the part is freed after the daemon's ``Ack(adapter_data)``), and, should that not be
0, again until it is or 30 s passed -- a CUDA IPC export an engine still holds (its reference
count above zero) stays in torch's IPC limbo and counts.

The garbage test of the base-weight fence, applied to adapter memory (``garbage_on_ack.py``
for base weights): ``AdapterPart.free`` is wrapped in this process so that, once the part is
``consumed`` (the daemon's ``Ack(adapter_data)`` was read), every byte the daemon's transport
used -- the device buffer on ``"device"`` (the engine mapped it), the shared-memory segment on
``"host"`` (the daemon read it) -- is overwritten with ``0xFF`` and the fill waited for, before
the real ``free``. An engine still reading the part after the Ack would load garbage. A
segment the rank sealed (laid out as the adapter's file, which the daemon may hard-link,
``AdapterPart.handle``) cannot be overwritten by the rank: its mapping is closed, which is
checked in ``/proc/self/maps``, and its bytes count as ``sealed``.

Answers: ``("round", rank, version, report)`` with ``report`` = the ``AdapterStats`` fields,
``left_now`` / ``left`` (bytes), ``garbage`` (bytes overwritten), ``sealed`` (bytes of a
sealed segment), ``part_tensors``, and on
rank 0 ``sums`` (``{name: sha256}`` of the whole adapter as the trainer holds it, from
``.cpu()`` bytes: independent of the publisher's digests); ``("crash", rank, traceback)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import traceback
from typing import Any

LORA_NAME = "qwen3"
R = 32


def config(r: int = R) -> dict[str, Any]:
    """The adapter's PEFT config."""
    from sglang_lora_gpu import MODULES

    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r,
            "lora_dropout": 0.0, "bias": "none", "target_modules": list(MODULES),
            "inference_mode": True}


def adapter(version: int, layers: int, device: str) -> dict[str, Any]:
    """The whole adapter of ``version`` (module docstring), on ``device``."""
    import torch
    from sglang_lora_gpu import qwen3_layout

    g = torch.Generator(device=device).manual_seed(1000 + version)
    return {n: (torch.randn(shape, generator=g, device=device) * 0.01).to(torch.bfloat16)
            for n, shape in qwen3_layout(R, layers)}


def sha256_of(t: Any) -> str:
    """sha256 of a tensor's bytes in C order (SGLang's and the reference engine's digest)."""
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                          .numpy().tobytes()).hexdigest()


def part_of(tensors: dict[str, Any], layout: str, rank: int, n: int
            ) -> tuple[dict[str, Any], dict[str, tuple[int, tuple[int, ...]]] | None]:
    """This rank's part of ``tensors`` under ``layout`` (module docstring), and ``rows``."""
    names = list(tensors)
    if layout == "one":
        return ({k: tensors[k] for k in names} if rank == 0 else {}), None
    if layout == "spread":
        return {k: tensors[k] for k in names[rank::n]}, None
    mine, rows = {}, {}
    for k, t in tensors.items():
        step = -(-t.shape[0] // n)
        lo, hi = min(rank * step, t.shape[0]), min((rank + 1) * step, t.shape[0])
        if hi > lo:
            mine[k] = t[lo:hi]
            rows[k] = (lo, tuple(t.shape))
    return mine, rows


def _install_garbage(spoiled: list[int], sealed: list[int]) -> None:
    import torch

    from slotsync.protocol.rank.adapters.part import AdapterPart

    real_free = AdapterPart.free

    def free(self: AdapterPart) -> None:
        if self.consumed and not getattr(self, "_spoiled", False):
            self._spoiled = True  # type: ignore[attr-defined]
            n = 0
            if self.device_buffer is not None:
                self.device_buffer.fill_(0xFF)
                torch.cuda.synchronize(self.device_buffer.device)
                n += self.device_buffer.numel()
            seg = self.segment
            if seg is not None and seg.tensor is not None:
                seg.tensor.fill_(0xFF)
                n += seg.tensor.numel()
            elif seg is not None and seg.sealed:
                # Sealed (a part laid out as the adapter's file, which the daemon may link):
                # this process gave up its mapping, so it can spoil nothing; prove it holds
                # no mapping of the segment any more, and count its bytes as sealed.
                with open("/proc/self/maps") as f:
                    assert seg.name not in f.read(), f"segment {seg.name} still mapped"
                sealed.append(self.nbytes)
            spoiled.append(n)
        real_free(self)

    AdapterPart.free = free  # type: ignore[method-assign]


def adapter_rank(rank: int, n: int, endpoint: str, url: str, device: str, layers: int,
                 commands: Any, answers: Any, gpu_uuid: str | None = "logical") -> None:
    """One trainer rank (module docstring) on ``device`` (``"cuda:<i>"``, or ``"cpu"``:
    shared memory), registering ``gpu_uuid`` (``rank_publisher``'s: ``"logical"``, or None
    for the GPU's own). Commands: ``(version, layout)``, or None to close the publisher and
    exit."""
    try:
        import torch

        from slotsync.testing.ranks import rank_publisher

        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.device(device))
        spoiled: list[int] = []
        sealed: list[int] = []
        _install_garbage(spoiled, sealed)
        pub = rank_publisher(endpoint, rank, (0, n), url, device=device if cuda else None,
                             gpu_uuid=gpu_uuid, packed=False, timeout_s=240.0)
        pub.register()
        try:
            while (cmd := commands.get()) is not None:
                version, layout = cmd
                tensors = adapter(version, layers, device)
                mine, rows = part_of(tensors, layout, rank, n)

                def held() -> int:
                    if not cuda:
                        return 0
                    torch.cuda.synchronize()
                    torch.cuda.ipc_collect()
                    return torch.cuda.memory_allocated()

                base = held()
                del spoiled[:], sealed[:]
                stats = pub.publish_adapter(LORA_NAME, mine, config(), version, rows=rows)
                left_now = left = held() - base
                deadline = time.monotonic() + 30
                while left and time.monotonic() < deadline:
                    time.sleep(0.2)
                    left = held() - base
                report = {**dataclasses.asdict(stats), "left_now": left_now, "left": left,
                          "garbage": sum(spoiled), "sealed": sum(sealed),
                          "part_tensors": len(mine)}
                if rank == 0:
                    report["sums"] = {k: sha256_of(t) for k, t in tensors.items()}
                del tensors, mine
                answers.put(("round", rank, version, report))
        finally:
            pub.close()
    except Exception:  # noqa: BLE001 - reported to the test
        answers.put(("crash", rank, traceback.format_exc()))

"""``python -m slotsync.engine``: run the reference engine (see ``slotsync.engine.server``).

Example::

    python -m slotsync.engine --port 8000 --workers 4 --device cpu
    python -m slotsync.engine --port 8000 --workers 2 --device cuda --cuda-devices 0,0 \\
        --gpu-uuids $(python -c 'from slotsync.protocol.wire import logical_gpu_uuid as u; \\
        print(u(0) + "," + u(1))')
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence

from slotsync.engine.worker import WorkerSpec
from slotsync.protocol.wire import logical_gpu_uuid, normalize_gpu_uuid


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m slotsync.engine",
        description="Reference engine speaking vLLM 0.33's weight-transfer HTTP contract.",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--uds", default=None,
                   help="serve on this Unix socket path instead of TCP (like `vllm serve --uds`); "
                   "clients use the URL unix:///PATH")
    p.add_argument("--workers", type=int, default=1, help="worker processes = world size")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--cuda-devices",
        type=_csv,
        default=None,
        help="device index per worker, e.g. 0,0,0,0 (default: worker i -> cuda:i if there are "
        "that many GPUs, else cuda:0)",
    )
    p.add_argument(
        "--gpu-uuids",
        type=_csv,
        default=None,
        help="GPU UUID per worker ('GPU-' prefix optional). Default: logical_gpu_uuid(i) on "
        "cpu, the real device UUID on cuda",
    )
    p.add_argument("--model", default=None, help="safetensors file loaded on every worker")
    p.add_argument(
        "--discard",
        action="store_true",
        help="benchmark mode: validate every update_info as usual (unpickle, lengths, GPU "
        "UUIDs) but map no memory and store nothing",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for the workers"
    )
    return p


def build_specs(args: argparse.Namespace) -> list[WorkerSpec]:
    """One ``WorkerSpec`` per worker from parsed CLI arguments.

    Raises:
        SystemExit: inconsistent options (lengths, bad UUIDs).
    """
    n = args.workers
    if n < 1:
        raise SystemExit("--workers must be >= 1")
    uuids: list[str | None]
    if args.gpu_uuids is not None:
        if len(args.gpu_uuids) != n:
            raise SystemExit(f"--gpu-uuids has {len(args.gpu_uuids)} entries, --workers is {n}")
        try:
            uuids = [normalize_gpu_uuid(u) for u in args.gpu_uuids]
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if len(set(uuids)) != n:
            raise SystemExit("--gpu-uuids must be distinct")
    elif args.device == "cpu":
        uuids = [logical_gpu_uuid(i) for i in range(n)]
    else:
        uuids = [None] * n
    if args.device == "cpu":
        devices = ["cpu"] * n
    else:
        if args.cuda_devices is not None:
            if len(args.cuda_devices) != n:
                raise SystemExit(
                    f"--cuda-devices has {len(args.cuda_devices)} entries, --workers is {n}"
                )
            idx = [int(x) for x in args.cuda_devices]
        else:
            import torch

            count = torch.cuda.device_count()
            if count == 0:
                raise SystemExit("--device cuda but no CUDA device is visible")
            idx = list(range(n)) if count >= n else [0] * n
        devices = [f"cuda:{i}" for i in idx]
    return [
        WorkerSpec(i, devices[i], uuids[i], args.model, discard=args.discard)
        for i in range(n)
    ]


def main(argv: Sequence[str] | None = None) -> None:
    """Start the workers, then serve HTTP until SIGINT/SIGTERM."""
    args = build_parser().parse_args(argv)
    specs = build_specs(args)


    from slotsync.engine.server import EngineApp, WorkerPool

    pool = WorkerPool(specs, startup_timeout_s=args.startup_timeout)
    engine = EngineApp(pool)
    for w in pool.workers:
        print(
            f"[slotsync.engine] worker {w.spec.index}: {w.device} gpu_uuid={w.gpu_uuid}",
            file=sys.stderr,
            flush=True,
        )
    where = f"unix://{args.uds}" if args.uds else f"http://{args.host}:{args.port}"
    try:
        import uvloop  # like the daemon: its sockets cost less per call than asyncio's

        runner = uvloop.run
    except ImportError:  # optional on platforms without it
        runner = asyncio.run
    try:
        runner(_serve(engine.app, args, where, len(specs)))
    except OSError as e:
        print(f"[slotsync.engine] cannot listen on {where}: {e.strerror}", file=sys.stderr)
        pool.close()
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        pass


async def _serve(app, args: argparse.Namespace, where: str, world_size: int) -> None:
    """Bind (TCP or Unix socket), say so only once bound, serve until SIGTERM / SIGINT."""
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = (web.UnixSite(runner, args.uds) if args.uds
                else web.TCPSite(runner, args.host, args.port))
        await site.start()
        print(f"[slotsync.engine] serving {where} (world size {world_size})", file=sys.stderr,
              flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()

if __name__ == "__main__":
    main()

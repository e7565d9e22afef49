"""``python -m slotsync.engine``: run an engine for tests, demos and benchmarks.

Two implementations (``--impl``):

* ``reference`` (default): slotsync's reference engine (aiohttp front
``slotsync.engine.reference.server``,
  workers ``slotsync.engine.reference.worker``). ``--receive vllm`` makes its workers load every
  update
  through vLLM's own ``IPCWeightTransferEngine.update_weights`` (``parse_update_info``,
  ``receive_weights``, ``PackedBufferImporter``; ``slotsync.engine.reference.vllm_receive``): for
  the GPU
  machine, where only ``vllm/distributed/weight_transfer`` can be made importable
  (``tools/vllm_shim.py``; ``SLOTSYNC_VLLM_SHIM=DIR`` puts such a folder first on the
  workers' ``sys.path``).
* ``vllm``: vLLM's own router, exception handlers, uvicorn launcher and per-worker
  ``gpu_worker.Worker`` state machine over stand-ins for the engine core and the CUDA calls
  (``slotsync.engine.vllm.server``, ``slotsync.engine.vllm.worker``). Needs the vllm package
  and ``--model``.
* ``sglang``: SGLang's weight-sync routes (``/pause_generation``,
  ``/update_weights_from_tensor``, ``/begin_weight_update``, ...) with the rules of the SGLang
  version given by ``--sglang-version`` (``slotsync.engine.sglang.server``), each TP rank a
  worker process that reads its own payload entry through SGLang's own
  ``normalize_serialized_named_tensor_payload``, ``SafeUnpickler``, ``patch_torch`` and
  ``FlattenedTensorBucket`` over a CPU stand-in for the CUDA rebuild, or with ``--device
  cuda`` over torch's own (real CUDA IPC; copies on a stream of the rank's own, as SGLang's
  ``schedule_stream``) (``slotsync.engine.sglang.worker``); bodies validated by SGLang's own
  ``msgspec_struct_pydantic_core_schema`` / ``Base64Bytes``. Needs the sglang package
  (``pip install --no-deps sglang``), or ``SLOTSYNC_SGLANG_SHIM=DIR`` (the folder
  ``tools/sglang_shim.py`` builds), and ``--model``.
* ``sglang-reference``: the same routes and rules with slotsync's own payload parser and
  validation helpers (needs pydantic, not SGLang).

All exit 2 with a message when what they need cannot be imported.

Example::

    python -m slotsync.engine --port 8000 --workers 4 --device cpu
    python -m slotsync.engine --impl vllm --workers 2 --model m.safetensors
    python -m slotsync.engine --impl vllm --workers 4 --data-parallel-size 2 --model m.safetensors
    python -m slotsync.engine --impl sglang --workers 2 --model m.safetensors \\
        --sglang-version 0.5.21
    SLOTSYNC_SGLANG_SHIM=build/sglang-shim python -m slotsync.engine --impl sglang \\
        --workers 1 --device cuda --model m.safetensors
    python -m slotsync.engine --port 8000 --workers 2 --device cuda --cuda-devices 0,0 \\
        --gpu-uuids $(python -c 'from slotsync.protocol.wire import logical_gpu_uuid as u; \\
        print(u(0) + "," + u(1))')
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence

from slotsync.engine import lora_flags
from slotsync.engine.reference.worker import WorkerSpec
from slotsync.protocol.wire import logical_gpu_uuid, normalize_gpu_uuid

IMPLS = ("reference", "vllm", "sglang", "sglang-reference")
SGLANG_IMPLS = ("sglang", "sglang-reference")
SGLANG_VERSIONS = ("0.5.20", "0.5.21", "0.5.23")
SGLANG_OPTIONS = {"sglang_version": "0.5.23", "weight_version": "default", "dp_size": 1,
                  "pp_size": 1, "enable_dp_attention": False, "api_key": None,
                  "admin_api_key": None, "reported_version": None,
                  "copy_sleep_cycles": None, "free_received": "version"}
"""The SGLang engines' options and their defaults (refused with another --impl)."""


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m slotsync.engine",
        description="Engine speaking vLLM's weight-transfer HTTP contract: slotsync's "
        "reference engine, or vLLM's own router and worker code (--impl vllm).",
    )
    p.add_argument("--impl", choices=IMPLS, default="reference",
                   help="reference: slotsync's reference engine (default); vllm: vLLM's own "
                   "router, handlers, uvicorn launcher and gpu_worker.Worker state machine "
                   "(needs vllm and --model); sglang: SGLang's weight-sync routes with "
                   "SGLang's own payload parser (needs sglang and --model); "
                   "sglang-reference: the same routes with slotsync's own parser")
    p.add_argument("--receive", choices=("reference", "vllm"), default="reference",
                   help="reference engine only: how workers load an update; vllm: through "
                   "vLLM's IPCWeightTransferEngine.update_weights (needs "
                   "vllm.distributed.weight_transfer.ipc_engine importable)")
    p.add_argument("--executor-replies", choices=("vllm", "all"),
                   default=os.environ.get("SLOTSYNC_VLLM_EXECUTOR_REPLIES", "vllm"),
                   help="--impl vllm with several workers: vllm (default) reads worker "
                   "replies as vLLM 0.32's MultiprocExecutor does (stops at the first "
                   "failure, later replies stay queued for the next calls); all: reads every "
                   "reply of each call. Default from $SLOTSYNC_VLLM_EXECUTOR_REPLIES")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--uds", default=None,
                   help="serve on this Unix socket path instead of TCP (like `vllm serve --uds`); "
                   "clients use the URL unix:///PATH")
    p.add_argument("--workers", type=int, default=1, help="worker processes = world size")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="DP replicas behind this one API server, like `vllm serve "
                   "--data-parallel-size D` (default 1): --workers counts all of them (D x "
                   "TP); worker i is TP rank i %% TP of replica i // TP, the index of a "
                   "list-form update_info")
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
    p.add_argument("--draft-model", default=None,
                   help="safetensors file of a speculative-decoding draft model on every "
                   "worker (issue 18: /start_draft_weight_update loads into it); default none")
    p.add_argument("--worker-models", type=_csv, default=None,
                   help="one safetensors file per worker, comma-separated, instead of --model: "
                   "worker i holds only the tensors of file i, as a worker of an "
                   "expert-parallel engine holds only its own experts (plus the shared "
                   "weights)")
    p.add_argument(
        "--discard",
        action="store_true",
        help="benchmark mode: validate every update_info as usual (unpickle, lengths, GPU "
        "UUIDs) but map no memory and store nothing",
    )
    p.add_argument("--parallel-config", type=_json_object, default=None,
                   help="--impl vllm only: a JSON object of vLLM ParallelConfig fields set on "
                   "this API server's vllm_config (what GET /server_info and /get_world_size "
                   "report), as `vllm serve`'s data-parallel flags would set them on one node "
                   "of a larger deployment, e.g. '{\"data_parallel_size\": 4, "
                   "\"data_parallel_size_local\": 2, \"data_parallel_rank\": 2, "
                   "\"data_parallel_hybrid_lb\": true}' (a hybrid-LB node whose server "
                   "reaches DP ranks 2-3); --data-parallel-size stays the replicas this "
                   "server runs")
    p.add_argument("--vllm-version", default=None,
                   help="reference engine only: the version GET /version reports (default "
                   "0.32.0, the vLLM it follows; any text, e.g. 0.25.0 or garbage, for "
                   "tests); --impl vllm reports the installed vllm's own")
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for the workers"
    )
    lora_flags.add_arguments(p)
    g = p.add_argument_group("SGLang engines (--impl sglang | sglang-reference); --workers "
                             "is the TP size")
    g.add_argument("--sglang-version", choices=SGLANG_VERSIONS, default="0.5.23",
                   help="the SGLang version whose routes and rules the engine follows "
                   "(default 0.5.23)")
    g.add_argument("--weight-version", default="default",
                   help="the weight version at start (SGLang's --weight-version)")
    g.add_argument("--dp-size", type=int, default=1,
                   help="reported DP size (SGLang's --dp-size; > 1 without "
                   "--enable-dp-attention refuses /update_weights_from_tensor with a 500)")
    g.add_argument("--pp-size", type=int, default=1, help="reported PP size (--pp-size)")
    g.add_argument("--enable-dp-attention", action="store_true",
                   help="attention DP (SGLang's --enable-dp-attention)")
    g.add_argument("--reported-version", default=None,
                   help="the version /server_info reports (default: --sglang-version's; a "
                   "test gives an unsupported one, e.g. 0.5.22, to see it refused)")
    g.add_argument("--api-key", default=None, help="SGLang's --api-key")
    g.add_argument("--admin-api-key", default=None, help="SGLang's --admin-api-key")
    g.add_argument("--copy-sleep-cycles", type=_csv, default=None, metavar="N[,N...]",
                   help="tests, --device cuda: GPU clock cycles of torch.cuda._sleep queued on "
                   "each TP rank's copy stream before each weight copy (one value for every "
                   "rank, or one per rank), so that the copies finish late (issue 26's "
                   "garbage test)")
    g.add_argument("--free-received", choices=("version", "after-barrier"),
                   default="version",
                   help="tests: when the TP ranks free the received tensors: as the SGLang "
                   "version does (default; 0.5.20 before the TP barrier, 0.5.21+ after it), "
                   "or after the barrier whatever the version (a 0.5.20 engine that frees "
                   "late: the garbage test's negative control)")
    from slotsync.engine.sglang.server_info import add_lora_args

    add_lora_args(g)  # (issue 36: the SGLang-code engine's LoRA routes)
    return p


def build_specs(args: argparse.Namespace) -> list[WorkerSpec]:
    """One ``WorkerSpec`` per worker from parsed CLI arguments.

    Raises:
        SystemExit: inconsistent options (lengths, bad UUIDs).
    """
    n = args.workers
    if n < 1:
        raise SystemExit("--workers must be >= 1")
    dp = getattr(args, "data_parallel_size", 1)
    if dp < 1 or n % dp:
        raise SystemExit(f"--workers {n} is not a multiple of --data-parallel-size {dp} "
                         "(every DP replica has the same number of workers)")
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
    models = getattr(args, "worker_models", None)
    if models is not None and len(models) != n:
        raise SystemExit(f"--worker-models has {len(models)} entries, --workers is {n}")
    lora = getattr(args, "lora", None) or lora_flags.LoraOptions()
    return [
        WorkerSpec(i, devices[i], uuids[i], models[i] if models else args.model,
                   discard=args.discard, receive=args.receive,
                   draft_model_path=args.draft_model, lora=lora)
        for i in range(n)
    ]


def _require(modules: Sequence[str], what: str) -> None:
    """Import ``modules`` or exit 2 saying why ``what`` cannot run."""
    import importlib

    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - ImportError, or vllm failing to initialise
            print(f"[slotsync.engine] {what} needs {m}, which cannot be imported: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> None:
    """Start the workers, then serve HTTP until SIGINT/SIGTERM."""
    from slotsync.testing.vllm_notices import (
        hide_triton_notice_if_asked,
        hide_triton_notice_in_children,
    )

    parser = build_parser()
    args = parser.parse_args(argv)
    hide_triton_notice_if_asked()  # vLLM's Triton notice: shown by this engine's parent, or
    hide_triton_notice_in_children()  # by this process, and not by each of its workers
    if args.model is not None and args.worker_models is not None:
        parser.error("--model and --worker-models exclude each other")
    if args.impl == "vllm":
        if args.model is None and args.worker_models is None:
            parser.error("--impl vllm needs --model or --worker-models (vLLM always serves a "
                         "model)")
        if args.discard or args.receive != "reference" or args.vllm_version is not None:
            parser.error("--discard, --receive and --vllm-version are reference-engine "
                         "options")
    if args.impl in SGLANG_IMPLS:
        _check_sglang_args(parser, args)
    else:
        given = [k for k, d in SGLANG_OPTIONS.items() if getattr(args, k) != d]
        if given:
            parser.error(f"--{given[0].replace('_', '-')} is an SGLang-engine option "
                         "(--impl sglang | sglang-reference)")
    if args.parallel_config is not None and args.impl != "vllm":
        parser.error("--parallel-config is a vLLM-code engine option (--impl vllm): the "
                     "reference engine's /server_info has no parallel_config")
    if args.impl in SGLANG_IMPLS:  # (their LoRA flags: server_info.lora_settings)
        for opt in ("max_loras", "max_cpu_loras"):
            if getattr(args, opt, None) is not None:
                parser.error(f"--{opt.replace('_', '-')} is an option of --impl reference | "
                             "vllm (SGLang's: --max-loras-per-batch, --max-loaded-loras)")
        args.lora = lora_flags.LoraOptions()
    else:
        try:
            args.lora = lora_flags.from_args(args)
        except ValueError as e:
            parser.error(str(e))
    for opt, path in [("--model", args.model), ("--draft-model", args.draft_model),
                      *(("--worker-models", m) for m in args.worker_models or ())]:
        if path is not None and not os.path.isfile(path):
            # (before any worker starts: a worker would only fail later, in a traceback)
            parser.error(f"{opt} {path}: no such file" if not os.path.exists(path)
                         else f"{opt} {path}: not a file")
    if args.draft_model is not None and args.receive != "reference":
        parser.error("--draft-model needs --receive reference (the draft model's loads use "
                     "the reference receive path)")
    specs = build_specs(args)
    if args.impl == "vllm":
        _main_vllm(args, specs)
        return
    if args.impl in SGLANG_IMPLS:
        _main_sglang(args, specs, argv)
        return
    if args.receive == "vllm":
        from slotsync.engine.reference.vllm_receive import use_shim_path

        use_shim_path()  # SLOTSYNC_VLLM_SHIM, as the workers will
        _require(["vllm.distributed.weight_transfer.ipc_engine"], "--receive vllm")

    from slotsync.engine.reference.server import EngineApp, WorkerPool

    pool = WorkerPool(specs, startup_timeout_s=args.startup_timeout,
                      data_parallel_size=args.data_parallel_size)
    engine = EngineApp(pool, lora=args.lora, base_model=args.model or "", **(
        {} if args.vllm_version is None else {"vllm_version": args.vllm_version}))
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


VLLM_WORKER_IMPORTS = ("vllm.v1.worker.gpu_worker", "vllm.config", "vllm.config.weight_transfer",
                       "vllm.distributed.weight_transfer", "slotsync.engine.vllm.model")
"""What a vLLM-code worker imports as it starts (``VllmWorkerHost``): imported once by the
front when the workers fork from it."""


def _main_vllm(args: argparse.Namespace, specs: list[WorkerSpec]) -> None:
    """``--impl vllm``: vLLM-code workers, vLLM's router and launcher."""
    import importlib.util
    import threading

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    # (vLLM's LoRA router exists only with it: engine/lora_flags.py)
    os.environ.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    if importlib.util.find_spec("vllm") is None:
        _require(["vllm"], "--impl vllm")
    # The front's vLLM imports (seconds) run while the workers start (each imports vLLM too).
    failed: list[BaseException] = []

    def front_imports() -> None:
        try:
            _require(["vllm.entrypoints.rl.online.api_router",
                      "vllm.entrypoints.serve.dev.sleep.api_router",
                      "vllm.entrypoints.serve.dev.server_info.api_router",
                      "vllm.entrypoints.serve.exception_handling.register",
                      "vllm.entrypoints.launchers.launcher",
                      "vllm.distributed.weight_transfer.ipc_engine",
                      "vllm.v1.worker.gpu_worker"], "--impl vllm")
        except BaseException as e:  # SystemExit(2) from _require
            failed.append(e)

    from slotsync.engine.pool import WorkerPool, start_method
    from slotsync.engine.vllm.worker import VllmWorkerSpec, vllm_worker_main

    dp = args.data_parallel_size
    vspecs = [VllmWorkerSpec(s.index, s.device, s.gpu_uuid, str(s.model_path), len(specs) // dp,
                             dp, args.draft_model, lora=args.lora)
              for s in specs]
    importer = threading.Thread(target=front_imports, name="vllm-imports")
    importer.start()
    if start_method(vspecs) == "fork":
        importer.join()  # no thread may run while the workers fork from this process
        if failed:
            raise failed[0]
    try:
        pool = WorkerPool(vspecs, startup_timeout_s=args.startup_timeout,
                          target=vllm_worker_main, data_parallel_size=dp,
                          preload=VLLM_WORKER_IMPORTS)
    except BaseException:
        importer.join()
        if failed:  # the workers failed for the same reason: say it as an import error
            raise failed[0] from None
        raise
    importer.join()
    if failed:
        pool.close()
        raise failed[0]
    from slotsync.engine.vllm.server import VllmEngineClient, build_app, serve

    try:
        client = VllmEngineClient(pool, replies=args.executor_replies,
                                  parallel_config=args.parallel_config, lora=args.lora,
                                  model_path=args.model or "")
    except Exception as e:  # noqa: BLE001 - vLLM's own validation of the fields
        pool.close()
        print(f"[slotsync.engine] --parallel-config: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        raise SystemExit(2) from None
    for w in pool.workers:
        print(f"[slotsync.engine] worker {w.spec.index}: {w.device} gpu_uuid={w.gpu_uuid} "
              "(vLLM gpu_worker.Worker)", file=sys.stderr, flush=True)
    where = f"unix://{args.uds}" if args.uds else f"http://{args.host}:{args.port}"
    app = build_app(client)
    try:
        import uvloop  # as vLLM's api_server entry (uvloop.run)

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(app, client, args.host, args.port, args.uds, where))
    except OSError as e:
        print(f"[slotsync.engine] cannot listen on {where}: {e.strerror}", file=sys.stderr)
        client.shutdown()
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        client.shutdown()


SGLANG_FRONT_IMPORTS = ("sglang.srt.utils.msgspec_utils", "sglang.srt.utils.auth",
                        "sglang.srt.utils.common", "sglang.srt.utils.patch_torch",
                        "sglang.srt.weight_sync.tensor_bucket")
"""The SGLang modules ``--impl sglang`` runs (validation and auth in the front, the payload
parser in every TP rank, which forks from the front)."""


def _check_sglang_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what the SGLang engines do not take."""
    if args.model is None:
        parser.error(f"--impl {args.impl} needs --model (SGLang always serves a model)")
    if args.device != "cpu" and args.impl != "sglang":
        parser.error(f"--impl {args.impl} runs on the CPU only (--device cpu); --impl "
                     "sglang runs on CUDA too")
    if args.copy_sleep_cycles is not None:
        if args.device == "cpu":
            parser.error("--copy-sleep-cycles needs --device cuda")
        try:
            cycles = [int(c) for c in args.copy_sleep_cycles]
        except ValueError:
            parser.error(f"--copy-sleep-cycles {args.copy_sleep_cycles}: not integers")
        if len(cycles) not in (1, args.workers) or min(cycles) < 0:
            parser.error(f"--copy-sleep-cycles: one value >= 0, or one per TP rank "
                         f"({args.workers}), not {args.copy_sleep_cycles}")
        args.copy_sleep_cycles = cycles * args.workers if len(cycles) == 1 else cycles
    for opt, bad in [("--worker-models", args.worker_models is not None),
                     ("--draft-model", args.draft_model is not None),
                     ("--discard", args.discard), ("--receive", args.receive != "reference"),
                     ("--vllm-version", args.vllm_version is not None),
                     ("--parallel-config", args.parallel_config is not None),
                     ("--data-parallel-size", args.data_parallel_size != 1),
                     ("--cuda-devices", args.cuda_devices is not None
                      and args.device == "cpu")]:
        if bad:
            parser.error(f"{opt} is not an option of --impl {args.impl}"
                         + (" on the CPU" if opt == "--cuda-devices" else ""))
    if args.dp_size < 1 or args.pp_size < 1:
        parser.error("--dp-size and --pp-size must be >= 1")


def _main_sglang(args: argparse.Namespace, specs: list[WorkerSpec],
                 argv: Sequence[str] | None) -> None:
    """``--impl sglang | sglang-reference``: TP-rank workers, the SGLang routes' front."""
    import time

    t0 = time.perf_counter()
    if args.impl == "sglang":
        from slotsync.engine.sglang.payload import use_shim_path

        use_shim_path()  # $SLOTSYNC_SGLANG_SHIM: SGLang's code where sglang is not installed
        _require(SGLANG_FRONT_IMPORTS, "--impl sglang")
    else:
        _require(["pydantic", "pydantic_core"], "--impl sglang-reference")
    from slotsync.engine.pool import WorkerPool
    from slotsync.engine.sglang.http import mirror_helpers, sglang_helpers
    from slotsync.engine.sglang.payload import ReferenceParser, SglangCodeParser
    from slotsync.engine.sglang.server import SglangEngineApp, serve
    from slotsync.engine.sglang.server_info import ServerConfig, lora_settings
    from slotsync.engine.sglang.state import VERSIONS
    from slotsync.engine.sglang.worker import SglangWorkerSpec, sglang_worker_main

    # (on CUDA a rank without --gpu-uuids answers to its GPU's own UUID, found by the rank)
    uuids = tuple(None if s.gpu_uuid is None else str(s.gpu_uuid) for s in specs)
    code = args.impl == "sglang"
    helpers = sglang_helpers() if code else mirror_helpers()
    front_parser = SglangCodeParser() if code else ReferenceParser(uuids)
    sleep = args.copy_sleep_cycles or [0] * len(specs)
    try:
        lora = lora_settings(args)
    except ValueError as e:
        raise SystemExit(f"slotsync.engine: {e}") from None
    wspecs = [SglangWorkerSpec(s.index, str(s.device), uuids[s.index], uuids,
                               str(s.model_path), "sglang" if code else "reference",
                               copy_sleep_cycles=sleep[s.index], lora=lora.rank_settings())
              for s in specs]
    pool = WorkerPool(wspecs, startup_timeout_s=args.startup_timeout,
                      target=sglang_worker_main)
    t_ranks = time.perf_counter()
    config = ServerConfig(
        impl=args.impl, model_path=str(args.model), tp_size=len(specs), dp_size=args.dp_size,
        pp_size=args.pp_size, enable_dp_attention=args.enable_dp_attention,
        weight_version=args.weight_version, api_key=args.api_key,
        admin_api_key=args.admin_api_key, host=args.host,
        reported_version=args.reported_version or "", lora=lora,
        port=0 if args.uds else args.port,
        launch_command=" ".join(["python -m slotsync.engine",
                                 *(sys.argv[1:] if argv is None else argv)]))
    # SGLang's startup phases (srt/observability/startup_time.py): measured here, so they
    # differ from one start to the next as a real server's do
    startup_time = {"load_weight": t_ranks - t0, "kv_cache_allocation": 0.0,
                    "scheduler_e2e": t_ranks - t0,
                    "tokenizer_e2e": time.perf_counter() - t0, "cuda_graph": {}}
    rules = None
    if code:  # SGLang's own scheduler rules (None where only the shim's receive code is)
        from slotsync.engine.sglang.scheduler_code import load as load_scheduler_code

        rules = load_scheduler_code()
    engine = SglangEngineApp(pool, VERSIONS[args.sglang_version], helpers, front_parser,
                             config, startup_time, free_received=args.free_received,
                             scheduler_code=rules)
    for w in pool.workers:
        print(f"[slotsync.engine] TP rank {w.spec.index}: {w.device} gpu_uuid={w.gpu_uuid} "
              f"(parser {wspecs[w.spec.index].parser})", file=sys.stderr, flush=True)
    where = f"unix://{args.uds}" if args.uds else f"http://{args.host}:{args.port}"
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    try:
        runner(serve(engine, args.host, args.port, args.uds, where))
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

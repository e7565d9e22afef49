"""``slotsync bench lora``: a LoRA adapter from the trainer's memory into the engine through
slotsync (``Publisher.publish_adapter``) against the disk path users have today (PEFT's
``save_pretrained`` into a folder, then vLLM's ``POST /v1/load_lora_adapter``), same machine,
same engine, same adapter, both in one run (issue 36).

What is timed, per repetition (the paths interleaved A/B then B/A, ``rank.py``):

* **slotsync**: from the last rank's ``publish_adapter`` call to the return of the last (each
  returns at ``Ack(adapter_data)``, sent when the engine's load call answered: the adapter is
  servable by every worker of the engine). Through a real ``slotsyncd`` whose ``adapter_dir``
  is a tmpfs (``/dev/shm``, as its default runtime folder is under systemd), the engine's own
  ``/v1/load_lora_adapter`` on the folder it writes.
* **disk**: rank 0 saves the whole adapter as ``save_pretrained`` does (``safetensors``'
  ``save_file`` + ``adapter_config.json``, no ``fsync``) into a folder of ``--disk-dir``
  (default: this run's folder under the temp folder, on the ordinary disk) and posts
  ``/v1/load_lora_adapter`` to the same engine itself, timed to the answer.

The daemon's own share of the slotsync path is measured from outside, adding nothing to the
daemon: each round's ``adapter_loaded`` log line (``--log-format json``) gives ``load_s``,
the time from its load call to the engine's answer; the rank that sent ``AdapterData`` last
waited ``data_wait_seconds`` (``AdapterStats``) from that send to ``Ack(adapter_data)``; the
difference is the daemon's time from the last ``AdapterData`` to its load call (making the
folder: linking the one rank's sealed segment as its file, or reading the ranks' shared
memory, checking each part's sha256 and writing it) plus two ZeroMQ hops. Its
``adapter_file`` log lines say how each one-rank folder was made and how long it took.
``profile.py`` times the steps alone. Targets (issue 36): ratio <= 0.5, daemon share <= 20 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slotsync.bench.lora.adapter import QWEN3_8B, SMALL, Shapes, peft_config, stub_model

RATIO_TARGET = 0.5
SHARE_TARGET_S = 0.020
FOLDER_PREFIX = "slotsync-bench-lora-"
SHM_DIR = "/dev/shm"


def add_arguments(p: argparse.ArgumentParser, positive_int: Any, nonneg_int: Any) -> None:
    """The options of ``slotsync bench lora``."""
    p.add_argument("--small", action="store_true",
                   help="a small adapter (Qwen3-like, 4 layers, rank 8; CI) instead of "
                        "Qwen3-8B's at rank 32 (174.6 MB bf16)")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="the engine serving both paths: the reference engine (default) or "
                        "vLLM's own LoRA router and worker LoRA manager (--impl vllm)")
    p.add_argument("--ranks", type=positive_int, default=1,
                   help="trainer ranks in the slot, = engine workers (default 1); slotsync: "
                        "each rank publishes its rows of every tensor; disk: rank 0 saves "
                        "the whole adapter (the gather before it not counted)")
    p.add_argument("--reps", type=positive_int, default=5,
                   help="counted repetitions of both paths (default 5)")
    p.add_argument("--warmup", type=nonneg_int, default=1,
                   help="repetitions first, not counted (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the ranks' tensors are (cuda: rank i on cuda:i; the D2H copy "
                        "is then in both paths); the engine runs on the CPU")
    p.add_argument("--disk-dir", default="", metavar="DIR",
                   help="the disk path's folder (default: this run's folder in the temp "
                        "folder); a folder of the run's own is made inside and removed")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="bound on each wait (default 300)")
    p.add_argument("--report", default="", metavar="FILE",
                   help="also rewrite this command's section of FILE (e.g. BENCHMARKS.md); "
                        "default: print only")
    p.add_argument("--section", default="lora", help="section of --report (default lora)")


def main_from_args(args: argparse.Namespace) -> int:
    """Run the bench: 0 when both paths ran and the engine held the last version as sent
    (the targets are reported, PASS or MISS, not enforced); 1 when a rank, the daemon or the
    engine failed; 2 for options it cannot run. Ctrl-C: 130, SIGTERM: 143, every process
    stopped and every folder removed (a SIGKILLed run's at the next run's start)."""
    import signal

    from slotsync.testing.owned_folders import owned_folder, remove_stale_folders, write_owner

    if not args.timeout_s > 0:
        print(f"slotsync bench lora: --timeout-s must be > 0, got {args.timeout_s}",
              file=sys.stderr)
        return 2
    if args.disk_dir and not os.path.isdir(args.disk_dir):
        print(f"slotsync bench lora: --disk-dir {args.disk_dir}: not a folder", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < 1:
            print("slotsync bench lora: --device cuda, but no CUDA device is visible",
                  file=sys.stderr)
            return 2

    def _term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _term)
    stale: list[str] = []
    shm = ""
    try:
        stale += remove_stale_folders(FOLDER_PREFIX, SHM_DIR)
        with owned_folder(FOLDER_PREFIX, stale) as folder:
            if stale:
                print(f"(removed {len(stale)} folder(s) of killed runs: {', '.join(stale)})")
            shm = tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=SHM_DIR)
            write_owner(shm)
            return _run(args, Path(folder), Path(shm))
    except KeyboardInterrupt:
        print("slotsync bench lora: interrupted; its ranks, engine and daemon are stopped and "
              "its folders removed", file=sys.stderr)
        return 130
    finally:
        if shm:
            import shutil

            shutil.rmtree(shm, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, folder: Path, shm: Path) -> int:
    import multiprocessing as mp
    from contextlib import ExitStack

    from slotsync.bench.lora.rank import rank_main
    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.testing.processes import DaemonProcess

    shapes = SMALL if args.small else QWEN3_8B
    disk = Path(tempfile.mkdtemp(prefix="disk-", dir=args.disk_dir or folder))
    reps = args.warmup + args.reps
    head = (f"slotsync bench lora: {shapes.name} adapter at rank {shapes.r} "
            f"({shapes.tensor_count()} tensors, {shapes.adapter_bytes() / 1e6:.1f} MB bf16), "
            f"{args.ranks} rank(s), {args.engine} engine ({args.ranks} worker(s)), tensors "
            f"on {args.device}; {args.reps} repetitions (+{args.warmup} warm-up), the paths "
            "interleaved")
    print(head, flush=True)
    with ExitStack() as stack:
        stack.callback(lambda: __import__("shutil").rmtree(disk, ignore_errors=True))
        t0 = time.monotonic()
        model = stub_model(folder / "model.safetensors", shapes)
        daemon = stack.enter_context(DaemonProcess(
            runtime_dir=str(folder / "daemon"), startup_timeout_s=args.timeout_s,
            args=["--adapter-dir", str(shm / "adapters"), "--log-format", "json",
                  "--adapter-load-timeout-s", str(args.timeout_s)]))
        engine = stack.enter_context(ReferenceEngine(
            workers=args.ranks, impl=args.engine, model=model, startup_timeout_s=args.timeout_s,
            log_path=folder / "engine.log",
            lora={"enable_lora": True, "max_lora_rank": shapes.r, "max_loras": 2,
                  "max_cpu_loras": 4}))
        print(f"  daemon (adapter_dir {shm / 'adapters'}, {_fs(shm)}), engine {engine.url}, "
              f"disk folder {disk} ({_fs(disk)}); started in {time.monotonic() - t0:.1f} s",
              flush=True)
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(args.ranks)
        pipes = [ctx.Pipe(duplex=False) for _ in range(args.ranks)]
        procs = [ctx.Process(target=rank_main, daemon=True, args=(
            r, args.ranks, shapes, args.device, daemon.endpoint, engine.url, str(disk), reps,
            args.timeout_s, barrier, w)) for r, (_, w) in enumerate(pipes)]
        stack.callback(_stop, procs)
        for p in procs:
            p.start()
        for _, w in pipes:
            w.close()
        load0 = os.getloadavg()[0]
        got = _collect([r for r, _ in pipes], procs, args.ranks, reps, args.timeout_s)
        got["load"] = (load0, os.getloadavg()[0])
        if "error" in got:
            print(f"slotsync bench lora: FAILED: {got['error']}\ndaemon log tail:\n"
                  f"{daemon.log_tail(2000)}\nengine log tail:\n{engine.log_tail(2000)}",
                  file=sys.stderr)
            return 1
        check = _check_engine(engine, f"bench@v{reps}", got["want"], args.ranks)
        loads = _loads(Path(daemon.log_path))
        got["files"] = _files(Path(daemon.log_path))
        from slotsync.bench.lora.profile import profile

        steps = profile(_tensors(shapes), peft_config(shapes), shapes.r, shm)
    lines = _figures(args, shapes, got, loads, steps, check)
    print("\n".join(lines))
    if args.report:
        from slotsync.bench.report import update_section

        update_section(args.report, args.section, "\n".join(lines))
        print(f"(written to {args.report}, section {args.section})")
    return 0 if check.startswith("ok") else 1


def _tensors(shapes: Shapes) -> dict[str, Any]:
    from slotsync.bench.lora.adapter import adapter_tensors

    return adapter_tensors(shapes, 0)


def _fs(path: Path) -> str:
    """``path``'s filesystem type, for the report."""
    from slotsync.daemon.service.folders import filesystem_type

    return filesystem_type(str(path)) or "?"


def _stop(procs: list[Any]) -> None:
    for sig in ("terminate", "kill"):
        alive = [p for p in procs if p.pid is not None and p.is_alive()]
        for p in alive:
            getattr(p, sig)()
        for p in alive:
            p.join(10)


def _collect(readers: list[Any], procs: list[Any], ranks: int, reps: int,
             timeout_s: float) -> dict[str, Any]:
    """The ranks' messages (``rank.py``) gathered: ``{"slotsync": {rep: [(rank, t0, t1,
    stats)]}, "disk": {rep: (t0, t_saved, t1)}, "want": {...}}`` or ``{"error": text}``."""
    from multiprocessing.connection import wait

    got: dict[str, Any] = {"slotsync": {}, "disk": {}}
    done = 0
    open_ = list(readers)
    deadline = time.monotonic() + timeout_s * (2 * reps + 2)
    printed: set[int] = set()
    while done < ranks:
        if time.monotonic() > deadline:
            return {"error": f"no end within {timeout_s * (2 * reps + 2):.0f} s"}
        ready = wait(open_, timeout=1.0)
        if not ready:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                return {"error": f"rank(s) {dead} exited without a word"}
            continue
        for conn in ready:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                open_.remove(conn)
                continue
            if msg[0] == "error":
                return {"error": f"rank {msg[1]}: {msg[2]}"}
            if msg[0] == "done":
                done += 1
            elif msg[0] == "want":
                got["want"] = msg[1]
            elif msg[0] == "slotsync":
                got["slotsync"].setdefault(msg[1], []).append(msg[2:])
            elif msg[0] == "disk":
                got["disk"][msg[1]] = msg[2:]
            if (msg[0] in ("slotsync", "disk") and msg[1] not in printed
                    and msg[1] in got["disk"] and len(got["slotsync"].get(msg[1], ())) == ranks):
                printed.add(msg[1])
                t0, _, t1 = got["disk"][msg[1]]
                print(f"  rep {msg[1] + 1}/{reps}: slotsync "
                      f"{_slotsync_s(got['slotsync'][msg[1]]):.3f} s, disk {t1 - t0:.3f} s",
                      flush=True)
    return got


def _slotsync_s(rows: list[tuple]) -> float:
    """From the last rank's call to the last return (every rank's ``(rank, t0, t1, stats)``)."""
    return max(t1 for _, _, t1, _ in rows) - max(t0 for _, t0, _, _ in rows)


def _loads(log: Path) -> dict[int, float]:
    """``update_id -> load_s`` of the daemon's ``adapter_loaded`` JSON log lines."""
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"adapter_loaded"' in line:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out[int(rec["update_id"])] = float(rec["load_s"])
    return out


def _files(log: Path) -> dict[str, int]:
    """How the daemon made its adapter files: ``{"linked": n, "copied": n, "seconds": [...]}``
    from its ``adapter_file`` JSON log lines (one per round a single rank held whole, with
    the seconds its folder took in the daemon's I/O thread; a round split over ranks is
    copied without such a line)."""
    out: dict[str, Any] = {"linked": 0, "copied": 0, "seconds": []}
    for line in log.read_text(errors="replace").splitlines():
        if '"adapter_file"' in line:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("how") in ("linked", "copied"):
                out[rec["how"]] += 1
                out["seconds"].append(float(rec.get("seconds", "nan")))
    return out


def _check_engine(engine: Any, served: str, want: dict[str, str], workers: int) -> str:
    """``"ok: ..."`` when every engine worker holds ``want`` under ``served`` (the engine's
    test-only ``/_slotsync/lora``), else what differs."""
    status, body = engine.request("GET", "/_slotsync/lora")
    if status != 200:
        return f"the engine's /_slotsync/lora answered {status}"
    ident = next((str(a["lora_int_id"]) for a in body["adapters"]
                  if a["lora_name"] == served), None)
    if ident is None:
        return f"{served} is not served"
    held = [w["loaded"].get(ident, {}).get("checksums") for w in body["workers"]]
    bad = [i for i, sums in enumerate(held) if sums != want]
    if len(held) != workers or bad:
        return f"{served}: workers {bad} hold other tensors than the trainer sent"
    return f"ok: every worker ({workers}) holds {served} as the trainer sent it"


def _stats(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _figures(args: argparse.Namespace, shapes: Shapes, got: dict[str, Any],
             loads: dict[int, float], steps: dict[str, float], check: str) -> list[str]:
    """The section's lines (the command, the machine, the table, the targets, the profile)."""
    from slotsync.bench.report import command_line, machine_line, table

    counted = range(args.warmup, args.warmup + args.reps)
    reps = args.warmup + args.reps
    files = got.get("files", {"linked": 0, "copied": 0, "seconds": []})
    slot = [_slotsync_s(got["slotsync"][k]) for k in counted]
    disk = [got["disk"][k][2] - got["disk"][k][0] for k in counted]
    save = [got["disk"][k][1] - got["disk"][k][0] for k in counted]
    post = [got["disk"][k][2] - got["disk"][k][1] for k in counted]

    def per_round(key: str) -> list[float]:  # the slowest rank's, per round
        return [max(s[key] for *_, s in got["slotsync"][k]) for k in counted]

    outside = [max(t1 - t0 - st["seconds"] for _, t0, t1, st in got["slotsync"][k])
               for k in counted]
    rest = [max(st["seconds"] - st["copy_seconds"] - st["digest_seconds"]
                - st["begin_wait_seconds"] - st["data_wait_seconds"]
                for *_, st in got["slotsync"][k]) for k in counted]
    load_s = [loads.get(got["slotsync"][k][0][3]["update_id"], float("nan")) for k in counted]
    last_wait = [min(s["data_wait_seconds"] for *_, s in got["slotsync"][k]) for k in counted]
    share = [w - ld for w, ld in zip(last_wait, load_s, strict=True)]
    ratio = [s / d for s, d in zip(slot, disk, strict=True)]
    med_ratio, med_share = statistics.median(ratio), statistics.median(share)
    cs = steps["engine_checksums"]
    est = (statistics.median(slot) - cs) / max(statistics.median(disk) - cs, 1e-9)

    def ms(x: float) -> str:
        return "n/a" if x != x else f"{x * 1e3:.1f}"

    rows = [["slotsync: last rank's `publish_adapter` call -> its return (Ack(adapter_data))",
             *map(ms, _stats(slot)), str(args.reps)],
            ["disk: `save_pretrained`-style save + `POST /v1/load_lora_adapter`",
             *map(ms, _stats(disk)), str(args.reps)]]
    verdict = "PASS" if med_ratio <= RATIO_TARGET else "MISS"
    share_verdict = "PASS" if med_share <= SHARE_TARGET_S else "MISS"
    med = statistics.median
    where = [
        ["rank: a shared-memory segment made, its part copied in, the sha256 digests taken "
         "meanwhile by threads (`copy_seconds`)", ms(med(per_round("copy_seconds")))],
        ["rank: the digests left after the copy (`digest_seconds`)",
         ms(med(per_round("digest_seconds")))],
        ["rank: AdapterBegin -> Ack(adapter_begin) (every rank's begin; the daemon's checks "
         "and its calls asking the engine's LoRA limits)",
         ms(med(per_round("begin_wait_seconds")))],
        ["daemon: last AdapterData -> its load call (the folder made: the rank's sealed "
         "segment linked as its file, or read, hashed and copied; + 2 ZeroMQ hops)",
         ms(med_share)],
        ["... of it, the folder made in the daemon's I/O thread (its `adapter_file` log "
         "lines' `seconds`; rounds one rank holds whole)",
         ms(med(files["seconds"][args.warmup:])) if files["seconds"][args.warmup:] else "n/a"],
        ["engine: the daemon's load call (`adapter_loaded` `load_s`: HTTP, the engine's read "
         "of the folder)", ms(med(load_s))],
        ["rank: the rest of `AdapterStats.seconds` (the messages built and sent, the part "
         "freed: its segment unmapped and unlinked)", ms(med(rest))],
        ["rank: the call outside `AdapterStats.seconds` (the arguments and the begin's size "
         "checked)", ms(med(outside))],
        ["disk: the save", ms(med(save))],
        ["disk: `POST /v1/load_lora_adapter` (HTTP, the engine's read of the folder)",
         ms(med(post))],
    ]
    alone = [
        ["the rank's `AdapterPart.fill` (shm): a fresh segment, the tensors copied in, the "
         "digests taken meanwhile (`copy_s`)", ms(steps["rank_copy"])],
        ["... and the digests left after the copy (`digest_s`)", ms(steps["rank_digests"])],
        ["sha256 of the adapter's bytes, once (the rank does it; the daemon again when it "
         "copies)",
         ms(steps["sha256"])],
        ["the daemon's `write_adapter_folder`, copying (read, sha256 checked by threads, "
         "written) to its tmpfs: a round split over ranks", ms(steps["daemon_write"])],
        ["the daemon's `write_adapter_folder`, linking one rank's sealed segment "
         "(`PartReader.take`): a round one rank holds whole", ms(steps["daemon_link"])],
        ["the engine's read of the folder (`safe_open`, every `get_tensor`)",
         ms(steps["engine_read"])],
        ["the test engines' sha256 of every tensor as read (their `/_slotsync/lora`; not "
         "vLLM's: in both paths' engine time here)", ms(steps["engine_checksums"])],
    ]
    return [
        "## A LoRA adapter through slotsync vs through the disk "
        f"({'GPU: tensors on ' + args.device if args.device != 'cpu' else 'CPU'}): "
        "`slotsync bench lora`",
        "",
        f"- command: `{command_line()}`",
        f"- machine: {machine_line()}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; load average (1 min) "
        f"{got['load'][0]:.2f} before the ranks started, {got['load'][1]:.2f} at their end "
        "(the machine is shared; the bench's own processes count at the end)",
        f"- adapter: {shapes.name} shapes at rank {shapes.r} (q/k/v/o/gate/up/down of "
        f"{shapes.layers} layers: {shapes.tensor_count()} tensors, "
        f"{shapes.adapter_bytes() / 1e6:.1f} MB bf16), tensors on {args.device}; "
        f"{args.ranks} trainer rank(s) (slotsync: rows of every tensor on each; disk: the "
        "whole adapter on rank 0)",
        f"- engine: the {args.engine} engine of {args.ranks} worker(s) serves both paths; the "
        "daemon's adapter folders on a tmpfs (/dev/shm), the disk path's on the ordinary disk "
        "(no fsync, as save_pretrained: the file stays in the page cache); each repetition "
        "ran both paths, interleaved",
        "",
        table(["path", "median ms", "min ms", "max ms", "reps"], rows),
        "",
        f"ratio slotsync / disk: median {med_ratio:.2f}x (per repetition "
        f"{min(ratio):.2f}x .. {max(ratio):.2f}x); target <= {RATIO_TARGET}x: {verdict}",
        f"daemon's own share (last AdapterData -> its load call, folder write included), "
        f"median: {ms(med_share)} ms; target <= {SHARE_TARGET_S * 1e3:.0f} ms: {share_verdict}",
        f"the daemon's adapter files (its `adapter_file` log lines, warm-up included): "
        f"{files['linked']} linked, {files['copied']} copied after a refused link, "
        f"{max(reps - files['linked'] - files['copied'], 0)} copied (tensors split over ranks)",
        f"without the test engines' own sha256 of what they read (below; vLLM does not "
        f"hash), an estimate: ratio {est:.2f}x",
        f"engine check: {check}",
        "",
        "Where the time goes (medians of the counted repetitions; rank figures: the slowest "
        "rank's):",
        "",
        table(["step", "ms"], where),
        "",
        "Each step alone, in the bench's process, with the code that runs it (medians of 3):",
        "",
        table(["step", "ms"], alone),
    ]

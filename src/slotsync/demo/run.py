"""``slotsync demo``'s run: the daemon, the engines and the ranks started, each round's
engine checksums and weight version checked against the trainers', a summary printed, and
everything stopped (``run_demo``).

Standard library only at import; torch and the engine launcher are imported by ``run_demo``.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from slotsync.console import CLOSED_STDOUT_EXIT, discard_stdout
from slotsync.demo import leftovers
from slotsync.demo.config import DemoConfig, plural
from slotsync.demo.ranks import RankResults, rank_main, stop_ranks


def run_demo(cfg: DemoConfig, out=sys.stdout, rank_context=None) -> int:
    """Run the demo; returns the process exit status (0: every round verified).

    Progress: one line per round with chunks, bytes, seconds and the verification result
    (``--lora``: the served name, the adapter's bytes and layout, seconds, and whether every
    worker's checksums equal the trainer's; ``slotsync.demo.lora``).
    ``rank_context``: the multiprocessing context the trainer ranks start from (default:
    spawn; the tests pass a forkserver that has imported torch already).
    """
    import torch.multiprocessing as mp

    from slotsync.engine.launcher import ReferenceEngine
    from slotsync.protocol.wire import logical_gpu_uuid
    from slotsync.testing.processes import DaemonProcess

    def say(text: str) -> None:
        try:
            print(text, file=out, flush=True)
        except BrokenPipeError:  # `slotsync demo | head -3`: stop quietly (the daemon and
            if out is sys.stdout:  # engines unwind)
                discard_stdout()
            raise SystemExit(CLOSED_STDOUT_EXIT) from None

    per = cfg.gpus_per_engine or cfg.ranks
    slots = [list(range(s0, s0 + per)) for s0 in range(0, cfg.ranks, per)]
    uuids: list[str] | None = None
    devices: list[int] | None = None
    if cfg.device == "cuda":
        import torch

        n = torch.cuda.device_count()
        if n < cfg.ranks:  # several logical GPUs share the physical ones
            uuids = [logical_gpu_uuid(i) for i in range(cfg.ranks)]
        devices = [i % n for i in range(cfg.ranks)]
    mode = "packed" if cfg.packed else "unpacked"
    transport = "CUDA IPC" if cfg.device == "cuda" else "shared memory (CPU)"
    layout = ("one engine slot" if len(slots) == 1
              else f"{len(slots)} engine slots of {per}")
    half = cfg.ranks // cfg.nodes
    if cfg.nodes > 1:
        layout = (f"one engine slot over 2 nodes (node0: ranks [0, {half}), node1: "
                  f"[{half}, {cfg.ranks}))")
    kind = {"reference": "", "vllm": ", vLLM's own engine code",
            "sglang": ", SGLang's own receive code (SGLang 0.5.23's rules)"}[cfg.engine]
    if cfg.backend == "vllm-api":
        kind += ", sent through vLLM's trainer API (SlotsyncTrainerInitInfo)"
    if cfg.lora:
        from slotsync.demo import lora

        model = (f"model {cfg.model} ({cfg.model.stat().st_size / 1e6:.1f} MB)" if cfg.model
                 else f"a small random Llama ({lora.llama_bytes() / 1e6:.1f} MB, made in the "
                 "demo's folder)")
        say(f"slotsync demo --lora: {model}, {plural(cfg.ranks, 'rank')} in {layout}, "
            f"{plural(cfg.rounds, 'adapter round')} (PEFT {'/'.join(lora.TARGETS)} at rank "
            f"{lora.LORA_RANK}, Publisher.publish_adapter), {transport}{kind}")
    else:
        say(f"slotsync demo: model {cfg.model} ({cfg.model.stat().st_size / 1e6:.1f} MB), "
            f"{plural(cfg.ranks, 'rank')} in {layout}, {plural(cfg.rounds, 'round')}, {mode}, "
            f"{transport}{kind}")
    stale = leftovers.remove_stale_demo_folders()
    if stale:
        say(f"  removed the folder(s) of {plural(len(stale), 'earlier demo')} that was killed: "
            + ", ".join(stale))
    with (tempfile.TemporaryDirectory(prefix=leftovers.DEMO_FOLDER_PREFIX) as tmp,
          ExitStack() as stack):
        leftovers.write_owner(tmp)  # a later demo removes the folder if this one is killed
        t0 = time.perf_counter()
        lora_engine: dict = {}
        if cfg.lora:  # the engines serve a Llama with LoRA on
            lora_engine = lora.engine_options(cfg.engine)
            if cfg.model is None:
                cfg = dataclasses.replace(
                    cfg, model=lora.make_llama(Path(tmp) / "llama.safetensors"))
        uds = None
        if cfg.nodes > 1:  # a daemon per node; the engine on a socket every namespace reaches
            from slotsync.demo.nodes import DemoNodes

            uds = os.path.join(tmp, "engine.sock")
            nodes = stack.enter_context(DemoNodes(tmp, cfg.ranks, f"unix://{uds}",
                                                  cfg.nodes_net, say, cfg.timeout_s))
            daemons = nodes.daemons
        else:
            daemons = [stack.enter_context(DaemonProcess(runtime_dir=tmp))]
        engines = [
            stack.enter_context(ReferenceEngine(
                workers=per, device=cfg.device,
                gpu_uuids=[uuids[r] for r in ranks] if uuids else None,
                cuda_devices=[devices[r] for r in ranks] if devices else None,
                model=cfg.model, log_path=os.path.join(tmp, f"engine{e}.log"),
                impl=cfg.engine, startup_timeout_s=300.0, uds=uds, **lora_engine,
            ))
            for e, ranks in enumerate(slots)
        ]
        if cfg.nodes > 1:
            say(f"  engine {engines[0].url}: {cfg.ranks} workers over both nodes (workers "
                f"[0, {half}) node0's, [{half}, {cfg.ranks}) node1's), driven by node0's "
                f"daemon; started in {time.perf_counter() - t0:.1f} s")
        else:
            say(f"  daemon {daemons[0].endpoint} (status {daemons[0].status_url}); "
                + ", ".join(f"engine {e.url} for ranks [{r[0]}, {r[-1] + 1})"
                            for e, r in zip(engines, slots, strict=True))
                + f"; started in {time.perf_counter() - t0:.1f} s")
        ctx = rank_context or mp.get_context("spawn")
        init_file = os.path.join(tmp, "gloo-init")
        urls = [e.url for e in engines]
        pipes = [ctx.Pipe(duplex=False) for _ in range(cfg.ranks)]
        results = RankResults([reader for reader, _ in pipes])
        stack.callback(results.close)
        procs = [
            ctx.Process(target=rank_main, args=(r, cfg, [d.endpoint for d in daemons], urls,
                                                 init_file, uuids, writer), daemon=True)
            for r, (_, writer) in enumerate(pipes)
        ]
        stack.callback(stop_ranks, procs)  # first out: ranks before engines and daemon
        for p in procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the ranks hold theirs: a rank's exit closes its pipe
        leftovers.record_rank_pids(tmp, [p.pid for p in procs])
        failures = 0
        done = 0
        before = [_weight_version(e) for e in engines]
        served: dict[int, str | None] = {}  # --lora: each slot's adapter served (first rank)
        deadline = time.monotonic() + cfg.timeout_s * (cfg.rounds + 2)
        while done < cfg.ranks:
            try:
                item = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or any(
                    p.exitcode not in (None, 0) for p in procs
                ):
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    say(f"FAILED: trainer rank(s) {dead or 'all'} stopped without finishing")
                    failures += 1
                    break
                continue
            if item[0] == "done":
                done += 1
            elif item[0] == "error":
                _, rank, msg, tb = item
                say(f"FAILED: rank {rank}: {msg}")
                if cfg.verbose:
                    say(tb)
                failures += 1
                break
            elif item[0] == "round":
                _, k, version, chunks, nbytes, secs, want, start = item
                ok, detail = _verify(engines[start // per], want, version)
                failures += 0 if ok else 1
                where = "" if len(slots) == 1 else f" slot [{start}, {start + per})"
                say(f"  round {k}/{cfg.rounds}{where}: {chunks} chunks, {nbytes / 1e6:.1f} MB "
                    f"per rank, {secs:.2f} s ({nbytes / 1e6 / max(secs, 1e-9):.0f} MB/s); "
                    f"{detail}")
            elif item[0] == "adapter":
                _, k, name, how, nbytes, secs, want, start = item
                ok, detail = lora.verify_adapter(engines[start // per], name, want,
                                                 served.get(start), per, cfg.timeout_s)
                served[start] = name
                failures += 0 if ok else 1
                where = "" if len(slots) == 1 else f" slot [{start}, {start + per})"
                say(f"  round {k}/{cfg.rounds}{where}: {name}, {len(want)} tensors, "
                    f"{nbytes / 1e6:.2f} MB ({lora.describe(how, per)}), publish_adapter "
                    f"{secs:.2f} s; {detail}")
        stop_ranks(procs, wait_s=30.0)
        for e, eng in enumerate(engines):
            _, stats = eng.request("GET", "/_slotsync/stats")
            starts = [w.get("start_count", w.get("begin_count")) for w in stats["workers"]]
            finishes = [w.get("finish_count", w.get("end_count")) for w in stats["workers"]]
            where = ", ".join(f"{w.get('device')} {w.get('gpu_uuid')}" for w in stats["workers"])
            say(f"  engine {e}: weight version {before[e]!r} -> "
                f"{_weight_version(eng)!r}; "
                f"start/finish per worker {starts}/{finishes}; paused={stats.get('paused')}; "
                f"workers on {where}")
        for k, daemon in enumerate(daemons):
            failures += _say_daemon(say, daemon, f"node{k}'s daemon" if cfg.nodes > 1
                                    else "daemon")
        if failures or done < cfg.ranks:
            say(f"slotsync demo FAILED ({failures} failure(s)); "
                + "".join(f"daemon log tail ({d.log_path}):\n{d.log_tail(2000)}\n"
                          for d in daemons)
                + f"engine log tail:\n{engines[0].log_tail(2000)}")
            return 1
    say("slotsync demo OK: every round's engine checksums equal the trainers'"
        + (" (every adapter version, on every worker)" if cfg.lora else ""))
    return 0


def _say_daemon(say, daemon, who: str) -> int:
    """Print a daemon's slots and peer links from its ``/status``; returns 1 when a peer link
    is down (the relayed rounds went over it), else 0."""
    status = daemon.status()
    for s_ in status["slots"]:
        by_node: dict[str, list[int]] = {}
        for r in s_.get("ranks", []):
            by_node.setdefault(r.get("node") or "", []).append(r["rank"])
        nodes = ("" if "" in by_node or not by_node else "; ranks by node: " + ", ".join(
            f"{n} {sorted(rs)}" for n, rs in sorted(by_node.items())))
        say(f"  {who}: slot [{s_['slot'][0]}, {s_['slot'][1]}) state {s_['state']}, "
            + rounds_summary(s_)
            + (f", last error: {s_['last_error']}" if s_["last_error"] else "")
            + (f", last adapter error: {s_['adapter_last_error']}"
               if s_.get("adapter_last_error") else "") + nodes)
        if s_.get("adapters"):
            say(f"  {who}: slot [{s_['slot'][0]}, {s_['slot'][1]}) adapters: " + ", ".join(
                f"{a['served_name']} {a['state']}" for a in s_["adapters"]))
    down = 0
    for lk in (status.get("peers") or {}).get("links", []):
        down += 0 if lk.get("up") else 1
        say(f"  {who}: peer link to {lk.get('node')} ({lk.get('role')}) "
            f"{'up' if lk.get('up') else 'DOWN'}, messages in/out "
            f"{lk.get('messages_in', 0)}/{lk.get('messages_out', 0)}")
    for r in status.get("relayed_slots", []):
        say(f"  {who}: slot [{r['slot'][0]}, {r['slot'][1]}) driven by node {r['driven_by']} "
            f"({r.get('owner_address')}); this node's ranks relayed there")
    return down


def rounds_summary(slot: dict) -> str:
    """A slot's rounds from its ``/status`` entry: ``updates ok 3, failed 0`` (base-weight
    updates: ``updates_succeeded`` / ``_failed``) and ``adapter rounds ok 2, failed 1``
    (LoRA adapter rounds, issue 36: ``adapter_rounds_succeeded`` / ``_failed``, which a
    daemon before issue 36 does not report); each part only where it has a round, the
    updates' when neither has one."""
    ok, failed = slot.get("updates_succeeded") or 0, slot.get("updates_failed") or 0
    a_ok = slot.get("adapter_rounds_succeeded") or 0
    a_failed = slot.get("adapter_rounds_failed") or 0
    parts = [f"updates ok {ok}, failed {failed}"] if ok or failed or not (a_ok or a_failed) \
        else []
    if a_ok or a_failed:
        parts.append(f"adapter rounds ok {a_ok}, failed {a_failed}")
    return "; ".join(parts)


def _weight_version(engine) -> str:
    """The engine's weight version: vLLM's ``GET /weight_info``, SGLang's ``/model_info``."""
    sglang = getattr(engine, "impl", "reference").startswith("sglang")
    return engine.request("GET", "/model_info" if sglang else "/weight_info")[1][
        "weight_version"]


def _verify(engine, want: dict[str, str], version: str) -> tuple[bool, str]:
    """Compare every engine worker's checksums with the trainers' and check the version."""
    from slotsync.engine.checksum import checksums_by_worker

    sglang = getattr(engine, "impl", "reference").startswith("sglang")
    if sglang:  # (its TP ranks' checksums: a test-only route)
        status, body = engine.request("POST", "/_slotsync/checksums")
    else:
        status, body = engine.request("POST", "/weight_checker", {"action": "checksum"})
    if status != 200:
        return False, f"MISMATCH: the engine's checksums answered {status}: {body}"
    by_worker = body if sglang else checksums_by_worker(body)
    bad = []
    for worker, sums in by_worker.items():
        diff = [n for n, h in want.items() if sums.get(n) != h]
        if diff:
            bad.append(f"worker {worker}: {len(diff)} tensors differ (e.g. {diff[0]})")
    got_version = _weight_version(engine)
    if got_version != version:
        bad.append(f"engine version {got_version!r}, expected {version!r}")
    if bad:
        return False, "MISMATCH: " + "; ".join(bad)
    n = len(by_worker)
    return True, f"checksums match on {n} workers ({len(want)} tensors), version {version!r}"

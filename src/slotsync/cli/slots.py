"""``slotsync slots drop START END [--force]``: make the daemon forget an engine slot.

For a slot a dead job left behind, before the daemon releases it on its own (``slot_release_s``
after its last rank is gone, or at once when a new job's registration conflicts with it). The
slot's ranks are forgotten (publishers still alive register again at their next begin); what
the daemon knows of the engine stays (paused, needing a full update). Refused while an update
runs unless ``--force``, which fails that update first (its ranks are told; the engine stays
paused and needs a full update).

Talks to the status server's ``POST /slots/drop``, which answers loopback clients only. Exit
status: 0 dropped, 1 refused (no such slot, an update runs), 2 the daemon cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

from slotsync.cli.status import DEFAULT_URL


def drop_slot(url: str, slot: tuple[int, int], force: bool, timeout_s: float = 10.0) -> dict:
    """``POST <url>/slots/drop``; returns the daemon's answer.

    Raises:
        urllib.error.HTTPError: the daemon refused (its JSON body says why).
        OSError: no connection / timeout.
    """
    body = json.dumps({"slot": list(slot), "force": force}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/slots/drop", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="slotsync slots")
    sub = p.add_subparsers(dest="slots_command", metavar="ACTION", required=True)
    d = sub.add_parser("drop", help="forget an engine slot and its ranks",
                       description=__doc__.split("\n\n")[1])
    d.add_argument("start", type=int, help="the slot's first global rank")
    d.add_argument("end", type=int, help="one past its last rank (slot [START, END))")
    d.add_argument("--force", action="store_true",
                   help="also when an update runs: fail it first (engine left paused)")
    d.add_argument("--url", default=os.environ.get("SLOTSYNC_STATUS_URL", DEFAULT_URL),
                   help=f"the daemon's status server (default: $SLOTSYNC_STATUS_URL or "
                   f"{DEFAULT_URL})")
    return p


def main_from_args(args: argparse.Namespace) -> int:
    if not 0 <= args.start < args.end:
        print(f"slotsync slots drop: slot [{args.start}, {args.end}) is empty or negative",
              file=sys.stderr)
        return 1
    try:
        out = drop_slot(args.url, (args.start, args.end), args.force)
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("error", e.reason)
        except ValueError:
            why = e.reason
        print(f"slotsync slots drop: refused ({e.code}): {why}", file=sys.stderr)
        return 1 if e.code in (404, 409) else 2
    except OSError as e:
        print(f"slotsync slots drop: cannot reach {args.url}: {getattr(e, 'reason', e)}",
              file=sys.stderr)
        return 2
    kept = " (the daemon still knows its engine needs a full update)" if out.get(
        "needs_full_update") else ""
    print(f"dropped slot [{args.start}, {args.end}) of {out.get('engine_url')}: ranks "
          f"{out.get('ranks')} forgotten{kept}")
    return 0

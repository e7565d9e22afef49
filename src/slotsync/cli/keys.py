"""``slotsync keys NODE [NODE ...] [--dir D]``: make the CURVE key pair of each node's daemon.

The peer link between the daemons of an engine over several nodes is authenticated and
encrypted with ZeroMQ's CURVE. Each node's daemon needs a key pair: ``NODE.key`` (the public
key) and ``NODE.key_secret`` (both keys, readable by its owner only), pyzmq's certificate
files. ``NODE.key`` goes into the ``peer_public_keys`` folder of every node's daemon (the file
name is the node the key may speak for); ``NODE.key_secret`` stays on that node, named by its
``curve_secret_key``.

Nothing is overwritten: when a key file of a named node is already in the folder, no file is
made and the exit status is 1. Exit status: 0 made, 1 a file exists or cannot be written,
2 a bad node name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="slotsync keys", description=__doc__)
    # nargs="*" and the check in main_from_args: with "+", argparse reports a missing NODE
    # before an unknown option (`slotsync keys -x`), naming the wrong thing.
    p.add_argument("nodes", nargs="*", metavar="NODE",
                   help="node name, as the daemon's `node` option and the engine table's "
                   "`nodes` name it (letters, digits, '_', '.', '-')")
    p.add_argument("--dir", default=".", metavar="D",
                   help="folder to write the key files into, made if missing (default: the "
                   "current folder)")
    return p


def main_from_args(args: argparse.Namespace) -> int:
    from slotsync.daemon.node_links.peer_keys import make_keys
    from slotsync.daemon.node_links.spans import check_node_name

    folder = Path(args.dir)
    if not args.nodes:
        print("slotsync keys: error: name at least one NODE (e.g. slotsync keys node0 node1)",
              file=sys.stderr)
        return 2
    if len(set(args.nodes)) != len(args.nodes):
        print("slotsync keys: a node is named twice", file=sys.stderr)
        return 2
    # Every name and every file first, so that a bad or taken name makes no file at all.
    for node in args.nodes:
        try:
            check_node_name(node, "node")
        except ValueError as e:
            print(f"slotsync keys: {e}", file=sys.stderr)
            return 2
    taken = [str(folder / f"{n}{ext}") for n in args.nodes for ext in (".key", ".key_secret")
             if (folder / f"{n}{ext}").exists()]
    if taken:
        print(f"slotsync keys: {', '.join(taken)} exist{'s' if len(taken) == 1 else ''} "
              "already; nothing was written (remove the old pair to make a new one, and "
              "replace its .key in every peer's peer_public_keys folder)", file=sys.stderr)
        return 1
    for node in args.nodes:
        try:
            public, secret = make_keys(node, folder)
        except FileExistsError as e:  # made meanwhile by someone else
            print(f"slotsync keys: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"slotsync keys: cannot write into {str(folder)!r}: "
                  f"{e.strerror or e}", file=sys.stderr)
            return 1
        print(public)
        print(secret)
        print(f"  copy {public.name} into the peer_public_keys folder of every node's daemon; "
              f"{secret.name} stays on {node} only, as its curve_secret_key = "
              f"\"{os.path.abspath(secret)}\"")
    return 0

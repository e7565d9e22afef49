"""``slotsync``: user commands. ``slotsync demo`` runs the main job end to end."""

from __future__ import annotations

import argparse
import os
import sys

from slotsync import __version__

CLOSED_STDOUT_EXIT = 141
"""Exit status of a command cut short because its stdout's reader went away (``slotsync demo
| head -3``): 128 + SIGPIPE, what a program killed by SIGPIPE reports."""


def discard_stdout() -> None:
    """Point stdout's file descriptor at /dev/null after its reader went away (a
    ``BrokenPipeError`` from a print): Python's flush at exit then writes nowhere, instead of
    printing 'Exception ignored ... BrokenPipeError' on stderr."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slotsync",
        description="slotsync: per-node weight sync from trainer ranks into colocated vLLM "
        "engines. The daemon itself is `slotsyncd`.",
    )
    p.add_argument("--version", action="version", version=f"slotsync {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    from slotsync import demo

    d = sub.add_parser(
        "demo", help="run daemon + reference engine + trainer ranks on real model weights",
        description=demo.__doc__.split("\n\n")[1] if demo.__doc__ else None,
    )
    demo.build_parser(d)
    from slotsync import status_cli

    st = sub.add_parser("status", help="show the daemon's slots (exit 1 if one failed, 2 if "
                        "the daemon is unreachable)", description=status_cli.__doc__)
    status_cli.build_parser(st)
    from slotsync import slots_cli

    sl = sub.add_parser("slots", help="operator actions on engine slots (drop)",
                        description=slots_cli.__doc__)
    slots_cli.build_parser(sl)
    from slotsync.bench import cli as bench_cli

    b = sub.add_parser("bench", help="control-plane (CPU) and data-plane (GPU) benchmarks")
    bench_cli.build_parser(b)
    from slotsync import keys_cli

    k = sub.add_parser("keys", help="make a node daemon's CURVE key pair (engines over "
                       "several nodes)", description=keys_cli.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    keys_cli.build_parser(k)
    return p


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: the demo's context managers have cleaned up
        print("slotsync: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # stdout's reader went away (`slotsync ... | head`): quietly
        discard_stdout()
        sys.exit(CLOSED_STDOUT_EXIT)


def _main(argv: list[str] | None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from slotsync import demo

        sys.exit(demo.main_from_args(args))
    if args.command == "bench":
        from slotsync.bench import cli as bench_cli

        sys.exit(bench_cli.main_from_args(args))
    if args.command == "slots":
        from slotsync import slots_cli

        sys.exit(slots_cli.main_from_args(args))
    if args.command == "keys":
        from slotsync import keys_cli

        sys.exit(keys_cli.main_from_args(args))
    if args.command == "status":
        from slotsync import status_cli

        sys.exit(status_cli.main_from_args(args))
    parser.print_help()
    sys.exit(2)


if __name__ == "__main__":
    main()

"""``slotsync``: user commands. ``slotsync demo`` runs the main job end to end.

The top of the package (entry point ``slotsync = slotsync.cli:main``, also ``python -m
slotsync``): this ``__init__`` holds the command line and dispatches to each subcommand's
module, importing it only when that subcommand is named. Here live the small commands
themselves: ``status`` (``slotsync status``: the daemon's slots from its ``/status``, with
``status_peers`` for engines over several nodes), ``slots`` (``slotsync slots drop``) and
``keys`` (``slotsync keys``: a node daemon's CURVE key pair). The bigger commands have their
own packages below: ``slotsync.demo`` and ``slotsync.bench``.

May import everything below it (the demo, the benches, the daemon, the engines, ``testing``,
``protocol``, ``slotsync.console``); nothing of slotsync imports it (the layers contract in
``pyproject.toml``).
"""

from __future__ import annotations

import argparse
import sys

from slotsync import __version__
from slotsync.console import CLOSED_STDOUT_EXIT, discard_stdout


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
    from slotsync.cli import status

    st = sub.add_parser("status", help="show the daemon's slots (exit 1 if one failed, 2 if "
                        "the daemon is unreachable)", description=status.__doc__)
    status.build_parser(st)
    from slotsync.cli import slots

    sl = sub.add_parser("slots", help="operator actions on engine slots (drop)",
                        description=slots.__doc__)
    slots.build_parser(sl)
    from slotsync.bench import cli as bench_cli

    b = sub.add_parser("bench", help="control-plane (CPU) and data-plane (GPU) benchmarks")
    bench_cli.build_parser(b)
    from slotsync.cli import keys

    k = sub.add_parser("keys", help="make a node daemon's CURVE key pair (engines over "
                       "several nodes)", description=keys.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    keys.build_parser(k)
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


def take_ctrl_c() -> None:
    """Make Ctrl-C (SIGINT) raise ``KeyboardInterrupt`` here even when this process started
    with SIGINT ignored (``slotsync demo &`` from a script, ``setsid``): the daemon, engines
    and ranks the demo and benches start react to SIGINT anyway, since a terminal's Ctrl-C or
    ``kill -INT -- -PGID`` reaches the whole process group, so a command still ignoring it
    reported their exits as failures ("no socket", "Connection refused") and exited 1
    instead of "slotsync: interrupted" and 130 (issue 35)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str] | None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("demo", "bench"):
        take_ctrl_c()
    if args.command == "demo":
        from slotsync import demo

        sys.exit(demo.main_from_args(args))
    if args.command == "bench":
        from slotsync.bench import cli as bench_cli

        sys.exit(bench_cli.main_from_args(args))
    if args.command == "slots":
        from slotsync.cli import slots

        sys.exit(slots.main_from_args(args))
    if args.command == "keys":
        from slotsync.cli import keys

        sys.exit(keys.main_from_args(args))
    if args.command == "status":
        from slotsync.cli import status

        sys.exit(status.main_from_args(args))
    parser.print_help()
    sys.exit(2)


if __name__ == "__main__":
    main()

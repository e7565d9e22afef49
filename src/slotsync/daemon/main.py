"""``slotsyncd``: run the node daemon until SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import json
import os
import sys

from slotsync.daemon.logs import configure_logging
from slotsync.daemon.service.config import Config, load_config
from slotsync.daemon.service.server import Daemon


async def serve(config: Config) -> int:
    """Run a daemon with ``config`` until a stop signal; returns the exit status
    (``service.server.Daemon.serve``: SIGTERM / SIGINT stop it gracefully, a second one at once;
    SIGHUP re-reads the engine table)."""
    return await Daemon(config).serve()


def make_folders(config: Config) -> str | None:
    """Create the socket's and the in-flight record's folders (the socket's mode 0770, as
    ``Daemon.start`` would), before anything is bound; the error naming the option, or None.

    ``Config.validate`` has checked them without creating anything; this catches what only
    trying shows, so that a start never ends in a bare ``[Errno 2]``.
    """
    for i, (folder, option, holds) in enumerate(config.folders()):
        if os.path.isdir(folder):  # e.g. systemd's RuntimeDirectory, made before the start
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            if i == 0:  # the socket's: the service user and its group only (umask aside)
                os.chmod(folder, 0o770)
        except OSError as e:
            return config.folder_error(folder, option, holds, f"cannot create "
                                       f"{e.filename or folder}: [Errno {e.errno}] {e.strerror}")
    return None


def main(argv: list[str] | None = None) -> None:
    config, check_only = load_config(argv)  # (argparse's --help ignores a closed stdout)
    if check_only:
        try:
            print(json.dumps(config.describe(), indent=2), flush=True)
        except BrokenPipeError:  # `--check-config | head -2`: the configuration is still OK
            from slotsync.console import discard_stdout

            discard_stdout()
        print("configuration OK", file=sys.stderr)
        sys.exit(0)
    problem = make_folders(config)
    if problem:
        print(f"slotsyncd: error: {problem}", file=sys.stderr)
        sys.exit(2)
    configure_logging(config.log_level, config.log_format)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is optional on platforms without it
        runner = asyncio.run
    sys.exit(runner(serve(config)))


if __name__ == "__main__":
    main()

"""``slotsyncd``: run the node daemon until SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from slotsync.daemon.config import Config, load_config
from slotsync.daemon.service import Daemon, DaemonAlreadyRunning


async def serve(config: Config) -> int:
    """Run a daemon with ``config`` until a stop signal; returns the exit status."""
    daemon = Daemon(config)
    try:
        await daemon.start()
    except DaemonAlreadyRunning as e:
        logging.getLogger("slotsync.daemon").error("%s; refusing to start", e)
        return 1
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(
            sig, lambda s=sig: asyncio.ensure_future(daemon.stop(f"received {s.name}"))
        )
    # One line on stdout that wrappers (the demo, tests) can parse.
    print(
        f"slotsyncd ready endpoint={daemon.endpoint} status_port={daemon.status_port}", flush=True
    )
    await daemon.wait_stopped()
    return 0


def main(argv: list[str] | None = None) -> None:
    config = load_config(argv)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is optional on platforms without it
        runner = asyncio.run
    sys.exit(runner(serve(config)))


if __name__ == "__main__":
    main()

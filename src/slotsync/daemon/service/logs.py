"""The daemon's log lines live in ``slotsync.daemon.logs`` (below the service and the node
links, which both write them); this name stays for ``daemon/main.py``'s import until it reads
``slotsync.daemon.logs``."""

from slotsync.daemon.logs import configure_logging  # noqa: F401

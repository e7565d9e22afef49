"""Start and stop ``slotsyncd`` as a subprocess: a re-export of
:mod:`slotsync.testing.processes` (moved there, issue 16), so that
``from slotsync.daemon.launcher import DaemonProcess`` keeps working."""

from slotsync.testing.processes import DaemonProcess, DaemonStartError, die_with_parent

__all__ = ["DaemonProcess", "DaemonStartError", "die_with_parent"]

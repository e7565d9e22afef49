"""slotsync.daemon.core."""

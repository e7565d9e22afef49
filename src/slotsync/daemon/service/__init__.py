"""slotsync.daemon.service."""

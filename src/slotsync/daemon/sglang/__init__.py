"""slotsync.daemon.sglang."""

"""slotsync.engine.sglang."""

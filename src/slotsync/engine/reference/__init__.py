"""slotsync.engine.reference."""

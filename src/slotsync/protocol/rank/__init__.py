"""slotsync.protocol.rank."""

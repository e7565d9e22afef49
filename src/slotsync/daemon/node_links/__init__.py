"""slotsync.daemon.node_links."""

"""slotsync.daemon.vllm."""

"""slotsync.engine.vllm."""

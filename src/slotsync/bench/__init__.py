"""``slotsync bench``: benchmarks of the control plane (CPU) and the data plane (GPU)."""

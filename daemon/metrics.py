"""Prometheus metrics of the daemon, on a registry of its own (served at ``/metrics``).

Names follow Prometheus conventions: one ``slotsync_`` prefix, base units in the name
(``_seconds``, ``_bytes``), counters end in ``_total``, small fixed label sets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

# Update durations span sub-second test rounds to minutes-long syncs of large models.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """The daemon's metric families. ``registry`` is what the status server exposes."""

    def __init__(self, version: str) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.info = Info("slotsync_build", "slotsync daemon build information", registry=r)
        self.info.info({"version": version})
        self.updates = Counter(
            "slotsync_updates", "Weight updates that ended, by outcome", ["outcome"], registry=r
        )
        for outcome in ("success", "failed"):
            self.updates.labels(outcome)
        self.update_duration = Histogram(
            "slotsync_update_duration_seconds",
            "Duration of one update, first begin to end",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.chunks = Counter("slotsync_chunks", "Chunks consumed by engines", registry=r)
        self.bytes = Counter(
            "slotsync_tensor_bytes",
            "Tensor bytes (one rank's copy) consumed by engines",
            registry=r,
        )
        self.in_flight = Gauge("slotsync_updates_in_flight", "Updates in flight", registry=r)
        self.ranks_connected = Gauge(
            "slotsync_ranks_connected", "Trainer ranks registered with this daemon", registry=r
        )
        self.vllm_request = Histogram(
            "slotsync_vllm_request_duration_seconds",
            "Duration of vLLM HTTP requests by route",
            ["route"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.vllm_errors = Counter(
            "slotsync_vllm_request_errors",
            "Failed vLLM HTTP requests by route",
            ["route"],
            registry=r,
        )
        self.bad_messages = Counter(
            "slotsync_rejected_messages", "Frames from ranks that failed to decode", registry=r
        )

    def observe_request(self, route: str, seconds: float, ok: bool) -> None:
        self.vllm_request.labels(route).observe(seconds)
        if not ok:
            self.vllm_errors.labels(route).inc()

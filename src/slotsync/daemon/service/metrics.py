"""Prometheus metrics of the daemon, on a registry of its own (served at ``/metrics``).

Conventions (https://prometheus.io/docs/practices/naming/):

* one ``slotsync_`` prefix; base units in the name (``_seconds``, ``_bytes``); counters end in
  ``_total``; ``slotsync_build_info`` is the usual constant-1 info gauge;
* small, fixed label sets only: ``outcome`` (2 values), ``route`` (the vLLM routes of
  ``daemon/vllm/client.py``'s ``ROUTES``), ``state`` (the ``SlotState`` values). Nothing is
  labelled by rank, slot, update id or weight version: those are unbounded over a run and
  belong in ``/status`` and the logs;
* every labelled child that can exist is created at start, so a counter's first increment is
  seen by ``increase()`` (a series that appears at 1 has no increase) and gauges read 0, not
  "absent";
* no ``*_created`` series (they double the series count and Prometheus 2.x stores them as
  plain gauges);
* the standard ``process_*`` metrics (CPU, memory, fds, start time) of the daemon's process.

The table-derived gauges (slots by state, ranks expected/connected, updates in flight and the
age of the oldest one) are computed when ``/metrics`` is scraped, from the ``SlotTable`` given to
``watch``: they are never stale and the daemon does no work for them between scrapes. Scrapes are
served on the daemon's event loop, the same thread that mutates the table, so the reads never
race with it.

Wiring in the daemon (``service/server.py``'s ``Daemon``)::

    self.metrics = Metrics(__version__)
    self.table = SlotTable(...)
    self.metrics.watch(self.table)          # once, right after the table exists
    ...
    # for every UpdateEnded action:
    self.metrics.update_ended(action)
    # each engine client's observe callback (the executor, ``service/executor.py``):
    cls(url, timeout, self.metrics.observe_request)  # VllmClient or SglangClient
"""

from __future__ import annotations

import platform
import time
from typing import TYPE_CHECKING

import zmq
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    disable_created_metrics,
)

from slotsync.daemon.core.coordinator import SlotState
from slotsync.daemon.vllm.client import ROUTES

if TYPE_CHECKING:
    from slotsync.daemon.core.coordinator import UpdateEnded
    from slotsync.daemon.core.slot_table import SlotTable

# Process-wide switch of prometheus_client: the daemon's process exposes one registry, this one.
disable_created_metrics()

# Update durations span sub-second test rounds to minutes-long syncs of large models; the last
# finite bucket is the engine request bound (engine_timeout_s default, 300 s).
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

OUTCOMES = ("success", "failed")  # UpdateEnded.outcome


class Metrics:
    """The daemon's metric families. ``registry`` is what the status server exposes.

    Args:
        version: the daemon's version, exported in ``slotsync_build_info``.

    Call ``watch(table)`` once after the ``SlotTable`` exists, ``update_ended(e)`` for every
    ``UpdateEnded`` action, and pass ``observe_request`` to each ``VllmClient``. The attributes
    (``updates``, ``update_duration``, ``chunks``, ``bytes``, ``bad_messages``, ...) stay public
    for callers that record directly.
    """

    def __init__(self, version: str) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)  # process_* (Linux /proc; a no-op elsewhere)
        self.info = Info(
            "slotsync_build", "slotsync daemon build information (constant 1)", registry=r
        )
        self.info.info(
            {
                "version": version,
                "python": platform.python_version(),
                "pyzmq": zmq.pyzmq_version(),
                "libzmq": zmq.zmq_version(),
            }
        )

        # ---- counters and histograms, recorded as things happen
        self.updates = Counter(
            "slotsync_updates", "Weight updates that ended, by outcome", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.updates.labels(outcome)
        self.update_duration = Histogram(
            "slotsync_update_duration_seconds",
            "Duration of one update, first begin to end (successful and failed)",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.chunks = Counter("slotsync_chunks", "Chunks consumed by engines", registry=r)
        self.bytes = Counter(
            "slotsync_tensor_bytes",
            "Tensor bytes (one rank's copy) consumed by engines",
            registry=r,
        )
        self.last_success = Gauge(
            "slotsync_update_last_success_timestamp_seconds",
            "Unix time of the last successful update (0: none since the daemon started)",
            registry=r,
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
        for route in ROUTES:
            self.vllm_errors.labels(route)
        self.bad_messages = Counter(
            "slotsync_rejected_messages", "Frames from ranks that failed to decode", registry=r
        )
        self.omitted_names = Counter(
            "slotsync_omitted_names",
            "Tensor names a successful update left out although the slot's previous successful "
            "update loaded them (vLLM keeps their old values)",
            registry=r,
        )

        # ---- gauges derived from the slot table at scrape time (see watch)
        self.in_flight = Gauge("slotsync_updates_in_flight", "Updates in flight", registry=r)
        self.in_flight_age = Gauge(
            "slotsync_update_in_flight_seconds",
            "Age of the oldest update in flight, from its first begin (0: none in flight)",
            registry=r,
        )
        self._table: SlotTable | None = None
        self.ranks_connected = Gauge(
            "slotsync_ranks_connected", "Trainer ranks registered with this daemon (with, on a "
            "relaying node, its ranks the owner's daemon accepted)", registry=r
        )
        self.ranks_expected = Gauge(
            "slotsync_ranks_expected",
            "Trainer ranks the known slots need (sum of slot sizes; a slot is known once it is "
            "declared in the engine table or one of its ranks registered; on a relaying node, "
            "plus this node's ranks of the engines another node drives)",
            registry=r,
        )
        self.slots = Gauge(
            "slotsync_slots",
            "Engine slots by state (failed: last update failed, engine paused, needs a full "
            "update)",
            ["state"],
            registry=r,
        )
        for state in SlotState:
            self.slots.labels(state.value)

    def watch(self, table: SlotTable) -> None:
        """Derive the table gauges from ``table`` at every scrape. Call once, after the table
        is created (``Daemon.__init__``).

        After this, ``in_flight.set()`` / ``ranks_connected.set()`` are harmless no-ops: the
        scrape-time value wins. Reads happen on the thread that serves ``/metrics``, which must
        be the table's event loop thread.
        """
        self._table = table
        self.in_flight.set_function(
            lambda: sum(c.current is not None for c in table.slots.values())
        )
        self.in_flight_age.set_function(lambda: _oldest_update_age(table, time.monotonic()))
        self.ranks_connected.set_function(table.connected_ranks)
        self.ranks_expected.set_function(lambda: sum(c.size for c in table.slots.values()))
        for state in SlotState:
            self.slots.labels(state.value).set_function(
                # (released slots' engines a later job must still update fully count as
                # failed: the engine stays paused, SlotsyncSlotFailed must see it)
                lambda s=state: sum(c.state == s for c in table.slots.values()) + (
                    sum(c.engine.needs_full_update for c in table.released.values())
                    if s is SlotState.FAILED else 0)
            )

    def watch_peers(self, peers) -> None:
        """Derive the peer-link series (engines over several nodes) from ``peers``
        (``peer_io.PeerLinks``) at every scrape, labelled by the peer's ``node`` (a fixed set:
        the nodes of the engine table); nothing is exported for a daemon without links. On a
        relaying node (``peers.relay``), after ``watch``: its relayed ranks count in
        ``slotsync_ranks_connected`` / ``_expected`` too."""
        self.registry.register(_PeerLinkCollector(peers))
        relay = getattr(peers, "relay", None)
        table = self._table
        if relay is not None and table is not None:
            # a relaying node's own ranks of the engines another node drives count here too
            # (issue 35: else SlotsyncRanksMissing could never fire on their node)
            self.ranks_connected.set_function(
                lambda: table.connected_ranks() + relay.registered_ranks())
            self.ranks_expected.set_function(
                lambda: sum(c.size for c in table.slots.values()) + relay.expected_ranks())

    def update_ended(self, e: UpdateEnded) -> None:
        """Record one ``UpdateEnded`` action (outcome, duration, chunks, bytes)."""
        outcome = e.outcome if e.outcome in OUTCOMES else "failed"  # keep the label set fixed
        self.updates.labels(outcome).inc()
        self.update_duration.observe(e.seconds)
        self.chunks.inc(e.chunks)
        self.bytes.inc(e.nbytes)
        self.omitted_names.inc(e.omitted_names)
        if outcome == "success":
            self.last_success.set(time.time())

    def observe_request(self, route: str, seconds: float, ok: bool) -> None:
        """``VllmClient``'s observe callback: one vLLM HTTP request ended."""
        self.vllm_request.labels(route).observe(seconds)
        if not ok:
            self.vllm_errors.labels(route).inc()


def _oldest_update_age(table: SlotTable, now: float) -> float:
    """Seconds since the first begin of the oldest update in flight (monotonic clock), or 0."""
    started = [c.current.started_at for c in table.slots.values() if c.current is not None]
    return max(0.0, now - min(started)) if started else 0.0


class _PeerLinkCollector:
    """``slotsync_peer_link_*``: one series per peer link, read from the link states."""

    def __init__(self, peers) -> None:
        self.peers = peers

    def describe(self):
        return []  # (the families depend on the engine table; read at collect)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        links = self.peers.links()
        if not links:
            return
        now = time.monotonic()
        up = GaugeMetricFamily("slotsync_peer_link_up", "Peer link to another node's daemon "
                               "up (1) or not (0)", labels=["node", "role"])
        heard = GaugeMetricFamily("slotsync_peer_link_last_heard_seconds", "Seconds since "
                                  "the peer's daemon was last heard", labels=["node"])
        rtt = GaugeMetricFamily("slotsync_peer_link_rtt_seconds", "Last round-trip time of "
                                "a ping on the peer link", labels=["node"])
        msgs = CounterMetricFamily("slotsync_peer_link_messages", "Messages on the peer link",
                                   labels=["node", "direction"])
        downs = CounterMetricFamily("slotsync_peer_link_downs", "Times the peer link went "
                                    "down", labels=["node"])
        for link in links:
            up.add_metric([link.node, link.role], 1.0 if link.up else 0.0)
            if link.last_heard is not None:
                heard.add_metric([link.node], now - link.last_heard)
            if link.rtt_s is not None:
                rtt.add_metric([link.node], link.rtt_s)
            msgs.add_metric([link.node, "in"], link.messages_in)
            msgs.add_metric([link.node, "out"], link.messages_out)
            downs.add_metric([link.node], link.downs)
        yield from (up, heard, rtt, msgs, downs)

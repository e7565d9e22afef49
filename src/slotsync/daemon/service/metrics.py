"""Prometheus metrics of the daemon, on a registry of its own (served at ``/metrics``).

Conventions (https://prometheus.io/docs/practices/naming/):

* one ``slotsync_`` prefix; base units in the name (``_seconds``, ``_bytes``); counters end in
  ``_total``; ``slotsync_build_info`` is the usual constant-1 info gauge;
* small, fixed label sets only: ``outcome`` (2 values), ``route`` (the vLLM routes of
  ``daemon/vllm/client.py``'s ``ROUTES``), ``state`` (the ``SlotState`` values). Nothing is
  labelled by rank, update id or weight version: those are unbounded over a run and belong in
  ``/status`` and the logs. The one exception, the adapter series (issue 36), is labelled by
  ``slot`` and ``lora_name``: the slots of this daemon's engine table and the adapter names
  the trainer publishes are a few each for a job, and an alert must name the engine whose
  adapter is lost; the adapter's version is a value, never a label;
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
    # for every SlotEvent action (the adapter rounds' ends, issue 36; the others are ignored):
    self.metrics.slot_event(action.event, action.fields)
    # each engine client's observe callback (the executor, ``service/executor.py``):
    cls(url, timeout, self.metrics.observe_request)  # VllmClient or SglangClient
"""

from __future__ import annotations

import platform
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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

OUTCOMES = ("success", "failed")  # UpdateEnded.outcome, and an adapter round's
ADAPTER_ROUND_END_EVENTS = {"adapter_loaded": "success", "adapter_failed": "failed"}
"""The ``SlotEvent`` names that end an adapter round, and the outcome each counts as."""
ADAPTER_STATES = ("served", "loading", "reloading", "unloading", "lost")
"""The ``state`` of an adapter version in a slot's ``/status`` ``"adapters"`` entries
(``daemon/core/slot_status.py``, ``core/adapters/ledger.py``'s ``STATES``): ``lost`` is a
version the engine should serve and does not (it restarted and the daemon holds no copy to
load again: SGLang's adapters, which the engine read from the ranks' memory)."""


class Metrics:
    """The daemon's metric families. ``registry`` is what the status server exposes.

    Args:
        version: the daemon's version, exported in ``slotsync_build_info``.

    Call ``watch(table)`` once after the ``SlotTable`` exists, ``update_ended(e)`` for every
    ``UpdateEnded`` action, ``slot_event(e.event, e.fields)`` for every ``SlotEvent`` (or
    ``adapter_round_ended(...)`` for every adapter round that ended), and pass
    ``observe_request`` to each ``VllmClient``. The attributes
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

        # ---- adapter rounds (issue 36), recorded by adapter_round_ended
        self.adapter_loads = Counter(
            "slotsync_adapter_loads", "Adapter rounds that ended, by outcome (failed: the "
            "previous version stays served)", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:
            self.adapter_loads.labels(outcome)
        self.adapter_load_duration = Histogram(
            "slotsync_adapter_load_duration_seconds",
            "Duration of one adapter round, first AdapterBegin to its end (successful and "
            "failed)",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.adapter_bytes = Counter(
            "slotsync_adapter_bytes", "Bytes of the adapters loaded (every rank's part; "
            "successful rounds)", registry=r
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
        self.registry.register(_AdapterCollector(table))
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

    def adapter_round_ended(self, outcome: str, seconds: float, nbytes: int = 0) -> None:
        """Record one adapter round that ended (issue 36): the service calls it once per
        round of a slot, when the round's last ``Ack(phase="adapter_data")`` or its ``Error``
        goes to the ranks.

        Args:
            outcome: ``"success"`` (the version is servable on the slot's engine) or
                ``"failed"`` (refused or failed at any phase; anything else counts as
                failed, to keep the label set fixed).
            seconds: from the round's first ``AdapterBegin`` to its end.
            nbytes: the adapter's bytes (every rank's part); counted only on success.
        """
        outcome = outcome if outcome in OUTCOMES else "failed"
        self.adapter_loads.labels(outcome).inc()
        self.adapter_load_duration.observe(seconds)
        if outcome == "success":
            self.adapter_bytes.inc(nbytes)

    def slot_event(self, event: str, fields: Mapping[str, Any]) -> None:
        """Record a ``SlotEvent`` action that ends an adapter round (issue 36; any other
        event is ignored, so the executor may pass every one): ``adapter_loaded`` (fields
        ``seconds``, ``bytes``) is a success, ``adapter_failed`` (``seconds``) a failure, as
        ``core/adapters/answers.py`` and ``core/adapters/rounds.py`` write them."""
        if event in ADAPTER_ROUND_END_EVENTS:
            self.adapter_round_ended(ADAPTER_ROUND_END_EVENTS[event],
                                     float(fields.get("seconds") or 0.0),
                                     int(fields.get("bytes") or 0))

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


class _AdapterCollector:
    """``slotsync_adapter_served_version`` and ``slotsync_adapter_versions``: the adapters of
    each slot's engine, read at scrape time from the slots' ``/status`` entries (their
    ``"adapters"`` list, issue 36), never from the core's ledger directly. One series per
    (slot, adapter name) the entries name, ``slot`` written as in ``/status`` and the logs
    (``[0,2)``); every state of ``ADAPTER_STATES`` is exported for each, at 0 where no version
    is in it, so that ``slotsync_adapter_versions{state="lost"} > 0`` has a series to read
    before an adapter is lost. Nothing for a slot without adapters."""

    def __init__(self, table: SlotTable) -> None:
        self.table = table

    def describe(self):
        return []  # (the series depend on the adapters loaded; read at collect)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        served = GaugeMetricFamily(
            "slotsync_adapter_served_version", "Highest version of the adapter the slot's "
            "engine serves (0: none, e.g. every version lost)", labels=["slot", "lora_name"])
        versions = GaugeMetricFamily(
            "slotsync_adapter_versions", "Versions of the adapter on the slot's engine, by "
            "state (lost: the engine should serve it and does not)",
            labels=["slot", "lora_name", "state"])
        for _, c in sorted(self.table.slots.items()):
            doc = c.status()
            entries = doc.get("adapters") or []
            if not entries:
                continue
            slot = f"[{doc['slot'][0]},{doc['slot'][1]})"
            for name in sorted({e["lora_name"] for e in entries}):
                mine = [e for e in entries if e["lora_name"] == name]
                served.add_metric([slot, name], max(
                    (e["version"] for e in mine if e["state"] == "served"), default=0))
                states = ADAPTER_STATES + tuple(sorted(
                    {e["state"] for e in mine} - set(ADAPTER_STATES)))  # (a newer state)
                for state in states:
                    versions.add_metric([slot, name, state],
                                        sum(e["state"] == state for e in mine))
        yield from (served, versions)

"""The daemon's service: the process and the I/O around the I/O-free core.

* ``server``: the asyncio ``Daemon`` -- startup, main loop, bounded graceful shutdown, signal
  handlers that only set flags (uvicorn's shape).
* ``config``: the configuration (TOML file, flags, environment) and the engine table's checks.
* ``intake``: the rank socket (ZeroMQ ROUTER, ZAP's ``peer_auth``) turned into core events;
  ``liveness``: which ranks are still there; ``executor``: runs the core's actions (HTTP calls
  through each engine family's client, replies, the durable record first where needed).
* ``mid_update_record``, ``runtime_dir``: what lives on disk (the record, the socket folder).
* ``status_documents``, ``status_server``: ``/status``, ``/healthz``, ``/metrics``;
  ``metrics``: Prometheus; ``systemd``: ``sd_notify`` (the event logs, one line per event,
  are ``daemon/logs.py``, below the service and the node links).

May import everything below it in the daemon (node_links, families, the family packages,
core) and ``slotsync.protocol``'s schema; never torch, never the CLIs.
"""

"""``slotsyncd``: the per-node daemon that drives each engine slot's update (never imports torch).

Rooms, from the top of the daemon's layers down (pyproject.toml ``[tool.importlinter]``; a
package may import the ones below it, never one above):

* ``main``: the ``slotsyncd`` entry point (configuration, folders, run the service).
* ``service/``: the process around the core -- configuration, the asyncio ``Daemon``
  (startup, main loop, shutdown), the ZeroMQ intake and the executor that runs the core's
  actions, the durable mid-update record, ``/status``, metrics, systemd notify.
* ``node_links/``: engines over several nodes -- the peer link's wire, its state machines,
  CURVE keys, relaying and the owner's side, the engine table's span rules.
* ``families``: which engine family a slot's URL serves, and the families the daemon speaks.
* ``vllm/``, ``sglang/``: one package per engine family -- its HTTP client, its routes, the
  pickles it is sent, its version table and what it refuses; independent of each other.
* ``core/``: the slot table and one I/O-free coordinator per engine slot, with its rules
  (registration, begin agreement, chunk window, aggregation, probe, recovery) and the
  engine-family interface it asks; it names no family.

Everything here may import ``slotsync.protocol``'s wire schema, and nothing here imports
torch, numpy or an engine's own package (design.md I6). ``launcher`` re-exports
``slotsync.testing.processes.DaemonProcess`` for older imports.
"""

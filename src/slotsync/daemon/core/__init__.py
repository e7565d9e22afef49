"""The daemon's core: the slot table and each slot's coordinator with its I/O-free parts
(update and phases, begin stages, chunk window, engine session, probe answers, recovery,
registration, claims, the ``/status`` entry), and ``family.py``, the interface through which
the coordinator asks an engine family what differs (it holds no family's name or rule).

Bottom layer of the daemon (pyproject.toml): imports only ``slotsync.protocol`` (the wire
schema) and itself; never ``daemon.vllm`` / ``daemon.sglang`` / ``daemon.families`` (they are
injected: ``SlotTable(families=...)``), the node links or the service; no I/O.
"""

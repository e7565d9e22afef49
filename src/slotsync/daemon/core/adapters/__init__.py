"""Adapter rounds (issue 36), I/O-free, naming no engine family.

``plan``: what one round of a LoRA adapter loads, and what an engine can hold; the rules that
gather a slot's ranks' ``AdapterBegin`` parts into a plan, and the ledger of what each engine
holds and must get again after a restart, live beside it.

Imports: ``slotsync.protocol.wire`` and ``daemon/logs.py`` only, like the rest of the core.
"""

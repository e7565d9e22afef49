"""Adapter rounds (issue 36), I/O-free, naming no engine family.

``plan``: what one round of a LoRA adapter loads, and what an engine can hold; ``gather``:
the rules that gather a slot's ranks' ``AdapterBegin`` parts into a plan and refuse a round
before any engine call; ``ledger``: what each engine holds and should hold, and what a
restart of it leaves; ``round``: one round's phases and the check of a rank's data;
``rounds`` and ``answers``: the adapter half of ``SlotCoordinator`` (a mixin, as
``outcomes.py`` and ``engine_steps.py`` are).

Imports: ``slotsync.protocol.wire``, ``daemon/logs.py`` and the rest of the core, like the
rest of the core.
"""

"""slotsync: per-node weight-sync daemon for colocated RL post-training.

Packages: ``slotsync.protocol`` (wire schema, topology, trainer-side publisher),
``slotsync.daemon`` (the ``slotsyncd`` service), ``slotsync.engine`` (a reference engine that
speaks vLLM's weight-transfer HTTP contract).
"""

__version__ = "0.1.0"

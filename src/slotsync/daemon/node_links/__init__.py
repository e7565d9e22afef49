"""Engines over several nodes: the links between the daemons of different nodes.

* ``spans``: the engine table's rules for an engine whose workers lie on several nodes, and
  each daemon's role (owner or relaying node).
* ``peer_wire``: the peer link's messages; ``peer_state``: its I/O-free state machines;
  ``peer_keys``: CURVE key pairs and the allow-list; ``peer_io``: the ZeroMQ CURVE sockets.
* ``relay``: a relaying node's side (its ranks' frames forwarded to the owner, unchanged);
  ``owner_links``: the owner's side (relayed frames into its slot table, under node names).

May import the daemon's core, the engine-family packages and ``slotsync.protocol``'s schema;
never the service above it (the service wires these adapters in).
"""

"""Engines over several nodes: the engine table's rules for them, and each daemon's role.

An engine whose workers lie on several nodes (vLLM ``--nnodes N``: TP=16 over two nodes, or
DP×TP replicas on different nodes) is declared in the engine table of every node it covers,
identically::

    [[engines]]
    url = "http://10.0.0.1:8000"         # its API server, on the owner node
    slot_start = 0
    slot_size = 8
    owner = "node0"                      # the node whose daemon drives it
    owner_address = "tcp://10.0.0.1:9461"  # that daemon's peer_listen, as the others reach it
    nodes = [{node = "node0", ranks = [0, 4]}, {node = "node1", ranks = [4, 8]}]

``nodes`` lists each node's trainer ranks ``[start, end)`` in worker order: together they
cover the slot, in order, with no gap (vLLM numbers an engine's workers node by node:
``--node-rank k`` holds global ranks ``k * workers_per_node ...``). The owner's daemon drives
the engine exactly as on one node; the other nodes' daemons relay their ranks' frames to it
(``relay.py``, ``owner_links.py``). Fixed by configuration: there is no leader election,
since the engine's API server is where it is.

I/O-free: parsing and checks (``parse_toml``, ``check_spanning``), the roles of one daemon
(``roles``), and the comparison of two nodes' declarations (``difference``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from slotsync.daemon.node_links.peer_wire import SpanEngine, SpanPart

TOML_KEYS = ("owner", "owner_address", "nodes")
"""The engine-table keys of an engine over several nodes."""
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}$")
_TCP_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


def check_node_name(name: str, what: str) -> None:
    """Raises ValueError unless ``name`` is a node name: letters, digits, ``_.-``, at most
    255 characters, not starting with punctuation (it names key files)."""
    if not _NODE_RE.match(name):
        raise ValueError(f"{what} {name!r} is not a node name (letters, digits, '_', '.', '-'; "
                         "starting with a letter or digit)")


def check_tcp_address(address: str, what: str) -> None:
    """Raises ValueError unless ``address`` is ``tcp://HOST:PORT`` with a port 1..65535 (the
    message names a port outside that range as such)."""
    m = _TCP_RE.match(address)
    if m and not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"{what} {address!r}: port {int(m.group(2))} is outside 1..65535")
    if not m:
        raise ValueError(f"{what} {address!r} must be tcp://HOST:PORT (the peer link is "
                         "ZeroMQ over TCP)")


def parse_toml(entry: dict[str, Any]) -> tuple[str, str, tuple[SpanPart, ...]]:
    """``(owner, owner_address, parts)`` of one TOML ``[[engines]]`` table; all empty for an
    engine on one node.

    Raises:
        ValueError: a key of the wrong type, or ``nodes`` entries without ``node`` and
            ``ranks = [start, end]``.
    """
    owner, address, nodes = entry.get("owner", ""), entry.get("owner_address", ""), \
        entry.get("nodes", [])
    if not isinstance(owner, str) or not isinstance(address, str):
        raise ValueError("owner and owner_address must be strings")
    if not isinstance(nodes, list):
        raise ValueError("nodes must be an array of {node = NAME, ranks = [START, END]}")
    parts = []
    for j, n in enumerate(nodes):
        ranks = n.get("ranks") if isinstance(n, dict) else None
        if (not isinstance(n, dict) or set(n) != {"node", "ranks"}
                or not isinstance(n["node"], str) or not isinstance(ranks, list)
                or len(ranks) != 2
                or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)):
            raise ValueError(f"nodes[{j}] must be {{node = NAME, ranks = [START, END]}}, "
                             f"got {n!r}")
        parts.append(SpanPart(n["node"], ranks[0], ranks[1]))
    if parts and not owner:
        raise ValueError("an engine with nodes needs its owner (the node whose daemon "
                         "drives it)")
    if (owner or address) and not parts:
        raise ValueError("owner and owner_address belong to an engine over several nodes: "
                         "list its nodes too")
    return owner, address, tuple(parts)


def check_spanning(engines: list, node: str, peer_listen: str, secret_key: str,
                   public_keys: str) -> None:
    """Check the engines over several nodes of one daemon's table (``config.EngineEntry``
    objects), for the daemon of node ``node``.

    Raises:
        ValueError: naming the engine and what is wrong: nodes whose ranks do not cover the
            slot in order, an owner not among them, this node not among them, an
            ``owner_address`` missing or not ``tcp://HOST:PORT`` with a port 1..65535 (checked
            on every node, the owner's too: ``--check-config`` on the owner refuses the table
            its peers would refuse), or a missing listener or key for the role this node has.
    """
    check_node_name(node, "node")
    owner_here = relay_here = False
    for e in engines:
        if not e.parts:
            continue
        where = f"engines: {e.url!r}"
        at = e.slot_start
        names = []
        for p in e.parts:
            check_node_name(p.node, f"{where}: node")
            if p.start != at or p.end <= p.start:
                raise ValueError(
                    f"{where}: node {p.node!r} has ranks [{p.start}, {p.end}); the nodes' "
                    f"ranks must cover the slot [{e.slot[0]}, {e.slot[1]}) in order, the "
                    f"next one starting at {at}")
            at = p.end
            names.append(p.node)
        if at != e.slot[1]:
            raise ValueError(f"{where}: the nodes' ranks end at {at}, the slot at {e.slot[1]}")
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: a node is listed twice in nodes")
        if len(names) < 2:
            raise ValueError(f"{where}: nodes lists one node; an engine on one node needs no "
                             "owner or nodes")
        sizes = {p.end - p.start for p in e.parts}
        if len(sizes) > 1:
            raise ValueError(
                f"{where}: the nodes hold unequal numbers of ranks ({_nodes(e)}): a slot over "
                "several nodes has the same number on each (vLLM --nnodes: each node runs "
                "world_size / nnodes workers); split the slot evenly")
        if e.owner not in names:
            raise ValueError(f"{where}: owner {e.owner!r} is not one of its nodes {names}")
        if node not in names:
            raise ValueError(f"{where}: this daemon's node {node!r} (option node) is not one "
                             f"of its nodes {names}; declare an engine only on its nodes")
        if not e.owner_address:
            raise ValueError(f"{where}: owner_address is not set: the daemons of the other "
                             f"nodes connect there (node {e.owner}'s peer_listen, as they reach "
                             "it, e.g. tcp://10.0.0.1:9461)")
        check_tcp_address(e.owner_address, f"{where}: owner_address")
        if e.owner == node:
            owner_here = True
            listen_port = _port(peer_listen)
            if listen_port and listen_port != _port(e.owner_address):
                raise ValueError(
                    f"{where}: owner_address {e.owner_address!r} is not this owner's "
                    f"peer_listen {peer_listen!r} (port {_port(e.owner_address)}, not "
                    f"{listen_port}): the other nodes connect to owner_address, where "
                    "nothing would listen; give both the same port")
        else:
            relay_here = True
    if owner_here and not peer_listen:
        raise ValueError(f"peer_listen is not set, but node {node!r} owns an engine over "
                         "several nodes: the other nodes' daemons connect there")
    if peer_listen:
        check_tcp_address(peer_listen, "peer_listen")
    if owner_here or relay_here or peer_listen:
        for option, path, kind in (("curve_secret_key", secret_key, "file"),
                                   ("peer_public_keys", public_keys, "folder")):
            if not path:
                raise ValueError(f"{option} is not set: the peer link of engines over several "
                                 "nodes is authenticated (slotsync keys NODE makes a key pair)")
            ok = os.path.isfile(path) if kind == "file" else os.path.isdir(path)
            if not ok:
                raise ValueError(f"{option} {path!r} is not a {kind}")


def _port(address: str) -> int:
    """The port of a ``tcp://HOST:PORT`` address (0 when it is not one)."""
    m = _TCP_RE.match(address)
    return int(m.group(2)) if m else 0


def span_engine(e: Any) -> SpanEngine:
    """A ``config.EngineEntry`` over several nodes as the peer link carries it."""
    return SpanEngine(e.url, e.slot_start, e.slot_size, e.owner, tuple(e.parts),
                      tuple(e.gpu_uuids), e.owner_address)


def misplaced_rank(engine: SpanEngine, node: str, rank: int) -> str:
    """Why trainer rank ``rank`` cannot register for ``engine`` at the daemon of ``node``: the
    engine table's ``nodes`` put it on another node ('' when they put it on ``node``, or on
    none: the owner's slot then refuses a rank outside the slot). Each rank publishes to its
    own node's daemon, since its CUDA IPC handles open only on its node."""
    part = next((p for p in engine.parts if p.start <= rank < p.end), None)
    if part is None or part.node == node:
        return ""
    mine = next((p for p in engine.parts if p.node == node), None)
    here = f" (this node's ranks: [{mine.start}, {mine.end}))" if mine else ""
    return (f"rank {rank} registers at node {node}'s daemon, but the engine table puts rank "
            f"{rank} of slot [{engine.slot_start}, {engine.slot_start + engine.slot_size}) "
            f"(engine {engine.url}) on node {part.node}{here}: each rank publishes to the "
            f"daemon of the node its GPU is on; check the trainer's ranks per node, or the "
            f"engine table's nodes ({_nodes(engine)})")


@dataclass(frozen=True)
class Relayed:
    """An engine over several nodes that another node's daemon drives: where to relay."""

    slot: tuple[int, int]
    owner: str
    owner_address: str
    engine: SpanEngine


@dataclass(frozen=True)
class Roles:
    """What one daemon does for the engines over several nodes of its table.

    ``owned``: slot -> engine, for engines this node drives (its peers relay to it);
    ``relayed``: slot -> ``Relayed``, for engines another node drives (this node relays its
    ranks' frames there); ``owners``: owner node -> (its address, the engines it owns here,
    as ``Hello`` lists them)."""

    node: str
    owned: dict[tuple[int, int], SpanEngine]
    relayed: dict[tuple[int, int], Relayed]

    def owners(self) -> dict[str, tuple[str, list[SpanEngine]]]:
        out: dict[str, tuple[str, list[SpanEngine]]] = {}
        for r in self.relayed.values():
            out.setdefault(r.owner, (r.owner_address, []))[1].append(r.engine)
        return out

    def peers_of_owned(self) -> set[str]:
        """The nodes whose daemons relay to this one."""
        return {p.node for e in self.owned.values() for p in e.parts} - {self.node}


def roles(engines: list, node: str) -> Roles:
    """The ``Roles`` of the daemon of ``node`` (its engine table already checked)."""
    owned, relayed = {}, {}
    for e in engines:
        if not e.parts:
            continue
        if e.owner == node:
            owned[e.slot] = span_engine(e)
        else:
            relayed[e.slot] = Relayed(e.slot, e.owner, e.owner_address, span_engine(e))
    return Roles(node, owned, relayed)


def difference(mine: list[SpanEngine], theirs: list[SpanEngine], me: str, them: str) -> str:
    """How node ``them``'s declaration of the engines that ``me`` owns and ``them`` is part
    of differs from ``me``'s own ('' when it does not), for the ``Refuse`` of a ``Hello``."""
    mine_here = {e.url: e for e in mine if any(p.node == them for p in e.parts)}
    theirs_by = {e.url: e for e in theirs}
    for url, e in sorted(mine_here.items()):
        t = theirs_by.get(url)
        if t is None:
            return (f"node {me} drives engine {url} over nodes {_nodes(e)}, which node {them}'s "
                    "engine table does not declare")
        if t != e:
            keys = [k for k, f in _KEYS if getattr(t, f) != getattr(e, f)]
            return (f"node {them} declares engine {url} as {_describe(t)}; node {me}, its "
                    f"owner, as {_describe(e)} (they differ in {', '.join(keys)}: the "
                    "engine tables must declare it identically)")
    for url, t in sorted(theirs_by.items()):
        if url not in mine_here:
            return (f"node {them} declares engine {url} as {_describe(t)}, owned by node {me}; "
                    f"node {me}'s engine table has no such engine over node {them}")
    return ""


COMPARED_KEYS = ("url", "slot_start", "slot_size", "owner", "nodes", "gpu_uuids",
                 "owner_address")
"""The engine-table keys the owner compares with each connecting node's (``difference``);
the others (``kind``, ``pause_mode``, ``api_key_file``, ``admin_api_key_file``) are the
owner's alone, read only by the daemon that drives the engine, and ignored elsewhere."""

_KEYS = (("url", "url"), ("slot_start", "slot_start"), ("slot_size", "slot_size"),
         ("owner", "owner"), ("nodes", "parts"), ("gpu_uuids", "gpu_uuids"),
         ("owner_address", "owner_address"))
"""The engine-table keys of a ``SpanEngine``, as (TOML key, field)."""


def _nodes(e: SpanEngine) -> str:
    return ", ".join(f"{p.node} [{p.start}, {p.end})" for p in e.parts)


def _describe(e: SpanEngine) -> str:
    text = (f"slot [{e.slot_start}, {e.slot_start + e.slot_size}) owned by {e.owner} over "
            f"{_nodes(e)}")
    text += f", GPU UUIDs {list(e.gpu_uuids)}" if e.gpu_uuids else ""
    return text + f", owner_address {e.owner_address or '(none)'}"

"""``slotsync status``'s part for engines over several nodes (issue 25 E): the peer links and
the slots this node's ranks feed but another node's daemon drives. Pure functions of the
``/status`` document's ``peers`` and ``relayed_slots`` (``daemon/service/server.py``)."""

from __future__ import annotations


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [head, *rows]]


def render_peers(status: dict) -> str:
    """The peer links (node, role, address, state, last heard, messages in/out, round-trip
    time, engines) and the relayed slots (who drives them); "" for a daemon without links."""
    peers = status.get("peers")
    if not peers:
        return ""
    out = [f"node {peers.get('node')}" + (f", listening for peers on {peers['listen']}"
                                          if peers.get("listen") else "")]
    rows = []
    for link in peers.get("links", []):
        heard = link.get("last_heard_s_ago")
        rtt = link.get("rtt_ms")
        rows.append([
            link["node"], link.get("role", "-"), link.get("address") or "-",
            "up" if link.get("up") else link.get("state", "down"),
            "-" if heard is None else f"{heard:.1f}s ago",
            f"{link.get('messages_in', 0)}/{link.get('messages_out', 0)}",
            "-" if rtt is None else f"{rtt:.2f} ms",
            ", ".join(link.get("engines", [])) or "-",
        ])
    if rows:
        out += _table(["PEER", "ROLE", "ADDRESS", "LINK", "LAST HEARD", "MSGS IN/OUT", "RTT",
                       "ENGINES"], rows)
    out += [f"link to {link['node']}: {link['cause']}" for link in peers.get("links", [])
            if link.get("cause")]  # (what its connect attempts met: issue 35)
    if peers.get("handshakes_refused"):
        out.append(f"{peers['handshakes_refused']} handshake(s) refused on the listener (a "
                   "key not allowed, a stale key of this node): see peer_key_refused and "
                   "peer_handshake_failed in the log")
    for r in status.get("relayed_slots", []):
        nodes = ", ".join(f"{n['node']} [{n['ranks'][0]}, {n['ranks'][1]})"
                          for n in r.get("nodes", []))
        out.append(f"slot [{r['slot'][0]},{r['slot'][1]}) {r.get('engine_url')}: driven by node "
                   f"{r['driven_by']} ({r.get('owner_address')}); nodes {nodes}; this node's "
                   "ranks are relayed there" + _relayed_ranks(r, peers.get("node")))
    return "\n".join(out)


def _relayed_ranks(r: dict, node: str | None) -> str:
    """``: 3/4 registered (4, 5, 6; missing 7)`` for a relayed slot's entry from a daemon that
    lists this node's ranks of it (issue 35); '' from an older one."""
    if "ranks_expected" not in r:
        return ""
    have = r.get("ranks_registered", [])
    mine = next((n["ranks"] for n in r.get("nodes", []) if n["node"] == node), None)
    missing = [k for k in range(*mine) if k not in have] if mine else []
    listed = ", ".join(str(k) for k in have)
    return (f": {len(have)}/{r['ranks_expected']} registered" + (f" ({listed}" if have else " (")
            + ("; " if have and missing else "")
            + (f"missing {', '.join(str(k) for k in missing)}" if missing else "") + ")")


def links_not_up(status: dict) -> list[str]:
    """``node0 (down: ...)`` for each peer link of the ``/status`` document that is not up
    (``slotsync status`` exits 1 while there is one)."""
    links = (status.get("peers") or {}).get("links", [])
    return [f"{lk['node']} ({lk.get('state', 'down')})" for lk in links if not lk.get("up")]

"""Pure registration checks of one slot (design.md "Topology rules"): who a registered rank
is, and why a ``Register`` is refused. The coordinator (``SlotCoordinator.on_register``)
applies them in order and owns what follows (replies, the slot's reset for a new job).
"""

from __future__ import annotations

from dataclasses import dataclass

from slotsync.protocol.wire import PROTOCOL_VERSION, Register


@dataclass
class RankInfo:
    """A registered rank: its socket identity, what it told us at registration, and whether
    its process is still there.

    ``pid`` is the pid it reported (in its own pid namespace); ``peer_pid`` the kernel's
    (SO_PEERCRED, in the daemon's namespace; 0 when the kernel could not name it, e.g. a
    process in a pid namespace the daemon cannot see). Times are monotonic seconds: ``last_seen``
    its last message, ``gone_at`` when its connection closed or its process exited (None while
    it lives), ``gone_why`` how that was seen.
    """

    rank: int
    identity: bytes
    gpu_uuid: str
    hostname: str
    pid: int
    peer_pid: int = 0
    last_seen: float = 0.0
    gone_at: float | None = None
    gone_why: str = ""

    @property
    def who(self) -> str:
        """``"rank 3 (pid 1234 on host-a)"``, for messages (``process_text``)."""
        return f"rank {self.rank} ({self.process})"

    @property
    def process(self) -> str:
        """``"pid 1234 on host-a"`` (the kernel's pid where known), for messages."""
        return process_text(self.peer_pid or self.pid, self.hostname)

    def same_process(self, msg: Register, peer_pid: int) -> bool:
        """Whether a registration comes from this rank's process (kernel pids where both are
        known, else the reported host and pid)."""
        if peer_pid and self.peer_pid:
            return peer_pid == self.peer_pid
        return (msg.hostname, msg.pid) == (self.hostname, self.pid)


def process_text(pid: int, hostname: str) -> str:
    """``"pid 1234 on host-a"``, or ``"pid 1234"`` when the rank sent no hostname
    (``Register.hostname`` is optional): never a dangling ``"on "``."""
    return f"pid {pid} on {hostname}" if hostname else f"pid {pid}"


def wrong_protocol_or_slot(msg: Register, slot: tuple[int, int]) -> str:
    """Why ``msg`` cannot register in ``slot`` = ``(start, end)`` at all: another protocol
    version (``wire.PROTOCOL_VERSION``), or a slot claim other than ``slot``; '' if neither."""
    if msg.protocol_version != PROTOCOL_VERSION:
        return (f"protocol version mismatch: rank {msg.rank} speaks {msg.protocol_version}, "
                f"this daemon speaks {PROTOCOL_VERSION}")
    if (msg.slot_start, msg.slot_start + msg.slot_size) != slot:
        return (f"rank {msg.rank} claims slot [{msg.slot_start}, {msg.slot_start + msg.slot_size})"
                f" but its rank belongs to slot [{slot[0]}, {slot[1]})")
    return ""


def rank_held(held: RankInfo | None, identity: bytes, msg: Register, peer_pid: int) -> str:
    """Why ``msg`` (on connection ``identity``, kernel pid ``peer_pid`` or 0) cannot take its
    rank: ``held``, its registration, is another live process's (``wire.RANK_HELD``); ''
    if the rank is free, gone, or this very process."""
    if (held is None or held.gone_at is not None or held.identity == identity
            or held.same_process(msg, peer_pid)):
        return ""
    return (f"rank {msg.rank} is already registered by {held.process}, which is still "
            f"connected; {process_text(peer_pid or msg.pid, msg.hostname)} claims it too: two "
            "trainer processes with one rank? (check the launcher's RANK; a restarted rank "
            "registers once its old process is gone)")


def unlike_the_slot(msg: Register, slot: tuple[int, int], others: dict[int, RankInfo],
                    engine_url: str | None, packed: bool | None, transport: str | None) -> str:
    """Why ``msg`` does not fit the slot's ranks already registered (``others``, rank ->
    info): another engine URL, packed mode or transport, or a GPU UUID another rank holds;
    '' if it fits."""
    if msg.engine_url != engine_url:
        return (f"rank {msg.rank} names engine {msg.engine_url!r} but rank(s) "
                f"{sorted(others)} of slot [{slot[0]}, {slot[1]}) name {engine_url!r}")
    if msg.packed != packed:
        return (f"rank {msg.rank} registers packed={msg.packed} but the slot uses "
                f"packed={packed}")
    if msg.transport != transport:
        return (f"rank {msg.rank} registers transport {msg.transport!r} but the slot uses "
                f"{transport!r}")
    dup = [r for r, i in others.items() if i.gpu_uuid == msg.gpu_uuid]
    if dup:
        return f"rank {msg.rank} registers GPU UUID {msg.gpu_uuid} already held by rank {dup[0]}"
    return ""


def uuid_mismatch(ranks: dict[int, RankInfo], declared: tuple[str, ...] | None,
                  reported: tuple[str, ...] | None, engine_url: str | None) -> str:
    """Why the ranks' GPU UUIDs are not the engine's workers' (I2, before the pause), or
    '' when they match or the engine's are not known (then vLLM names a missing one)."""
    want = declared or reported
    if not want:
        return ""
    have = {i.gpu_uuid: r for r, i in ranks.items()}
    if set(have) == set(want):
        return ""
    strays = sorted((r, g) for g, r in have.items() if g not in want)
    lacking = sorted(set(want) - set(have))
    source = ("the engine table declares" if declared
              else f"engine {engine_url} reports")
    parts = []
    if strays:
        parts.append("rank(s) " + ", ".join(f"{r} ({g})" for r, g in strays)
                     + " have GPU UUIDs the engine does not")
    if lacking:
        parts.append(f"no rank has {', '.join(lacking)}")
    return (f"the ranks' GPU UUIDs are not the engine's: {'; '.join(parts)} ({source} "
            f"{list(want)})")


def split_relayed(identity: bytes) -> tuple[str, bytes] | None:
    """``(node, origin)`` of a relayed rank's identity (``node_links.peer_wire.relayed_identity``:
    ``b"peer:" + node + b"/" + origin``), or None for a local rank's identity."""
    if not identity.startswith(b"peer:"):
        return None
    node, sep, origin = identity[5:].partition(b"/")
    return (node.decode(), origin) if sep else None

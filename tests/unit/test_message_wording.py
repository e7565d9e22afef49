"""Wording of messages a fresh-user trial found broken (issue 24, Why 4): the update named
twice ("update 67 of update 67") and a rank's process with no host ("pid 25574 on )")."""

from __future__ import annotations

from types import SimpleNamespace

from slotsync.daemon.core.registration import RankInfo, rank_held
from slotsync.daemon.core.update import Timeouts
from slotsync.daemon.families import SlotTable
from slotsync.protocol.rank.session import Awaited
from slotsync.protocol.rank.waits import DaemonWaits
from slotsync.protocol.wire import PROTOCOL_VERSION, Register, logical_gpu_uuid


def _waits(update_id: int | None, registered: object = None) -> DaemonWaits:
    session = SimpleNamespace(update_id=update_id, forget_registration=lambda: None,
                              registered=registered)
    link = SimpleNamespace(peer_pid=4321)
    return DaemonWaits(link, session, endpoint="ipc:///nonexistent/slotsync.sock",  # type: ignore[arg-type]
                       rank=0, slot_range=(0, 2), timeout_s=5.0, liveness_s=3.0,
                       on_error=lambda e: None, end_update=lambda: None)  # type: ignore[arg-type,return-value]


def test_a_lost_daemon_names_the_update_once():
    err = _waits(67).daemon_gone("begin", Awaited("begin", 67).describe())
    text = str(err)
    assert "while waiting for Ack(begin) for update 67:" in text, text
    assert "of update 67" not in text and text.count("update 67") == 2, text  # (prefix + once)
    # waiting for Registered, with an update open: the update is named after it
    err = _waits(67).daemon_gone("register", Awaited("register").describe())
    assert "while waiting for Registered of update 67:" in str(err), str(err)


def test_a_lost_daemon_names_the_node_that_drives_the_engine_over_several_nodes():
    """Issue 25: the owner's daemon gone, its own ranks are told which node drove the engine
    (``Registered.node``, set by a daemon with peer links); one node: not said."""
    from slotsync.protocol.wire import Registered

    reg = Registered(0, 0, 2, 5, node="node0")
    text = str(_waits(67, reg).daemon_gone("begin", Awaited("begin", 67).describe()))
    assert "the engine of slot [0, 2) is driven by the daemon of node node0" in text, text
    text = str(_waits(67, Registered(0, 0, 2, 5)).daemon_gone("begin", "Ack(begin)"))
    assert "driven by" not in text


def _info(rank: int, hostname: str, pid: int = 25574) -> RankInfo:
    return RankInfo(rank, f"id-{rank}".encode(), logical_gpu_uuid(rank), hostname, pid, pid)


def test_a_rank_without_a_hostname_is_named_without_a_dangling_on():
    assert _info(3, "").who == "rank 3 (pid 25574)"
    assert _info(3, "host-a").who == "rank 3 (pid 25574 on host-a)"
    claim = Register(PROTOCOL_VERSION, 3, logical_gpu_uuid(3), 0, 4, "http://e:1", True, "shm",
                     "", 999)
    why = rank_held(_info(3, ""), b"other", claim, 999)
    assert "registered by pid 25574, which is still connected; pid 999 claims it" in why, why
    assert " on ," not in why and " on )" not in why
    from slotsync.daemon.core.registration import process_text  # (new with issue 24)

    assert process_text(25574, "") == "pid 25574"
    assert process_text(25574, "host-a") == "pid 25574 on host-a"


def test_a_slot_held_by_live_ranks_without_hostnames_names_them_cleanly():
    t = SlotTable(Timeouts(10, 10, 10))
    ident = b"id-0"
    t.on_message(ident, Register(PROTOCOL_VERSION, 0, logical_gpu_uuid(0), 0, 2, "http://e:1",
                                 True, "shm", "", 25574), 0.0, peer_pid=25574)
    # another topology claims an overlapping slot: refused, naming the live ranks
    out = t.on_message(b"id-9", Register(PROTOCOL_VERSION, 1, logical_gpu_uuid(1), 1, 2,
                                         "http://e:2", True, "shm", "", 77), 0.0, peer_pid=77)
    text = " ".join(str(getattr(a.msg, "message", "")) for a in out)
    assert "0 (pid 25574)" in text and " on )" not in text, text

"""The daemon's liveness and log hygiene against a real slotsyncd (issue 15): ranks seen gone
when their connection closes, /status and `slotsync status` per rank, the slot released,
`slotsync slots drop`, rejected-message warnings rate-limited, an oversize frame logged."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq
from in_process_daemon import Rank

from slotsync.daemon.launcher import DaemonProcess
from slotsync.protocol import wire


def _wait(pred, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slotsync", *args], capture_output=True,
                          text=True, timeout=60)


def test_closed_connections_show_ranks_gone_then_the_slot_is_released(tmp_path):
    with DaemonProcess(runtime_dir=str(tmp_path), args=["--slot-release-s", "3"]) as d:
        ctx = zmq.Context()
        r0, r1 = Rank(ctx, d.endpoint, 0), Rank(ctx, d.endpoint, 1)
        assert isinstance(r0.reply, wire.Registered) and isinstance(r1.reply, wire.Registered)
        ranks = d.status()["slots"][0]["ranks"]
        assert [r["alive"] for r in ranks] == [True, True]
        # the kernel's pid (this process), not the one the message claims (4242)
        import os
        assert {r["pid"] for r in ranks} == {os.getpid()}
        r1.close()
        assert _wait(lambda: not d.status()["slots"][0]["ranks"][1]["alive"], 10)
        r = d.status()["slots"][0]["ranks"][1]
        assert "its connection closed" in r["gone_why"] and r["gone_s"] >= 0
        out = _cli("status", "--url", d.status_url)
        assert out.returncode == 0, out.stderr
        assert "2/2 (1 gone)" in out.stdout and "gone" in out.stdout and "PID" in out.stdout
        r0.close()
        # both gone: released slot_release_s later (3 s), and the daemon forgets them
        assert _wait(lambda: d.status()["slots"] == [], 15), d.status()
        assert "slot_released" in d.log_tail()
        ctx.term()


def test_slots_drop_refuses_nothing_and_drops_a_slot(tmp_path):
    with DaemonProcess(runtime_dir=str(tmp_path)) as d:
        ctx = zmq.Context()
        r0 = Rank(ctx, d.endpoint, 0)
        missing = _cli("slots", "drop", "4", "6", "--url", d.status_url)
        assert missing.returncode == 1 and "no slot [4, 6)" in missing.stderr, missing.stderr
        out = _cli("slots", "drop", "0", "2", "--url", d.status_url)
        assert out.returncode == 0, out.stderr
        assert "dropped slot [0, 2)" in out.stdout and "[0]" in out.stdout
        assert d.status()["slots"] == [] and d.status()["ranks_connected"] == 0
        assert "slot_dropped" in d.log_tail()
        # the dropped rank's next message is answered "not registered" (it registers again)
        r0.s.send(wire.encode(wire.Begin(0, "v")))
        assert r0.s.poll(10_000)
        err = wire.decode_from_daemon(r0.s.recv())
        assert isinstance(err, wire.Error) and err.code == wire.NOT_REGISTERED
        r0.close()
        ctx.term()


def test_junk_frames_are_answered_but_logged_a_few_times_per_peer(tmp_path):
    with DaemonProcess(runtime_dir=str(tmp_path)) as d:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(d.endpoint)
        n = 2000
        for i in range(n):
            s.send(b"junk %d" % i)
        got = 0
        while got < n and s.poll(10_000):
            err = wire.decode_from_daemon(s.recv())
            assert isinstance(err, wire.Error) and err.phase == "decode"
            got += 1
        assert got == n  # every frame answered
        assert _wait(lambda: f"slotsync_rejected_messages_total {float(n)}" in d.metrics(), 10)
        lines = [ln for ln in d.log_tail(10**6).splitlines() if "rejected_message " in ln]
        assert 1 <= len(lines) <= 5, len(lines)  # (20,009 lines for 20,000 frames, before)
        s.close()
        ctx.term()


def test_frame_far_over_the_cap_closes_the_connection_and_is_logged(tmp_path):
    # libzmq drops a peer whose frame is over the socket's MAXMSGSIZE (twice the cap) without
    # a word; the daemon logs the connection that closed without a message
    with DaemonProcess(runtime_dir=str(tmp_path), args=["--max-message-bytes", "4096"]) as d:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 2000)
        s.connect(d.endpoint)
        s.send(b"\x00" * 100_000)
        assert _wait(lambda: "connection_closed_without_message" in d.log_tail(), 15), (
            d.log_tail())
        assert "8192 bytes" in d.log_tail()
        s.close()
        ctx.term()


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_liveness_s_must_be_sane(value):
    out = subprocess.run([sys.executable, "-m", "slotsync.daemon", "--liveness-s", value,
                          "--check-config"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "liveness_s" in out.stderr, out.stderr


def test_invalid_option_from_the_environment_names_the_variable():
    import os

    out = subprocess.run([sys.executable, "-m", "slotsync.daemon", "--check-config"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SLOTSYNC_LIVENESS_S": "0"})
    assert out.returncode == 2 and "liveness_s must be" in out.stderr, out.stderr
    assert "(set by environment SLOTSYNC_LIVENESS_S)" in out.stderr, out.stderr


def test_status_shows_an_engine_no_process_answers_as_unreachable(tmp_path):
    # issue 24: while an engine process was dead, `slotsync status` showed it "paused" (or
    # "serving") with a last update of "0.00s", the failed begin's duration
    with DaemonProcess(runtime_dir=str(tmp_path)) as d:
        ctx = zmq.Context()
        ranks = [Rank(ctx, d.endpoint, r) for r in (0, 1)]  # (engine http://127.0.0.1:1)
        for r in ranks:
            assert isinstance(r.reply, wire.Registered), r.reply
            r.s.send(wire.encode(wire.Begin(r.reply.next_update_id, "v1")))
        for r in ranks:  # the begin fails: GET /version finds no process at the URL
            assert r.s.poll(30_000)
            err = wire.decode_from_daemon(r.s.recv())
            assert isinstance(err, wire.Error) and "cannot reach" in err.message, err
        s = d.status()["slots"][0]
        assert "cannot reach http://127.0.0.1:1" in s["engine_unreachable"], s
        assert s["engine_last_answer_s"] is None and s["last_success_duration_s"] is None, s
        out = _cli("status", "--url", d.status_url)
        row = out.stdout.splitlines()[2]
        assert "unreachable for" in row and "never answered" in row, out.stdout
        assert "0.00s" not in row and "serving" not in row and "paused" not in row, out.stdout
        assert "1 engine(s) unreachable" in out.stderr and "127.0.0.1:1" in out.stderr, out.stderr
        for r in ranks:
            r.close()
        ctx.term()


def test_a_publisher_timeout_says_which_rank_the_daemon_waits_for(tmp_path):
    # issue 24: a publisher whose timeout_s is shorter than the daemon's begin deadline was
    # asked "is slotsyncd still running?" when rank 1 of its slot had never begun
    import torch

    from slotsync.protocol.errors import SlotsyncTimeout
    from slotsync.protocol.rank.publisher import Publisher

    with DaemonProcess(runtime_dir=str(tmp_path), args=["--begin-timeout-s", "60"]) as d, \
            Publisher(d.endpoint, 0, (0, 2), "http://127.0.0.1:1", transport="shm",
                      timeout_s=2.0) as pub:
        with pytest.raises(SlotsyncTimeout) as ei:
            pub.publish([("w", torch.ones(4))], "v1")
        text = str(ei.value)
        assert ("slotsyncd is waiting for the begin of rank(s) 1 of slot [0, 2) (update 0); "
                "rank(s) 1 have not registered; its begin deadline (begin_timeout_s) is 60 s"
                in text), text
        assert "still running" not in text, text


def test_gone_ranks_are_told_apart_a_clean_close_and_a_stopped_process(tmp_path):
    # issue 24: a clean Publisher.close() was logged as "closed it, no heartbeat, or frame
    # over limit"; a stopped process (it answers no heartbeat) is told as such
    import os
    import signal

    child = ("import sys, time, zmq\nfrom slotsync.protocol import wire\n"
             "s = zmq.Context().socket(zmq.DEALER)\ns.connect(sys.argv[1])\n"
             "s.send(wire.encode(wire.Register(wire.PROTOCOL_VERSION, 1, "
             "wire.logical_gpu_uuid(1), 0, 2, 'http://127.0.0.1:1', True, 'shm')))\n"
             "s.poll(10_000)\ns.recv()\nprint('registered', flush=True)\ntime.sleep(120)\n")
    with DaemonProcess(runtime_dir=str(tmp_path), args=["--liveness-s", "1"]) as d:
        ctx = zmq.Context()
        p = subprocess.Popen([sys.executable, "-c", child, d.endpoint], stdout=subprocess.PIPE,
                             text=True)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "registered"
            r0 = Rank(ctx, d.endpoint, 0)  # (after rank 1: a slot with no live rank is freed)
            r0.s.send(wire.encode(wire.Close("Publisher.close()")))
            r0.close()
            assert _wait(lambda: not d.status()["slots"][0]["ranks"][0]["alive"], 30)
            os.kill(p.pid, signal.SIGSTOP)
            assert _wait(lambda: [r["alive"] for r in d.status()["slots"][0]["ranks"]]
                         == [False, False], 30), (d.status(), d.log_tail())
            r = d.status()["slots"][0]["ranks"]
        finally:
            p.kill()
            p.wait()
        assert r[0]["gone_why"] == "its publisher closed the connection (Publisher.close())", r
        assert r[1]["gone_why"] == ("it answered no heartbeat within liveness_s=1 s: its "
                                    f"process (pid {p.pid}) is stopped (SIGSTOP, job control "
                                    "or a debugger)"), r
        log = d.log_tail(20_000)
        assert "Publisher.close()" in log and "is stopped" in log, log
        ctx.term()

"""``Publisher.publish_adapter`` when the rank itself fails (issue 36, the fresh-user trial's
findings), against the scripted fake daemon of test_publisher.py:

* an error raised on this rank before its begin went out (a bad argument, the part's
  memory) opens the round and aborts it, so that the daemon fails the round for every rank
  of the slot at once (``rank/adapters/round.py`` ``_abort_before_begin``); a publisher that
  never registered registers first;
* a base-weight name is refused at the rank, naming the tensor and PEFT's LoRA names;
* an interrupt (a SIGTERM handler's ``SystemExit``) while waiting for the daemon says, in the
  exception's notes and in the ``Abort``'s reason, what the rank waited for and what the
  daemon waits for (the phase, the ranks);
* the daemon's ``Error.code`` is the exception's ``code``.

Red before: nothing was sent for an error before the begin (the other ranks waited for their
begin deadline); ``...q_proj.weight`` went to the daemon; an interrupted wait said nothing of
what it waited for.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

import pytest
import test_publisher
import torch
from test_publish_adapter import CONFIG, PREFIX, Adapterd, _adapter, _wait_for
from test_publisher import NEXT_ID, FakeDaemon, _no_segments, _publisher

from slotsync.protocol import errors, wire
from slotsync.protocol.errors import SlotsyncError
from slotsync.protocol.rank.adapters import part as adapter_part

endpoint = test_publisher.endpoint  # (the fixtures: an ipc:// endpoint, a FakeDaemon there)
make_daemon = test_publisher.make_daemon
BASE = f"{PREFIX}.q_proj.weight"


def _bad(kind: str) -> dict:
    a = _adapter()
    return {
        "base-weight": {"tensors": {**a, BASE: torch.zeros(16, 16)}},
        "dtype": {"tensors": {f"{PREFIX}.q_proj.lora_A.weight": torch.zeros(4, 16,
                                                                           dtype=torch.complex64)}},
        "version": {"version": -1},
        "config": {"config": {"r": 4}},
        "lora-name": {"lora_name": 3},
    }[kind]


@pytest.mark.parametrize("kind", ["base-weight", "dtype", "version", "config", "lora-name"])
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "unregistered"])
def test_a_bad_argument_opens_the_round_and_aborts_it_naming_the_error(
        make_daemon: Callable[..., FakeDaemon], endpoint: str, kind: str,
        registered: bool) -> None:
    daemon = make_daemon(Adapterd())
    args = {"lora_name": "math", "tensors": _adapter(), "config": CONFIG, "version": 1,
            **_bad(kind)}
    with _publisher(endpoint) as pub:
        if registered:
            pub.register()
        with pytest.raises((ValueError, TypeError)) as ei:
            pub.publish_adapter(args["lora_name"], args["tensors"], args["config"],
                                args["version"])
        assert daemon.of_type(wire.AdapterBegin) == [] and pub.update_id is None
        _wait_for(lambda: daemon.of_type(wire.Abort))
        (abort,) = daemon.of_type(wire.Abort)
        assert abort.update_id == NEXT_ID  # (the round the rank would have begun)
        assert abort.reason.startswith(f"{type(ei.value).__name__}: ")
        assert str(ei.value)[:200] in abort.reason
        assert len(daemon.of_type(wire.Register)) == 1  # (registered once, either way)
        assert _no_segments() == []
        # the ids stay in step with the daemon's (the aborted round's id is used up)
        assert pub.publish_adapter("math", _adapter(), CONFIG, 1).update_id == NEXT_ID + 1
    assert _no_segments() == []


def test_a_part_that_cannot_be_allocated_aborts_the_round_and_leaves_nothing(
        make_daemon: Callable[..., FakeDaemon], endpoint: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = make_daemon(Adapterd())
    real = adapter_part.AdapterPart.fill

    def fill(self):  # (the segment is made, then the device buffer fails)
        real(self)
        raise MemoryError("cannot allocate 2048 bytes on cuda:0 for this rank's adapter part")

    monkeypatch.setattr(adapter_part.AdapterPart, "fill", fill)
    with _publisher(endpoint) as pub:
        with pytest.raises(MemoryError):
            pub.publish_adapter("math", _adapter(), CONFIG, 1)
        assert _no_segments() == []  # (the segment made before the failure is freed)
        _wait_for(lambda: daemon.of_type(wire.Abort))
        (abort,) = daemon.of_type(wire.Abort)
        assert abort.update_id == NEXT_ID and abort.reason.startswith("MemoryError: cannot")
        assert daemon.of_type(wire.AdapterBegin) == []


def test_a_base_weight_name_is_refused_naming_the_tensor_and_peft_names(
        make_daemon: Callable[..., FakeDaemon], endpoint: str) -> None:
    make_daemon(Adapterd())
    with _publisher(endpoint) as pub:
        for name, words in [(BASE, "is a base-model weight"),
                            (f"{PREFIX}.q_proj.lora_magnitude_vector", "DoRA"),
                            (f"{PREFIX}.q_proj.base_layer.weight", "base-model weight"),
                            ("lora_A.weight", "an adapter holds only"),
                            (f"{PREFIX}.q_proj.lora_A.x", "not a LoRA tensor")]:
            with pytest.raises(ValueError) as ei:
                pub.publish_adapter("math", {name: torch.zeros(4, 4)}, CONFIG, 1)
            text = str(ei.value)
            assert text.startswith(f"adapter tensor {name!r} ") and words in text, text
            assert "'<module>.lora_A.weight'" in text and "'<module>.lora_A.weight'" in text
            assert "get_peft_model_state_dict" in text


def test_the_daemons_code_is_the_exceptions(make_daemon: Callable[..., FakeDaemon],
                                            endpoint: str) -> None:
    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.AdapterBegin):
            return [wire.Error("adapter_begin", "adapter 'math' version 1 is the same version "
                               "as version 1", [0, 2], msg.update_id,
                               code=errors.VERSION_REFUSED)]
        return Adapterd()(msg)

    make_daemon(script)
    with _publisher(endpoint) as pub, pytest.raises(SlotsyncError) as ei:
        pub.publish_adapter("math", _adapter(), CONFIG, 1)
    assert ei.value.code == errors.VERSION_REFUSED


WAITING = ("slotsyncd is waiting for the adapter begin (begin_timeout_s) of rank(s) 0 "
           f"(adapter round {NEXT_ID} (math@v1) of slot [0, 2)); 60 s, 58 s left")


@pytest.fixture
def sigterm_exits() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` in the main thread, as a trainer's handler does
    (the demo's ranks: ``demo/ranks.py``)."""
    def handler(_sig: int, _frame: object) -> None:
        raise SystemExit(143)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_sigterm_while_waiting_says_what_the_round_waited_for(
        make_daemon: Callable[..., FakeDaemon], endpoint: str, sigterm_exits: None) -> None:
    """This publisher is rank 1 of slot [0, 2). The daemon acknowledges nothing (it waits for
    rank 0's begin) and answers the publisher's Query as the real one does; the SIGTERM comes
    once the begin is in and the publisher waits (its main thread polls the socket)."""
    main = threading.main_thread().ident
    assert main is not None

    def kill_when_waiting() -> None:
        def waiting() -> bool:
            frame = sys._current_frames().get(main)
            while frame is not None:
                if frame.f_code.co_name == "_wait_loop":
                    return True
                frame = frame.f_back
            return False

        _wait_for(waiting)
        signal.pthread_kill(main, signal.SIGTERM)

    def script(msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        if isinstance(msg, wire.AdapterBegin):
            threading.Thread(target=kill_when_waiting, daemon=True).start()
            return []
        if isinstance(msg, wire.Query):
            return [wire.Waiting(msg.update_id, WAITING, "adapter_begin", [0], 60.0, 58.0)]
        return Adapterd()(msg)

    daemon = make_daemon(script)
    with _publisher(endpoint, timeout_s=120) as pub:
        with pytest.raises(SystemExit) as ei:
            pub.publish_adapter("math", _adapter(), CONFIG, 1)
        assert ei.value.code == 143  # (its exit status kept)
        text = "".join(traceback.format_exception(ei.value))
        assert (f"rank 1: interrupted (SystemExit) while publish_adapter waited for "
                f"Ack(adapter_begin) for update {NEXT_ID} (every rank's AdapterBegin, then the "
                f"daemon's checks of the engine): {WAITING}") in text, text
        assert _no_segments() == [] and pub.update_id is None
        _wait_for(lambda: daemon.of_type(wire.Abort))
        (abort,) = daemon.of_type(wire.Abort)
        assert abort.reason.startswith("SystemExit: 143 (rank 1: interrupted")
        assert "of rank(s) 0" in abort.reason
    assert _no_segments() == []


def test_an_interrupt_with_a_daemon_that_does_not_say_still_names_the_phase(
        make_daemon: Callable[..., FakeDaemon], endpoint: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    make_daemon(Adapterd())  # (answers no Query)
    monkeypatch.setattr("slotsync.protocol.rank.waits.ASK_S", 0.2)
    with _publisher(endpoint) as pub:
        real = pub._waits.wait

        def wait(awaited):  # (Ctrl-C while the engines load)
            if awaited.phase == "adapter_data":
                raise KeyboardInterrupt
            return real(awaited)

        monkeypatch.setattr(pub._waits, "wait", wait)
        with pytest.raises(KeyboardInterrupt) as ei:
            pub.publish_adapter("math", _adapter(), CONFIG, 1)
        (note,) = ei.value.__notes__
        assert note == (f"rank 1: interrupted (KeyboardInterrupt) while publish_adapter "
                        f"waited for Ack(adapter_data) for update {NEXT_ID} (every rank's "
                        "AdapterData, then the engines' load): the daemon did not say what "
                        "it waits for")
    assert _no_segments() == []

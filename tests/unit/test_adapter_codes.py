"""The daemon's errors of an adapter round carry a code, and a rank's abort before its begin
fails the round for every rank at once (issue 36, the fresh-user trial's findings;
``daemon/core/adapters/rounds.py``, ``gather.py``; the codes in ``protocol/errors.py``).

Through the I/O-free slot table with the scripted LoRA engine of test_adapter_rounds.py.
Red before: every adapter ``Error`` had ``code == ""``; a tensor named as a base weight went
through the gather (vLLM refused it with an HTTP 500 after the round began); an ``Abort`` of a
round no rank had begun was answered to its sender alone, and the ranks that began it waited
for their begin deadline.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from adapter_ranks import B, begin, laid_out, part, two_rank_parts
from test_adapter_rounds import INFO, LoraHarness, started, whole_parts
from test_coordinator import ident, reg
from test_third_family import ToyFamily

from slotsync.daemon.core.update import Timeouts
from slotsync.daemon.families import Families
from slotsync.daemon.sglang.family import SGLANG
from slotsync.daemon.vllm.family import VLLM
from slotsync.protocol import errors, wire
from slotsync.protocol.wire import Begin, Error

BASE = "base_model.model.model.layers.0.self_attn.q_proj.weight"


def _data(h: LoraHarness, uid: int, version: int = 1) -> None:
    for r in range(2):
        n = len(laid_out(two_rank_parts(version)[r]))
        h.send(r, wire.AdapterData(uid, wire.ShmHandle(f"lora-{r}", 0, n)))


def _disagree(h: LoraHarness) -> None:
    h.send(0, begin(0, two_rank_parts()[0], version=1))
    h.send(1, begin(0, two_rank_parts()[1], version=2))


def _base_weight_name(h: LoraHarness) -> None:
    parts = two_rank_parts()
    h.send(0, begin(0, parts[0]))
    h.send(1, begin(0, parts[1] + [part(BASE, (16, 16), (0, 16))]))


def _split_on_sglang(h: LoraHarness) -> None:
    h.coord.engine.declare_kind("sglang")
    h.engine.sglang = True
    h.adapter_round(0, version=1, data=False)


def _older(h: LoraHarness) -> None:
    h.adapter_round(0, version=3)
    h.adapter_round(1, version=2, data=False)


def _lora_off(h: LoraHarness) -> None:
    h.engine.lora_info = {"vllm_config": {}}
    h.adapter_round(0, version=1, data=False)


def _rank_too_high(h: LoraHarness) -> None:
    h.engine.lora_info = {"vllm_config": {"lora_config": {"max_lora_rank": 2}}}
    h.adapter_round(0, version=1, data=False)


def _no_adapters(h: LoraHarness) -> None:
    h.table.families = h.coord._families = Families((VLLM, SGLANG, ToyFamily()))
    h.coord.engine.declare_kind("toy")
    h.adapter_round(0, version=1, data=False)


def _load_refused(h: LoraHarness) -> None:
    h.engine.fail[("load_lora_adapter", 0)] = "load_lora_adapter: HTTP 500: worker failed"
    h.adapter_round(0, version=1)


def _info_failed(h: LoraHarness) -> None:
    h.engine.fail[("models", 0)] = "models: cannot reach engine"
    h.adapter_round(0, version=1, data=False)


def _files_failed(h: LoraHarness) -> None:
    h.files_fail = f"sha256 of tensor {B!r} of rank 1 does not match its digest"
    h.adapter_round(0, version=1)


def _rank_gone(h: LoraHarness) -> None:
    h.adapter_round(0, version=1, data=False)
    h.run(h.table.on_connection_gone(ident(1), h.now, "its process (pid 7) exited"))


def _reregistered(h: LoraHarness) -> None:
    h.adapter_round(0, version=1, data=False)
    h.send(1, reg(1, 0, 2))


def _begin_deadline(h: LoraHarness) -> None:
    h.send(0, begin(0, two_rank_parts()[0]))
    h.now = 100.0
    h.run(h.table.poll(h.now))


def _aborted(h: LoraHarness) -> None:
    h.adapter_round(0, version=1, data=False)
    h.send(1, wire.Abort(0, "KeyboardInterrupt: "))


def _bad_handle(h: LoraHarness) -> None:
    h.adapter_round(0, version=1, handles={0: wire.ShmHandle("lora-0", 0, 8)})


def _malformed(h: LoraHarness) -> None:
    h.adapter_round(0, version=1, data=False)
    err = wire.ProtocolError("bad", kind="adapter_data", field="handle", update_id=0)
    h.run(h.table.on_bad_message(ident(1), err, h.now))


def _stopped(h: LoraHarness) -> None:
    h.adapter_round(0, version=1, data=False)
    h.run(h.table.drop((0, 2), h.now, force=True))


# (scenario, the code every rank's error carries, words of its message)
ROUND_FAILURES: list[tuple[Callable[[LoraHarness], None], str, str]] = [
    (_disagree, errors.ADAPTER_REFUSED, "the ranks disagree on the version"),
    (_base_weight_name, errors.ADAPTER_REFUSED, f"rank 1's adapter tensor {BASE!r} is a "
     "base-model weight"),
    (_split_on_sglang, errors.ADAPTER_REFUSED, "is split over ranks"),
    (_older, errors.VERSION_REFUSED, "version 2 is a version older than version 3"),
    (_lora_off, errors.ENGINE_UNFIT, "--enable-lora"),
    (_rank_too_high, errors.ENGINE_UNFIT, "--max-lora-rank"),
    (_no_adapters, errors.ENGINE_UNFIT, "loads no LoRA adapters"),
    (_load_refused, errors.ENGINE_FAILED, "worker failed"),
    (_info_failed, errors.ENGINE_FAILED, "cannot reach engine"),
    (_files_failed, errors.ADAPTER_FILES_FAILED, "does not match its digest"),
    (_rank_gone, errors.RANK_GONE, "is gone: its process (pid 7) exited"),
    (_reregistered, errors.RANK_GONE, "re-registered during adapter round 0"),
    (_begin_deadline, errors.RANK_TIMEOUT, "adapter begin (begin_timeout_s) of rank(s) [1]"),
    (_aborted, errors.RANK_ABORTED, "rank 1 aborted adapter round 0: KeyboardInterrupt"),
    (_bad_handle, errors.BAD_MESSAGE, "covers 8 bytes, but its part"),
    (_malformed, errors.BAD_MESSAGE, "rank 1 sent a adapter_data message"),
    (_stopped, errors.DAEMON_STOPPING, "dropped by the operator"),
]


@pytest.mark.parametrize("scenario, code, words", ROUND_FAILURES,
                         ids=[f[0].__name__.strip("_") for f in ROUND_FAILURES])
def test_every_rank_is_told_each_adapter_failure_with_its_code(
        scenario: Callable[[LoraHarness], None], code: str, words: str) -> None:
    h = started(timeouts=Timeouts(30, 40, 50))
    scenario(h)
    errs = [h.errors(r)[-1] for r in range(2) if h.errors(r)]
    assert len(errs) == 2, h.replies  # (the round's end reaches every rank of the slot)
    for err in errs:
        assert err.code == code and words in err.message, (err.code, err.message)
        assert err.code in errors.ADAPTER_CODES
    assert not h.table.slots or h.coord.adapter_round is None


def test_a_base_weight_name_is_refused_before_any_engine_call() -> None:
    h = started()
    _base_weight_name(h)
    err = h.error(0, 0)
    assert err.phase == "adapter_begin" and "lora_A.weight" in err.message
    assert "parse_fine_tuned_lora_name" in err.message
    assert h.engine.calls == []


def test_errors_to_one_rank_of_an_adapter_round_carry_a_code_too() -> None:
    h = started()
    h.engine.hold = True  # (round 0's info calls stay out)
    h.adapter_round(0, version=1, data=False)
    h.send(0, Begin(1, "w"))  # a base round while the adapter round is in flight
    assert (h.errors(0)[-1].phase, h.errors(0)[-1].code) == ("begin", errors.ROUND_IN_FLIGHT)
    h.send(1, begin(0, two_rank_parts()[1]))  # the same begin twice
    assert h.errors(1)[-1].code == errors.BAD_MESSAGE
    assert "began adapter round 0 twice" in h.errors(1)[-1].message
    h.send(0, begin(3, two_rank_parts()[0]))  # a second round meanwhile
    assert h.errors(0)[-1].code == errors.ROUND_IN_FLIGHT
    h.answer_pending()
    _data(h, 0)
    h.send(0, wire.AdapterData(0, None))  # data of a round that ended
    assert h.errors(0)[-1].code == errors.BAD_MESSAGE
    # an adapter begin during a base round
    for r in range(2):
        h.send(r, Begin(1, "w"))
    h.send(0, begin(2, two_rank_parts(2)[0], version=2))
    assert h.errors(0)[-1].code == errors.ROUND_IN_FLIGHT
    # while the daemon drains
    h2 = started()
    h2.run(h2.table.on_drain())
    h2.send(0, begin(0, two_rank_parts()[0]))
    assert h2.errors(0)[-1].code == errors.DAEMON_STOPPING


@pytest.mark.parametrize("first", ["abort", "begin"])
def test_a_rank_aborting_before_its_begin_fails_the_round_for_every_rank_at_once(
        first: str) -> None:
    """Rank 1's ``publish_adapter`` raised before its begin (a bad argument): its publisher
    opens round 0 and aborts it. Whether rank 0 began first or begins after, it is told at
    once (not at its begin deadline) that rank 1 aborted, and why; the engine is never
    called; the next round, both ranks at id 1, goes through."""
    h = started(timeouts=Timeouts(30, 40, 50))
    reason = f"ValueError: adapter tensor {BASE!r} is a base-model weight"
    if first == "begin":
        h.send(0, begin(0, two_rank_parts()[0]))
        assert h.errors(0) == []
    h.send(1, wire.Abort(0, reason))
    err = h.error(1, 0)  # (the aborting rank gets it too: stale there, as after any abort)
    assert err.code == errors.RANK_ABORTED
    if first == "abort":  # rank 0 begins the failed round afterwards
        h.send(0, begin(0, two_rank_parts()[0]))
    errs0 = [e for e in h.errors(0) if e.update_id == 0]
    assert errs0, h.replies[0]
    for e in errs0:
        assert e.phase == "adapter_begin" and e.code == errors.RANK_ABORTED, e
        assert f"rank 1 aborted adapter round 0 before its begin: {reason}" in e.message
    assert h.engine.calls == [] and h.coord.adapter_round is None
    assert h.table.next_deadline() is None  # (nothing waits for a begin deadline)
    assert h.coord.status()["adapter_rounds_failed"] == 1
    h.adapter_round(1, version=1)
    assert h.acks(0)[-1] == ("adapter_data", "math@v1")
    assert h.engine.calls == [*INFO, "load_lora_adapter"]


def test_an_abort_of_no_round_is_still_answered_to_its_rank_alone() -> None:
    """An abort of an id that is not the slot's next one (a stale one) starts nothing."""
    h = started()
    h.adapter_round(0, version=1)
    h.send(1, wire.Abort(0, "late"))
    assert h.errors(0) == [] and h.coord.adapter_round is None
    assert isinstance(h.replies[1][-1], Error) and h.replies[1][-1].phase == "abort"


def test_whole_parts_on_sglang_still_go_through() -> None:
    """(The name rule refuses nothing PEFT's LoRA naming has: the SGLang family's tensors.)"""
    h = started(kind="sglang")
    h.adapter_round(0, version=1, parts=whole_parts())
    assert h.acks(0)[-1] == ("adapter_data", "math@v1")


@pytest.mark.parametrize("exits", [False, True])
def test_a_rank_starting_after_its_peer_aborted_is_told_the_abort_at_once(exits: bool) -> None:
    """The fresh-user trial (HIGH): rank 1's ``publish_adapter`` failed before its begin (a
    config without ``r``) and its publisher aborted round 0 before rank 0 had even
    registered. Rank 0, starting later, is told round 0's id (the round a rank aborted
    before any begin stays the slot's next until every rank was told) and its begin fails
    at once with ``rank_aborted`` naming rank 1 and its error; then both meet at round 1.
    (Red before: the abort moved the next id on to 1, rank 0's begin opened round 1 and it
    waited for rank 1 until begin_timeout_s, failing with ``rank_timeout``.) ``exits``:
    rank 1's process then exited, so rank 0's registration releases the slot for a new job:
    the same."""
    h = LoraHarness(2, timeouts=Timeouts(30, 40, 50))
    h.send(1, reg(1, 0, 2, packed=h.packed))
    h.coord.engine.declare_kind("vllm")
    reason = "ValueError: the adapter's config has no 'r'"
    h.send(1, wire.Abort(0, reason))
    assert h.error(1, 0).code == errors.RANK_ABORTED
    if exits:
        h.run(h.table.on_connection_gone(ident(1), h.now, "its process (pid 7) exited"))
    h.send(0, reg(0, 0, 2, packed=h.packed))
    registered = h.replies[0][-1]
    assert isinstance(registered, wire.Registered) and registered.next_update_id == 0
    h.send(0, begin(registered.next_update_id, two_rank_parts()[0]))
    err = h.errors(0)[-1]
    assert (err.update_id, err.phase, err.code) == (0, "adapter_begin", errors.RANK_ABORTED)
    assert f"rank 1 aborted adapter round 0 before its begin: {reason}" in err.message
    assert h.coord.adapter_round is None and h.table.next_deadline() is None
    assert h.engine.calls == []
    h.send(0, reg(0, 0, 2, packed=h.packed))  # (every rank told: the next id moved on)
    assert h.replies[0][-1].next_update_id == 1
    if exits:  # (a new process of rank 1)
        h.send(1, reg(1, 0, 2, packed=h.packed))
        h.coord.engine.declare_kind("vllm")
    h.adapter_round(1, version=1)
    assert h.acks(0)[-1] == ("adapter_data", "math@v1")


@pytest.mark.parametrize("case", ["registered", "comes_back", "starts_later"])
def test_a_rank_gone_before_the_round_begins_gets_liveness_s_not_the_begin_deadline(
        case: str) -> None:
    """The fresh-user trial (HIGH): rank 1 registered, then raised and exited before rank 0
    began adapter round 0 (rank 0 registered before, or only after: then the slot is
    released for it as a new job, and rank 1 of the gone job is still known as gone). As a
    base round does (``update.wait_in_force``), the round gives the gone rank
    ``liveness_s`` (``Timeouts.gone_s``) for a new process of it to register, then fails
    with ``rank_gone`` naming it; a new process of it that registers in time joins the
    round. (Red before: the round waited begin_timeout_s and failed with ``rank_timeout``.)"""
    h = LoraHarness(2, timeouts=Timeouts(120, 40, 50, gone_s=5))
    h.send(1, reg(1, 0, 2, packed=h.packed))
    if case != "starts_later":
        h.send(0, reg(0, 0, 2, packed=h.packed))
    h.coord.engine.declare_kind("vllm")
    h.run(h.table.on_connection_gone(ident(1), h.now, "its process (pid 7) exited"))
    h.now = 1.0
    if case == "starts_later":
        h.send(0, reg(0, 0, 2, packed=h.packed))
        assert sorted(h.coord.ranks) == [0]  # (released: a new job's rank)
        h.coord.engine.declare_kind("vllm")
    h.send(0, begin(0, two_rank_parts()[0]))
    if case == "registered":  # (its connection's end seen again: the process's exit)
        h.run(h.table.on_connection_gone(ident(1), h.now, "its connection closed"))
    assert h.errors(0) == []
    assert h.table.next_deadline() == 1.0 + 5  # (not 1 + 120)
    if case == "comes_back":
        h.send(1, reg(1, 0, 2, packed=h.packed))
        h.send(1, begin(0, two_rank_parts()[1]))
        assert h.acks(0)[-1] == ("adapter_begin", "host") and h.errors(0) == []
        return
    h.now = 6.0
    h.run(h.table.poll(h.now))
    err = h.errors(0)[-1]
    assert (err.phase, err.code, err.missing_ranks) == ("adapter_begin", errors.RANK_GONE, [1])
    assert "is gone: its process (pid 7) exited" in err.message and "liveness_s" in err.message
    assert h.coord.adapter_round is None and h.engine.calls == []

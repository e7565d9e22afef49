"""A scripted trainer rank for integration tests (run in a spawned process).

``run_rank`` publishes synthetic tensors through a real ``Publisher`` and reports what the rank
saw on a queue, one dict per event with named keys (issue 16: they were positional tuples),
always ``event`` (its kind) and ``rank``:

* ``{"event": "registered"}``, or ``{"event": "register_error", "phase", "message"}``;
* per round ``k``: ``{"event": "round", "round": k, "status": "ok", "chunks", "bytes",
  "omitted_names", "engine_resumed"}`` (``chunks``/``bytes`` -1 where the round did not count
  them; ``omitted_names`` ``[]`` and ``engine_resumed`` None outside ``publish``) or
  ``{"event": "round", "round": k, "status": "error", "phase", "message", "missing_ranks",
  "slot", "update_id", "fatal", "error_type"}`` (``slot`` a tuple or None; ``error_type`` the
  exception's class name: ``SlotsyncTimeout`` means the rank's own deadline expired, the
  daemon never told it; ``ValueError`` with phase ``input`` for ``raise_after``);
* last ``{"event": "exit"}``.

``script`` keys bend the behaviour to inject faults:

* ``rounds``: how many rounds (default 1);
* ``stop_before_chunk``: ``(round, k)``: send chunks < k, then sleep instead of chunk k;
* ``delay_before_chunk``: ``(round, k, seconds)``: sleep that long before chunk k, then go on;
* ``dtype_of``: ``{name: dtype}``: this rank casts those tensors (a dtype mismatch);
* ``engine_url``: override the engine URL this rank registers with;
* ``register_delay_s``: sleep before registering;
* ``staging_buffers``: the publisher's staging regions (default 4);
* ``cuda``: publish CUDA tensors over CUDA IPC (GPU tests), with ``logical_gpu_uuid(rank)`` so
  several ranks can share one physical GPU; after each ``publish`` the rank reports
  ``{"event": "cuda_left", "round": k, "bytes"}``: GPU memory still allocated beyond the
  round's tensors.

Keys added for the fault-injection suite (``tests/faults/test_faults.py``):

* ``first_round``: number of the first round (default 1), so that a replacement process for a
  rank publishes the same weight version and tensors as the ranks that kept running;
* ``delay_before_commit``: ``(round, seconds)``: after the last chunk's ack, report
  ``{"event": "stalling_commit", "round": k}`` and sleep that long before committing
  (``delay_before_chunk`` reports ``{"event": "stalling", "round": k}``);
* ``start_at``: a ``time.time()`` value: after registering, sleep until then before the first
  round (so that every rank of a restarted job has re-registered before any of them begins);
* ``trace``: report ``{"event": "begun", "round": k}`` after the begin is sent and
  ``{"event": "acked", "round": k, "chunk": i}`` after chunk i's ack (to act at a precise
  point of the round).

Keys added for issue 14's scenarios:

* ``omit``: ``{round: [names]}``: leave those tensors out of that round (a tied weight that
  ``named_parameters()`` skips);
* ``raise_after``: ``(round, n[, delay_s])``: the round's iterator raises ``ValueError``
  after ``n`` tensors (bad input found mid-publish: the publisher aborts the update), after
  sleeping ``delay_s`` seconds.

Key added for issue 18's draft sessions:

* ``draft``: ``publish`` each round with ``make_draft_tensors(k)`` as its draft part.

Key added for issue 26 E (SGLang on one GPU):

* ``gpu_uuid``: with ``cuda``, ``"real"`` publishes under the GPU's own UUID instead of the
  logical one (an engine of one TP rank on that GPU, whose UUID lookup then runs unchanged).

Keys added for issue 35 (SGLang TP order):

* ``gpu_uuid``: any other string: the GPU UUID this rank registers with, on shared memory too
  (a rank on another rank's logical GPU);
* ``seed_offset``: round ``k``'s tensors are ``make_tensors(k + seed_offset)`` (ranks with
  values of their own, to tell whose an engine rank loaded).

Key added for issue 36 (LoRA adapters):

* ``adapter``: a list of adapter (and base) rounds: ``tests/adapter_trainer.py`` runs the
  rank instead.

Keys for holding on (the rank stays registered and alive after its rounds):

* ``hold_s``: that many seconds before closing;
* ``hold_until``: a file path: the hold ends as soon as it exists (``hold_s`` then bounds it;
  issue 35: a test ends the hold once it has checked what it needed, instead of waiting it out).
"""

from __future__ import annotations

import time
from typing import Any

from slotsync.testing.tensors import (  # (moved there, issue 16; re-exported)
    make_draft_tensors,
    make_tensors,
)

__all__ = ["error_round", "event", "hold_on", "make_tensors", "ok_round", "register_or_report",
           "run_rank", "slotsync_error_round"]


def event(kind: str, rank: int, **fields: object) -> dict:
    """One report: ``{"event": kind, "rank": rank, **fields}`` (sent through a pipe: plain
    values only)."""
    return {"event": kind, "rank": rank, **fields}


def ok_round(rank: int, k: int, *, chunks: int = -1, nbytes: int = -1,
             omitted_names: list[str] | None = None,
             engine_resumed: bool | None = None) -> dict:
    """Round ``k`` succeeded (``chunks``/``nbytes`` -1: not counted)."""
    return event("round", rank, round=k, status="ok", chunks=chunks, bytes=nbytes,
                 omitted_names=omitted_names or [], engine_resumed=engine_resumed)


def error_round(rank: int, k: int, *, phase: str, message: str,
                missing_ranks: list[int] | None = None, slot: tuple[int, int] | None = None,
                update_id: int | None = None, fatal: bool = True,
                error_type: str = "SlotsyncError") -> dict:
    """Round ``k`` failed: the ``SlotsyncError``'s fields (or a ``ValueError``'s)."""
    return event("round", rank, round=k, status="error", phase=phase, message=message,
                 missing_ranks=missing_ranks or [], slot=slot, update_id=update_id,
                 fatal=fatal, error_type=error_type)


def slotsync_error_round(rank: int, k: int, e: Any) -> dict:
    """Round ``k`` failed with the ``SlotsyncError`` ``e``: its fields, ``error_type`` its
    class name (``SlotsyncTimeout``: the rank's own deadline)."""
    return error_round(rank, k, phase=e.phase, message=e.message,
                       missing_ranks=list(e.missing_ranks), slot=e.slot,
                       update_id=e.update_id, fatal=e.fatal, error_type=type(e).__name__)


def register_or_report(pub: Any, rank: int, results: Any) -> bool:
    """Register ``pub`` and report ``registered``; or report the ``register_error`` (its
    phase and message) and return False."""
    from slotsync.protocol.errors import SlotsyncError

    try:
        pub.register()
    except SlotsyncError as e:
        results.put(event("register_error", rank, phase=e.phase, message=e.message))
        return False
    results.put(event("registered", rank))
    return True


def run_rank(rank, endpoint, slot, engine_url, packed, script, results):
    if "adapter" in script:  # (issue 36: LoRA adapter rounds, tests/adapter_trainer.py)
        from adapter_trainer import run_adapter_rank

        return run_adapter_rank(rank, endpoint, slot, engine_url, packed, script, results)
    import torch

    from slotsync.protocol.errors import SlotsyncError
    from slotsync.testing.ranks import rank_publisher

    url = script.get("engine_url", engine_url)
    time.sleep(script.get("register_delay_s", 0))
    cuda = script.get("cuda", False)
    uuid = script.get("gpu_uuid", "logical")
    uuid = None if uuid == "real" else uuid
    kw = {"packed": packed, "staging_bytes": 40_000,
          "staging_buffers": script.get("staging_buffers", 4),
          "timeout_s": script.get("timeout_s", 20.0),
          "liveness_s": script.get("liveness_s", 10.0)}
    if not cuda and uuid not in (None, "logical"):  # (rank_publisher ignores it on shm)
        from slotsync.protocol import Publisher

        pub = Publisher(endpoint, rank, slot, url, transport="shm", gpu_uuid=uuid, **kw)
    else:
        pub = rank_publisher(endpoint, rank, slot, url, device="cuda:0" if cuda else None,
                             gpu_uuid=uuid, **kw)
    try:
        if not register_or_report(pub, rank, results):
            return
        if script.get("start_at"):
            time.sleep(max(0.0, script["start_at"] - time.time()))
        stop = script.get("stop_before_chunk")
        first = script.get("first_round", 1)
        for k in range(first, first + script.get("rounds", 1)):
            named = make_tensors(k + script.get("seed_offset", 0))
            if cuda:
                named = [(n, t.to("cuda:0")) for n, t in named]
            for name, dt in script.get("dtype_of", {}).items():
                named = [(n, t.to(getattr(torch, dt)) if n == name else t) for n, t in named]
            try:
                delay = script.get("delay_before_chunk")
                if delay and delay[0] != k:
                    delay = None
                hold = script.get("delay_before_commit")
                if hold and hold[0] != k:
                    hold = None
                if delay or hold or script.get("trace"):
                    pub.begin(f"v{k}")
                    if script.get("trace"):
                        results.put(event("begun", rank, round=k))
                    sent = 0
                    for i, chunk in enumerate(_chunks(named, 40_000)):
                        if delay and i == delay[1]:
                            results.put(event("stalling", rank, round=k))
                            time.sleep(delay[2])
                        pub.send_chunk(chunk)
                        sent += 1
                        if script.get("trace"):
                            results.put(event("acked", rank, round=k, chunk=i))
                    if hold:
                        results.put(event("stalling_commit", rank, round=k))
                        time.sleep(hold[1])
                    pub.commit()
                    results.put(ok_round(rank, k, chunks=sent))
                elif stop and stop[0] == k:
                    pub.begin(f"v{k}")
                    for i, chunk in enumerate(_chunks(named, 40_000)):
                        if i == stop[1]:
                            time.sleep(script.get("stall_s", 30))
                            break
                        pub.send_chunk(chunk)
                    pub.commit()
                    results.put(ok_round(rank, k))
                else:
                    drop = set(script.get("omit", {}).get(k, ()))
                    items = [(n, t) for n, t in named if n not in drop]
                    bad = script.get("raise_after")
                    if bad and bad[0] == k:
                        items = _raising(items, *bad[1:])
                    # (after the list above replaced the last round's: its tensors are gone)
                    before = torch.cuda.memory_allocated() if cuda else 0
                    draft = make_draft_tensors(k) if script.get("draft") else None
                    st = pub.publish(items, f"v{k}", draft=draft)
                    # (the round's tensors must not outlive it: the next round's then take
                    # the same addresses, as a trainer's parameters keep theirs)
                    del items
                    results.put(ok_round(rank, k, chunks=st.chunks, nbytes=st.bytes,
                                         omitted_names=list(st.omitted_names),
                                         engine_resumed=st.engine_resumed))
                    if cuda:  # what the round left allocated on the GPU beyond its tensors
                        results.put(event("cuda_left", rank, round=k,
                                          bytes=torch.cuda.memory_allocated() - before))
            except ValueError as e:  # (raise_after): the publisher aborted the update
                results.put(error_round(rank, k, phase="input", message=str(e), fatal=True,
                                        error_type=type(e).__name__))
            except SlotsyncError as e:
                if pub.update_id is not None:  # own timeout: the update is still open here
                    pub.abort(f"{type(e).__name__}: {e.phase}")
                results.put(slotsync_error_round(rank, k, e))
    finally:
        hold_on(script.get("hold_s", 0), script.get("hold_until"))  # (the rank stays alive)
        pub.close()
        results.put(event("exit", rank))


def hold_on(seconds: float, until: str | None) -> None:
    """Sleep ``seconds``, or less once the file ``until`` exists."""
    import os

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (until and os.path.exists(until)):
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))


def _chunks(named, limit):
    from slotsync.protocol.chunking import cut  # the publisher's own chunking rule

    return list(cut(named, lambda item: item[1].numel() * item[1].element_size(), limit))


def _raising(items, n, delay_s=0.0):
    """``items``, raising ValueError after ``n`` of them (a bad tensor found mid-publish),
    ``delay_s`` seconds later."""
    for i, it in enumerate(items):
        if i == n:
            time.sleep(delay_s)
            raise ValueError(f"bad input at tensor {n} (test)")
        yield it

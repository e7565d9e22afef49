"""A scripted trainer rank for integration tests (run in a spawned process).

``run_rank`` publishes synthetic tensors through a real ``Publisher`` and reports what the rank
saw on a queue: ``("registered", rank)``, ``("round", rank, k, "ok", chunks, nbytes)`` or
``("round", rank, k, "error", phase, message, missing_ranks)``, ``("register_error", ...)``,
then ``("exit", rank)``. ``script`` keys bend the behaviour to inject faults:

* ``rounds``: how many rounds (default 1);
* ``stop_before_chunk``: ``(round, k)``: send chunks < k, then sleep instead of chunk k;
* ``delay_before_chunk``: ``(round, k, seconds)``: sleep that long before chunk k, then go on;
* ``dtype_of``: ``{name: dtype}``: this rank casts those tensors (a dtype mismatch);
* ``engine_url``: override the engine URL this rank registers with;
* ``register_delay_s``: sleep before registering;
* ``staging_buffers``: the publisher's staging regions (default 4);
* ``cuda``: publish CUDA tensors over CUDA IPC (GPU tests), with ``logical_gpu_uuid(rank)`` so
  several ranks can share one physical GPU; after each ``publish`` the rank reports
  ``("cuda_left", rank, k, bytes)``: GPU memory still allocated beyond the round's tensors.

Keys added for the fault-injection suite (``tests/test_faults.py``):

* ``first_round``: number of the first round (default 1), so that a replacement process for a
  rank publishes the same weight version and tensors as the ranks that kept running;
* ``delay_before_commit``: ``(round, seconds)``: after the last chunk's ack, report
  ``("stalling_commit", rank, k)`` and sleep that long before committing;
* ``start_at``: a ``time.time()`` value: after registering, sleep until then before the first
  round (so that every rank of a restarted job has re-registered before any of them begins);
* ``trace``: report ``("begun", rank, k)`` after the begin is sent and ``("acked", rank, k,
  i)`` after chunk i's ack (to act at a precise point of the round).

Keys added for issue 14's scenarios:

* ``omit``: ``{round: [names]}``: leave those tensors out of that round (a tied weight that
  ``named_parameters()`` skips);
* ``raise_after``: ``(round, n[, delay_s])``: the round's iterator raises ``ValueError``
  after ``n`` tensors (bad input found mid-publish: the publisher aborts the update), after
  sleeping ``delay_s`` seconds.

Successful ``publish`` rounds report two more fields: the commit's ``omitted_names`` (list) and
``engine_resumed``.

Error events carry four more fields after ``missing_ranks``: ``slot`` (tuple or None),
``update_id``, ``fatal`` and the exception's class name (``SlotsyncTimeout`` means the rank's
own deadline expired: the daemon never told it).
"""

from __future__ import annotations

import time

from slotsync.testing.tensors import make_tensors  # (moved there, issue 16; re-exported)

__all__ = ["make_tensors", "run_rank"]


def run_rank(rank, endpoint, slot, engine_url, packed, script, results):
    import torch

    from slotsync.protocol.errors import SlotsyncError
    from slotsync.testing.ranks import rank_publisher

    url = script.get("engine_url", engine_url)
    time.sleep(script.get("register_delay_s", 0))
    cuda = script.get("cuda", False)
    pub = rank_publisher(endpoint, rank, slot, url, device="cuda:0" if cuda else None,
                         packed=packed, staging_bytes=40_000,
                         staging_buffers=script.get("staging_buffers", 4),
                         timeout_s=script.get("timeout_s", 20.0),
                         liveness_s=script.get("liveness_s", 10.0))
    try:
        try:
            pub.register()
        except SlotsyncError as e:
            results.put(("register_error", rank, e.phase, e.message))
            return
        results.put(("registered", rank))
        if script.get("start_at"):
            time.sleep(max(0.0, script["start_at"] - time.time()))
        stop = script.get("stop_before_chunk")
        first = script.get("first_round", 1)
        for k in range(first, first + script.get("rounds", 1)):
            named = make_tensors(k)
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
                        results.put(("begun", rank, k))
                    sent = 0
                    for i, chunk in enumerate(_chunks(named, 40_000)):
                        if delay and i == delay[1]:
                            results.put(("stalling", rank, k))
                            time.sleep(delay[2])
                        pub.send_chunk(chunk)
                        sent += 1
                        if script.get("trace"):
                            results.put(("acked", rank, k, i))
                    if hold:
                        results.put(("stalling_commit", rank, k))
                        time.sleep(hold[1])
                    pub.commit()
                    results.put(("round", rank, k, "ok", sent, -1))
                elif stop and stop[0] == k:
                    pub.begin(f"v{k}")
                    for i, chunk in enumerate(_chunks(named, 40_000)):
                        if i == stop[1]:
                            time.sleep(script.get("stall_s", 30))
                            break
                        pub.send_chunk(chunk)
                    pub.commit()
                    results.put(("round", rank, k, "ok", -1, -1))
                else:
                    drop = set(script.get("omit", {}).get(k, ()))
                    items = [(n, t) for n, t in named if n not in drop]
                    bad = script.get("raise_after")
                    if bad and bad[0] == k:
                        items = _raising(items, *bad[1:])
                    # (after the list above replaced the last round's: its tensors are gone)
                    before = torch.cuda.memory_allocated() if cuda else 0
                    st = pub.publish(items, f"v{k}")
                    # (the round's tensors must not outlive it: the next round's then take
                    # the same addresses, as a trainer's parameters keep theirs)
                    del items
                    results.put(("round", rank, k, "ok", st.chunks, st.bytes,
                                 list(st.omitted_names), st.engine_resumed))
                    if cuda:  # what the round left allocated on the GPU beyond its tensors
                        results.put(("cuda_left", rank, k,
                                     torch.cuda.memory_allocated() - before))
            except ValueError as e:  # (raise_after): the publisher aborted the update
                results.put(("round", rank, k, "error", "input", str(e), [], None, None, True,
                             type(e).__name__))
            except SlotsyncError as e:
                if pub.update_id is not None:  # own timeout: the update is still open here
                    pub.abort(f"{type(e).__name__}: {e.phase}")
                results.put(("round", rank, k, "error", e.phase, e.message,
                             list(e.missing_ranks), e.slot, e.update_id, e.fatal,
                             type(e).__name__))
    finally:
        time.sleep(script.get("hold_s", 0))  # (keep the connection: the rank stays alive)
        pub.close()
        results.put(("exit", rank))


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

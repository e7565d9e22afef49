"""One adapter round of a publisher (issue 36): ``Publisher.publish_adapter`` runs
:func:`publish_adapter` on itself.

The conversation (``wire/adapter.py``): the round takes the slot's next update id (shared with
base-weight rounds, ``PublisherSession.adapter_round``); the rank sends ``wire.AdapterBegin``
(its part's tensors, rows and digests) and waits for ``Ack(phase="adapter_begin")``, whose
``transport`` says how to hand the part over; sends ``wire.AdapterData`` with that handle
(``part.AdapterPart.handle``) and waits for ``Ack(phase="adapter_data")``, which names the
adapter the engines now serve; then frees the part. Each wait is bounded by the publisher's
``timeout_s`` and notices a daemon gone within ``liveness_s`` (``waits.DaemonWaits``), as in
``publish``.

Failures: everything is checked before anything is allocated or sent (``inputs.py``); an
``Error`` from the daemon raises its ``SlotsyncError`` (the round is over there: the previous
version stays served; its ``code`` says which kind of failure, ``errors.ADAPTER_CODES``), a
rank-side failure (a timeout, an exception, ``KeyboardInterrupt``) sends ``Abort`` first (best
effort), and on every path the part is freed before the call returns or raises (no segment
left in ``/dev/shm``). A rank-side failure *before* the begin went out (a bad argument, the
part's memory, an interrupt while copying) opens the round all the same and aborts it
(``_abort_before_begin``; registering first if this publisher never did), so that the daemon
fails the round for every rank of the slot at once, naming this rank and its exception
(``code "rank_aborted"``), instead of waiting for this rank's begin until
``begin_timeout_s``: the other ranks' ``publish_adapter`` raise at once, and the engine is
never called. An interrupt (``KeyboardInterrupt``, or the ``SystemExit`` of a SIGTERM handler)
while waiting for the daemon gets a note (PEP 678, printed with its traceback, and sent as the
``Abort``'s reason) saying what this rank waited for, in the daemon's words (it is asked, as a
timeout asks it: ``waits.DaemonWaits.what_daemon_waits_for``): which phase, which ranks.

A daemon that restarted before the begin's ack (``Error`` code ``not_registered``) is
registered with again and the begin sent once more under its next update id, as ``publish``
does; a daemon older than adapter rounds refuses the message it cannot decode, which raises
``SlotsyncError(code="adapters_unsupported")``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec
import torch

from slotsync.protocol import wire
from slotsync.protocol.errors import ADAPTERS_UNSUPPORTED, SlotsyncError
from slotsync.protocol.rank.adapters.inputs import (
    PartTensor,
    Rows,
    config_text,
    part_tensors,
    version_of,
)
from slotsync.protocol.rank.adapters.part import AdapterPart
from slotsync.protocol.rank.connection import PublisherConnection
from slotsync.protocol.rank.session import Awaited

__all__ = ["ADAPTERS_UNSUPPORTED", "AdapterStats", "publish_adapter"]

log = logging.getLogger("slotsync.protocol.rank.publisher")  # (the log lines stay the publisher's)

_DIGEST_PLACEHOLDER = "0" * 64


@dataclass(frozen=True)
class AdapterStats:
    """What one ``publish_adapter`` did.

    ``served_name``: the name every engine of the slot serves this version under (the
    daemon's, ``wire.served_name``: ``"math@v3"``); requests name it. ``update_id``: the
    round's id. ``tensors`` and ``nbytes``: this rank's part (bytes as laid out behind its
    handle, alignment included). ``transport``: how it was handed over (``"host"``: a
    shared-memory segment the daemon read; ``"device"``: the registered transport's handle).
    ``seconds``: wall time of the call from the first allocation to the data's ack; of it,
    ``copy_seconds`` copying the tensors into the part (device packing and the copy to the
    host), ``digest_seconds`` hashing, ``begin_wait_seconds`` waiting for
    ``Ack(adapter_begin)`` (every rank of the slot began, the daemon's checks) and
    ``data_wait_seconds`` for ``Ack(adapter_data)`` (the engines loaded it)."""

    served_name: str
    update_id: int
    tensors: int
    nbytes: int
    transport: str
    seconds: float
    copy_seconds: float = 0.0
    digest_seconds: float = 0.0
    begin_wait_seconds: float = 0.0
    data_wait_seconds: float = 0.0


def _begin(update_id: int, lora_name: str, version: int, config_json: str,
           parts: list[PartTensor], digests: list[str]) -> wire.AdapterBegin:
    return wire.AdapterBegin(
        update_id=update_id, lora_name=lora_name, version=version, config_json=config_json,
        tensors=[wire.AdapterTensor(t.name, t.dtype, list(t.shape), t.row_start, t.row_stop,
                                    d) for t, d in zip(parts, digests, strict=True)])


def _checked_begin(pub: PublisherConnection, lora_name: object, version: int,
                   config_json: str, parts: list[PartTensor]) -> None:
    """The begin as the daemon will decode it, and its size against the daemon's cap
    (learnt at registration), with placeholder digests: refused here, before anything is
    allocated or sent.

    Raises:
        TypeError: ``lora_name`` is not a str.
        ValueError: a field the daemon refuses (``lora_name``'s characters, say), or the
            message is over the daemon's ``max_message_bytes``.
    """
    if not isinstance(lora_name, str):
        raise TypeError(f"lora_name must be a str, got {type(lora_name).__name__}")
    try:
        msg = _begin(0, lora_name, version, config_json, parts,
                     [_DIGEST_PLACEHOLDER] * len(parts))
        frame = wire.encode(msg)
        wire.decode_to_daemon(frame)  # (the checks the daemon runs: lengths, ranges)
    except (ValueError, msgspec.ValidationError) as e:
        raise ValueError(f"adapter {lora_name!r} version {version}: {e}") from None
    reg = pub.registered
    cap = reg.max_message_bytes if reg is not None else 0
    if cap and len(frame) > cap:
        raise ValueError(
            f"adapter {lora_name!r}: its begin lists {len(parts)} tensors and encodes to "
            f"{len(frame)} bytes, over the daemon's max_message_bytes of {cap}: raise the "
            "daemon's --max-message-bytes")


def _older_daemon(e: SlotsyncError) -> bool:
    """Whether ``e`` is an older daemon's refusal of an adapter message it cannot decode
    (``daemon/core/malformed.py``'s text around msgspec's "Invalid value 'adapter_begin' -
    at `$.type`": the message's tag is unknown to it)."""
    return (e.phase == "decode" and "Invalid value 'adapter_" in e.message
            and "$.type" in e.message)


def _unsupported(pub: PublisherConnection, e: SlotsyncError) -> SlotsyncError:
    reg = pub.registered
    version = f" {reg.daemon_version}" if reg is not None and reg.daemon_version else ""
    return SlotsyncError(
        "adapter_begin",
        f"slotsyncd{version} at {pub.endpoint} does not know adapter rounds (issue 36: it "
        "cannot decode wire.AdapterBegin): run a slotsyncd that serves publish_adapter on "
        f"this node (it said: {e.message})",
        slot=e.slot, update_id=e.update_id, fatal=False, code=ADAPTERS_UNSUPPORTED)


_WAITED_FOR = {"adapter_begin": "every rank's AdapterBegin, then the daemon's checks of the "
               "engine", "adapter_data": "every rank's AdapterData, then the engines' load"}


def _reason(e: BaseException) -> str:
    """An exception as an ``Abort``'s reason: its type and text, and its notes."""
    notes = "; ".join(str(n) for n in getattr(e, "__notes__", ()))
    return f"{type(e).__name__}: {e}" + (f" ({notes})" if notes else "")


def _wait(pub: PublisherConnection, awaited: Awaited) -> wire.FromDaemon:
    """``pub._wait(awaited)``; an interrupt during it (a ``BaseException`` that is not an
    ``Exception``: ``KeyboardInterrupt``, a SIGTERM handler's ``SystemExit``) gets a note
    saying what this rank waited for and, asked (``DaemonWaits.what_daemon_waits_for``), what
    the daemon waits for: the phase and the ranks ("rank 0: interrupted (SystemExit) while
    publish_adapter waited for Ack(adapter_begin) for update 7 (every rank's AdapterBegin,
    then the daemon's checks of the engine): slotsyncd is waiting for the adapter begin
    (begin_timeout_s) of rank(s) 1 (...)"). The exception is re-raised as it is (its type
    and exit status kept)."""
    try:
        return pub._wait(awaited)
    except Exception:
        raise
    except BaseException as e:
        says = pub._waits.what_daemon_waits_for(awaited.update_id)
        e.add_note(
            f"rank {pub.rank}: interrupted ({type(e).__name__}) while publish_adapter waited "
            f"for {awaited.describe()} ({_WAITED_FOR.get(awaited.phase, awaited.phase)}): "
            + (says or "the daemon did not say what it waits for"))
        raise


def _abort_before_begin(pub: PublisherConnection, e: BaseException) -> None:
    """``publish_adapter`` failed on this rank before its begin went out (``e``: a bad
    argument, the part's memory, an interrupt): open the round and abort it, so that the
    daemon fails it for every rank of the slot now, naming this rank and ``e``
    (``rounds.adapter_abort``), rather than waiting for this rank's begin until its
    ``begin_timeout_s``. A publisher that never registered (or whose daemon went away)
    registers first (bounded by ``timeout_s``), except on an interrupt. Best effort: a
    failure to tell the daemon is logged, and ``e`` is what the caller sees. Nothing for a
    ``SlotsyncError`` (the daemon's, or one with the daemon), nor when an update is open
    (the round's own abort)."""
    if isinstance(e, SlotsyncError) or pub.closed or pub.update_id is not None:
        return
    try:
        if pub.registered is None or pub._waits.connected is False:
            if not isinstance(e, Exception):
                return  # (an interrupt: no wait for a registration)
            pub.register()
        uid = pub._session.adapter_round()
        log.info("rank %d: publish_adapter failed before its begin; aborting round %d so that "
                 "the slot's other ranks are told now: %s", pub.rank, uid, _reason(e))
        pub.abort(_reason(e))
    except Exception as err:  # noqa: BLE001 - e is what the caller must see
        log.warning("rank %d: could not tell the daemon that publish_adapter failed before "
                    "its begin (%s): %s", pub.rank, _reason(e), err)


def _send_begin(pub: PublisherConnection, fields: dict) -> tuple[int, wire.Ack, float]:
    """Open the round, send its begin, wait for ``Ack(adapter_begin)``; after a daemon
    restart (``not_registered`` before the ack) register again and begin once more.

    Returns ``(update_id, ack, seconds waited)``.

    Raises:
        SlotsyncError, SlotsyncTimeout: as ``publish_adapter``.
    """
    resent = False
    waited = 0.0
    while True:
        uid = pub._session.adapter_round()
        pub._send(wire.AdapterBegin(update_id=uid, **fields))
        t0 = time.perf_counter()
        try:
            ack = _wait(pub, Awaited("adapter_begin", uid))
        except SlotsyncError as e:
            waited += time.perf_counter() - t0
            if _older_daemon(e):
                raise _unsupported(pub, e) from None
            if e.code == wire.NOT_REGISTERED and not resent and pub.update_id is None:
                # The daemon restarted and forgot us (the error ended the round): register
                # again, learning its next update id, and begin once more.
                log.info("rank %d: daemon does not know this rank; registering again",
                         pub.rank)
                resent = True
                pub.register()
                continue
            raise
        waited += time.perf_counter() - t0
        assert isinstance(ack, wire.Ack)
        return uid, ack, waited


def publish_adapter(
    pub: PublisherConnection,
    lora_name: str,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    config: Mapping[str, object] | str,
    version: int,
    rows: Rows | None = None,
) -> AdapterStats:
    """One adapter round of ``pub`` (see the module's docstring and
    ``Publisher.publish_adapter``, which documents the arguments and errors).

    Raises:
        RuntimeError: an update is open, or the publisher is closed.
        TypeError, ValueError: bad arguments (``inputs.part_tensors``, ``config_text``,
            ``version_of``, ``_checked_begin``), before the begin is sent (the round is
            opened and aborted instead: ``_abort_before_begin``).
        MemoryError: the part cannot be allocated (before the begin: aborted likewise).
        SlotsyncError, SlotsyncTimeout: the round failed.
    """
    pub._check_usable()
    if pub.update_id is not None:
        raise RuntimeError(f"update {pub.update_id} is still open; commit or abort it first")
    part: AdapterPart | None = None
    try:
        version = version_of(version)
        config_json = config_text(config)
        parts = part_tensors(tensors, rows, rank=pub.rank, slot=pub.slot,
                             transport=pub.transport, device=pub.device)
        pub._read_monitor(during_update=False)
        if pub.registered is None or pub._waits.connected is False:
            pub.register()  # (never registered, or the daemon went away since; and its cap)
        _checked_begin(pub, lora_name, version, config_json, parts)
        t0 = time.perf_counter()
        part = AdapterPart(parts, rank=pub.rank, transport=pub.transport, device=pub.device,
                           owned=pub._exporter.segments)
        digests = part.fill()
        fields = {"lora_name": lora_name, "version": version, "config_json": config_json,
                  "tensors": _begin(0, lora_name, version, config_json, parts,
                                    digests).tensors}
    except BaseException as e:
        if part is not None:
            part.free()
        _abort_before_begin(pub, e)
        raise
    assert part is not None
    try:
        uid, ack, begin_wait = _send_begin(pub, fields)
        if ack.transport not in ("host", "device"):
            raise SlotsyncError(
                "protocol", f"the daemon's Ack(adapter_begin) names transport "
                f"{ack.transport!r}; this publisher hands a part over as 'host' or 'device'",
                slot=(pub.slot.start, pub.slot.end), update_id=uid)
        pub._send(wire.AdapterData(update_id=uid, handle=part.handle(ack.transport)))
        t1 = time.perf_counter()
        done = _wait(pub, Awaited("adapter_data", uid))
        data_wait = time.perf_counter() - t1
        assert isinstance(done, wire.Ack)
        part.consumed = True
        part.free()
        pub._end_update(succeeded=True)
    except BaseException as e:
        if pub.update_id is not None:
            pub.abort(_reason(e))
        raise
    finally:
        part.free()
    served = done.served_name or wire.served_name(lora_name, version)
    log.debug("rank %d: adapter %s (update %d) served: %d tensors, %d bytes over %s",
              pub.rank, served, uid, len(parts), part.nbytes, ack.transport)
    return AdapterStats(
        served_name=served, update_id=uid, tensors=len(parts), nbytes=part.nbytes,
        transport=ack.transport, seconds=time.perf_counter() - t0, copy_seconds=part.copy_s,
        digest_seconds=part.digest_s, begin_wait_seconds=begin_wait,
        data_wait_seconds=data_wait)

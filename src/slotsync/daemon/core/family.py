"""The one interface between a slot's coordinator and the engine families it drives (I/O-free;
issue 34 B).

The coordinator speaks one vocabulary of engine steps (``update.BEGIN_STAGES``' routes, then
``update_weights``, ``finish_weight_update``, ``resume``, ... : the keys of vLLM's route table,
whose shapes its answers are read in) and holds no family's name or rule. What differs from
one family to another it asks an ``EngineFamily``; which family an engine is, and what the
version stage's answers mean, it asks the daemon's ``Families`` (``slotsync.daemon.families``
implements both for vLLM and SGLang and is injected into ``SlotTable``):

    question                                      asked                  vLLM      SGLang
    the body of a begin step (init, draft probe)  EngineFamily.step_body  its JSON  ignored
    the version stage's answers and failures,     Families.version_*      /version  /server_info
      the kind they tell, refused before the pause
    a probe answer unlike the engine's kind       Families.kind_in_doubt  (a 404: another
      (another engine at its URL: ask again)                            engine there)
    can it take rank-local / draft rounds         rank_local_refusal,     EP lists  refused
                                                  pause_refusal, drafts
    a start that met an open session              session_open            "already  SESSION_OPEN
                                                                          active"
    a complete chunk merged into the payload      merge, chunk_body       update_info  the whole
                                                                                    body
    when a chunk's memory may go back             fence, reads_memory     its reply  a fence

    an adapter round (issue 36): transport,       EngineFamily.adapters  "host":   "device":
      limits, load body, list of adapters         (AdapterSupport)       files on  the ranks'
                                                                         a tmpfs   memory

A family never imports another (the pyproject's layers); what both use lives below them.
``HeldErrors`` and the ``ChunkFence`` protocol live here because the coordinator runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # (types only: the modules below import nothing of this one)
    from pathlib import Path

    from slotsync.daemon.core.actions import Action
    from slotsync.daemon.core.adapters.plan import AdapterPlan, LoraLimits
    from slotsync.daemon.core.aggregation import MergedChunk
    from slotsync.daemon.core.engine_session import EngineSession
    from slotsync.protocol.wire import Chunk, Handle

Update = Any
"""``update.Update`` (not imported: ``update.py`` imports this module for ``ChunkFence``)."""


class ChunkFence(Protocol):
    """When the chunks an engine loaded may be acknowledged (their memory given back): an
    engine whose reply comes before its copies out of the ranks' memory finished (SGLang 0.5.21+,
    ``daemon/sglang/fence.py``) acks a chunk only once a later call proves it."""

    def proves(self, route: str) -> bool:
        """Whether step ``route``'s successful reply proves the chunks before it."""

    def on_send(self, call_id: int) -> None:
        """A proving call ``call_id`` was sent."""

    def on_chunk_reply(self, call_id: int, index: int, due: list[int]) -> list[int]:
        """Chunk ``index`` answered; returns the chunks proven now (index order)."""

    def on_proof(self, call_id: int) -> list[int]:
        """Call ``call_id`` proved what was sent before it; returns the chunks to ack."""

    def waiting(self) -> bool:
        """A loaded chunk is not proven yet."""


@dataclass(frozen=True, slots=True)
class MergeFacts:
    """What a merge needs to know of the slot: each rank's GPU UUID, the packed mode, the
    transport (``"cuda"`` or ``"shm"``), the engine's world size and its ``family`` (None: not
    known yet -- complete chunks wait, unmerged, until the version stage told it:
    ``chunk_window.merge_waiting``); ``engine_gpu_uuids`` the GPU of each engine worker in
    worker order where known (the engine table's ``gpu_uuids``, else the engine's own
    report; None: not known), for a family whose payload is indexed by worker (SGLang's, by
    TP rank: ``daemon/sglang/merge.py``)."""

    gpu_uuids: Mapping[int, str]
    packed: bool
    transport: str
    world_size: int
    family: EngineFamily | None = None
    engine_gpu_uuids: tuple[str, ...] | None = None


@dataclass
class VersionVerdict:
    """What an answer of the version stage means (``Families.version_answer`` /
    ``version_failure``): ``fail`` the update in its begin with this text (before the pause);
    else ``events`` for the log and, with ``merge``, the engine's kind is known now: merge the
    chunks that waited for it. ``recheck``: the answer is unlike the kind the daemon took the
    engine for (another engine at its URL, issue 35): ask its kind again from the version
    stage on (once per begin; ``fail`` is the refusal should it be asked already)."""

    fail: str = ""
    events: list[Action] = field(default_factory=list)
    merge: bool = False
    recheck: str = ""


class AdapterSupport(Protocol):
    """How one engine family takes LoRA adapters (issue 36), as the adapter round asks it
    (``core/adapters/rounds.py``; I/O-free but ``write_files`` / ``remove_files``, which the
    service runs in a thread). A family without it has ``EngineFamily.adapters`` None (or
    lacks the attribute): its rounds are refused before any engine call.

    ``transport``: how the ranks hand their parts over (``Ack(adapter_begin).transport``):
    ``"host"`` (a shared-memory segment the daemon reads and writes into ``write_files``'
    folder) or ``"device"`` (the ranks' registered transport, read by the engine).
    ``reloadable``: an adapter the engine lost with a restart can be loaded again from its
    folder. ``load_route`` / ``unload_route`` / ``list_route``: the engine steps (keys of the
    family client's routes) that load, unload and list adapters."""

    transport: str
    reloadable: bool
    load_route: str
    unload_route: str
    list_route: str

    def limits(self, answers: Mapping[str, Any]) -> LoraLimits:
        """What the engine can hold, from the version stage's answers (``{"version": ...,
        "server_info": ...}``, an answer that failed left out)."""

    def refusal(self, plan: AdapterPlan, answers: Mapping[str, Any] | None = None) -> str:
        """Why this family cannot take ``plan`` (e.g. a layout it cannot load), or '';
        asked before any engine call and again with the version stage's ``answers`` (the
        engine's own settings)."""

    def served(self, listing: Any) -> set[str]:
        """The adapters' served names in the answer of ``list_route``."""

    def roots(self, listing: Any) -> Mapping[str, str]:
        """Where the engine says it read each listed adapter from, in the answer of
        ``list_route`` (served name -> path; the daemon adopts a version whose path is its
        own folder of that version: ``adapters/watch.py``). Optional: a family without it
        has its listed versions adopted without a folder."""

    def load_body(self, plan: AdapterPlan, folder: str, handles: Mapping[int, Handle | None],
                  gpu_uuids: Mapping[int, str], tp_size: int,
                  engine_gpu_uuids: Sequence[str] | None = None) -> Any:
        """The body of ``load_route`` for ``plan``: from ``folder`` (``write_files``' result,
        '' for a ``"device"`` family) or the ranks' ``handles`` (rank -> its
        ``AdapterData.handle``) with their GPU UUIDs (rank -> UUID), the engine's TP size and
        its workers' GPUs where declared.

        Raises:
            ValueError: a body the engine could not take (named; the round fails, nothing
                was sent).
        """

    def proof(self, tp_size: int, engine: EngineSession) -> tuple[str, Any] | None:
        """``(step, body)`` of the call whose successful answer, sent after the load's,
        proves that the engine read all of the ranks' memory (SGLang with several TP ranks:
        the load's answer proves TP rank 0's copies only); None: the load's answer proves it."""

    def unload_body(self, served_name: str) -> Any:
        """The body of ``unload_route`` for ``served_name``."""

    def explain(self, error: str) -> str:
        """A failed load's ``error`` (``str(EngineError)``) in words saying what to do."""

    def absent(self, error: str) -> bool:
        """An unload's ``error`` says the engine does not hold that name (nothing to undo)."""

    def already_loaded(self, error: str) -> bool:
        """A load's ``error`` says the engine already holds that name (a load again after a
        suspected restart that was none)."""

    def write_files(self, root: Path, plan: AdapterPlan,
                    read: Callable[[int, int, int], bytes | memoryview],
                    take: Callable[[int, Path, bytes], str] | None = None) -> Path:
        """``"host"`` families: write ``plan``'s folder under ``root`` from the ranks' bytes
        (``read(rank, offset, nbytes)``); returns the folder. I/O (the service's thread).
        ``take(rank, dest, header)``, where the service offers it, hard-links a rank's
        segment as the file ``dest`` when the segment is ``header`` then its part and is
        sealed, returning '' (else why not; then nothing is at ``dest``): a family whose
        file is one rank's part as it lies may use it instead of copying
        (``service/adapter_io.py`` ``PartReader.take``).

        Raises:
            ValueError: a part's bytes do not match its sha256 (the text names tensor and
                rank), or the bytes cannot be read.
        """

    def remove_files(self, root: Path, served_name: str) -> None:
        """Remove ``served_name``'s folder under ``root`` (none: nothing). I/O."""


class EngineFamily(Protocol):
    """One engine family's rules, as the coordinator asks them (I/O-free). ``name`` is its
    kind (the engine table's ``kind``, ``/status``'s ``engine_kind``); ``display`` its name in
    error texts ("vLLM update_weights failed: ..."); ``pause_modes``: the engine table may set
    its pause mode; ``asks_draft_support``: a round with a draft part asks its workers before
    the pause (else such a round is refused by ``pause_refusal``); ``reads_memory``: the steps
    whose call may still read the ranks' memory after a failed update (their errors are held
    until none is at the engine: ``HeldErrors``); ``adapters``: how it takes LoRA adapters
    (``AdapterSupport``), None (or no such attribute) for a family without them."""

    name: str
    display: str
    pause_modes: bool
    asks_draft_support: bool
    reads_memory: frozenset[str]
    adapters: AdapterSupport | None

    def step_body(self, route: str, packed: bool | None) -> Any:
        """The JSON body of begin step ``route`` (None: none)."""

    def rank_local_refusal(self, u: Update, engine: EngineSession,
                           engine_url: str | None) -> str:
        """Why this engine cannot take rank-local update ``u`` (asked first at the pause)."""

    def pause_refusal(self, u: Update, engine: EngineSession, engine_url: str | None) -> str:
        """Why update ``u`` must not pause the engine (after the generic checks), or ''."""

    def session_open(self, error: str) -> bool:
        """A failed start's ``error`` says a session nobody recorded is open."""

    def fence(self, engine: EngineSession) -> ChunkFence | None:
        """The update's chunk fence once its start returned (None: a reply proves a chunk)."""

    def merge(self, index: int, got: Mapping[int, Chunk], facts: MergeFacts,
              u: Update | None) -> MergedChunk:
        """Check chunk ``index`` of every rank and build the engine's payload.

        Raises:
            ChunkMismatch: the ranks disagree, or the engine could not load it.
        """

    def chunk_body(self, merged: MergedChunk) -> Any:
        """The ``update_weights`` call's body for ``merged`` (its JSON made at merge time)."""


class Families(Protocol):
    """The engine families the daemon drives, and the rules above them: which family an engine
    is, and what the version stage's two answers (in either order) mean."""

    by_kind: Mapping[str, EngineFamily]
    """The families by ``name`` (the engine table's ``kind``)."""

    def of(self, engine: EngineSession) -> EngineFamily:
        """The family to ask for ``engine`` (an engine of unknown kind: the default one)."""

    def known(self, engine: EngineSession) -> EngineFamily | None:
        """``engine``'s family once declared or told by its answers; None before."""

    def version_answer(self, engine: EngineSession, u: Update, route: str, result: Any,
                       slot: tuple[int, int], size: int,
                       engine_url: str | None) -> VersionVerdict:
        """Step ``route`` of the version stage (``version`` or ``server_info``) answered
        ``result``."""

    def version_failure(self, engine: EngineSession, u: Update, error: str,
                        engine_url: str | None, server_info_out: bool) -> VersionVerdict:
        """``version`` answered an HTTP error ``error``; ``server_info_out``: still out."""

    def kind_in_doubt(self, engine: EngineSession, route: str, ok: bool, result: Any,
                      error: str, engine_url: str | None) -> str:
        """Why the probe step ``route``'s answer (``ok`` with ``result``, or ``error``) says
        the engine may not be of the kind the daemon took it for (another engine at its URL:
        the coordinator asks its kind again, once per begin), or ''."""


@dataclass
class HeldErrors:
    """A failed update's errors to its ranks, held while a call of it that may still read
    their memory is at the engine (``EngineFamily.reads_memory``; SGLang: a rank told frees
    its memory, SGLang mapping it for a queued chunk raises in its scheduler, and that kills
    the whole server, docs/sglang-contract.md 2.7; each call is bounded by the engine
    timeout). ``actions``: the held replies, in order."""

    actions: list[Any] = field(default_factory=list)
    reading: frozenset[str] = frozenset()

    def hold(self, actions: list[Any], at_engine: Mapping[int, str],
             reading: frozenset[str]) -> list[Any]:
        """The failed update's ``actions`` (its errors to the ranks), with its calls still
        at the engine ``at_engine`` (call id -> step): those to send now; the rest are held
        while a step of ``reading`` is among them."""
        self.reading = reading
        if any(step in reading for step in at_engine.values()):
            self.actions = list(actions)
            return []
        return actions

    def release(self, at_engine: Mapping[int, str]) -> list[Any]:
        """A call of the failed update returned (``at_engine``: those left): the held
        replies once none of them reads the ranks' memory, else nothing."""
        if self.actions and not any(step in self.reading for step in at_engine.values()):
            out, self.actions = self.actions, []
            return out
        return []

    def late(self, out: list[Any], of_failed: bool) -> list[Any]:
        """A chunk or commit answered ``out`` (an error); ``of_failed``: it belongs to the
        failed update. Held with the rest while they are held, so that it does not free the
        rank's memory first; else ``out``."""
        if self.actions and of_failed:
            self.actions += out
            return []
        return out

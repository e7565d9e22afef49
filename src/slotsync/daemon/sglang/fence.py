"""When a chunk's staging region may go back to the publisher, on an SGLang engine (I/O-free;
issue 26 C).

SGLang answers ``/update_weights_from_tensor`` **before** its GPU copies out of the producer's
memory finish: nothing on that path synchronizes the device (docs/sglang-contract.md 5.1;
slime says so in its own code and allocates a fresh bucket per chunk). A region handed back at
the reply could be refilled while SGLang still reads it. What does prove the copies finished
(docs/sglang-contract.md 5.2): a TP rank's copies of a chunk are finished once it freed the
chunk's received tensors -- torch's consumer-side deleter of a CUDA-IPC storage synchronizes
the stream before it lets go (``THPStorage_newSharedCuda``); the GPU test of issue 26 E
overwrites each region with garbage the moment it is handed back and checks the engine's
checksums, so a torch or SGLang that drops this fails loudly.

* SGLang 0.5.20 frees them before the TP barrier, and rank 0 replies after it: **a chunk's own
  reply proves it** (no fence: ``needed`` is false).
* SGLang 0.5.21+ frees them after the barrier: a chunk's reply proves only TP rank 0's copies.
  Every rank handles requests one at a time in order, so the successful reply of any call that
  passes the barrier **and was sent after the chunk's reply arrived** proves it on every rank:
  a later chunk's ``/update_weights_from_tensor``, the commit's ``/end_weight_update``, or --
  when no later chunk comes (a publisher waiting for this very region) -- a proving call, an
  update of no tensor (``routes.py``, step ``prove_copies``).

Acks stay in index order (I3): a chunk is acknowledged once it and every chunk before it is
proven. A failed update acknowledges nothing more, and its ranks get the error only once no
chunk call of it is left at SGLang (``core/family.py`` ``HeldErrors``, its ``reads_memory``
``PROVING_STEPS``): a rank told earlier frees its
memory, and a queued call mapping it would raise in SGLang's scheduler, which kills the
server. A copy still running when they are told reads memory a later full update overwrites
(SGLang's scheduler is sequential), so it cannot leave torn weights behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from slotsync.daemon.sglang import versions as sglang_versions

PROVING_STEPS = frozenset({"update_weights", "prove_copies", "finish_weight_update"})
"""The daemon's steps whose SGLang call passes the TP barrier when it succeeds (a chunk's
``/update_weights_from_tensor``, the proving call, the commit's ``/end_weight_update``)."""


def needed(version: str | None) -> bool:
    """Whether ``version``'s replies prove only TP rank 0's copies (0.5.21+: frees after the
    barrier, weight_updater.py L241 / L262)."""
    return sglang_versions.has(version, "frees_after_barrier")


@dataclass
class Fence:
    """The fence of one update: ``replies`` successful chunk replies so far, each chunk's
    reply number, each call's replies seen when it was sent, and ``unproven`` the chunks
    loaded (``chunk_window.returned``) but not yet proven, in index order."""

    replies: int = 0
    reply_no: dict[int, int] = field(default_factory=dict)  # chunk index -> its reply's number
    sent_after: dict[int, int] = field(default_factory=dict)  # call id -> replies at send time
    unproven: list[int] = field(default_factory=list)

    def proves(self, route: str) -> bool:
        """Whether the daemon's step ``route`` passes the TP barrier (``PROVING_STEPS``)."""
        return route in PROVING_STEPS

    def on_send(self, call_id: int) -> None:
        """A call that passes the TP barrier (a chunk, a proving call, the end) was sent."""
        self.sent_after[call_id] = self.replies

    def on_chunk_reply(self, call_id: int, index: int, due: list[int]) -> list[int]:
        """Chunk ``index``'s call ``call_id`` answered success; ``due`` are the chunks it made
        loaded in index order. Returns the chunks proven now, in index order (ack them)."""
        self.replies += 1
        self.reply_no[index] = self.replies
        self.unproven += due
        return self.on_proof(call_id)

    def on_proof(self, call_id: int) -> list[int]:
        """Call ``call_id`` passed SGLang's TP barrier (a successful reply): every chunk whose
        reply arrived before it was sent is proven. Returns the chunks that may be
        acknowledged now: the longest proven prefix of ``unproven``."""
        proof = self.sent_after.pop(call_id, 0)
        n = 0
        while n < len(self.unproven) and self.reply_no[self.unproven[n]] <= proof:
            n += 1
        proven, self.unproven = self.unproven[:n], self.unproven[n:]
        return proven

    def waiting(self) -> bool:
        """Some loaded chunk is not yet proven (its region stays with the daemon)."""
        return bool(self.unproven)

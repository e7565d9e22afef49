"""A stand-in daemon's socket for the rank-side unit tests: a ZMQ ROUTER bound at the test's
endpoint and served by a thread, each message decoded as the real daemon decodes it (so
validated) and answered by the test's code, and the reader of the shared memory a rank's
handle points at. ``tests/unit/test_publisher.py``'s ``FakeDaemon`` and
``tests/unit/test_publish_adapter_fsdp.py``'s ``RankedDaemon`` are both one (issue 36 wrote
the socket and its thread a second time)."""

from __future__ import annotations

import threading

import zmq

from slotsync.protocol import wire


def read_shm(h: wire.ShmHandle) -> bytes:
    """The ``h.nbytes`` bytes at ``h.offset`` of ``/dev/shm/<h.segment>``."""
    with open(f"/dev/shm/{h.segment}", "rb") as f:
        f.seek(h.offset)
        return f.read(h.nbytes)


class RouterThread:
    """A ROUTER bound at ``endpoint``; a daemon thread hands each frame, decoded by
    ``wire.decode_to_daemon``, to :meth:`answer` with its sender's identity, and sends what it
    returns back to that sender. The thread starts in ``__init__``: a subclass sets its own
    state before calling it. ``close`` stops the thread and closes the socket."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def answer(self, ident: bytes, msg: wire.ToDaemon) -> list[wire.FromDaemon]:
        """The replies to ``msg`` from ``ident`` (runs in the thread)."""
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, frame = self._sock.recv_multipart()  # one frame, no delimiter
            for reply in self.answer(ident, wire.decode_to_daemon(frame)):
                self._sock.send_multipart([ident, wire.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(linger=0)
        self._ctx.term()

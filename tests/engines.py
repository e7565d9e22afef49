"""Which engine the integration tests, the fault suite and the soak talk to.

``SLOTSYNC_TEST_ENGINE`` (or ``pytest --engine``, which sets it for this process and the rank
processes it spawns) is ``reference`` (default: ``python -m slotsync.engine``, our aiohttp
stand-in), ``vllm`` (``python -m slotsync.engine --impl vllm``: vLLM's own RL router,
exception handlers and uvicorn, vLLM's ``Worker`` weight-update state machine and
``IPCWeightTransferEngine`` payload parser, with a stand-in only for the CUDA rebuild on CPU),
``sglang`` (``--impl sglang``: SGLang's weight-sync routes and rules, each TP rank parsing
its payload entry with SGLang's own code over a CPU stand-in for the CUDA rebuild) or
``sglang-reference`` (the same routes with slotsync's own parser). All expose the test-only
routes ``/_slotsync/stats`` and ``/_slotsync/fault``; the SGLang engines speak SGLang's
routes, not vLLM's, so only suites written for them (``test_sglang_engine.py``) run against
them until the daemon speaks SGLang.

vLLM's and SGLang's engines load weights into a real model, so they need one whose names,
dtypes and shapes are what the tests publish: :func:`start_engine` writes it from
``slotsync.testing.tensors.make_tensors`` (or the ``named`` tensors given) as a safetensors
file. :class:`EngineBox`'s ``stats`` / ``checksums`` / ``weight_version`` / ``is_paused``
ask any impl the same questions through its own routes.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

from slotsync.testing.ports import port_free

__all__ = ["ENGINE_ENV", "IMPLS", "SGLANG_IMPLS", "EngineBox", "impl", "model_file",
           "port_free", "remove_model_files", "sglang_importable", "start_engine",
           "vllm_importable"]

ENGINE_ENV = "SLOTSYNC_TEST_ENGINE"
IMPLS = ("reference", "vllm", "sglang", "sglang-reference")
SGLANG_IMPLS = ("sglang", "sglang-reference")


_module_default: str | None = None
"""The engine of the test module running now where no ``--engine`` was given: set by
``conftest.py`` from the module's ``ENGINE_UNDER_TEST`` (see :func:`impl`)."""


def impl() -> str:
    """The engine implementation under test: one of :data:`IMPLS`.

    ``--engine`` / ``$SLOTSYNC_TEST_ENGINE`` where given; else the module's own choice:
    the daemon-behaviour suites (``test_integration.py``, ``test_faults.py``) set
    ``ENGINE_UNDER_TEST = "vllm"`` and run against vLLM's own code where it is importable
    (issue 24: one run, no second pass of them against the reference engine, whose likeness
    to vLLM the comparison tests hold); everything else: ``reference``."""
    name = os.environ.get(ENGINE_ENV) or _module_default or "reference"
    if name not in IMPLS:
        raise ValueError(f"{ENGINE_ENV}={name!r}: use one of {IMPLS}")
    return name


@functools.cache
def vllm_importable() -> str:
    """'' when vLLM's RL router and worker import here, else why not (asked once)."""
    try:
        import vllm.entrypoints.rl.online.api_router  # noqa: F401
        import vllm.v1.worker.gpu_worker  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable
        return f"{type(e).__name__}: {e}"
    return ""


@functools.cache
def sglang_importable() -> str:
    """'' when SGLang's receive code (its serializer, ``SafeUnpickler``, ``patch_torch``,
    ``tensor_bucket``) and body validation (``msgspec_utils``) import here, else why not
    (``scripts/test`` installs it, issue 26; asked once). The ``sglang`` marker and the
    ``sglang`` engine need it."""
    try:
        import sglang.srt.utils.common  # noqa: F401
        import sglang.srt.utils.msgspec_utils  # noqa: F401
        import sglang.srt.utils.patch_torch  # noqa: F401
        import sglang.srt.weight_sync.tensor_bucket  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable
        return f"{type(e).__name__}: {e}"
    return ""


_models: dict[tuple, Path] = {}


def model_file(named: list[tuple[str, Any]] | None = None) -> Path:
    """A safetensors file holding ``named`` (default: ``make_tensors(0)``), written once per
    process into a temporary folder."""
    from safetensors.torch import save_file

    if named is None:
        from slotsync.testing.tensors import make_tensors

        named = make_tensors(0)
    key = tuple((n, str(t.dtype), tuple(t.shape)) for n, t in named)  # (values aside)
    path = _models.get(key)
    if path is None or not path.exists():
        folder = Path(tempfile.mkdtemp(prefix="slotsync-test-model-"))
        path = folder / "model.safetensors"
        save_file({n: t.contiguous() for n, t in named}, str(path))
        _models[key] = path
    return path


def remove_model_files() -> None:
    """Remove the folders :func:`model_file` wrote (``conftest.py``, at the end of the run)."""
    import shutil

    for path in _models.values():
        shutil.rmtree(path.parent, ignore_errors=True)
    _models.clear()


def start_engine(workers: int = 2, *, named: list[tuple[str, Any]] | None = None,
                 impl_name: str | None = None,
                 worker_named: list[list[tuple[str, Any]]] | None = None, **kw: Any):
    """A started engine of the implementation under test (``impl_name`` overrides it), with
    ``workers`` workers; keyword arguments go to ``ReferenceEngine`` (e.g.
    ``data_parallel_size=2``: ``workers`` = 2 x TP, worker ``i`` is TP rank ``i % TP`` of
    DP replica ``i // TP``). For vLLM's engine the model is ``named`` (default
    ``make_tensors(0)``) unless ``model=`` is given. ``worker_named``: one tensor list per
    worker (``--worker-models``, either engine): worker ``i`` holds only ``worker_named[i]``
    (an expert-parallel worker's own experts and the shared weights; ``model_file`` caches
    files by names, dtypes and shapes, so lists differing only in values share one). The
    SGLang engines take their options as ``sglang={"sglang_version": "0.5.21", ...}``
    (``ReferenceEngine``'s ``sglang``); ``workers`` is their TP size."""
    from slotsync.engine.launcher import ReferenceEngine

    which = impl_name or impl()
    if worker_named is not None:
        kw["worker_models"] = [model_file(n) for n in worker_named]
    elif which in ("vllm", *SGLANG_IMPLS):
        if "model" not in kw:
            kw["model"] = model_file(named)
        kw.setdefault("startup_timeout_s", 300.0)
    return ReferenceEngine(workers=workers, impl=which, **kw)


class EngineBox:
    """A started engine (:func:`start_engine`) that a test may restart on the same port and
    that fixtures bring back to a clean state between tests (:meth:`reset`)."""

    def __init__(self, workers: int = 2, **kw: Any) -> None:
        self.workers = workers
        self.kw = kw
        self.eng = start_engine(workers, **kw)
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.eng.url

    def request(self, *a: Any, **kw: Any):
        return self.eng.request(*a, **kw)

    def kill(self) -> None:
        """Stop the engine abruptly (SIGKILL): connections drop, weights are gone."""
        assert self.eng.proc is not None
        self.eng.proc.kill()
        self.eng.proc.wait()

    def start_again(self) -> None:
        """A new engine process on the same port: default weights and version, not paused,
        never initialised."""
        import time

        port = self.eng.port
        self.eng.stop(1)
        deadline = time.monotonic() + 10
        while not port_free(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.eng = start_engine(self.workers, port=port, **self.kw)
        self.restarts += 1

    @property
    def impl(self) -> str:
        """The engine's implementation (one of :data:`IMPLS`)."""
        return self.eng.impl

    @property
    def is_sglang(self) -> bool:
        """Whether the engine speaks SGLang's routes."""
        return self.eng.impl in SGLANG_IMPLS

    def alive(self) -> bool:
        """Whether the engine process still runs (an SGLang engine dies of a scheduler
        exception)."""
        return self.eng.proc is not None and self.eng.proc.poll() is None

    def stats(self) -> dict[str, Any]:
        """``GET /_slotsync/stats`` (every impl; shapes in the engines' docstrings: a
        ``paused`` flag and ``workers`` with ``index`` / ``gpu_uuid`` / ``update_count`` /
        ``bytes_loaded`` / ``num_weights`` in all)."""
        status, body = self.request("GET", "/_slotsync/stats")
        assert status == 200, (status, body)
        return body

    def checksums(self) -> dict[str, dict[str, str]]:
        """``{worker: {name: sha256 hex}}`` of every worker's weights
        (``slotsync.engine.checksum.tensor_checksum``): the reference engine keys workers by
        GPU UUID, vLLM's code by ``tp<t>`` (``dp<d>:pp0:pcp0:tp<t>`` past replica 0), the
        SGLang engines by ``tp<r>`` (``POST /_slotsync/checksums``; the others answer
        ``/weight_checker``, read by ``checksum.checksums_by_worker``)."""
        if self.is_sglang:
            status, body = self.request("POST", "/_slotsync/checksums")
            assert status == 200, (status, body)
            return body
        from slotsync.engine.checksum import checksums_by_worker

        status, body = self.request("POST", "/weight_checker", {"action": "checksum"})
        assert status == 200, (status, body)
        return checksums_by_worker(body)

    def weight_version(self) -> str:
        """The engine's weight version: ``GET /weight_info`` (vLLM's contract) or SGLang's
        ``GET /model_info``."""
        status, body = self.request("GET", "/model_info" if self.is_sglang
                                    else "/weight_info")
        assert status == 200, (status, body)
        return body["weight_version"]

    def is_paused(self) -> bool:
        """Whether generation is paused: ``GET /is_paused`` (vLLM's contract); SGLang has no
        such route: the SGLang engines' ``/_slotsync/stats`` ``paused`` (the tokenizer's
        flag)."""
        if self.is_sglang:
            return bool(self.stats()["paused"])
        status, body = self.request("GET", "/is_paused")
        assert status == 200, (status, body)
        return bool(body["is_paused"])

    def reset(self) -> None:
        """Clear faults, end any half-open session, any sleep and any pause, without calls
        that would fail on a worker: on vLLM's code a failing call can leave a later
        worker's reply queued for the next call (vLLM gh-58242). An engine split between
        workers in and out of a session, or with replies out of step, is restarted; so is
        an SGLang engine that died."""
        if self.is_sglang:
            self._reset_sglang()
            return
        self.request("POST", "/_slotsync/fault", {"clear": True})
        stats = self.request("GET", "/_slotsync/stats")[1]
        active = [w["active"] for w in stats["workers"]]
        if any(stats.get("unread_replies") or ()) or (any(active) and not all(active)):
            self.start_again()
            return
        if all(active):
            self.request("POST", "/finish_weight_update")
        if stats.get("sleeping_tags"):  # the executor sleeps (not just a paused scheduler)
            self.request("POST", "/wake_up")
        if stats.get("paused"):
            self.request("POST", "/resume")

    def _reset_sglang(self) -> None:
        """An SGLang engine back to a clean state: restarted if it died; else faults cleared,
        an open session ended, generation continued, the simulator's requests finished."""
        if not self.alive():
            self.start_again()
            return
        self.request("POST", "/_slotsync/fault", {"clear": True})
        stats = self.stats()
        if stats["session_open"]:
            self.request("POST", "/end_weight_update", {})
        if stats["paused"] or stats["engine_paused"]:
            self.request("POST", "/continue_generation", {})
        if any(stats["requests"][k] for k in ("held", "waiting", "running")):
            self.request("POST", "/_slotsync/requests", {"finish": None})

    def close(self) -> None:
        self.eng.stop()

"""Start and stop an engine (``python -m slotsync.engine``) as a subprocess, for tests and demos.

Example::

    with ReferenceEngine(workers=2) as eng:
        status, body = eng.request("GET", "/get_world_size")   # 200, {"world_size": 2}
        eng.gpu_uuids                                          # logical UUIDs of workers 0, 1
    with ReferenceEngine(workers=2, impl="vllm", model="m.safetensors") as eng:
        ...                                                    # vLLM's own router and workers
    with ReferenceEngine(workers=2, impl="sglang", model="m.safetensors",
                         sglang_version="0.5.21") as eng:
        ...                                                    # SGLang's routes, TP=2
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from slotsync.protocol.wire import logical_gpu_uuid, normalize_gpu_uuid
from slotsync.testing.ports import free_port  # (moved there, issue 16; re-exported here)
from slotsync.testing.processes import die_with_parent

_zygote: Any = None  # a slotsync.testing.zygote.Zygote, or None: see use_zygote


def use_zygote(zygote: Any) -> None:
    """Start CPU engines of this process by forking them from ``zygote``
    (``slotsync.testing.zygote.Zygote``, which has imported torch and vLLM once) instead of
    a new interpreter each; None: subprocesses again. For tests only (``tests/conftest.py``):
    a forked engine is the zygote's child, not this process's."""
    global _zygote
    _zygote = zygote


class EngineStartError(RuntimeError):
    """The engine subprocess exited or did not answer its readiness route in time."""


IMPLS = ("reference", "vllm", "sglang", "sglang-reference")
SGLANG_IMPLS = ("sglang", "sglang-reference")
READY_ROUTE = {"sglang": "/model_info", "sglang-reference": "/model_info"}
"""The route whose 200 says an engine is up: ``/get_world_size`` (vLLM's), or SGLang's
``/model_info`` (answered by the tokenizer alone; SGLang has no ``/get_world_size``)."""


class ReferenceEngine:
    """``python -m slotsync.engine`` in a subprocess on a loopback port (the reference engine,
    or with ``impl="vllm"`` the vLLM-code engine, or with ``impl="sglang"`` /
    ``"sglang-reference"`` an SGLang engine; the class keeps its name for all).

    Args:
        workers: number of worker processes (= ``/get_world_size``).
        device: ``"cpu"`` or ``"cuda"``.
        gpu_uuids: GPU UUID per worker; default ``logical_gpu_uuid(i)`` on cpu, the real
            UUIDs on cuda (then :attr:`gpu_uuids` is read from ``/_slotsync/stats``).
        cuda_devices: device index per worker (cuda only).
        model: safetensors file loaded as initial weights on every worker.
        host, port: where to listen; ``port=None`` picks a free one.
        startup_timeout_s: bound on the wait for ``/get_world_size`` to answer (seconds).
        env: extra environment variables for the subprocess.
        log_path: file receiving the subprocess's stdout and stderr (default: a temp file made by
            :meth:`start`,
            deleted by :meth:`stop`).
        discard: start the engine with ``--discard`` (validate updates, load nothing).
        impl: ``"reference"``, ``"vllm"``, ``"sglang"`` or ``"sglang-reference"`` (``--impl``;
            every impl but ``"reference"`` needs ``model``).
        receive: reference engine: ``"reference"`` or ``"vllm"`` (``--receive``).
        executor_replies: ``impl="vllm"``: ``"vllm"`` or ``"all"`` (``--executor-replies``);
            None: the engine's default.
        draft_model: safetensors file of a speculative-decoding draft model on every worker
            (``--draft-model``, issue 18), or None (no draft model).
        data_parallel_size: DP replicas (``--data-parallel-size``); ``workers`` counts all
            of them (D x TP) and must be a multiple of it.
        worker_models: one safetensors file per worker (``--worker-models``, instead of
            ``model``): each worker holds only its file's tensors (an expert-parallel
            worker's own experts and the shared weights).
        vllm_version: reference engine: what ``GET /version`` reports (``--vllm-version``);
            None: its default, ``server.EMULATED_VLLM_VERSION``.
        parallel_config: ``impl="vllm"``: vLLM ``ParallelConfig`` fields of the server's
            ``vllm_config`` (``--parallel-config``), e.g. a hybrid-LB node's; None: none.
        uds: serve on this Unix socket path instead of ``host:port`` (``--uds``, like
            ``vllm serve --uds``): :attr:`url` is then ``unix://<path>`` and :meth:`request`
            goes over the socket (a stale socket file there is removed at start).
        sglang: ``impl="sglang"`` / ``"sglang-reference"`` only: the SGLang engines' options
            as a dict of their CLI names without ``--`` and with ``_`` (``sglang_version``,
            ``weight_version``, ``dp_size``, ``pp_size``, ``enable_dp_attention``,
            ``api_key``, ``admin_api_key``); ``api_key`` / ``admin_api_key`` also make
            :meth:`request` send ``Authorization: Bearer`` (:meth:`auth_header`).

    The engine starts in the constructor unless ``start=False``; :meth:`stop` (also run by
    the context manager) terminates it, then kills it after a grace period.
    """

    def __init__(
        self,
        workers: int = 2,
        device: str = "cpu",
        gpu_uuids: Sequence[str] | None = None,
        cuda_devices: Sequence[int] | None = None,
        model: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        start: bool = True,
        discard: bool = False,
        impl: str = "reference",
        receive: str = "reference",
        executor_replies: str | None = None,
        draft_model: str | os.PathLike[str] | None = None,
        data_parallel_size: int = 1,
        worker_models: Sequence[str | os.PathLike[str]] | None = None,
        vllm_version: str | None = None,
        parallel_config: dict[str, Any] | None = None,
        uds: str | os.PathLike[str] | None = None,
        sglang: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
        if sglang and impl not in SGLANG_IMPLS:
            raise ValueError(f"sglang options need impl sglang or sglang-reference, not {impl!r}")
        self.sglang = dict(sglang or {})
        # issue 36: {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
        # "max_cpu_loras": 4} -> --enable-lora --max-loras 2 ... (engine/lora_flags.py)
        self.lora = dict(lora or {})
        self.workers = workers
        self.data_parallel_size = data_parallel_size
        self.worker_models = ([str(m) for m in worker_models] if worker_models is not None
                              else None)
        self.discard = discard
        self.impl = impl
        self.receive = receive
        self.executor_replies = executor_replies
        self.vllm_version = vllm_version
        self.parallel_config = parallel_config
        self.device = device
        self.uds = str(uds) if uds is not None else None
        self.host = host
        self.port = port or free_port(host)
        self.startup_timeout_s = startup_timeout_s
        self._gpu_uuids = [normalize_gpu_uuid(u) for u in gpu_uuids] if gpu_uuids else None
        self._cuda_devices = list(cuda_devices) if cuda_devices is not None else None
        self._model = str(model) if model is not None else None
        self._draft_model = str(draft_model) if draft_model is not None else None
        self._env = env or {}
        self._owns_log = log_path is None
        # (an engine never started makes no log file: see start)
        self.log_path: Path | None = None if log_path is None else Path(log_path)
        self.proc: Any = None  # subprocess.Popen, or a zygote's ForkedProcess (use_zygote)
        if start:
            self.start()

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:38211`` (no trailing slash), or
        ``unix:///path/engine.sock`` when serving on a Unix socket (``uds``)."""
        if self.uds is not None:
            return f"unix://{self.uds}"
        return f"http://{self.host}:{self.port}"

    @property
    def gpu_uuids(self) -> list[str]:
        """Each worker's GPU UUID in rank order (torch format)."""
        if self._gpu_uuids is not None:
            return list(self._gpu_uuids)
        if self.device == "cpu":
            return [logical_gpu_uuid(i) for i in range(self.workers)]
        _, stats = self.request("GET", "/_slotsync/stats")
        return [w["gpu_uuid"] for w in stats["workers"]]

    def command(self) -> list[str]:
        """The subprocess's argv."""
        where = (["--uds", self.uds] if self.uds is not None
                 else ["--host", self.host, "--port", str(self.port)])
        cmd = [
            sys.executable, "-m", "slotsync.engine", *where,
            "--workers", str(self.workers), "--device", self.device, "--impl", self.impl,
        ]  # fmt: skip
        if self.receive != "reference":
            cmd += ["--receive", self.receive]
        if self.executor_replies is not None:
            cmd += ["--executor-replies", self.executor_replies]
        if self.data_parallel_size != 1:
            cmd += ["--data-parallel-size", str(self.data_parallel_size)]
        if self.worker_models is not None:
            cmd += ["--worker-models", ",".join(self.worker_models)]
        if self._gpu_uuids is not None:
            cmd += ["--gpu-uuids", ",".join(self._gpu_uuids)]
        if self._cuda_devices is not None:
            cmd += ["--cuda-devices", ",".join(str(i) for i in self._cuda_devices)]
        if self._model is not None:
            cmd += ["--model", self._model]
        if self._draft_model is not None:
            cmd += ["--draft-model", self._draft_model]
        if self.discard:
            cmd += ["--discard"]
        if self.vllm_version is not None:
            cmd += ["--vllm-version", self.vllm_version]
        if self.parallel_config is not None:
            cmd += ["--parallel-config", json.dumps(self.parallel_config)]
        for key, value in [*self.lora.items(), *self.sglang.items()]:
            flag = "--" + key.replace("_", "-")
            if value is True:
                cmd.append(flag)
            elif value not in (None, False):
                cmd += [flag, str(value)]
        return cmd

    def auth_header(self, path: str) -> dict[str, str]:
        """``Authorization: Bearer <key>`` for a call of ``path`` on an SGLang engine started
        with keys, else ``{}``: SGLang's admin routes want the admin key when one is set, the
        others the API key (``engine/sglang/state.py``'s ``ADMIN_OPTIONAL_ROUTES``)."""
        from slotsync.engine.sglang.state import ADMIN_OPTIONAL_ROUTES

        route = path.split("?", 1)[0]
        admin, api = self.sglang.get("admin_api_key"), self.sglang.get("api_key")
        key = (admin or api) if route in ADMIN_OPTIONAL_ROUTES else api
        return {"Authorization": f"Bearer {key}"} if key else {}

    def log_tail(self, n_chars: int = 4000) -> str:
        """The last ``n_chars`` characters of the subprocess's output."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:] if self.log_path else ""
        except OSError:
            return ""

    def start(self) -> None:
        """Start the subprocess and wait until ``GET /get_world_size`` answers 200.

        Raises:
            EngineStartError: the process exited, or did not answer within
                ``startup_timeout_s``; the message ends with its output's tail.
        """
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="slotsync-engine-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self._env}
        if self.uds is not None and Path(self.uds).is_socket():
            Path(self.uds).unlink()  # (a killed engine's: vLLM's server binds without removing)
        if (_zygote is not None and self.device == "cpu"
                and "SLOTSYNC_VLLM_SHIM" not in env  # (the zygote imported the real vLLM,
                and "SLOTSYNC_SGLANG_SHIM" not in env):  # and the real SGLang)
            self.proc = _zygote.spawn(self.command(), env, self.log_path)
            try:
                self._wait_ready()
            except BaseException:
                self.stop()
                raise
            return
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
            )  # fmt: skip
        try:
            self._wait_ready()
        except BaseException:  # Ctrl-C / SIGTERM while waiting too: leave nothing running
            self.stop()
            raise

    def _wait_ready(self) -> None:
        route = READY_ROUTE.get(self.impl, "/get_world_size")
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                tail = self.log_tail()
                raise EngineStartError(
                    f"{self.impl} engine exited with code {rc} during startup; output "
                    f"tail:\n{tail}"
                )
            try:
                status, _ = self.request("GET", route, timeout=2.0)
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                raise EngineStartError(
                    f"{self.impl} engine did not answer {self.url}{route} within "
                    f"{self.startup_timeout_s:.0f} s; output tail:\n{tail}"
                )
            time.sleep(0.1)

    def request(
        self, method: str, path: str, body: Any = None, timeout: float = 60.0
    ) -> tuple[int, Any]:
        """One HTTP call; returns ``(status, decoded JSON body or raw text)``.

        Error statuses are returned, not raised; connection errors raise ``OSError``.
        """
        data = None if body is None else json.dumps(body).encode()
        if self.uds is not None:
            status, raw = _unix_request(self.uds, method, path, data, timeout,
                                        self.auth_header(path))
            try:
                return status, json.loads(raw) if raw else None
            except json.JSONDecodeError:
                return status, raw.decode(errors="replace")
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers=self.auth_header(path))
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, wait ``grace_s`` seconds, then SIGKILL; removes an auto-created log.
        Idempotent."""
        p = self.proc
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._owns_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> ReferenceEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _unix_request(path: str, method: str, route: str, data: bytes | None,
                  timeout: float, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP/1.1 call over the Unix socket ``path``: ``(status, body)``. Connection
    errors raise ``OSError``."""
    import http.client
    import socket

    class _Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            try:
                s.connect(path)
            except OSError:
                s.close()
                raise
            self.sock = s

    conn = _Conn("localhost", timeout=timeout)
    try:
        hdrs = dict(headers or {})
        if data is not None:
            hdrs["Content-Type"] = "application/json"
        conn.request(method, route, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except http.client.HTTPException as e:
        raise OSError(f"unix://{path}{route}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()

"""HTTP client for one vLLM engine's weight-transfer routes (vllm-contract.md, vLLM 0.27–0.33).

One ``aiohttp.ClientSession`` per engine keeps its connections alive across calls. The engine
URL is ``http://host:port`` or, for ``vllm serve --uds PATH``, ``unix:///PATH``.

Connections after a failure: vLLM answers a failed weight call (any worker error) with a 500
raised through Starlette's ``ServerErrorMiddleware``, and uvicorn then closes the TCP
connection, a moment after the response; a restarted engine leaves every pooled connection
dead. A request on such a connection fails with "Connection reset by peer". So after a 5xx, a
timeout or a connection error the client retires its session: later calls go out on fresh
connections, while calls still running on the old session finish there (closing it would
abort them, and the engine would still run them). A connection error on an idempotent probe
(a ``GET``) is retried once, on a fresh connection. ``connection_errors`` counts refused and
reset connections, so that the daemon can treat one since its last round as a possible
engine restart (design.md I9).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from slotsync.daemon.core.engine_session import CANNOT_REACH

# Route name used by the coordinator -> (HTTP method, path). ``finish_recover`` is a finish
# whose failure is expected (recovery from a split engine, vllm-contract.md "Per-worker state").
ROUTES: dict[str, tuple[str, str]] = {
    "get_world_size": ("GET", "/get_world_size?include_dp=true"),
    "init_weight_transfer_engine": ("POST", "/init_weight_transfer_engine"),
    "pause": ("POST", "/pause?mode=keep"),
    "start_weight_update": ("POST", "/start_weight_update"),
    "update_weights": ("POST", "/update_weights"),
    "finish_weight_update": ("POST", "/finish_weight_update"),
    "finish_recover": ("POST", "/finish_weight_update"),
    # issue 18: a round's draft-model session (vLLM 0.26+ api_router.py), ended by a finish
    # without weight_version (the main finish set the engine's one version)
    "start_draft_weight_update": ("POST", "/start_draft_weight_update"),
    "finish_draft_weight_update": ("POST", "/finish_weight_update"),
    # ... and, before the pause, whether the engine can load one at all: dev-mode
    # /collective_rpc with {"method": "supports_draft_weight_updates"} (gpu_worker.py)
    "draft_support": ("POST", "/collective_rpc"),
    "resume": ("POST", "/resume"),
    "is_paused": ("GET", "/is_paused"),
    "is_sleeping": ("GET", "/is_sleeping"),
    "weight_info": ("GET", "/weight_info"),
    "weight_checker": ("POST", "/weight_checker"),
    # vLLM's dev-mode /collective_rpc, only ever with engine_session.CHECK_REPLIES (each
    # worker's rpc_rank): after a worker's failure, whether the executor's replies still
    # line up (coordinator)
    "check_replies": ("POST", "/collective_rpc"),
    # vLLM's GET /version (serve/instrumentator/basic.py): {"version": VLLM_VERSION}
    "version": ("GET", "/version"),
    # vLLM's dev-mode GET /server_info (serve/dev/server_info/api_router.py), asked with the
    # version: the server's VllmConfig as JSON, whose DP layout daemon/vllm/dp_layout.py reads
    "server_info": ("GET", "/server_info?config_format=json"),
}

# Routes whose 2xx answer must be JSON: any other body is an EngineError naming it.
JSON_ONLY = frozenset({"version"})

# Routes an engine may not have: a 404 answers None ("no information", daemon/vllm/dp_layout.py),
# not an
# EngineError (the reference engine, a server without the route).
ABSENT_IS_NONE = frozenset({"server_info"})

# Routes that only read the engine's state: a connection error on one is retried once.
PROBES = frozenset(r for r, (method, _) in ROUTES.items() if method == "GET")


class EngineError(RuntimeError):
    """A vLLM route failed: HTTP status (0 for no answer) and vLLM's own message."""

    def __init__(self, route: str, status: int, message: str) -> None:
        super().__init__(f"{route}: HTTP {status}: {message}" if status else f"{route}: {message}")
        self.route = route
        self.status = status
        self.message = message


def error_message(body: Any, text: str) -> str:
    """vLLM's error text from a failed response body.

    Shapes (vllm-contract.md "Errors"): ``{"error": {"message": ...}}`` (weight routes),
    ``{"error": "<str>"}`` (pause/resume), ``{"detail": [...]}`` (FastAPI 400).
    """
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "detail" in body:
            return str(body["detail"])
        if "message" in body:
            return str(body["message"])
    return text[:2000]


class VllmClient:
    """Calls one engine's routes.

    Args:
        url: ``http://host:port`` or ``unix:///path/to.sock``.
        timeout_s: bound on each request, seconds (design.md I5); a retried probe may take
            twice that.
        observe: called with ``(route, seconds, ok)`` after each HTTP request (metrics).

    Attributes:
        connection_errors: refused or reset connections seen so far (a retried probe counts
            too): a change since the last round means the engine may have restarted.
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 300.0,
        observe: Callable[[str, float, bool], None] | None = None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._observe = observe
        self.connection_errors = 0
        if url.startswith("unix://"):
            self._path: str | None = url[7:]
            self._base = "http://localhost"
        else:
            self._path = None
            self._base = url.rstrip("/")
        self._session = self._new_session()
        self._users: dict[aiohttp.ClientSession, int] = {}  # session -> calls running on it
        self._retired: set[aiohttp.ClientSession] = set()  # closed once no call uses them

    def _new_session(self) -> aiohttp.ClientSession:
        # Idle connections are dropped after 4 s, before uvicorn's keep-alive timeout (vLLM's
        # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) closes them under a request reusing them.
        connector: aiohttp.BaseConnector = (
            aiohttp.UnixConnector(path=self._path, keepalive_timeout=4.0)
            if self._path is not None
            else aiohttp.TCPConnector(limit=4, keepalive_timeout=4.0)
        )
        return aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )

    def _retire(self, session: aiohttp.ClientSession) -> None:
        """Send later calls on fresh connections; ``session`` closes when its last call ends."""
        if session is self._session:
            self._retired.add(session)
            self._session = self._new_session()

    async def close(self) -> None:
        for s in (*self._retired, self._session):
            await s.close()
        self._retired.clear()

    async def call(self, route: str, body: Any = None) -> Any:
        """Call ``route`` (a key of ``ROUTES``) with JSON ``body``; return the parsed reply.

        ``body`` is encoded by ``msgspec.json``: ``bytes`` values become standard base64
        strings (how ``MergedChunk.update_info`` carries ``ipc_handles_pickled``).

        Raises:
            EngineError: non-2xx status (with vLLM's message; not a 404 of a route in
                ``ABSENT_IS_NONE``, which returns None), a timeout after ``timeout_s``, or no
                connection (status 0; a probe only after one retry).
        """
        method, path = ROUTES[route]
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"} if data is not None else None
        tries = 2 if route in PROBES else 1
        for attempt in range(1, tries + 1):
            try:
                return await self._request(route, method, path, data, headers)
            except _ConnectionLost as e:
                if attempt == tries:
                    raise EngineError(route, 0, f"{CANNOT_REACH}{self.url}: {e.cause}") from None
        raise AssertionError("unreachable")

    async def _request(self, route: str, method: str, path: str, data: bytes | None,
                       headers: dict[str, str] | None) -> Any:
        session = self._session
        self._users[session] = self._users.get(session, 0) + 1
        t0 = time.perf_counter()
        ok = False
        try:
            async with session.request(
                method, self._base + path, data=data, headers=headers
            ) as resp:
                if resp.status >= 500:
                    # uvicorn closes the connection after vLLM's 500 (see the module doc)
                    self._retire(session)
                text = await resp.text()
                try:
                    parsed = msgspec.json.decode(text) if text else None
                except msgspec.DecodeError:
                    parsed = None
                if resp.status == 404 and route in ABSENT_IS_NONE:
                    parsed = None
                elif resp.status >= 400:
                    raise EngineError(route, resp.status, error_message(parsed, text))
                if parsed is None and route in JSON_ONLY:
                    raise EngineError(route, resp.status, f"not JSON: {text[:200]!r}")
                ok = True
                return parsed
        except TimeoutError:
            self._retire(session)
            raise EngineError(route, 0, f"no answer within {self.timeout_s:g} s") from None
        except aiohttp.ClientConnectionError as e:
            self._retire(session)
            self.connection_errors += 1
            raise _ConnectionLost(e) from None
        except aiohttp.ClientError as e:
            self._retire(session)
            raise EngineError(route, 0, f"{CANNOT_REACH}{self.url}: {e}") from None
        finally:
            if self._observe is not None:
                self._observe(route, time.perf_counter() - t0, ok)
            self._users[session] -= 1
            if session in self._retired and not self._users[session]:
                del self._users[session]
                self._retired.discard(session)
                await session.close()


class _ConnectionLost(Exception):
    """A refused or reset connection (``aiohttp.ClientConnectionError``)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause

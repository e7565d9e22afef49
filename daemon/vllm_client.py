"""HTTP client for one vLLM engine's weight-transfer routes (vllm-contract.md, vLLM 0.27–0.33).

One ``aiohttp.ClientSession`` per engine keeps its connection alive across calls. The engine
URL is ``http://host:port`` or, for ``vllm serve --uds PATH``, ``unix:///PATH``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

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
    "resume": ("POST", "/resume"),
    "is_paused": ("GET", "/is_paused"),
    "weight_info": ("GET", "/weight_info"),
    "weight_checker": ("POST", "/weight_checker"),
}


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
        timeout_s: bound on each request, seconds (design.md I5).
        observe: called with ``(route, seconds, ok)`` after each call (metrics).
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
        if url.startswith("unix://"):
            self._connector: aiohttp.BaseConnector = aiohttp.UnixConnector(path=url[7:])
            self._base = "http://localhost"
        else:
            self._connector = aiohttp.TCPConnector(limit=4)
            self._base = url.rstrip("/")
        self._session = aiohttp.ClientSession(
            connector=self._connector, timeout=aiohttp.ClientTimeout(total=timeout_s)
        )

    async def close(self) -> None:
        await self._session.close()

    async def call(self, route: str, body: Any = None) -> Any:
        """Call ``route`` (a key of ``ROUTES``) with JSON ``body``; return the parsed reply.

        ``body`` is encoded by ``msgspec.json``: ``bytes`` values become standard base64
        strings (how ``MergedChunk.update_info`` carries ``ipc_handles_pickled``).

        Raises:
            EngineError: non-2xx status (with vLLM's message), a timeout after ``timeout_s``,
                or no connection.
        """
        method, path = ROUTES[route]
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"} if data is not None else None
        t0 = time.perf_counter()
        ok = False
        try:
            async with self._session.request(
                method, self._base + path, data=data, headers=headers
            ) as resp:
                text = await resp.text()
                try:
                    parsed = msgspec.json.decode(text) if text else None
                except msgspec.DecodeError:
                    parsed = None
                if resp.status >= 400:
                    raise EngineError(route, resp.status, error_message(parsed, text))
                ok = True
                return parsed
        except TimeoutError:
            raise EngineError(route, 0, f"no answer within {self.timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise EngineError(route, 0, f"cannot reach {self.url}: {e}") from None
        finally:
            if self._observe is not None:
                self._observe(route, time.perf_counter() - t0, ok)

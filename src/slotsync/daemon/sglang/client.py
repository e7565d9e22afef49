"""HTTP client for one SGLang server: sends what ``routes.plan`` says, one request
after the other, and answers in the shape the coordinator reads (issue 26).

It is ``VllmClient``'s base (``engine_http.EngineHttp``) with another route table: the same
aiohttp session per engine, retired after a 5xx, a timeout or a lost connection, and the same
``connection_errors`` count (a possible restart, design.md I9). SGLang's failures:
``{"success": false, "message": ...}`` (its routes' own refusals), ``{"object": "error",
"message": ...}`` (body validation), plain text (``/flush_cache``, a 500) --
``engine_http.error_message`` reads all three. A reset connection during a weight call is
SGLang's scheduler dying (any exception in it kills the
server, docs/sglang-contract.md 2.7): it is never retried.
"""

from __future__ import annotations

from typing import Any

import msgspec

from slotsync.daemon.core.engine_session import CANNOT_REACH
from slotsync.daemon.engine_http import EngineError, EngineHttp, _ConnectionLost
from slotsync.daemon.sglang.routes import (
    Dialect,
    answer,
    key_for,
    key_hint,
    key_wanted,
    plan,
)


class SglangClient(EngineHttp):
    """Calls one SGLang server's routes (``url``, ``timeout_s``, ``observe``: as
    ``VllmClient``; the metrics label of each request is the daemon's step)."""

    json_only = frozenset({"version", "models"})  # (/server_info's arguments; /v1/models)
    absent_is_none = frozenset({"server_info"})  # (as VllmClient's; no request here)

    def key_for(self, path: str) -> tuple[str, str]:
        """The admin key or the API key, per SGLang's rule for ``path`` (``routes.key_for``;
        issue 35)."""
        return key_for(path, self.keys.api_key, self.keys.admin_api_key)

    def key_wanted(self, path: str) -> str:
        return key_wanted(path)

    def key_hint(self, path: str, option: str) -> str:
        return key_hint(path, option)

    async def call(self, route: str, body: Any = None,
                   dialect: Dialect | None = None) -> Any:
        """Run the daemon's step ``route`` with its vLLM-shaped ``body`` as SGLang requests
        (``routes.plan`` for ``dialect``); returns the step's answer
        (``routes.answer``).

        Raises:
            EngineError: a request's non-2xx status with SGLang's message (except a tolerated
                one), a timeout after ``timeout_s``, or no connection (status 0; a ``GET``
                after one retry). The message names the SGLang route.
        """
        dialect = dialect or Dialect(None)
        replies: list[Any] = []
        for req in plan(route, body, dialect):
            data = None if req.body is None else msgspec.json.encode(req.body)
            headers = {"Content-Type": "application/json"} if data is not None else None
            name = req.path.split("?")[0].lstrip("/")
            tries = 2 if req.method == "GET" else 1
            for attempt in range(1, tries + 1):
                try:
                    replies.append(await self._request(route, req.method, req.path, data,
                                                       headers))
                    break
                except _ConnectionLost as e:
                    if attempt == tries:
                        raise EngineError(route, 0, f"{CANNOT_REACH}{self.url}: {name}: "
                                                    f"{e.cause}") from None
                except EngineError as e:
                    if req.tolerated and req.tolerated in e.message:
                        replies.append(None)
                        break
                    raise EngineError(route, e.status, f"SGLang {name}: {e.message}") from None
        return answer(route, replies)

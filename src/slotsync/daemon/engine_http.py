"""The HTTP client that both engine families' clients are (``daemon/vllm/client.py``,
``daemon/sglang/client.py``): one ``aiohttp.ClientSession`` per engine, retired after a 5xx, a
timeout or a lost connection, and the count of refused or reset connections (a possible
engine restart, design.md I9). Below both families (neither imports the other); I/O.

API keys (issue 35): an engine started with ``--api-key`` (vLLM, SGLang) or
``--admin-api-key`` (SGLang) wants ``Authorization: Bearer <key>``; the engine table names a
file holding each (``service/engine_keys.py`` reads them), and each family's client says
which key a request carries (``EngineHttp.key_for``). A 401 or 403 is an ``EngineError``
saying so (``key_refusal``): no key was sent, or the one sent is not the server's.

Connections after a failure: vLLM answers a failed weight call (any worker error) with a 500
raised through Starlette's ``ServerErrorMiddleware``, and uvicorn then closes the TCP
connection, a moment after the response; a restarted engine leaves every pooled connection
dead. A request on such a connection fails with "Connection reset by peer". So after a 5xx, a
timeout or a connection error the client retires its session: later calls go out on fresh
connections, while calls still running on the old session finish there (closing it would
abort them, and the engine would still run them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from slotsync.daemon.core.engine_session import CANNOT_REACH


@dataclass(frozen=True)
class EngineKeys:
    """The API keys the daemon sends one engine (issue 35), read from the files its
    ``[[engines]]`` entry names (``api_key_file``, ``admin_api_key_file``; '' where none).
    Never printed: ``repr`` names the files only."""

    api_key: str = field(default="", repr=False)
    admin_api_key: str = field(default="", repr=False)
    api_key_file: str = ""
    admin_api_key_file: str = ""


NO_KEYS = EngineKeys()
"""An engine without keys."""


def key_refusal(url: str, status: int, path: str, option: str, file: str,
                wanted: str = "api_key_file", hint: str = "") -> str:
    """The words for a request to ``path`` of engine ``url`` refused with HTTP ``status``
    (401: no key or a wrong one; 403: forbidden, SGLang's answer for a route that needs an
    admin key the server was not started with): ``option`` the engine table's key the
    request carried (``api_key_file`` / ``admin_api_key_file``, '' for none), ``file`` its
    file; ``wanted``: what to set when none was sent; ``hint``: what else may be wrong when
    a key was sent (the family's). Never the key itself."""
    what = "Unauthorized" if status == 401 else "Forbidden"
    head = f"engine {url} refused the daemon's API key (HTTP {status} {what} for {path})"
    if not option:
        return (f"{head}: the daemon sent none; the server wants one: set {wanted} in its "
                "[[engines]] entry (a file holding the key, readable by the daemon's user "
                "only)")
    flag = "--admin-api-key" if option == "admin_api_key_file" else "--api-key"
    if status == 403:
        return (f"{head}: the server forbids {path} with the key of {option} ({file}); "
                f"was it started with {flag}?")
    more = f"; {hint}" if hint else ""
    return (f"{head}: wrong key: the key in {option} ({file}) of its [[engines]] entry is "
            f"not the server's {flag}{more}")


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
    ``{"error": "<str>"}`` (pause/resume), ``{"detail": [...]}`` (FastAPI 400); SGLang's
    ``{"message": ...}`` and its LoRA routes' ``{"success": false, "error_message": ...}``
    (``LoRAUpdateOutput``, io_struct.py).
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
        if isinstance(body.get("error_message"), str):
            return body["error_message"]
    return text[:2000]


class EngineHttp:
    """Sends one engine's HTTP requests (each family's client adds its ``call``).

    Args:
        url: ``http://host:port`` or ``unix:///path/to.sock``.
        timeout_s: bound on each request, seconds (design.md I5); a retried probe may take
            twice that.
        observe: called with ``(route, seconds, ok)`` after each HTTP request (metrics).
        keys: the engine's API keys (``EngineKeys``; none by default); the executor
            replaces them when the engine table is read again (SIGHUP).

    Attributes:
        connection_errors: refused or reset connections seen so far (a retried probe counts
            too): a change since the last round means the engine may have restarted.
    """

    json_only: frozenset[str] = frozenset()
    """Steps whose 2xx answer must be JSON: any other body is an ``EngineError`` naming it."""
    absent_is_none: frozenset[str] = frozenset()
    """Steps an engine may not have: a 404 answers None, not an ``EngineError``."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 300.0,
        observe: Callable[[str, float, bool], None] | None = None,
        keys: EngineKeys | None = None,
    ) -> None:
        self.url = url
        self.keys = keys or NO_KEYS
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

    def key_for(self, path: str) -> tuple[str, str]:
        """``(key, option)``: the API key a request to ``path`` carries and the engine
        table's option it came from (``('', '')``: none). Here the API key on every request;
        a family's client whose server wants another key on some routes says so (SGLang's:
        ``daemon/sglang/routes.py`` ``key_for``)."""
        return (self.keys.api_key, "api_key_file") if self.keys.api_key else ("", "")

    def key_wanted(self, path: str) -> str:
        """What to set when a request to ``path`` that carried no key was refused."""
        return "api_key_file (the server's --api-key)"

    def key_hint(self, path: str, option: str) -> str:
        """What else may be wrong when a request to ``path`` that carried the key of
        ``option`` was refused ('' for nothing)."""
        return ""

    def _retire(self, session: aiohttp.ClientSession) -> None:
        """Send later calls on fresh connections; ``session`` closes when its last call ends."""
        if session is self._session:
            self._retired.add(session)
            self._session = self._new_session()

    async def close(self) -> None:
        for s in (*self._retired, self._session):
            await s.close()
        self._retired.clear()

    async def _request(self, route: str, method: str, path: str, data: bytes | None,
                       headers: dict[str, str] | None) -> Any:
        session = self._session
        self._users[session] = self._users.get(session, 0) + 1
        t0 = time.perf_counter()
        ok = False
        key, option = self.key_for(path.split("?", 1)[0])
        if key:
            headers = {**(headers or {}), "Authorization": f"Bearer {key}"}
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
                if resp.status in (401, 403):  # (the engine's auth: named as such)
                    file = getattr(self.keys, option, "") if option else ""
                    bare = path.split("?", 1)[0]
                    raise EngineError(route, resp.status, key_refusal(
                        self.url, resp.status, bare, option, file, self.key_wanted(bare),
                        self.key_hint(bare, option)))
                if resp.status == 404 and route in self.absent_is_none:
                    parsed = None
                elif resp.status >= 400:
                    raise EngineError(route, resp.status, error_message(parsed, text))
                if parsed is None and route in self.json_only:
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

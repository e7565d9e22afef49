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

from typing import Any

import msgspec

from slotsync.daemon.core.engine_session import CANNOT_REACH
from slotsync.daemon.engine_http import EngineError, EngineHttp, _ConnectionLost, error_message

__all__ = ["ABSENT_IS_NONE", "JSON_ONLY", "PROBES", "ROUTES", "EngineError", "VllmClient",
           "error_message"]

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
    # issue 36: LoRA adapters (vLLM 0.32 serve/lora/api_router.py, registered only with
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: a 404 otherwise, adapters.load_error_text), and the
    # models the server lists (openai/models/api_router.py: base models, then one card per
    # loaded adapter, adapters.served_adapters). The load and unload answer 200 with a text
    # body ("Success: ..."); their errors are vLLM's {"error": {...}} (400, 404, 500).
    "load_lora_adapter": ("POST", "/v1/load_lora_adapter"),
    "unload_lora_adapter": ("POST", "/v1/unload_lora_adapter"),
    "models": ("GET", "/v1/models"),
}

# Routes whose 2xx answer must be JSON: any other body is an EngineError naming it.
JSON_ONLY = frozenset({"version"})

# Routes an engine may not have: a 404 answers None ("no information", daemon/vllm/dp_layout.py),
# not an
# EngineError (the reference engine, a server without the route).
ABSENT_IS_NONE = frozenset({"server_info"})

# Routes that only read the engine's state: a connection error on one is retried once.
PROBES = frozenset(r for r, (method, _) in ROUTES.items() if method == "GET")


class VllmClient(EngineHttp):
    """Calls one vLLM engine's routes (``url``, ``timeout_s``, ``observe``, ``connection_errors``:
    ``engine_http.EngineHttp``)."""

    json_only = JSON_ONLY
    absent_is_none = ABSENT_IS_NONE

    def key_for(self, path: str) -> tuple[str, str]:
        """The engine's API key (``api_key_file``) on every request, if the table gives one
        (issue 35). vLLM has no admin key, and vLLM 0.32's ``--api-key`` guards only
        ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` (``serve/middleware/
        authenticate.py`` ``GUARDED_PREFIX``): its weight-transfer routes take the key
        without needing it; a proxy in front of them may want it."""
        return (self.keys.api_key, "api_key_file") if self.keys.api_key else ("", "")

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

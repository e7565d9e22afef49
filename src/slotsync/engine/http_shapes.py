"""vLLM's HTTP shapes for the reference engine's aiohttp front (``slotsync.engine.server``):
error bodies, 400 validation texts, request-body reading.

Rules, from vLLM 0.32 ``vllm/entrypoints/serve/exception_handling/`` (its handlers) and the
pydantic errors FastAPI raises for vLLM's ``Body(embed=True)`` / ``Query`` parameters:

* an error is ``{"error": {"message", "type", "param", "code"}}``; a 500's type is
  ``InternalServerError``, another status's its HTTP phrase;
* after a 500 raised through Starlette's ``ServerErrorMiddleware`` uvicorn closes the
  connection (the response carries :data:`CLOSE_AFTER`; the server's middleware closes it);
* a 400 is ``{"error": {"message": ..., "type": "Bad Request", "param": "body.<key>" |
  "query.<key>" | null, "code": 400}}``, its connection kept; a pydantic error's message is
  ``1 validation error:\\n  <the error dict>``.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import msgspec
from aiohttp import web

CLOSE_AFTER = "slotsync.close_after"  # response key: close the connection once it is sent
PAUSE_MODES = ("abort", "wait", "keep")
"""vLLM 0.32 ``PauseMode``."""


def err500(message: str, status: int = 500, close: bool = True) -> web.Response:
    """vLLM's error body; ``close``: close the connection after it, as uvicorn does after an
    error raised through ``ServerErrorMiddleware`` (vLLM's handlers render any status but
    only an unhandled ``Exception``'s 500 is re-raised there)."""
    resp = web.json_response(
        {
            "error": {
                "message": message,
                "type": "InternalServerError" if status == 500 else _phrase(status),
                "param": None,
                "code": status,
            }
        },
        status=status,
    )
    if close and status == 500:
        resp[CLOSE_AFTER] = True  # see EngineApp._log_middleware
    return resp


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def bad_request(message: str, param: str | None = None) -> web.Response:
    """A 400 as vLLM's validation / HTTP-exception handlers render it (connection kept)."""
    return web.json_response(
        {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}},
        status=400,
    )


def missing(key: str) -> web.Response:
    """vLLM 0.32's 400 for a missing ``Body(embed=True)`` key (pydantic's error, as vLLM's
    ``validation_exception_handler`` formats it)."""
    err = {"type": "missing", "loc": f"body.{key}", "msg": "Field required", "input": "None"}
    return bad_request(f"1 validation error:\n  {err}", f"body.{key}")


def query_error(kind: str, name: str, msg: str, given: str,
                ctx: dict[str, Any] | None = None) -> web.Response:
    """vLLM 0.32's 400 for query parameter ``name`` that pydantic refused: error ``kind``
    (e.g. ``int_parsing``), pydantic's ``msg``, the ``given`` text and its ``ctx``."""
    err: dict[str, Any] = {"type": kind, "loc": f"query.{name}", "msg": msg, "input": given}
    if ctx is not None:
        err["ctx"] = ctx
    return bad_request(f"1 validation error:\n  {err}", err["loc"])


def pause_mode(request: web.Request) -> str | web.Response:
    """The ``mode`` query parameter (default ``abort``), or vLLM's 400 for another."""
    mode = request.query.get("mode", "abort")
    if mode in PAUSE_MODES:
        return mode
    return query_error("literal_error", "mode", "Input should be 'abort', 'wait' or 'keep'",
                       mode, {"expected": "'abort', 'wait' or 'keep'"})


def sleep_level(request: web.Request) -> int | web.Response:
    """``/sleep``'s ``level`` query parameter (default 1; vLLM 0.32 ``Query(ge=0, le=2)``),
    or vLLM's 400."""
    text = request.query.get("level", "1")
    try:
        level = int(text)
    except ValueError:
        return query_error("int_parsing", "level", "Input should be a valid integer, unable "
                           "to parse string as an integer", text)
    if level < 0:
        return query_error("greater_than_equal", "level",
                           "Input should be greater than or equal to 0", text, {"ge": 0})
    if level > 2:
        return query_error("less_than_equal", "level",
                           "Input should be less than or equal to 2", text, {"le": 2})
    return level


def detail(status: int, text: Any) -> web.Response:
    """The test-only routes' error shape ``{"detail": text}``."""
    return web.json_response({"detail": text}, status=status)


class UpdateBody(msgspec.Struct):
    """``/update_weights`` body: ``update_info`` kept as JSON text (other keys ignored)."""

    update_info: msgspec.Raw = msgspec.Raw(b"null")


UPDATE_BODY = msgspec.json.Decoder(UpdateBody)


async def read_json(request: web.Request) -> dict[str, Any] | web.Response:
    """The body as a dict (``{}`` when empty), or a 400 response like vLLM's."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return bad_request("Invalid JSON format", "body")
    if not isinstance(body, dict):
        return bad_request("Request body must be a JSON object", "body")
    return body


async def read_required(request: web.Request,
                        key: str) -> tuple[dict[str, Any], Any] | web.Response:
    """The body and its ``key`` (a vLLM ``Body(embed=True)`` parameter), or vLLM's 400 (the
    body is not a JSON object, or ``key`` is missing or null)."""
    body = await read_json(request)
    if isinstance(body, web.Response):
        return body
    value = body.get(key)
    if value is None:
        return missing(key)
    return body, value

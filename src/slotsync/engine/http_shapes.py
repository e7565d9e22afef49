"""vLLM's HTTP shapes for the reference engine's aiohttp front
(``slotsync.engine.reference.server``):
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


_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def include_dp(request: web.Request) -> bool | web.Response:
    """``/get_world_size``'s ``include_dp`` query parameter (default true; vLLM 0.32
    ``Query(True)`` of type ``bool``: pydantic's lax string-to-bool rules, case-insensitive),
    or vLLM's 400."""
    text = request.query.get("include_dp", "true")
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    return query_error("bool_parsing", "include_dp",
                       "Input should be a valid boolean, unable to interpret input", text)


def _error_input(value: Any) -> Any:
    """A pydantic error's ``input`` as vLLM 0.32 shows it (``handlers/validation.py``
    ``_summarize_error_input``): a string as is (cut at 200 characters), a container as
    ``<list of N items>``, anything else its ``str()``."""
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text if len(text) <= 200 else text[:200] + "...[truncated]"


def validation_errors(errors: list[dict[str, Any]]) -> web.Response:
    """vLLM 0.32's 400 for pydantic ``errors`` (``validation_exception_handler``): ``N
    validation errors:`` then each error dict on its own line (at most 10, then ``...and K
    more errors``; each cut at 1000 characters), ``param`` the first error's ``loc``."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    lines = []
    for err in errors[:10]:
        text = str({**err, "input": _error_input(err["input"])})
        lines.append(text if len(text) <= 1000 else text[:1000] + "...[truncated]")
    message = f"{count} validation {label}:\n" + "".join(f"  {t}\n" for t in lines)
    if count > 10:
        message += f"  ...and {count - 10} more {label}\n"
    return bad_request(message.rstrip(), errors[0]["loc"])


def update_info_shape(value: Any) -> web.Response | None:
    """None when ``update_info`` has the type vLLM 0.32's ``/update_weights`` declares
    (``WeightTransferUpdatePayload = dict[str, Any] | list[dict[str, Any]]``, ``distributed/
    weight_transfer/base.py``), else the 400 FastAPI's validation gives before any worker
    sees the call: for a list with entries that are not objects, the dict branch's error
    then one per such entry (``body.update_info.<j>``); for another value, the dict and
    the list branch's errors."""
    loc = "body.update_info"
    if isinstance(value, dict):
        return None
    dict_type = {"type": "dict_type", "loc": loc, "msg": "Input should be a valid dictionary",
                 "input": value}
    if isinstance(value, list):
        bad = [{"type": "dict_type", "loc": f"{loc}.{j}",
                "msg": "Input should be a valid dictionary", "input": e}
               for j, e in enumerate(value) if not isinstance(e, dict)]
        return validation_errors([dict_type, *bad]) if bad else None
    return validation_errors([dict_type, {"type": "list_type", "loc": loc,
                                          "msg": "Input should be a valid list",
                                          "input": value}])


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

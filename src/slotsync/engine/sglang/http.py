"""SGLang's HTTP shapes for the SGLang engines' aiohttp front: the request structs, their
validation, the error bodies and the auth rule.

Request structs: ``srt/managers/io_struct.py`` does not import on CPU (its imports pull
transformers' image utils, which need a real torchvision), so :func:`request_structs` mirrors
the ones the weight-sync routes take, field by field, per version (cited on each class).
They are validated as SGLang validates them: every struct inherits ``BaseReq``, whose
``__get_pydantic_core_schema__`` is ``msgspec_struct_pydantic_core_schema``
(``srt/utils/msgspec_utils.py`` L70-118, identical in 0.5.20 / 0.5.21 / 0.5.23): unknown
fields ignored, missing required fields and ``Literal`` violations refused, pydantic's lax
coercions (``"yes"`` is ``True``); ``serialized_named_tensors`` is
``Annotated[List[bytes], Base64Bytes()]`` (``Base64Bytes._decode_value``: ``b64decode(value,
validate=True)``, else "Expected base64-encoded bytes"). The ``--impl sglang`` engine passes
SGLang's own two helpers (:class:`SchemaHelpers` from ``sglang.srt.utils.msgspec_utils``);
``--impl sglang-reference`` passes :func:`mirror_helpers`, this module's copy of them.
Validation runs through pydantic's ``TypeAdapter`` in python mode on the decoded JSON, as
FastAPI does for ``obj: Annotated[X, Body()]``.

Errors (``srt/entrypoints/http_server.py``, the same in all three versions):

* a validation error is a 400 ``{"object": "error", "message": "<str(exc)> <exc.errors()>",
  "type": "Bad Request", "param": null, "code": 400}`` (``validation_exception_handler``
  L635-690 (0.5.23) / L614 / L598, ``ErrorResponse`` of ``entrypoints/openai/protocol.py``
  L106-111); ``str(exc)`` is FastAPI's ``N validation error(s):\\n  {err}...`` followed by the
  endpoint (FastAPI 0.136 names the file and line of SGLang's route, here
  ``sglang/srt/entrypoints/http_server.py`` and the version's decorator line). No body at
  all is ``missing`` at ``('body',)``; a body that is not JSON ``json_invalid``; a body
  without a JSON content type is validated as the raw bytes (FastAPI reads JSON only then);
* an unknown route is ``404 {"detail": "Not Found"}``, a wrong method ``405 {"detail":
  "Method Not Allowed"}`` (Starlette's router; SGLang's ``HTTPException`` handler is
  ``fastapi.HTTPException``'s and does not see them);
* an exception escaping a route (the DP assertion) is Starlette's plain-text 500 ``Internal
  Server Error``, after which uvicorn closes the connection.

Auth (``srt/utils/auth.py`` ``decide_request_auth``, L74-150 (0.5.23)): the weight routes
are ``ADMIN_OPTIONAL`` (open without keys; else ``Authorization: Bearer <admin key, else api
key>``), the rest ``NORMAL`` (the api key when set), ``/health*`` always open; refused with
``401 {"error": "Unauthorized"}`` or ``403 {"error": "Forbidden"}``.
"""

import base64
import binascii
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web

from slotsync.engine.http_shapes import CLOSE_AFTER
from slotsync.engine.sglang.state import ADMIN_OPTIONAL_ROUTES, SglangVersion

ADMIN_OPTIONAL = "admin_optional"
NORMAL = "normal"


def auth_level(path: str) -> str:
    """The auth level of route ``path``: ``ADMIN_OPTIONAL`` for the routes of
    ``state.ADMIN_OPTIONAL_ROUTES``, else ``NORMAL``."""
    return ADMIN_OPTIONAL if path in ADMIN_OPTIONAL_ROUTES else NORMAL


SGLANG_ROUTE_FILE = "sglang/srt/entrypoints/http_server.py"


@dataclass(frozen=True)
class SchemaHelpers:
    """The two validation helpers of ``srt/utils/msgspec_utils.py`` and the auth decision of
    ``srt/utils/auth.py``: SGLang's own (:func:`sglang_helpers`) or this module's mirror
    (:func:`mirror_helpers`)."""

    schema: Callable[..., Any]
    """``msgspec_struct_pydantic_core_schema(cls, handler)``."""
    base64_bytes: type
    """``Base64Bytes``."""
    decide_auth: Callable[..., Any]
    """``decide_request_auth(*, method, path, authorization_header, api_key, admin_api_key,
    auth_level)`` -> an object with ``allowed`` and ``error_status_code``."""
    origin: str
    """``"sglang"`` or ``"mirror"`` (``/_slotsync/stats``)."""


def sglang_helpers() -> SchemaHelpers:
    """SGLang's own helpers (imports SGLang).

    Raises:
        ImportError: SGLang is not importable.
    """
    from sglang.srt.utils.auth import AuthLevel, decide_request_auth
    from sglang.srt.utils.msgspec_utils import Base64Bytes, msgspec_struct_pydantic_core_schema

    levels = {ADMIN_OPTIONAL: AuthLevel.ADMIN_OPTIONAL, NORMAL: AuthLevel.NORMAL}

    def decide(*, auth_level: str, **kw: Any) -> Any:
        return decide_request_auth(auth_level=levels[auth_level], **kw)

    return SchemaHelpers(msgspec_struct_pydantic_core_schema, Base64Bytes, decide, "sglang")


# -- the mirror (Apache-2.0 SGLang code, copied with its behaviour; cites above) -----------


class MirrorBase64Bytes:
    """Mirror of ``Base64Bytes`` (msgspec_utils.py L12-35)."""

    def __get_pydantic_core_schema__(self, source_type: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.no_info_before_validator_function(self._decode_value,
                                                             handler(source_type))

    @classmethod
    def _decode_value(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except binascii.Error as exc:
                raise ValueError("Expected base64-encoded bytes") from exc
        if isinstance(value, list):
            return [cls._decode_value(item) for item in value]
        if isinstance(value, tuple):
            return tuple(cls._decode_value(item) for item in value)
        return value


def mirror_struct_schema(cls: type[msgspec.Struct], handler: Any) -> Any:
    """Mirror of ``msgspec_struct_pydantic_core_schema`` (msgspec_utils.py L70-118)."""
    from pydantic_core import core_schema

    fields = {}
    for struct_field in msgspec.structs.fields(cls):
        field_schema = handler.generate_schema(struct_field.type)
        required = (struct_field.default is msgspec.NODEFAULT
                    and struct_field.default_factory is msgspec.NODEFAULT)
        if struct_field.default is not msgspec.NODEFAULT:
            field_schema = core_schema.with_default_schema(field_schema,
                                                           default=struct_field.default)
        elif struct_field.default_factory is not msgspec.NODEFAULT:
            field_schema = core_schema.with_default_schema(
                field_schema, default_factory=struct_field.default_factory)
        fields[struct_field.name] = core_schema.typed_dict_field(field_schema,
                                                                 required=required)
    typed_dict_schema = core_schema.typed_dict_schema(
        fields, cls_name=cls.__name__, extra_behavior="ignore", ref=cls.__name__)

    def build_struct(value: Any) -> Any:
        return value if isinstance(value, cls) else cls(**value)

    dict_to_struct_schema = core_schema.no_info_after_validator_function(build_struct,
                                                                         typed_dict_schema)
    return core_schema.json_or_python_schema(
        json_schema=dict_to_struct_schema,
        python_schema=core_schema.union_schema(
            [core_schema.is_instance_schema(cls), dict_to_struct_schema],
            mode="left_to_right"),
    )


@dataclass(frozen=True)
class _Decision:
    allowed: bool
    error_status_code: int = 401


def mirror_decide_auth(*, method: str, path: str, authorization_header: str | None,
                       api_key: str | None, admin_api_key: str | None,
                       auth_level: str) -> _Decision:
    """Mirror of ``decide_request_auth`` (auth.py L74-150) for ``NORMAL`` and
    ``ADMIN_OPTIONAL``."""
    import secrets

    if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return _Decision(True)

    def bearer(expected: str) -> bool:
        if not authorization_header:
            return False
        parts = authorization_header.split(" ", 1)
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return False
        return secrets.compare_digest(parts[1], expected)

    if auth_level == ADMIN_OPTIONAL:
        if admin_api_key:
            return _Decision(bearer(admin_api_key))
        if api_key:
            return _Decision(bearer(api_key))
        return _Decision(True)
    if api_key:
        return _Decision(bearer(api_key))
    return _Decision(True)


def mirror_helpers() -> SchemaHelpers:
    """This module's mirror of SGLang's helpers (needs pydantic, not SGLang)."""
    return SchemaHelpers(mirror_struct_schema, MirrorBase64Bytes, mirror_decide_auth, "mirror")


# -- the request structs -------------------------------------------------------------------


@dataclass(frozen=True)
class RequestStructs:
    """The request structs of one SGLang version, validated with one set of helpers. Each is
    a ``msgspec.Struct`` as in io_struct.py (``BaseReq``: ``tag=True, kw_only=True,
    array_like=True``, ``rid`` and ``http_worker_ipc``); ``None`` where the version has no
    such route."""

    pause: type
    cont: type
    begin: type | None
    end: type | None
    update: type
    version: type


def request_structs(version: SglangVersion, helpers: SchemaHelpers) -> RequestStructs:
    """The structs of ``version`` (cites per class: io_struct.py line 0.5.23 / 0.5.21 /
    0.5.20)."""
    schema = helpers.schema
    b64 = helpers.base64_bytes

    class BaseReq(msgspec.Struct, tag=True, kw_only=True, array_like=True):
        """io_struct.py L86 / L86 / L83."""

        rid: str | None = None
        http_worker_ipc: str | None = None

        @classmethod
        def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
            return schema(cls, handler)

    class PauseGenerationReqInput(BaseReq, kw_only=True):
        """L1927 / L1826 / L1743."""

        mode: Literal["abort", "retract", "in_place"] = "abort"

    class ContinueGenerationReqInput(BaseReq, kw_only=True):
        """L1949 / L1848 / L1765."""

        torch_empty_cache: bool = True

    class BeginWeightUpdateReqInput(BaseReq, kw_only=True):
        """L2197 / L2096 (0.5.21+)."""

        selector: Literal["target", "draft", "all"] = "all"

    class EndWeightUpdateReqInput(BaseReq, kw_only=True):
        """L2208 / L2107 (0.5.21+): no field."""

    if version.selector_field:
        class UpdateWeightsFromTensorReqInput(BaseReq, kw_only=True):
            """L2027 / L1926."""

            serialized_named_tensors: Annotated[list[bytes], b64()]
            load_format: str | None = None
            flush_cache: bool = True
            abort_all_requests: bool = False
            weight_version: str | None = None
            selector: Literal["target", "draft", "all"] = "all"
            torch_empty_cache: bool = False
    else:
        class UpdateWeightsFromTensorReqInput(BaseReq, kw_only=True):  # type: ignore[no-redef]
            """L1841 (0.5.20)."""

            serialized_named_tensors: Annotated[list[bytes], b64()]
            load_format: str | None = None
            flush_cache: bool = True
            abort_all_requests: bool = False
            weight_version: str | None = None
            disable_draft_model: bool | None = None
            torch_empty_cache: bool = False

    class UpdateWeightVersionReqInput(BaseReq, kw_only=True):
        """L2155 / L2054 / L1969."""

        new_version: str
        abort_all_requests: bool = True

    for cls in (BaseReq, PauseGenerationReqInput, ContinueGenerationReqInput,
                BeginWeightUpdateReqInput, EndWeightUpdateReqInput,
                UpdateWeightsFromTensorReqInput, UpdateWeightVersionReqInput):
        cls.__qualname__ = cls.__name__  # as io_struct's module-level classes (error texts)
    return RequestStructs(
        PauseGenerationReqInput, ContinueGenerationReqInput,
        BeginWeightUpdateReqInput if version.sessions else None,
        EndWeightUpdateReqInput if version.sessions else None,
        UpdateWeightsFromTensorReqInput, UpdateWeightVersionReqInput)


class BodyValidator:
    """Validates request bodies into one version's structs (see the module docstring)."""

    def __init__(self, version: SglangVersion, helpers: SchemaHelpers) -> None:
        from pydantic import TypeAdapter

        self.version = version
        self.helpers = helpers
        self.structs = request_structs(version, helpers)
        self._adapters: dict[type, Any] = {}
        for cls in (self.structs.pause, self.structs.cont, self.structs.begin,
                    self.structs.end, self.structs.update, self.structs.version):
            if cls is not None:
                self._adapters[cls] = TypeAdapter(cls)

    async def read(self, request: web.Request, cls: type, route: str
                   ) -> Any | web.Response:
        """The body of ``request`` as a ``cls``, or the 400 SGLang answers."""
        raw = await request.read()
        media = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        body: Any
        if not raw:
            body = None
        elif media == "application/json" or (media.startswith("application/")
                                             and media.endswith("+json")):
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                pos = getattr(e, "pos", 0)
                msg = getattr(e, "msg", str(e))
                return self.error(request, route, [{
                    "type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
                    "input": {}, "ctx": {"error": msg}}])
        else:
            body = raw
        if body is None:
            return self.error(request, route, [{"type": "missing", "loc": ("body",),
                                                "msg": "Field required", "input": None}])
        from pydantic import ValidationError

        try:
            return self._adapters[cls].validate_python(body)
        except ValidationError as e:
            return self.error(request, route, [
                {**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)])

    def error(self, request: web.Request, route: str, errors: list[dict[str, Any]]
              ) -> web.Response:
        """SGLang's 400 for a ``RequestValidationError`` with ``errors`` (FastAPI's error
        dicts, ``loc`` starting with ``"body"``)."""
        n = len(errors)
        text = f"{n} validation error{'s' if n != 1 else ''}:\n"
        for err in errors:
            text += f"  {err}\n"
        line = self.version.route_lines.get(route.lstrip("/"))
        if line is not None:
            fn = route.lstrip("/")
            text += (f'\n  File "{SGLANG_ROUTE_FILE}", line {line}, in {fn}\n'
                     f"    {request.method} {route}")
        exc_str = text.rstrip()
        errors_str = str(errors)
        message = f"{exc_str} {errors_str}" if errors_str and errors_str != exc_str else exc_str
        return web.json_response({"object": "error", "message": message,
                                  "type": "Bad Request", "param": None, "code": 400},
                                 status=400)


def success_body(success: bool, message: str, status: int | None = None) -> web.Response:
    """``{"success", "message"}`` with 200 or 400 (the weight routes' answer; ``status``
    overrides, for injected faults)."""
    return web.json_response({"success": success, "message": message},
                             status=status or (200 if success else 400))


def internal_error() -> web.Response:
    """Starlette's plain-text 500 for an exception escaping a route; the connection is
    closed after it (uvicorn)."""
    resp = web.Response(status=500, text="Internal Server Error")
    resp[CLOSE_AFTER] = True
    return resp


def not_found() -> web.Response:
    """Starlette's 404 for a route that does not exist."""
    return web.json_response({"detail": "Not Found"}, status=404)


def method_not_allowed() -> web.Response:
    """Starlette's 405."""
    return web.json_response({"detail": "Method Not Allowed"}, status=405)


def unauthorized(status: int) -> web.Response:
    """``add_api_key_middleware``'s refusal (auth.py L186-200)."""
    return web.json_response({"error": "Unauthorized" if status == 401 else "Forbidden"},
                             status=status)

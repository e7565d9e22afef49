"""SGLang's own auth rule, for the key tests (issue 35 item 14): which level each route of the
installed SGLang has (read from its ``http_server.py``, which does not import on a CPU
machine), and a FastAPI app guarded by SGLang's own ``add_api_key_middleware``
(``srt/utils/auth.py``, which does) whose routes are the ones the daemon asks, each marked with
SGLang's own ``auth_level`` decorator at the level SGLang gives it."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest

ROUTES = {
    "/server_info": ("GET",), "/model_info": ("GET",), "/pause_generation": ("POST",),
    "/continue_generation": ("POST",), "/flush_cache": ("GET", "POST"),
    "/begin_weight_update": ("POST",), "/end_weight_update": ("POST",),
    "/update_weights_from_tensor": ("POST",), "/update_weight_version": ("POST",),
}
"""The routes the daemon's SGLang client asks (``daemon/sglang/routes.py``), their methods."""


def sglang_route_levels() -> dict[str, str]:
    """Path -> ``"admin_optional"`` / ``"admin_force"`` / ``"normal"`` of every route in the
    installed SGLang's ``srt/entrypoints/http_server.py``, from its decorators
    (``@app.get/post/api_route(path)`` with ``@auth_level(AuthLevel.X)``)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed")
    src = Path(spec.submodule_search_locations[0], "srt", "entrypoints", "http_server.py")
    levels: dict[str, str] = {}
    for node in ast.walk(ast.parse(src.read_text())):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        level, paths = "normal", []
        for d in node.decorator_list:
            if not isinstance(d, ast.Call) or not d.args:
                continue
            name = ast.unparse(d.func)
            if name == "auth_level":
                level = ast.unparse(d.args[0]).split(".")[-1].lower()
            elif name in ("app.get", "app.post", "app.api_route", "app.put", "app.delete"):
                if isinstance(d.args[0], ast.Constant):
                    paths.append(d.args[0].value)
        for p in paths:
            levels[p] = level
    return levels


def guarded_app(api_key: str | None, admin_api_key: str | None) -> Any:
    """A FastAPI app answering ``ROUTES`` as SGLang 0.5.23 does (shapes only), guarded as
    ``http_server.py`` L2886-2898 guards SGLang's: ``add_api_key_middleware`` with the
    server's keys, each route's endpoint marked ``@auth_level`` at SGLang's level."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse
    from sglang.srt.utils.auth import AuthLevel, add_api_key_middleware, auth_level

    levels = sglang_route_levels()
    app = FastAPI()

    def endpoint(path: str) -> Any:
        async def answer() -> Any:
            if path == "/server_info":
                return JSONResponse({"version": "0.5.23", "tp_size": 2, "dp_size": 1,
                                     "pp_size": 1, "tokenizer_worker_num": 1})
            if path == "/model_info":
                return JSONResponse({"weight_version": "default"})
            if path == "/flush_cache":
                return PlainTextResponse("Cache flushed.")
            return JSONResponse({"success": True, "status": "ok"})

        level = levels[path]
        if level != "normal":
            answer = auth_level(AuthLevel(level))(answer)
        return answer

    for path, methods in ROUTES.items():
        app.add_api_route(path, endpoint(path), methods=list(methods))
    add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
    return app

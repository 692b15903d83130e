"""The development routes of `dew serve`: the calls a weight push makes on a vLLM launched with
VLLM_SERVER_DEV_MODE=1, answered the way vLLM answers them.

POST /pause?mode=wait, POST /resume, GET /is_paused, POST /collective_rpc {"method":
"reload_weights"}, POST /reset_prefix_cache, POST /update_weight_version, GET /weight_info.
Whoever reaches them can stop the server (a paused server admits no request until /resume) and
make it serve whatever the launch directory holds, so `create_app` mounts them only when asked
(`--dev-endpoints`), and they are behind the API key when the server has one (`guard`). With
adapters served over the base (`adapters`), a pause pauses them all, and reload_weights is refused:
the adapters share the base's arrays, so unload them first (or restart).

Not here: the OpenAI routes (`app`), pausing and reloading themselves (`policy`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse

from dew_lib.serve.adapters import ServedModels
from dew_lib.serve.policy import ReloadError
from dew_lib.serve.protocol import ServeError


def dev_routes(models: ServedModels) -> APIRouter:
    """The routes a weight push calls (see the module docstring)."""
    router = APIRouter()
    policy = models.base

    @router.post("/pause")
    async def pause(mode: Literal["abort", "wait", "keep"] = "abort", wait_for_inflight_requests: bool = False,
                    clear_cache: bool = True) -> JSONResponse:
        if mode != "wait" and not wait_for_inflight_requests:
            raise ServeError(f"mode={mode}: dew serve pauses with mode=wait only (in-flight requests finish, "
                             "new ones wait for /resume); it cannot abort or freeze a draw", param="query.mode")
        await models.pause()
        return JSONResponse({"status": "paused"})

    @router.post("/resume")
    async def resume() -> JSONResponse:
        models.resume()
        return JSONResponse({"status": "resumed"})

    @router.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": policy.paused})

    @router.post("/collective_rpc")
    async def collective_rpc(raw: Request) -> JSONResponse:
        try:
            body = await raw.json()
        except (ValueError, RecursionError) as error:  # not JSON, not UTF-8, nested too deep
            raise ServeError(f"JSON decode error: {error}", param="body") from None
        method = body.get("method") if isinstance(body, dict) else None
        if method is None:
            raise ServeError("Missing 'method' in request body", param="method")
        if method != "reload_weights":
            raise ServeError(f"method={method!r}: dew serve answers reload_weights only (re-read the launch "
                             "directory)", param="method")
        if body.get("args") or body.get("kwargs"):
            raise ServeError("reload_weights takes no args or kwargs here: it re-reads the launch directory",
                             param="args" if body.get("args") else "kwargs")
        if models.adapters:
            raise ServeError(f"reload_weights re-reads the base, which the adapters {sorted(models.adapters)} share; "
                             "unload them first (POST /v1/unload_lora_adapter), or restart dew serve",
                             param="method")
        try:
            await policy.reload()
        except (ReloadError, OSError, ValueError) as error:
            raise ServeError(f"reload_weights failed: {error}", status=500, kind="InternalServerError") from None
        return JSONResponse({"results": [None]})  # one engine, whose reload returns nothing

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> JSONResponse:
        return JSONResponse({"success": True})  # the native server keeps no prefix cache

    @router.post("/update_weight_version")
    async def update_weight_version(new_version: Annotated[str, Body(embed=True)]) -> JSONResponse:
        policy.weight_version = new_version
        return JSONResponse({"success": True, "new_version": new_version})

    @router.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": policy.weight_version})

    return router


__all__ = ["dev_routes"]

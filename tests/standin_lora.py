"""Stand-ins for the runtime LoRA routes of vLLM and SGLang, for tests of adapter pushes.

Each factory returns an `APIRouter` over a `standin_weights.Replica` (its journal and injected
faults), answering with the real servers' statuses and bodies:

- vLLM (vllm/entrypoints/serve/lora/api_router.py, openai/serving_models.py), mounted only with
  `runtime_updating` (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): POST /v1/load_lora_adapter
  {lora_name, lora_path} answers 200 with the plain text "Success: LoRA adapter '<name>' added
  successfully.", 400 InvalidUserInput for a missing field or a name already loaded, 404
  NotFoundError when no adapter is at the path; POST /v1/unload_lora_adapter {lora_name}
  answers "Success: LoRA adapter '<name>' removed successfully." or 404 NotFoundError.
- SGLang (python/sglang/srt/entrypoints/http_server.py): POST /load_lora_adapter and
  /unload_lora_adapter answer `{"success", "error_message", "loaded_adapters"}`, 200 or 400.

A load reads the adapter's adapter_config.json, as both engines do before loading its tensors;
`replica.adapters` is what a replica serves now, {name: path}.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from standin_weights import Replica


class LoRAReplica(Replica):
    """A stand-in replica that also serves LoRA adapters: `adapters` is {name: path} loaded now."""

    def __init__(self, name, journal, **options):
        super().__init__(name, journal, **options)
        self.adapters: dict[str, str] = {}


def _vllm_error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def _readable(path: str) -> bool:
    try:
        return json.loads((Path(path) / "adapter_config.json").read_text()).get("peft_type") == "LORA"
    except (OSError, ValueError):
        return False


def vllm_lora_router(replica: LoRAReplica, *, runtime_updating: bool = True) -> APIRouter:
    router = APIRouter()
    if not runtime_updating:
        return router

    @router.post("/v1/load_lora_adapter")
    async def load(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return _vllm_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if name in replica.adapters:
            return _vllm_error(400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput")
        if not _readable(path):
            return _vllm_error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
        replica.adapters[name] = path
        return Response(f"Success: LoRA adapter '{name}' added successfully.", 200)

    @router.post("/v1/unload_lora_adapter")
    async def unload(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        name = body.get("lora_name")
        if not name:
            return _vllm_error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if replica.adapters.pop(name, None) is None:
            return _vllm_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", 200)

    return router


def sglang_lora_router(replica: LoRAReplica) -> APIRouter:
    router = APIRouter()

    def answer(error: str | None) -> JSONResponse:
        return JSONResponse({"success": error is None, "error_message": error,
                             "loaded_adapters": dict(replica.adapters)}, 200 if error is None else 400)

    @router.post("/load_lora_adapter")
    async def load(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        name, path = body.get("lora_name"), body.get("lora_path")
        if name in replica.adapters:
            return answer(f"Failed to load LoRA adapter {name}: already loaded")
        if not _readable(path):
            return answer(f"Failed to load LoRA adapter {name} from {path}")
        replica.adapters[name] = path
        return answer(None)

    @router.post("/unload_lora_adapter")
    async def unload(request: Request):
        body, fault = await replica.enter(request)
        if fault:
            return fault
        name = body.get("lora_name")
        if replica.adapters.pop(name, None) is None:
            return answer(f"LoRA adapter {name} is not loaded")
        return answer(None)

    return router


__all__ = ["LoRAReplica", "sglang_lora_router", "vllm_lora_router"]

"""vLLM's runtime LoRA routes on `dew serve`: POST /v1/load_lora_adapter and /v1/unload_lora_adapter.

vLLM serves them only under VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; `dew serve` mounts them with
its other development routes (`--dev-endpoints`, behind the API key when there is one). Requests
and answers are vLLM's (vllm/entrypoints/serve/lora/api_router.py and
vllm/entrypoints/openai/serving_models.py):

    POST /v1/load_lora_adapter {"lora_name", "lora_path"}
        200, the plain text "Success: LoRA adapter '<name>' added successfully."
        400 InvalidUserInput  a name or path missing, or the name already loaded
        404 NotFoundError     no adapter at lora_path ("... No adapter found for <path>")
        400 BadRequestError   any other reason the adapter did not load
    POST /v1/unload_lora_adapter {"lora_name"}
        200, the plain text "Success: LoRA adapter '<name>' removed successfully."
        400 InvalidUserInput  no name;  404 NotFoundError  no adapter of that name

Errors carry vLLM's JSON, `{"error": {"message", "type", "param", "code"}}`.

Not here: serving the adapters (`adapters`), the weight-push routes (`dev`).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from dew_lib.serve.adapters import ServedModels
from dew_lib.serve.protocol import ServeError


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # as vLLM's OpenAIBaseModel: unknown fields are ignored
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: str
    lora_int_id: int | None = None  # vLLM accepts it and unloads by name


def _invalid(message: str, status: int = 400, kind: str = "InvalidUserInput") -> ServeError:
    return ServeError(message, param=None, status=status, kind=kind)


def lora_routes(models: ServedModels) -> APIRouter:
    """The two runtime LoRA routes over `models` (see the module docstring)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        if name in models.adapters:
            raise _invalid(f"The lora adapter '{name}' has already been loaded.")
        if name == models.base.name:
            raise _invalid(f"lora_name '{name}' is the base model's name; give the adapter another name")
        try:
            await models.load(name, path)
        except FileNotFoundError as error:
            raise _invalid(f"Loading lora {name} failed: No adapter found for {path} ({error})", status=404,
                           kind="NotFoundError") from None
        except Exception as error:  # noqa: BLE001 - vLLM answers every failed load with a 400
            raise _invalid(f"Loading lora {name} failed: {error}", kind="BadRequestError") from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
        name = request.lora_name
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in models.adapters:
            raise _invalid(f"The lora adapter '{name}' cannot be found.", status=404, kind="NotFoundError")
        models.unload(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)

    return router


__all__ = ["LoadLoRAAdapterRequest", "UnloadLoRAAdapterRequest", "lora_routes"]

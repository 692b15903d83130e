"""Adapter-only weight pushes: a LoRA policy published to vLLM, SGLang or `dew serve` as PEFT files.

When the trained policy is a frozen base with LoRA adapters, the engines keep the base they were
launched on and need the adapters alone. `AdapterReload(pretrained, directory, engines)` is a push
(`push(variables, version)`, for `Publication`) that, for version v:

1. writes the adapter only (`save_adapter`, PEFT's adapter_config.json and adapter_model.safetensors,
   with `base_model_name_or_path` the launch directory) into `<directory>/adapters/<prefix>-v<v>`,
   a new directory and a new name per version;
2. loads it on every replica under the name `<prefix>-v<v>`;
3. unloads every older version but the one before v from every replica and removes its directory:
   draws labelled v - 1 that are still in flight finish on their own adapter.

`name(version)` is the name a draw labelled `version` asks for: `OpenAIRolloutServer(adapter=
push.name)` sends it as the request's `model` (vLLM, `dew serve`) or its `lora_path` (SGLang), so
every draw comes from the adapter of the version it is labelled with. `written` records the bytes
each push wrote, a few percent of a full checkpoint for a small rank.

    engine  load                                              unload
    vllm    POST /v1/load_lora_adapter {lora_name, lora_path}  POST /v1/unload_lora_adapter {lora_name}
            200 plain text; 4xx JSON error                     (404 when it is not loaded: already gone)
    sglang  POST /load_lora_adapter {lora_name, lora_path}     POST /unload_lora_adapter {lora_name}
            {"success": true, ...}; 400 {"success": false}

Launch vLLM with `--enable-lora --max-lora-rank R --max-loras 2` and
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; SGLang with `--enable-lora --max-lora-rank R
--lora-target-modules ...`; `dew serve` with `--dev-endpoints`. A replica on another host must see
`directory` at the same path.

Not here: full-weight pushes (`publish`, `nccl`), PEFT's files (`dew_lib.models.pretrained.peft`).
"""

from __future__ import annotations

import functools
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx

from dew_lib.inference.endpoints import EndpointFailed, call, on_every, root_urls
from dew_lib.inference.publish import ENGINES
from dew_lib.models.pretrained import Pretrained, save_adapter

KEPT = 2  # versions loaded after a push: the new one, and the one draws in flight may still use


def directory_bytes(path: Path) -> int:
    """The bytes of every file under `path`."""
    return sum(item.stat().st_size for item in Path(path).rglob("*") if item.is_file())


class AdapterReload:
    """Push a LoRA policy's adapters alone to every replica in `engines` (see the module docstring).

    pretrained: the adapted model's `Pretrained` (`pretrained.model.lora` set). directory: the
    checkpoint directory every replica was launched on (the base); adapters go under
    `directory/adapters`. engines: the replicas' root URLs. engine: "vllm" (also `dew serve`) or
    "sglang". prefix: the adapters' names before "-v<version>". timeout: seconds one call may take.
    """

    def __init__(self, pretrained: Pretrained, directory: str | Path, engines, *, engine: str = "vllm",
                 prefix: str = "dew-lora", timeout: float = 600.0):
        if not isinstance(pretrained, Pretrained) or getattr(pretrained.model, "lora", None) is None:
            raise ValueError("AdapterReload.pretrained must be the adapted model's Pretrained (its model has a "
                             "LoRA, as lora.attach or load_adapter made it); push a full model with "
                             "SafetensorsReload")
        if engine not in ENGINES:
            raise ValueError(f"AdapterReload.engine={engine!r} is not supported; use one of {ENGINES}")
        if not isinstance(prefix, str) or not prefix or "/" in prefix:
            raise ValueError(f"AdapterReload.prefix must be a nonempty name without '/', got {prefix!r}")
        if not timeout > 0:
            raise ValueError(f"AdapterReload.timeout must be positive seconds, got {timeout!r}")
        self.pretrained, self.engine, self.prefix, self.timeout = pretrained, engine, prefix, float(timeout)
        self.directory = Path(directory).absolute()
        self.engines = root_urls(engines, "engines")
        self.loaded: list[int] = []  # versions loaded on every replica, oldest first
        self.written: list[int] = []  # bytes each successful push wrote
        self._lock = threading.Lock()

    def name(self, version: int) -> str | None:
        """The adapter a draw labelled `version` asks for; None (the base) before the first push."""
        return f"{self.prefix}-v{int(version)}" if self.loaded else None

    def path(self, version: int) -> Path:
        return self.directory / "adapters" / f"{self.prefix}-v{int(version)}"

    def __call__(self, variables: Any, version: int) -> None:
        """Write version `version`'s adapter, load it on every replica, retire the older ones."""
        with self._lock:
            version = int(version)
            if version in self.loaded:  # the same version again (a resumed stage): replace it
                self._retire([version])
            path, name = self.path(version), f"{self.prefix}-v{version}"
            shutil.rmtree(path, ignore_errors=True)
            save_adapter(path, self.pretrained.model, variables, base_model_name_or_path=str(self.directory))
            try:
                on_every(self.engines, lambda root: self._load(root, name, path),
                         f"loading adapter {name} from {path}")
            except BaseException:
                self._forget(name)  # replicas that did load it drop it; the next push writes a new one
                shutil.rmtree(path, ignore_errors=True)
                raise
            self.loaded.append(version)
            self.written.append(directory_bytes(path))
            self._retire(self.loaded[:-KEPT])

    def _retire(self, versions: list[int]) -> None:
        for version in versions:
            name = f"{self.prefix}-v{version}"
            on_every(self.engines, functools.partial(self._unload, name=name), f"unloading adapter {name}")
            self.loaded.remove(version)
            shutil.rmtree(self.path(version), ignore_errors=True)

    def _forget(self, name: str) -> None:
        for root in self.engines:
            try:
                self._unload(root, name)
            except EndpointFailed:
                pass  # never loaded there

    def _load(self, root: str, name: str, path: Path) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        with httpx.Client(timeout=self.timeout) as client:
            if self.engine == "sglang":
                call(client, root, "POST", "/load_lora_adapter", body=body, must_succeed=True)
            else:
                _text_call(client, root, "/v1/load_lora_adapter", body)

    def _unload(self, root: str, name: str) -> None:
        body = {"lora_name": name}
        with httpx.Client(timeout=self.timeout) as client:
            if self.engine == "sglang":
                call(client, root, "POST", "/unload_lora_adapter", body=body, must_succeed=True)
            else:
                _text_call(client, root, "/v1/unload_lora_adapter", body, missing_ok=True)


def _text_call(client: httpx.Client, root: str, path: str, body: dict, *, missing_ok: bool = False) -> None:
    """POST to one of vLLM's LoRA routes, which answer success in plain text and failure in JSON."""
    endpoint = f"POST {path}"
    try:
        response = client.post(root + path, json=body)
    except httpx.TimeoutException as error:
        raise EndpointFailed(root, endpoint, f"gave no answer within the timeout ({type(error).__name__})") from error
    except httpx.HTTPError as error:
        raise EndpointFailed(root, endpoint, f"gave no answer ({type(error).__name__}: {error})") from error
    if response.status_code == 404 and missing_ok:
        return  # not loaded there: already gone
    if not response.is_success or not response.text.startswith("Success"):
        raise EndpointFailed(root, endpoint, f"answered {response.status_code}: {response.text[:400]}")


__all__ = ["KEPT", "AdapterReload", "directory_bytes"]

"""An asynchronous GRPO stage's rollouts drawn on a remote engine: vLLM, SGLang or `dew serve`.

`RemoteEngine` says where the engine is and where its weights live; `remote_server` turns it,
with the stage's `Pretrained` and starting variables, into the `RolloutServer` a
`ScheduledRollout` draws from: an `OpenAIRolloutServer` on the engine's completions route whose
weights are a `Publication` over `SafetensorsReload`. Whatever the engine was launched on, it
serves the stage's own weights before anything is drawn: the scheduler's first call pushes the
state it trains (version 0 on a fresh stage, the checkpoint's update on a resumed one).

A stage that trains LoRA adapters on a frozen base (`pretrained.model.lora` set) pushes the
adapters alone instead (`AdapterReload`): the engine keeps the base it was launched on, loads one
PEFT adapter per version, and every draw names the adapter of the version it is labelled with.
Launch the engine on the base with LoRA on (docs/remote_engines.md, "Adapter pushes").

Not here: the wire formats (dew_lib.inference.openai_engine), the pushes (dew_lib.inference.publish),
launching engines (docs/remote_engines.md, `dew serve`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import httpx

from dew_lib.inference import (
    AdapterReload,
    OpenAICompletion,
    OpenAIRolloutServer,
    Publication,
    RemoteOptions,
    SafetensorsReload,
)
from dew_lib.inference.endpoints import root_urls
from dew_lib.models.pretrained import Pretrained
from dew_lib.options import choice, number
from dew_lib.sampling import Sampling

PROVIDERS = ("vllm", "sglang")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RemoteEngine:
    """A remote engine for a GRPO stage's rollouts.

    url: the root URL of the engine that answers completions (not its /v1). directory: the
    checkpoint directory every replica was launched on; pushes rewrite it, so it must be the
    same path on the engines' hosts. provider: "vllm" (also `dew serve`) or "sglang". model: the
    served model name (None: the one model the engine lists). replicas: the root URLs of every
    replica to push to (empty: `url` alone). processed_logprobs: the vLLM engine reports
    processed log-probabilities (`--logprobs-mode processed_logprobs`). routing: read the
    experts each token of a mixture-of-experts model was routed to (the engine runs with
    `--enable-return-routed-experts`). timeout: seconds a draw or one push call may take.
    """

    url: str
    directory: str
    provider: str = "vllm"
    model: str | None = None
    replicas: tuple[str, ...] = ()
    processed_logprobs: bool = False
    routing: bool = False
    timeout: float = 600.0

    def __post_init__(self):
        (url,) = root_urls((self.url,), "RemoteEngine.url")
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "replicas", root_urls(self.replicas or (url,), "RemoteEngine.replicas"))
        choice("RemoteEngine.provider", self.provider, PROVIDERS)
        number("RemoteEngine.timeout", self.timeout, above=0)
        if not self.directory:
            raise ValueError("RemoteEngine.directory is empty; give the checkpoint directory the engine was "
                             "launched on (pushes rewrite it)")


def served_model(url: str, timeout: float = 30.0) -> str:
    """The one base model an OpenAI-compatible engine at `url` lists on /v1/models (LoRA adapters,
    listed with a `parent`, are not counted)."""
    try:
        answer = httpx.get(f"{url}/v1/models", timeout=timeout)
        answer.raise_for_status()
        names = [entry["id"] for entry in answer.json()["data"] if not entry.get("parent")]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"could not read the served model from {url}/v1/models ({error}); is the engine up? "
                         "Or set RemoteEngine.model") from error
    if len(names) != 1:
        raise ValueError(f"{url} serves {len(names)} models ({names}); name one with RemoteEngine.model")
    return names[0]


def remote_server(engine: RemoteEngine, pretrained: Pretrained) -> Callable[[Sampling], Any]:
    """A factory `sampling -> OpenAIRolloutServer` on `engine`, pushing to every replica the
    weights a RolloutScheduler hands it (its first push comes before its first draw): the
    adapters alone (`AdapterReload`) when `pretrained.model` has a LoRA, else the whole model."""
    import openai

    def build(sampling: Sampling) -> OpenAIRolloutServer:
        options = RemoteOptions(timeout=engine.timeout)
        client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="EMPTY")  # timeouts: options'
        completion = OpenAICompletion(engine.model or served_model(engine.url), client, engine.provider)
        push = pushes(engine, pretrained)
        return OpenAIRolloutServer(completion, sampling, Publication(push, version=0), routing=engine.routing,
                                   processed_logprobs=engine.processed_logprobs, options=options,
                                   routing_shape=routing_shape(engine, pretrained.model),
                                   adapter=push.name if isinstance(push, AdapterReload) else None)

    return build


def routing_shape(engine: RemoteEngine, model: Any) -> tuple[int, int] | None:
    """(layers, top_k) of the routes `engine` reports for `model`, or None when it reports none;
    refuses routing for a dense model."""
    if not engine.routing:
        return None
    if not getattr(model, "experts", 0):
        raise ValueError("RemoteEngine.routing reads each token's experts, and the policy has none "
                         "(experts=0); turn routing off for a dense model")
    return len(model.moe_layers), model.experts_per_token  # the sparse layers, as the engines report


def pushes(engine: RemoteEngine, pretrained: Pretrained) -> AdapterReload | SafetensorsReload:
    """The push for `pretrained`: its adapters alone when its model has a LoRA, else the whole model."""
    if getattr(pretrained.model, "lora", None) is not None:
        return AdapterReload(pretrained, engine.directory, engine.replicas, engine=engine.provider,
                             timeout=engine.timeout)
    return SafetensorsReload(pretrained, engine.directory, engine.replicas, engine=engine.provider,
                             timeout=engine.timeout)


__all__ = ["RemoteEngine", "pushes", "remote_server", "served_model"]

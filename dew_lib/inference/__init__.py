"""Inference for rollouts: the `RolloutServer` contract and Dew's native continuous-batching server.

`RolloutServer` (submit a token-id prompt, get a future `Draw`; load new weights under a version)
is what the asynchronous GRPO scheduler and its sources draw from. `Server` batches requests
continuously in JAX; `NativeRolloutServer(Server.from_task(ServeTask(...), slots=, capacity=))`
drives it on a background thread, on one device or tensor-parallel over `serving_mesh(n)`.
`TextGeneration` is a model bound to one snapshot of its variables, the policy a lock-step
`EpisodeRollout` samples each turn from. See docs/inference.md.

Remote engines speak the same contract: `OpenAIRolloutServer` (vLLM's or SGLang's completions
route) and `VLLMGenerateServer` (vLLM's token route) draw over HTTP (docs/remote_engines.md);
`SafetensorsReload` and `NCCLPush` push weights to them (`AdapterReload` a LoRA policy's adapters
alone), `Publication` versions the pushes and `Gateway` stamps them on a recording gateway
(docs/publishing.md).
"""

from dew_lib.inference.adapter_push import AdapterReload
from dew_lib.inference.base import Publisher, RolloutServer, ServerClosed
from dew_lib.inference.endpoints import EndpointFailed, PushFailed
from dew_lib.inference.gateway import Gateway, GatewayNotReady
from dew_lib.inference.native import NativeRolloutServer
from dew_lib.inference.nccl import NCCLError, NCCLLibrary, NCCLPush
from dew_lib.inference.openai_engine import Completion, CompletionChoice, OpenAICompletion, OpenAIRolloutServer
from dew_lib.inference.placement import serving_mesh
from dew_lib.inference.publish import Publication, SafetensorsReload
from dew_lib.inference.remote import EngineError, RemoteOptions, RemoteRolloutServer
from dew_lib.inference.server import Server, ServeTask
from dew_lib.inference.text import TextGeneration
from dew_lib.inference.vllm_generate import VLLMGenerateServer
from dew_lib.records.draw import Draw

__all__ = ["AdapterReload", "Completion", "CompletionChoice", "Draw", "EndpointFailed", "EngineError", "Gateway",
           "GatewayNotReady", "NCCLError", "NCCLLibrary", "NCCLPush", "NativeRolloutServer", "OpenAICompletion",
           "OpenAIRolloutServer",
           "Publication", "Publisher", "PushFailed", "RemoteOptions", "RemoteRolloutServer", "RolloutServer",
           "SafetensorsReload", "ServeTask", "Server", "ServerClosed", "TextGeneration", "VLLMGenerateServer",
           "serving_mesh"]

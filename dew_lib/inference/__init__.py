"""Inference for rollouts: the `RolloutServer` contract and Dew's native continuous-batching server.

`RolloutServer` (submit a token-id prompt, get a future `Draw`; load new weights under a version)
is what the asynchronous GRPO scheduler and its sources draw from. `Server` batches requests
continuously in JAX; `NativeRolloutServer(Server.from_task(ServeTask(...), slots=, capacity=))`
drives it on a background thread. `TextGeneration` is a model bound to one snapshot of its
variables, the policy a lock-step `EpisodeRollout` samples each turn from. See docs/inference.md.
"""

from dew_lib.inference.base import Publisher, RolloutServer, ServerClosed
from dew_lib.inference.native import NativeRolloutServer
from dew_lib.inference.server import Server, ServeTask
from dew_lib.inference.text import TextGeneration
from dew_lib.records.draw import Draw

__all__ = ["Draw", "NativeRolloutServer", "Publisher", "RolloutServer", "ServeTask", "Server", "ServerClosed",
           "TextGeneration"]

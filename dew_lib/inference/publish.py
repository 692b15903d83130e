"""Publishing policy versions to remote engines: `SafetensorsReload` through disk, `Publication` on top.

A push is a callable `push(variables, version)` that puts the trainer's weights on every replica
and raises when any replica did not take them. It holds no version of its own: `Publication`
turns a push (this module's `SafetensorsReload`, or `dew_lib.inference.nccl.NCCLPush`) into the
versioned `Publisher` that `push_weights` and `RolloutScheduler(weights=...)` expect, and stamps
each version on a recording gateway once every replica serves it.

`SafetensorsReload` writes the policy once as a Hugging Face directory in bfloat16
(`Pretrained.save`: written into a hidden sibling and swapped in whole, so an engine reading it
sees the old checkpoint or the new one, never a mixture), then asks every replica to re-read it,
all replicas at once. Launch every replica on that directory, first written with `write`; a
replica on another host must see it at the same path (a shared filesystem).

vLLM (v0.30.0's routes; these are development endpoints, served only under
VLLM_SERVER_DEV_MODE=1, so keep them on a trusted network), per replica:

  POST /pause?mode=wait                           in-flight requests finish, none are scheduled
  POST /collective_rpc {"method": "reload_weights"}  every worker re-reads the launch directory
  POST /reset_prefix_cache                        must answer {"success": true}: vLLM reports a
                                                  reset that did not happen as 200 + false
  POST /update_weight_version {"new_version": "v"}
  POST /resume

A failure after the pause leaves that replica paused, so nothing is drawn from weights a push may
have half loaded; the next successful push resumes it. SGLang makes one call,
POST /update_weights_from_disk {"model_path": directory, "flush_cache": true,
"abort_all_requests": false, "weight_version": "v"}: it waits for in-flight requests, holds new
ones while it loads, flushes its radix cache and answers; a failed load answers 400 (and SGLang
re-reads the same directory as its rollback), and a 200 with `"success": false` fails too.

Not here: NCCL pushes (`nccl`), the gateway's HTTP (`gateway`), starting engines.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jax.numpy as jnp

from dew_lib.inference.endpoints import call, on_every, root_urls
from dew_lib.models.pretrained import Pretrained
from dew_lib.train import distributed

ENGINES = ("vllm", "sglang")


@dataclasses.dataclass(frozen=True)
class SafetensorsReload:
    """Push by writing `directory` and having every replica in `engines` re-read it.

    pretrained: the `Pretrained` the replicas serve (its tensor names, config and tokenizer are
    written). directory: the checkpoint directory every replica was launched on. engines: the
    replicas' root URLs (not their /v1 APIs). engine: "vllm" or "sglang". timeout: seconds one
    call may take; a vLLM pause or an SGLang load waits for the longest request in flight.

    `push(variables, version)` (this object is callable) writes and reloads; it raises
    `PushFailed` naming each failed replica, its endpoint and its answer.
    """

    pretrained: Pretrained
    directory: Path
    engines: tuple[str, ...]
    engine: str = "vllm"
    timeout: float = 600.0

    def __post_init__(self):
        if not isinstance(self.pretrained, Pretrained):
            raise ValueError(f"pretrained must be a dew_lib.models.pretrained.Pretrained, got "
                             f"{type(self.pretrained).__name__}; build one with Pretrained.from_model or "
                             "load_pretrained")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r} is not supported; use one of {ENGINES}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {self.timeout!r}")
        object.__setattr__(self, "directory", Path(self.directory).absolute())
        object.__setattr__(self, "engines", root_urls(self.engines, "engines"))

    def write(self, variables: Any) -> Path:
        """Write `variables` into `directory` in bfloat16 (also how the launch directory is made)."""
        return self.pretrained.save(variables, self.directory, dtype=jnp.bfloat16)

    def __call__(self, variables: Any, version: int) -> None:
        """Write `variables`, then have every replica serve them under `version`."""
        self.write(variables)
        sequence = self._vllm if self.engine == "vllm" else self._sglang
        on_every(self.engines, lambda root: sequence(root, str(version)),
                 f"reloading version {version} from {self.directory}")

    def _vllm(self, root: str, version: str) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            call(client, root, "POST", "/pause", params={"mode": "wait"})
            call(client, root, "POST", "/collective_rpc", body={"method": "reload_weights"})
            call(client, root, "POST", "/reset_prefix_cache", must_succeed=True)
            call(client, root, "POST", "/update_weight_version", body={"new_version": version})
            call(client, root, "POST", "/resume")

    def _sglang(self, root: str, version: str) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            call(client, root, "POST", "/update_weights_from_disk", must_succeed=True, body={
                "model_path": str(self.directory), "flush_cache": True, "abort_all_requests": False,
                "weight_version": version})


class Publication:
    """A versioned `Publisher` over a push: `load(variables, v)` pushes, stamps, then moves `version`.

    push: a callable `push(variables, version)` that raises when a replica did not take the
    weights (`SafetensorsReload`, `NCCLPush`). version: the version the replicas were launched
    with. stamp: None, or a callable `stamp(version)` run after every replica serves a version,
    such as `Gateway(url).stamp`; construction stamps `version` so a stamp an earlier run left on
    the gateway never labels this run's calls.

    `version` moves to v only when both the push and the stamp succeeded; a failure raises and
    leaves it where it was. The stamp comes after the push because a gateway labels each call
    with the version when the call arrives: a stamp ahead of a replica would claim weights the
    call was not drawn from, a stamp behind only overstates its lag.

    In a multi-process trainer every process calls `load` with its own copy of the weights
    (`distributed.local_copy`, as the RolloutScheduler passes them); process 0 pushes and stamps,
    and every process raises when that failed, or moves `version` when it did not.
    """

    def __init__(self, push: Callable[[Any, int], None], version: int = 0,
                 stamp: Callable[[int], None] | None = None):
        if not callable(push):
            raise ValueError(f"push must be callable as push(variables, version), got {type(push).__name__}")
        if stamp is not None and not callable(stamp):
            raise ValueError(f"stamp must be None or callable as stamp(version), got {type(stamp).__name__}")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be an int (the launch version), got {version!r}")
        self.push, self.stamp = push, stamp
        if stamp is not None:
            stamp(version)
        self.version = version

    def load(self, variables: Any, version: int) -> None:
        version = operator.index(version)  # a numpy step count becomes a plain int for the JSON bodies
        failure = None
        if distributed.is_primary():  # in a multi-process trainer one process publishes
            try:
                self.push(variables, version)
                if self.stamp is not None:
                    self.stamp(version)
            except Exception as error:  # noqa: BLE001 - raised below, on every process
                failure = error
        distributed.raise_together(failure, f"publishing version {version}")
        self.version = version

    def close(self) -> None:
        """Close the push if it holds resources (`NCCLPush`'s groups); a `SafetensorsReload` holds none."""
        close = getattr(self.push, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Publication:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Several PEFT LoRA adapters served over one base checkpoint, each chosen by a request's `model`.

`ServedModels(base)` holds the base's `ServedPolicy` and one more `ServedPolicy` per adapter
(`dew serve --lora NAME=PATH`, or POST /v1/load_lora_adapter at runtime). An adapter's policy
runs its own `NativeRolloutServer`, so it has its own slots and KV cache (the cost of an adapter:
one more cache of `slots x capacity` ids), but no weights of its own beyond the adapter: its
variables are the base server's device arrays, the very same objects, plus the adapter's leaves.
Adapters with the same `LoRA` (rank, alpha, targets, rsLoRA) and the base's shapes make the same
model and the same traced arguments, so jax's cache hands every one of them the programs the first
one compiled: a second adapter, or one loaded at runtime, compiles nothing. An adapter of another
rank or targets is served too, and compiles its own programs once.

Requests name the base (its served name, or no model) or an adapter; any other name is answered
with vLLM's 404, listing the served names. `cards` lists the base and every adapter the way vLLM
lists LoRA modules (`parent`: the base's name, `root`: the adapter's directory).

Unloading takes the name away at once (new requests get the 404); requests already drawing on the
adapter finish, then its server closes.

Not here: the routes (`app`, `lora_routes`), PEFT's files (`dew_lib.models.pretrained.peft`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dew_lib.inference import NativeRolloutServer, Server
from dew_lib.models import lora
from dew_lib.models.pretrained.peft import load_adapter
from dew_lib.serve.policy import ServedPolicy
from dew_lib.serve.protocol import ModelCard, ServeError


def shared_variables(base: Mapping[str, Any], adapted: Mapping[str, Any]) -> dict[str, Any]:
    """`adapted`'s adapter leaves beside `base`'s own leaves (the same arrays, not copies)."""
    adapters, _ = lora.split(adapted["params"])
    return {**base, "params": lora.merge(adapters, base["params"])}


def adapter_server(base: Server, directory: str | Path) -> Server:
    """A `Server` like `base` (sampling, slots, capacity, steps, mesh, routing) drawing from
    `base`'s weights with the PEFT adapter in `directory`: a KV cache of its own, the base's
    arrays shared."""
    model, adapted = load_adapter(directory, base.model, base.variables)
    return Server(model, shared_variables(base.variables, adapted), sampling=base.sampling, slots=base.slots,
                  capacity=base.capacity, steps=base.steps, version=base.version, mesh=base.mesh, shared=True,
                  routing=base.routing)


def adapter_policy(base: ServedPolicy, name: str, directory: str | Path, *, seed: int = 0) -> ServedPolicy:
    """`base` with the PEFT adapter in `directory`, served as `name`, compiled before it returns."""
    native = NativeRolloutServer(adapter_server(base.native.server, directory), seed=seed)
    policy = ServedPolicy(native, name=name, directory=Path(directory), tokenizer=base.tokenizer, dtype=base.dtype,
                          primary_eos=base.primary_eos, logprobs_mode=base.logprobs_mode, window=base.window,
                          quiet=base.quiet)
    try:
        policy.warm_up()
    except BaseException:
        policy.close()
        raise
    return policy


def parse_lora_modules(specs: list[str] | tuple[str, ...]) -> dict[str, str]:
    """`--lora NAME=PATH` flags as {name: path}; refuses a flag without both parts or a name twice."""
    found: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"--lora {spec!r} must be NAME=PATH (the name requests send as `model`, the PEFT "
                             "adapter directory)")
        if name in found:
            raise ValueError(f"--lora names {name!r} twice; give each adapter its own name")
        found[name] = path
    return found


class ServedModels:
    """The base policy and the adapters served over it, by the names requests send."""

    def __init__(self, base: ServedPolicy):
        if not isinstance(base, ServedPolicy):
            raise TypeError(f"ServedModels needs the base's ServedPolicy, got {type(base).__name__}")
        self.base = base
        self.adapters: dict[str, ServedPolicy] = {}
        self._loading: asyncio.Lock | None = None
        self._retiring: dict[asyncio.Task, ServedPolicy] = {}  # unloaded adapters finishing their requests

    @property
    def names(self) -> list[str]:
        return [self.base.name, *self.adapters]

    @property
    def policies(self) -> list[ServedPolicy]:
        return [self.base, *self.adapters.values()]

    def pick(self, name: str | None) -> ServedPolicy:
        """The policy a request's `model` names (none: the base); vLLM's 404 for any other name."""
        if not name or name == self.base.name:
            return self.base
        policy = self.adapters.get(name)
        if policy is None:
            served = ", ".join(f"`{n}`" for n in self.names)
            raise ServeError(f"The model `{name}` does not exist; this server serves {served}.", param="model",
                             status=404, kind="NotFoundError")
        return policy

    def cards(self) -> list[ModelCard]:
        """/v1/models: the base, then every adapter with the base as its parent (vLLM's LoRA cards)."""
        base = ModelCard(id=self.base.name, root=str(self.base.directory), max_model_len=self.base.capacity)
        return [base, *(ModelCard(id=name, root=str(policy.directory), parent=self.base.name)
                        for name, policy in self.adapters.items())]

    def add(self, name: str, directory: str | Path) -> ServedPolicy:
        """Serve the PEFT adapter in `directory` as `name` (blocking: reads it and warms it up)."""
        self._check_new(name)
        policy = adapter_policy(self.base, name, directory, seed=len(self.adapters) + 1)
        self.adapters[name] = policy
        return policy

    def _check_new(self, name: str) -> None:
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")  # vLLM's words
        if not name or name == self.base.name:
            raise ValueError(f"an adapter cannot be named {name!r}: give it a nonempty name other than the base "
                             f"model's ({self.base.name!r})")

    async def load(self, name: str, directory: str) -> None:
        """`add` off the event loop, one load at a time."""
        if self._loading is None:
            self._loading = asyncio.Lock()
        async with self._loading:
            self._check_new(name)
            policy = await asyncio.to_thread(adapter_policy, self.base, name, directory,
                                             seed=len(self.adapters) + 1)
            self.adapters[name] = policy

    def unload(self, name: str) -> None:
        """Stop serving `name` now; its requests in flight finish, then its server closes."""
        policy = self.adapters.pop(name)
        task = asyncio.ensure_future(self._retire(policy))
        self._retiring[task] = policy
        task.add_done_callback(lambda done: self._retiring.pop(done, None))

    @staticmethod
    async def _retire(policy: ServedPolicy) -> None:
        try:
            await policy.pause()  # returns once every admitted request has finished
        finally:
            policy.close()

    async def pause(self) -> None:
        """Pause every served policy (see `ServedPolicy.pause`)."""
        await asyncio.gather(*(policy.pause() for policy in self.policies))

    def resume(self) -> None:
        for policy in self.policies:
            policy.resume()

    def close(self) -> None:
        """Close every adapter's server (those still retiring too), then the base's."""
        for policy in [*self._retiring.values(), *self.adapters.values(), self.base]:
            policy.close()
        self.adapters.clear()


__all__ = ["ServedModels", "adapter_policy", "adapter_server", "parse_lora_modules", "shared_variables"]

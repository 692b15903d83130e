"""Continuous batching in JAX: a fixed set of slots that requests join and leave between calls.

`Server` owns a KV cache of `slots` rows, `capacity` ids each, and the weights it serves. A
request claims a free slot when it is added; the requests added between two steps are prefilled
together by one compiled call at the next `step` (their prompts right-padded to a power-of-two
width bucket, their count padded to a power of two, so a handful of shapes cover every batch of
joiners), which writes each prompt's keys and values into its row and samples its first id.
Each `step` then decodes every slot together in one compiled call, up to `steps` ids per slot,
and returns early as soon as any request finishes, so its slot can be refilled and its draw
delivered. Free and finished slots are carried along untouched. Shapes never change: a server
compiles one decode and one prefill per (width, count) bucket for its whole life (shared with
every other server of the same model, sampling and shape), and `compilations` counts them.

Several decode steps per call keep the device busy between the host's visits: on a shared CPU a
call costs milliseconds of thread hand-offs, as much as a small model's step. `steps=1` makes
every decode step its own call; a larger `steps` delays a request arriving for a free slot, a
weight swap and a cancellation by at most that many steps.

Each slot keeps its own PRNG key: id i of a request with seed s is drawn with
`fold_in(key(s), i)` from that row's logits alone, exactly as `dew_lib.sampling.generate` draws
row 0 of a one-row batch with `key=jax.random.key(s)`. A draw therefore does not depend on its
slot or on the requests that share the batch.

`Server` is single-threaded: one caller drives `add`, `cancel`, `step` and `reload`. The
background thread, futures and queueing live in `NativeRolloutServer`.

Given a mesh (`serving_mesh(n)`: n devices on the `tensor` axis), the weights are split by the
logical axes their modules declare (attention heads, KV heads, the MLP's hidden units, the
vocabulary) and every layer's KV cache by KV heads, so each device holds 1/n of both and XLA
inserts the all-reduces of Megatron's column and row pairs. `reload` puts new weights into the
served layout from whatever layout they arrive in (a trainer's FSDP shards, one device, the
host), one leaf at a time.

Not here: prefix caching, paged attention, speculative decoding, top-k supports in the draw (the
scheduler's filtered-sampling training input).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dew_lib.inference import slot_steps
from dew_lib.inference.placement import place_state
from dew_lib.inference.slot_steps import SlotState
from dew_lib.models import partitioning
from dew_lib.options import integer
from dew_lib.records.draw import Draw
from dew_lib.sampling import Sampling

MIN_BUCKET = 16  # the narrowest prefill; shorter prompts share it


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ServeTask:
    """What a server needs to draw from a policy: the model, its weights and how to sample.

    model: a decoder with `prefill`, `decode` and `empty_cache` (the causal transformer).
    variables: its Flax variables (`{"params": ...}`), e.g. a TrainState's `params`.
    sampling: temperature, filters and EOS ids for every request.
    dtype: cast floating leaves to this dtype for serving (e.g. `jnp.bfloat16` for a float32
    trainer); None serves them as given. Later `load`s are cast to the served dtypes. The
    model's own `dtype` stays its compute dtype.
    version: the version number of `variables` (draws report it until the first load).
    """

    model: Any
    variables: Any
    sampling: Sampling = Sampling()
    dtype: Any = None
    version: int = 0

    def __post_init__(self):
        missing = [m for m in ("prefill", "decode", "empty_cache") if not hasattr(self.model, m)]
        if missing:
            raise ValueError(
                f"ServeTask.model must be a decoder with prefill, decode and empty_cache; "
                f"{type(self.model).__name__} lacks {', '.join(missing)}")
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"ServeTask.sampling must be a dew_lib.sampling.Sampling, got {self.sampling!r}")
        if self.dtype is not None and not jnp.issubdtype(self.dtype, jnp.floating):
            raise ValueError(f"ServeTask.dtype must be a floating dtype or None, got {self.dtype!r}")
        _check_version(self.version, "ServeTask.version")


@jax.jit
def _copied(tree: Any) -> Any:
    """A copy of every leaf, by one program (leaf by leaf, each shape compiles one of its own)."""
    return jax.tree.map(jnp.copy, tree)


def _check_version(version, name):
    if isinstance(version, bool) or not isinstance(version, int | np.integer):
        raise ValueError(f"{name} must be an int, got {version!r}")


def _buckets(capacity: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Powers-of-two multiples of `smallest` below `capacity`, then `capacity`."""
    sizes = [w for w in (smallest << i for i in range(32)) if w < capacity]
    return (*sizes, capacity)


class _Request:
    """Host-side record of one request in a slot."""

    __slots__ = ("key", "slot", "budget", "version", "prompt", "ids", "raw", "behavior", "done")

    def __init__(self, key, slot, budget, version, prompt):
        self.key, self.slot, self.budget, self.version = key, slot, budget, version
        self.prompt = prompt  # its prompt's length
        self.ids: list[int] = []
        self.raw: list[float] = []
        self.behavior: list[float] = []
        self.done = False


class Server:
    """A continuous-batching decoder over `slots` rows of `capacity` ids each.

    Use `Server.from_task(task, slots=..., capacity=..., steps=16)`. `add` puts a request into a
    free slot, `step` decodes every slot (at most `steps` ids, fewer once a request finishes) and
    returns the draws that finished, `cancel` frees a request's slot, `reload` swaps the weights
    between two calls. A request needs `len(prompt_ids) + max_new_tokens <= capacity`. `shared`
    serves `variables` as given rather than a copy: arrays nobody donates, such as another
    server's base under an adapter. `routing` (a mixture of experts) records the experts every
    layer chose for each prompt and sampled id into the draws' `routed_experts`, for routing
    replay in training.
    """

    def __init__(self, model, variables, *, sampling: Sampling, slots: int, capacity: int,
                 steps: int = 16, version: int = 0, mesh: Mesh | None = None, shared: bool = False,
                 routing: bool = False):
        slots, capacity, steps = (integer(f"Server.{name}", value) for name, value in
                                  (("slots", slots), ("capacity", capacity), ("steps", steps)))
        if capacity < 2:
            raise ValueError(f"Server.capacity must be >= 2 (one prompt id and one sampled id), got {capacity}")
        limit = getattr(model, "max_seq_len", None)
        if limit is not None and capacity > limit:
            raise ValueError(
                f"Server.capacity={capacity} exceeds the model's max_seq_len={limit}; lower the "
                f"capacity or build the model with max_seq_len >= {capacity}")
        _check_version(version, "Server version")
        self.model, self.sampling = model, sampling
        self.slots, self.capacity, self.steps = slots, capacity, steps
        self.version = int(version)
        self.mesh = mesh
        # A copy of its own: a trainer that donates its state must not delete the served weights.
        self.variables = (variables if shared else _copied(variables)
                          if mesh is None else partitioning.place(variables, mesh))
        self.vocab_size = getattr(model, "vocab_size", None)
        self.buckets = _buckets(capacity)  # prompt widths of a prefill
        self.row_buckets = _buckets(slots, 1)  # requests prefilled together

        def zeros():  # a buffer of its own: the state is donated leaf by leaf
            return jnp.zeros((slots,), jnp.int32)

        self.routing = bool(routing)
        if self.routing and not getattr(model, "sparse", False):
            raise ValueError("Server.routing records each token's experts, and the model has none "
                             "(experts=0); leave routing off for a dense model")
        routes = (jnp.zeros((slots, capacity, len(model.moe_layers) * model.experts_per_token), jnp.int32)
                  if self.routing else None)
        self._state = SlotState(
            model.empty_cache(slots, capacity), zeros(),
            jax.vmap(jax.random.key)(jnp.zeros((slots,), jnp.uint32)), zeros(), zeros(),
            jnp.zeros((slots,), bool), routes)
        if mesh is not None:  # the cache split by KV heads like the projections that fill it
            self._state = place_state(self._state, mesh)
        self._owners: list[_Request | None] = [None] * slots
        self._by_key: dict[Hashable, _Request] = {}
        self._joining: list[tuple[_Request, np.ndarray, int]] = []  # (request, prompt, seed) to prefill
        # dispatched calls whose ids are not read yet: (each row's or slot's request, the call's output)
        self._events: deque[tuple[tuple[Any, ...], Any]] = deque()

    @classmethod
    def from_task(cls, task: ServeTask, *, slots: int, capacity: int, steps: int = 16,
                  mesh: Mesh | None = None, routing: bool = False) -> Server:
        """A server for `task`'s model, weights (cast to `task.dtype`) and sampling.

        slots: requests decoded together. capacity: cache length per slot, prompt plus sampled
        ids. steps: decode steps per compiled call, at most. mesh: the devices to serve on,
        the weights and the KV cache split over its `tensor` axis (`serving_mesh` builds one);
        None serves from the default device. routing: record each token's experts in the draws.
        """
        if not isinstance(task, ServeTask):
            raise ValueError(
                f"Server.from_task needs a dew_lib.inference.ServeTask(model, variables, sampling), "
                f"got {type(task).__name__}")
        variables = jax.tree.map(jnp.asarray, task.variables)
        if task.dtype is not None:
            variables = jax.tree.map(
                lambda x: x.astype(task.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                variables)
        return cls(task.model, variables, sampling=task.sampling, slots=slots, capacity=capacity,
                   steps=steps, version=task.version, mesh=mesh, routing=routing)

    # ---- requests ---------------------------------------------------------------------------

    def check(self, prompt_ids, max_new_tokens: int, seed: int | None) -> np.ndarray:
        """The prompt as int32 ids, after refusing what this server cannot serve."""
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"prompt_ids must be a nonempty 1-D sequence of ids, got shape {prompt.shape}")
        if not (np.issubdtype(prompt.dtype, np.integer) and prompt.dtype != np.bool_):
            raise ValueError(f"prompt_ids must be integer token ids, got dtype {prompt.dtype}")
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
            raise ValueError(
                f"prompt_ids must lie in [0, {self.vocab_size}), the model's vocabulary; got ids "
                f"from {low} to {high}")
        max_new_tokens = integer("max_new_tokens", max_new_tokens)
        if prompt.size >= self.capacity:
            raise ValueError(
                f"a prompt of {prompt.size} ids is too long for the server's capacity="
                f"{self.capacity} ids per slot, which must hold the prompt and its sampled ids; "
                f"shorten the prompt or build the server with capacity >= "
                f"{prompt.size + max_new_tokens}")
        if prompt.size + max_new_tokens > self.capacity:
            raise ValueError(
                f"a prompt of {prompt.size} ids plus max_new_tokens={max_new_tokens} exceeds the "
                f"server's capacity={self.capacity} ids per slot; lower max_new_tokens to "
                f"{self.capacity - prompt.size} or build the server with capacity >= "
                f"{prompt.size + max_new_tokens}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)
                                 or not 0 <= seed < 2**32):
            raise ValueError(f"seed must be None or an int in [0, 2**32), got {seed!r}")
        return prompt.astype(np.int32)

    @property
    def compilations(self) -> dict[str, int]:
        """Compilations of this server's decode and prefills (all buckets) in this process.

        Servers of the same model, sampling, steps, shape and weight dtypes share them.
        """
        sig = slot_steps.signature(self.model, self.sampling, self.mesh, self.variables, self.slots,
                                   self.capacity)
        return {"decode": slot_steps.TRACES["decode", self.steps, *sig],
                "prefill": sum(slot_steps.TRACES["prefill", w, r, *sig] for w in self.buckets
                               for r in self.row_buckets)}

    @property
    def free(self) -> int:
        """Slots a request can join now."""
        return sum(owner is None for owner in self._owners)

    @property
    def busy(self) -> bool:
        """Whether any request holds a slot or any dispatched step is still unread."""
        return bool(self._events) or any(owner is not None for owner in self._owners)

    def add(self, key: Hashable, prompt_ids, max_new_tokens: int, *, seed: int = 0) -> None:
        """Start a request in a free slot; the next `step` prefills its prompt (with every other
        request added since the last step) and samples its first id.

        key names the request in `step`'s results and in `cancel`. Raises if no slot is free.
        """
        prompt = self.check(prompt_ids, max_new_tokens, seed)
        if key in self._by_key:
            raise ValueError(f"a request named {key!r} is already in a slot")
        slot = next((i for i, owner in enumerate(self._owners) if owner is None), None)
        if slot is None:
            raise RuntimeError(f"all {self.slots} slots are busy; step until `free` is positive")
        request = _Request(key, slot, int(max_new_tokens), self.version, prompt.size)
        self._owners[slot] = request
        self._by_key[key] = request
        self._joining.append((request, prompt, int(seed)))

    def cancel(self, key: Hashable) -> bool:
        """Stop the request named `key` and free its slot; False if it is not in a slot."""
        request = self._by_key.pop(key, None)
        if request is None:
            return False
        request.done = True
        self._owners[request.slot] = None
        self._state = slot_steps.release(self._state, np.int32(request.slot))
        return True

    def sampled(self, key: Hashable, start: int = 0) -> tuple[list[int], list[float], list[float]]:
        """The ids the request named `key` has sampled from index `start` on, with their raw and
        behavior log-probs: what the last `step` read back, so no device work. Empty lists for a
        request that is not in a slot (finished, cancelled or never added)."""
        request = self._by_key.get(key)
        if request is None:
            return [], [], []
        return request.ids[start:], request.raw[start:], request.behavior[start:]

    def step(self) -> list[tuple[Hashable, Draw]]:
        """Prefill the requests added since the last step, decode every slot until a request
        finishes (at most `steps` ids each), and return the draws that finished.

        At most two compiled calls, dispatched before anything is read back.
        """
        finished: list[tuple[Hashable, Draw]] = []
        self._prefill_joining()
        if any(owner is not None for owner in self._owners):
            self._state, out = slot_steps.decode(self.model, self.sampling, self.steps, self.mesh, self.variables,
                                       self._state)
            self._events.append((tuple(self._owners), out))
        while self._events:
            self._read(*self._events.popleft(), finished)
        return finished

    def _prefill_joining(self) -> None:
        joining = [j for j in self._joining if not j[0].done]  # not cancelled since `add`
        self._joining = []
        if not joining:
            return
        width = next(w for w in self.buckets if w >= max(prompt.size for _, prompt, _ in joining))
        rows = next(r for r in self.row_buckets if r >= len(joining))
        prompts = np.zeros((rows, width), np.int32)
        lengths = np.ones(rows, np.int32)
        slots = np.full(rows, self.slots, np.int32)  # out of range: a padding row, dropped
        seeds = np.zeros(rows, np.uint32)
        budgets = np.ones(rows, np.int32)
        for row, (request, prompt, seed) in enumerate(joining):
            prompts[row, :prompt.size] = prompt
            lengths[row], slots[row], seeds[row], budgets[row] = prompt.size, request.slot, seed, request.budget
        self._state, out = slot_steps.prefill(self.model, self.sampling, self.mesh, self.variables, self._state,
                                    prompts, lengths, slots, seeds, budgets)
        self._events.append((tuple(request for request, _, _ in joining), out))

    def _read(self, owners, out, finished):
        ids, raw, behavior, *emitted = jax.device_get(out)
        if not emitted:  # a prefill: the first id of each joining request, in row order
            for row, request in enumerate(owners):
                self._record(request, int(ids[row]), float(raw[row]), float(behavior[row]), finished)
            return
        (emitted,) = emitted
        for step, slot in zip(*np.nonzero(emitted), strict=True):  # in step order per slot
            request = owners[slot]
            if request is not None:
                self._record(request, int(ids[step, slot]), float(raw[step, slot]),
                             float(behavior[step, slot]), finished)

    def _record(self, request: _Request, token, raw, behavior, finished):
        if request.done:  # cancelled after this step was dispatched
            return
        request.ids.append(token)
        request.raw.append(raw)
        request.behavior.append(behavior)
        eos = token in self.sampling.eos_ids
        if eos or len(request.ids) >= request.budget:
            request.done = True
            self._owners[request.slot] = None
            del self._by_key[request.key]
            finished.append((request.key, Draw(
                ids=np.array(request.ids, np.int32), behavior_log_probs=np.array(request.behavior, np.float32),
                raw_log_probs=np.array(request.raw, np.float32), eos=eos, version=request.version,
                routed_experts=self._routes(request))))

    def _routes(self, request: _Request) -> np.ndarray | None:
        """A finished request's experts `[prompt + sampled ids, layers, k]`, zeros for the last
        sampled id (never fed); None unless this server records routing."""
        if self._state.routes is None:
            return None
        fed = request.prompt + len(request.ids) - 1
        routes = np.zeros((fed + 1, len(self.model.moe_layers), self.model.experts_per_token), np.int32)
        routes[:fed] = np.asarray(self._state.routes[request.slot, :fed]).reshape(fed, *routes.shape[1:])
        return routes

    # ---- weights ----------------------------------------------------------------------------

    def prepare(self, variables) -> Any:
        """A copy of `variables` on the served devices in the served dtypes, checked against them.

        Safe to call from any thread; `reload` then swaps it in. Always copies, so the caller may
        donate or delete its own arrays afterwards.
        """
        served, structure = jax.tree.flatten(self.variables)
        leaves, given = jax.tree.flatten(variables)
        # jax annotates the treedefs as tree_util.PyTreeDef, an alias of an attribute of its compiled
        # extension that mypy cannot resolve (it sees "PyTreeDef?", with no __ne__)
        if given != structure:  # type: ignore[operator]
            raise ValueError(
                f"load got a variables tree that differs from the served one; served {structure}, "
                f"got {given}")
        out = []
        for path_leaf, old, new in zip(jax.tree_util.tree_leaves_with_path(self.variables), served,
                                       leaves, strict=True):
            path = jax.tree_util.keystr(path_leaf[0])
            new = new if isinstance(new, jax.Array) else np.asarray(new)
            if tuple(new.shape) != tuple(old.shape):
                raise ValueError(f"load: {path} has shape {tuple(new.shape)}, the served weights "
                                 f"have {tuple(old.shape)}")
            if new.dtype != old.dtype:
                if not (jnp.issubdtype(old.dtype, jnp.floating) and jnp.issubdtype(new.dtype, jnp.floating)):
                    raise ValueError(f"load: {path} has dtype {new.dtype}, the served weights have "
                                     f"{old.dtype}; only floating leaves are cast")
                new = new.astype(old.dtype)  # a fresh array on the source device
                out.append(jax.device_put(new, old.sharding))
            else:
                out.append(partitioning.copy_to(new, old.sharding))
        return jax.tree.unflatten(structure, out)

    def reload(self, variables, version: int, *, prepared: bool = False) -> None:
        """Serve `variables` as `version` from the next step on.

        Requests already in a slot keep generating on the new weights; their draw reports the
        oldest version they ran under. `prepared=True` skips `prepare` for a tree it returned.
        """
        _check_version(version, "load version")
        self.variables = variables if prepared else self.prepare(variables)
        self.version = int(version)
        for request in self._by_key.values():
            request.version = min(request.version, self.version)


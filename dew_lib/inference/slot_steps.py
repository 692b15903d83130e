"""The compiled calls a `Server` makes on its slots: prefill the joiners, decode every slot.

Both take the per-slot `SlotState` and donate it, so the KV cache is updated in place. A
server that records routing (a mixture of experts, for routing replay) also keeps each slot's
experts per position, `[slots, capacity, layers * top_k]`: a prefill writes the prompt's, each
decode step the experts of the id it fed. The last sampled id is never fed, so its position
holds no routes of its own; `Server` reports zeros there, as the engines do.

`TRACES` counts the traces of each call by what selects its executable, so a server can say how
many compilations it caused (`Server.compilations`).
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dew_lib.inference.placement import laid_out
from dew_lib.models.decoder import KVCache, split_layers
from dew_lib.sampling import Sampling, _is_eos, sample


class SlotState(NamedTuple):
    """Everything the device keeps per slot between steps."""

    cache: KVCache
    last: jax.Array  # [S] int32: the id sampled last, fed to the next step
    keys: jax.Array  # [S] PRNG keys, one per request
    sampled: jax.Array  # [S] int32: ids sampled so far (not `count`, which is tuple's method)
    budget: jax.Array  # [S] int32: max_new_tokens
    live: jax.Array  # [S] bool: still decoding
    routes: jax.Array | None = None  # [S, capacity, layers * k] int32 experts, when recording routing


def _sample_rows(logits, keys, sampling: Sampling):
    """`sample` applied to each row with that row's own key: ids, raw and behavior log-probs `[S]`."""
    one = jax.vmap(lambda row, key: sample(row[None], key, sampling))
    ids, raw, behavior = one(logits, keys)
    return ids[:, 0], raw[:, 0], behavior[:, 0]


# Traces of the compiled functions by what selects their executable: a trace is a compilation.
TRACES: collections.Counter = collections.Counter()


def signature(model, sampling, mesh, variables, slots, capacity):
    """What, besides a call's own shapes, selects its executable."""
    dtypes = tuple(str(x.dtype) for x in jax.tree.leaves(variables))
    return (model, sampling, mesh, slots, capacity, dtypes)


@functools.partial(jax.jit, static_argnames=("model", "sampling", "steps", "mesh"), donate_argnames=("state",))
def decode(model, sampling, steps, mesh, variables, state: SlotState):
    """Decode steps over every slot until one of them finishes, none is live, or `steps` ran.

    Returns the state and, per step and slot `[steps, S]`, the sampled id, its raw and behavior
    log-probs and whether that slot emitted it (false for slots that were not live and for steps
    that did not run).
    """
    slots, capacity = state.live.shape[0], state.cache.keys[0].shape[2]
    TRACES["decode", steps, *signature(model, sampling, mesh, variables, slots, capacity)] += 1

    layers = split_layers(variables)  # sliced once per call, not in every step
    routing = state.routes is not None

    def one(carry):
        i, _, state, (ids_out, raw_out, behavior_out, emitted_out) = carry
        live = state.live
        if routing:
            logits, cache, fed = model.apply(variables, state.last, state.cache, live, layers,
                                             method=model.decode, return_routes=True)
            where = jnp.where(live, state.cache.lengths, capacity)  # out of range: dropped
            routes = state.routes.at[jnp.arange(slots), where].set(
                fed.reshape(slots, -1).astype(jnp.int32), mode="drop")
        else:
            logits, cache = model.apply(variables, state.last, state.cache, live, layers,
                                        method=model.decode)
            routes = None
        keys = jax.vmap(jax.random.fold_in)(state.keys, state.sampled)
        ids, raw, behavior = _sample_rows(logits, keys, sampling)
        count = state.sampled + live.astype(jnp.int32)
        stop = live & (_is_eos(ids, sampling) | (count >= state.budget))
        state = SlotState(cache, jnp.where(live, ids, state.last), state.keys, count, state.budget,
                          live & ~stop, routes)
        out = (ids_out.at[i].set(ids), raw_out.at[i].set(raw), behavior_out.at[i].set(behavior),
               emitted_out.at[i].set(live))
        return i + 1, jnp.any(stop), state, out

    def going(carry):
        i, finished, state, _ = carry
        return (i < steps) & ~finished & jnp.any(state.live)

    zeros = jnp.zeros((steps, slots), jnp.float32)
    out = (jnp.zeros((steps, slots), jnp.int32), zeros, zeros, jnp.zeros((steps, slots), bool))
    _, _, state, out = jax.lax.while_loop(going, one, (jnp.int32(0), jnp.bool_(False), state, out))
    return laid_out(state, mesh), out


@functools.partial(jax.jit, static_argnames=("model", "sampling", "mesh"), donate_argnames=("state",))
def prefill(model, sampling, mesh, variables, state: SlotState, prompts, lengths, slots, seeds, budgets):
    """Fill rows `slots` `[R]` with right-padded prompts `[R, W]` and sample each first id.

    A row whose slot is out of range (`>= S`) is padding: it is computed and dropped.
    """
    rows, width = prompts.shape
    capacity = state.cache.keys[0].shape[2]
    TRACES["prefill", width, rows, *signature(model, sampling, mesh, variables, state.live.shape[0], capacity)] += 1
    columns = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (rows, width))
    segments = (columns < lengths[:, None]).astype(jnp.int32)  # 0 marks the padding after a prompt
    routes = state.routes
    if routes is None:
        logits, kvs = model.apply(variables, prompts, segments, columns, method=model.prefill)
    else:
        logits, kvs, read = model.apply(variables, prompts, segments, columns, method=model.prefill,
                                        return_routes=True)
        routes = routes.at[slots, :width].set(read.reshape(rows, width, -1).astype(jnp.int32), mode="drop")
    keys = jax.vmap(jax.random.key)(seeds)
    last = logits[jnp.arange(rows), lengths - 1]  # [R, V]
    ids, raw, behavior = _sample_rows(last, jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(seeds)),
                                      sampling)

    def write(cache, new):  # new [R, W, KV, D] -> rows `slots`, columns [0, W) of [S, KV, T, D]
        new = new.transpose(0, 2, 1, 3).astype(cache.dtype)
        return cache.at[slots, :, :width].set(new, mode="drop")

    def put(column, value):
        return column.at[slots].set(value, mode="drop")

    cache = KVCache(
        tuple(write(cache, k) for cache, (k, _) in zip(state.cache.keys, kvs, strict=True)),
        tuple(write(cache, v) for cache, (_, v) in zip(state.cache.values, kvs, strict=True)),
        put(state.cache.lengths, lengths),
    )
    stop = _is_eos(ids, sampling) | (budgets <= 1)
    state = SlotState(cache, put(state.last, ids), put(state.keys, keys), put(state.sampled, jnp.ones_like(ids)),
                      put(state.budget, budgets), put(state.live, ~stop), routes)
    return laid_out(state, mesh), (ids, raw, behavior)


@functools.partial(jax.jit, donate_argnames=("state",))
def release(state: SlotState, slot):
    """The state with `slot` no longer decoding (a cancelled request)."""
    return state._replace(live=state.live.at[slot].set(False))


__all__ = ["TRACES", "SlotState", "decode", "prefill", "release", "signature"]

"""Mixture-of-experts routing in the losses: routing replay and the router's auxiliary terms.

Routing replay (`routing_replay="rollout"`, verl's R3): the training forward sends each token to
the experts the engine chose for it when it drew the rollout (`routed_experts`, packed from each
call's record), recomputing only the gate weights over those experts, so the ratio of the
current to the behavior policy compares the same computation and the router still learns.
Tokens the engine did not report (`routed` false) route freely.

The router's terms: `router_aux_loss_coef` times the load-balancing loss and `router_z_loss_coef`
times the z-loss, both from the model (a Hugging Face MoE checkpoint carries its coefficient),
added to every MoE stage's loss, with the per-layer load as metrics.

Not here: the routing itself (models/moe.py), packing the routes (rollouts/packing.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.options import choice

ROUTING_REPLAY = ("none", "rollout")


def has_experts(model: Any) -> bool:
    """Whether `model` routes tokens to experts (a `CausalTransformer` with `experts > 0`)."""
    return int(getattr(model, "experts", 0) or 0) > 0


def check_replay(owner: str, model: Any, routing_replay: str) -> str:
    """`routing_replay` checked against `model`: replay on a dense model is refused."""
    choice(f"{owner}.routing_replay", routing_replay, ROUTING_REPLAY)
    if routing_replay != "none" and not has_experts(model):
        raise ValueError(f"{owner}(routing_replay={routing_replay!r}) replays the experts a rollout's "
                         "tokens were routed to, and this model has none (experts=0); leave "
                         "routing_replay='none' for a dense model")
    return routing_replay


def check_routes(owner: str, model: Any, routing_replay: str, batch: Mapping[str, Any]) -> None:
    """Refuse, on the host, a batch that replay cannot read: no recorded routes at all, or
    routes of another model's shape."""
    if routing_replay == "none":
        return
    if "routed_experts" not in batch or "routed" not in batch:
        raise KeyError(
            f"{owner}(routing_replay={routing_replay!r}) needs the engine's routes in the batch "
            "('routed_experts' and 'routed', packed from each call's record): draw with "
            "Server(routing=True) or generate(return_routes=True), or run vLLM or SGLang with "
            "--enable-return-routed-experts (RemoteEngine.routing); or set routing_replay='none'")
    shape, rows = np.shape(batch["routed_experts"]), np.shape(batch["input_ids"])
    expected = (*rows, len(model.moe_layers), model.experts_per_token)
    if tuple(shape) != expected:
        raise ValueError(
            f"batch field 'routed_experts' has shape {tuple(shape)}; this model routes "
            f"[rows, width, sparse layers, top_k] = {expected} (sparse layers {list(model.moe_layers)}, "
            f"experts_per_token={model.experts_per_token}): the routes come from another model")
    if np.shape(batch["routed"]) != rows:
        raise ValueError(f"batch field 'routed' has shape {np.shape(batch['routed'])}; expected the "
                         f"rows' shape {rows}")


def replayed(batch: Mapping[str, Any], routing_replay: str) -> tuple[jax.Array, jax.Array] | None:
    """The routes of input columns 0..W-2 (what a scoring forward reads) as `(experts, routed)`,
    or None when the objective does not replay."""
    if routing_replay == "none":
        return None
    return (jnp.asarray(batch["routed_experts"])[:, :-1].astype(jnp.int32),
            jnp.asarray(batch["routed"])[:, :-1].astype(bool))


def router_terms(model: Any, routing: Any, weight: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
    """The router's share of a loss written as `total / weight`, and its metrics.

    Returns `(total, metrics)`: `total / weight` is `router_aux_loss_coef * aux_loss +
    router_z_loss_coef * z_loss`. Metrics: the two losses, `router/load_max` (the busiest
    expert's share of the token slots times the expert count, averaged over layers: 1 is a
    perfect balance, `experts` all on one).
    """
    one = jnp.ones((), jnp.float32)
    load = routing.load.astype(jnp.float32)  # [L, E]
    extra = model.router_aux_loss_coef * routing.aux_loss + model.router_z_loss_coef * routing.z_loss
    metrics = {
        "router/aux_loss": (routing.aux_loss.astype(jnp.float32), one),
        "router/z_loss": (routing.z_loss.astype(jnp.float32), one),
        "router/load_max": ((load.max(axis=-1) * load.shape[-1]).mean(), one),
    }
    return extra * weight, metrics


__all__ = ["ROUTING_REPLAY", "check_replay", "check_routes", "has_experts", "replayed", "router_terms"]

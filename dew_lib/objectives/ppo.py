"""PPOObjective: PPO with a learned critic on packed episode rows; ValueHead, a critic.

The variables are one tree with two subtrees, `{"policy": ..., "critic": ...}`, trained by the
ordinary optimizer. The policy's part of the loss is GRPO's clipped token surrogate (and its KL
to the frozen reference, which covers the policy subtree only: `reference_params`), on
per-token advantages from GAE (`dew_lib.rollouts.PPORollout`). The critic's part is the clipped
value loss on the same tokens, scaled by `value_coefficient`:

    loss = pg_loss + beta * kl + value_coefficient * 0.5 * max((V - R)^2, (clip(V) - R)^2)

each summed over the batch's sampled ids and divided by their count (token-mean; both terms
reduce over the same token mass, so session-mean and sequence masks are refused). The critic
reads the same packed rows as the policy: its value for sampled id j is its output at position
j - 1, the state the id was drawn from.

With LoRA (models/lora.py) the policy trains its adapters alone and its frozen reference is its
base with the adapters off (no copy kept). The critic trains whole, or, when its backbone carries
adapters of its own (`ValueHead` on an adapted decoder), those adapters and its value head
(`trainable`). Such a critic can read the policy's frozen base rather than a copy of it
(`critic_from_policy(..., share_base=True)`): its subtree then holds its adapters and value head
alone, and `critic_params` puts them over the policy's base for each forward.

Batch columns beyond GRPO's, aligned with `input_ids`: `old_values` (the critic when the rows
were prepared), `advantages` (GAE, whitened) and `returns` (advantages plus old values).

Not here: sampling episodes and computing the targets (`rollouts/ppo.py`), the formulas
(`algorithms.gae`, `masked_whiten`, `clipped_value_loss`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dew_lib.models import lora, partitioning
from dew_lib.objectives import algorithms
from dew_lib.objectives.base import LossTerms, Metrics, Objective, adapters_or_all, with_perplexity
from dew_lib.objectives.grpo import GRPOObjective
from dew_lib.objectives.lm import dropout_rngs
from dew_lib.options import number

TARGETS = ("old_values", "advantages", "returns")


partitioning.declare({("value", "kernel"): ("embed", None), ("value", "bias"): (None,)})


class ValueHead(nn.Module):
    """One scalar per position from a backbone's features: a Dew decoder's final hidden states
    (`backbone.hidden`), or what any other backbone returns for `(ids, segment_ids, positions)`
    as `[B, S, E]`. The head starts at zero, so a fresh critic predicts 0 everywhere."""

    backbone: nn.Module

    @nn.compact
    def __call__(self, tokens, segment_ids=None, positions=None):
        if hasattr(self.backbone, "hidden"):
            features = self.backbone.hidden(tokens, segment_ids, positions)
        else:
            features = self.backbone(tokens, segment_ids, positions)
        head = nn.Dense(1, kernel_init=nn.initializers.zeros, name="value")
        return head(features.astype(jnp.float32))[..., 0]


def critic_from_policy(critic: ValueHead, policy_variables: Any, seq_len: int, key: jax.Array | None = None, *,
                       share_base: bool = False):
    """Variables for `critic` (a ValueHead on the policy's own model) whose backbone starts as a
    copy of `policy_variables` and whose value head starts at zero: the usual way to start a
    critic from the policy PPO begins with.

    share_base: for an adapted policy, keep only a copy of the adapters in the backbone; the
    PPOObjective then reads the policy's frozen base under them (`critic_params`), so the
    train state holds one base, not two. `policy_variables` must be on the policy's own base."""
    if share_base and not lora.has_adapters(policy_variables):
        raise ValueError("critic_from_policy(share_base=True) shares the policy's frozen base, and these policy "
                         "variables have no adapters, so every weight of the policy trains: attach adapters "
                         "(lora.attach) or keep a copy (share_base=False)")
    key = jax.random.key(0) if key is None else key
    ids = jnp.zeros((1, seq_len), jnp.int32)
    fresh = jax.jit(critic.init)(key, ids, jnp.ones_like(ids), jnp.arange(seq_len)[None])
    backbone = lora.split(policy_variables["params"])[0] if share_base else policy_variables["params"]
    return {**fresh, "params": {**fresh["params"], "backbone": jax.tree.map(jnp.array, backbone)}}


def shares_base(critic_variables: Any) -> bool:
    """Whether a critic's variables hold only its adapters in its backbone (`share_base`)."""
    backbone = critic_variables.get("params", {}).get("backbone") if isinstance(critic_variables, Mapping) else None
    return isinstance(backbone, Mapping) and lora.has_adapters(backbone) and not lora.split(backbone)[1]


class PolicyOf:
    """The policy subtree of PPO variables as a `TextGeneration`: what `EpisodeRollout` samples
    with; `bind(snapshot)` binds the snapshot's `policy` part."""

    def __init__(self, model, variables: Any = None, *, pad_id: int = 0, routing: bool = False):
        from dew_lib.inference.text import TextGeneration  # here: a loss module loads no sampler

        self.generation = TextGeneration(model, None if variables is None else variables["policy"],
                                         pad_id=pad_id, routing=routing)

    def bind(self, snapshot: Any):
        if "policy" not in snapshot:
            raise KeyError("PPO variables are {'policy': ..., 'critic': ...}; this snapshot has "
                           f"{sorted(snapshot)}")
        return self.generation.bind(snapshot["policy"])


class PPOObjective(Objective):
    """PPO on packed episode rows with a critic (module docstring).

    critic: a Flax module returning one value per position for `(ids, segment_ids, positions)`,
    e.g. `ValueHead(backbone)`; initialized on its own, or from `critic_variables`.
    value_coefficient: the value loss's weight. value_clip: how far a prediction may move from
    `old_values` before its error is clipped. beta, pretrained, epsilon_low, epsilon_high,
    dual_clip, behavior_importance (a TIS cap only), sampling_temperature, kl_estimator,
    routing_replay: as in GRPOObjective, for the policy (the critic routes freely).
    """

    def __init__(self, model, seq_len: int, *, critic: nn.Module, value_coefficient: float = 0.5,
                 value_clip: float = 0.2, beta: float = 0.0, pretrained: Any = None,
                 critic_variables: Any = None, epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                 dual_clip: float | None = 3.0, behavior_importance: float | None = None,
                 sampling_temperature: float = 1.0, kl_estimator: str = "k3", routing_replay: str = "none"):
        if not callable(critic) or not hasattr(critic, "init"):
            raise TypeError("PPOObjective.critic must be a Flax module returning one value per position, "
                            "e.g. ValueHead(backbone)")
        if behavior_importance is not None and not isinstance(behavior_importance, (int, float)):
            raise ValueError("PPOObjective.behavior_importance takes a TIS cap (a number >= 1) or None; "
                             "bands and sequence masks would drop tokens from the policy loss but not "
                             "from the value loss, which share one token mass")
        self.actor = GRPOObjective(model, seq_len, beta=beta, pretrained=pretrained, policy_loss="ppo",
                                   epsilon_low=epsilon_low, epsilon_high=epsilon_high, dual_clip=dual_clip,
                                   aggregation="token-mean", behavior_importance=behavior_importance,
                                   sampling_temperature=sampling_temperature, kl_estimator=kl_estimator,
                                   routing_replay=routing_replay)
        self.model, self.seq_len, self.critic = model, seq_len, critic
        self.value_coefficient = number("PPOObjective.value_coefficient", value_coefficient, at_least=0)
        self.value_clip = number("PPOObjective.value_clip", value_clip, above=0)
        self.critic_variables = critic_variables
        self.shares_base = critic_variables is not None and shares_base(critic_variables)
        if self.shares_base and not isinstance(critic, ValueHead):
            raise ValueError("PPOObjective.critic_variables share the policy's base (adapters alone in "
                             "'backbone'), which only a ValueHead on the policy's model reads")
        self.beta = self.actor.beta
        self.ema_decay = self.actor.ema_decay

    @property
    def width(self) -> int:
        return self.seq_len + 1

    def init(self, key, variables=None):
        if variables is not None:
            return variables
        policy_key, critic_key = jax.random.split(key)
        critic = self.critic_variables
        if critic is None:
            ids = jnp.zeros((1, self.seq_len), jnp.int32)
            critic = self.critic.init(critic_key, ids, jnp.ones_like(ids), jnp.arange(self.seq_len)[None])
        return {"policy": self.actor.init(policy_key), "critic": jax.tree.map(jnp.asarray, critic)}

    def reference_params(self, params):
        """What the frozen reference keeps: the policy subtree."""
        return params["policy"]

    def critic_params(self, params):
        """The critic's variables in the PPO variables `params`: their `critic` subtree, or, when
        the critic shares the policy's base, its adapters and head over the policy's frozen base
        (the policy's adapters swapped out; nothing is copied)."""
        critic = params["critic"]
        if not self.shares_base:
            return critic
        base = lora.split(params["policy"]["params"])[1]
        backbone = lora.merge(critic["params"]["backbone"], base)
        return {**critic, "params": {**critic["params"], "backbone": backbone}}

    def trainable(self, params):
        """The policy's adapters (or all of it without any); the critic whole, or, when its
        backbone has adapters, those and every leaf outside the backbone (the value head): with a
        shared base, every leaf of its subtree."""
        critic = params["critic"]
        if not lora.has_adapters(critic):
            return {"policy": adapters_or_all(params["policy"]), "critic": jax.tree.map(lambda _: True, critic)}
        if not isinstance(self.critic, ValueHead):
            raise ValueError(f"PPOObjective.critic holds LoRA adapters but is a {type(self.critic).__name__}, "
                             "whose value head cannot be told from its frozen base; use ValueHead(backbone)")

        def head_or_adapter(path, _):
            return lora.is_adapter(path) or partitioning.path_names(path)[:2] != ("params", "backbone")

        return {"policy": adapters_or_all(params["policy"]),
                "critic": jax.tree_util.tree_map_with_path(head_or_adapter, critic)}

    def policy(self, variables: Any = None, *, pad_id: int = 0) -> PolicyOf:
        """The policy for `EpisodeRollout`: binds the `policy` part of each snapshot, and records
        the routes its draws took when the objective replays them."""
        return PolicyOf(self.model, variables, pad_id=pad_id, routing=self.actor.routing_replay != "none")

    # ----- host checks -------------------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any]) -> None:
        self.actor.check_batch(batch)
        if "input_ids" not in batch:
            return
        missing = [name for name in TARGETS if name not in batch]
        if missing:
            raise KeyError(f"PPOObjective needs {missing} beside the packed rows: run the rows through "
                           "PPORollout (or PPORollout.prepare), which adds the critic's targets")
        shape = np.shape(batch["input_ids"])
        for name in TARGETS:
            if np.shape(batch[name]) != shape:
                raise ValueError(f"batch field {name!r} has shape {np.shape(batch[name])}, but 'input_ids' "
                                 f"has {shape}; PPO's targets are aligned with input_ids")

    # ----- the critic --------------------------------------------------------------------------
    def values(self, critic_params, batch, dropout_key: jax.Array | None = None) -> jax.Array:
        """The critic's value of the state before each of ids 1..W-1, `[R, W - 1]`.
        dropout_key: the training forward's, for the critic's own adapters' dropout."""
        ids = batch["input_ids"]
        return self.critic.apply(critic_params, ids[:, :-1], batch["text_segment_ids"][:, :-1],
                                 batch["text_positions"][:, :-1], rngs=dropout_rngs(dropout_key)).astype(jnp.float32)

    def packed_values(self, critic_params, batch) -> jax.Array:
        """`values` aligned with input_ids, `[R, W]` (column 0 holds 0)."""
        return jnp.pad(self.values(critic_params, batch), ((0, 0), (1, 0)))

    # ----- the loss ----------------------------------------------------------------------------
    def terms(self, params, batch, *, step, reference, key) -> LossTerms:
        actor = self.actor.terms(params["policy"], batch, step=step, reference=reference, key=key)
        mask = batch["response_mask"][:, 1:].astype(jnp.float32)
        critic_key = None if key is None else jax.random.fold_in(key, 1)  # its own dropout masks
        predictions = self.values(self.critic_params(params), batch, critic_key)
        old_values = batch["old_values"][:, 1:].astype(jnp.float32)
        returns = batch["returns"][:, 1:].astype(jnp.float32)
        losses, clipped = algorithms.clipped_value_loss(predictions, returns, old_values, self.value_clip)
        value_total = (losses * mask).sum()
        total = actor.total + self.value_coefficient * value_total
        tokens = mask.sum()
        residual = (returns - old_values) * mask
        metrics: Metrics = dict(actor.metrics)
        metrics.update({
            "loss": (total, actor.weight),
            "critic/vf_loss": (value_total, actor.weight),
            "critic/vf_clipfrac": ((clipped * mask).sum(), tokens),
            "critic/vpred_mean": ((predictions * mask).sum(), tokens),
            "critic/returns_mean": ((returns * mask).sum(), tokens),
            "critic/returns_square": ((returns * returns * mask).sum(), tokens),
            "critic/residual_mean": (residual.sum(), tokens),
            "critic/residual_square": ((residual * residual).sum(), tokens),
        })
        return LossTerms(total, actor.weight, metrics)

    def evaluate(self, params, batch) -> Metrics:
        return self.actor.evaluate(params["policy"], batch)

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        return with_perplexity(means)

    def derive_training(self, means: dict[str, float]) -> dict[str, float]:
        """A training window's means with `critic/vf_explained_var`: 1 - Var(returns - old
        values) / Var(returns) over the window's sampled ids."""
        means = dict(means)
        names = ("critic/returns_mean", "critic/returns_square", "critic/residual_mean",
                 "critic/residual_square")
        if all(name in means for name in names):
            r, r2, d, d2 = (means[name] for name in names)
            means["critic/vf_explained_var"] = 1.0 - (d2 - d * d) / (r2 - r * r + 1e-5)
        return means


def split_optimizer(policy: optax.GradientTransformation,
                    critic: optax.GradientTransformation) -> optax.GradientTransformation:
    """One optimizer for PPO's `{"policy", "critic"}` tree that updates each part with its own
    transformation: a critic usually wants a larger rate than the policy it judges."""
    return optax.multi_transform({"policy": policy, "critic": critic},
                                 lambda params: {name: name for name in params})


__all__ = ["PPOObjective", "PolicyOf", "ValueHead", "critic_from_policy", "shares_base", "split_optimizer"]

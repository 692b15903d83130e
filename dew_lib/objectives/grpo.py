"""GRPOObjective: clipped policy-gradient training on packed rollout rows.

The batch is what `dew_lib.rollouts.pack` builds (`[R, W]` columns with W = seq_len + 1; see that module).
Input position i predicts id i + 1, so every per-token quantity below is read from columns
1..W-1 of the packed arrays and counts only where `response_mask` marks a sampled id.

One update:
  1. score the sampled ids under the current policy (at `sampling_temperature`, over the
     recorded support when the batch has `support_ids`);
  2. the policy ratio compares them with the proximal policy the batch names
     (`PackedBatch.proximal`): its `old_log_probs` ("recorded": the raw policy at sampling time or
     a rescoring pass), the detached scores of step 1 ("in_update": the weights being trained,
     scored in the update's own forward pass), or, in "bypass" mode, the behavior policy, so the
     ratio is current over behavior;
  3. behavior corrections weight or mask tokens: `behavior_importance` as a TIS cap or an
     IcePop band, `sequence_mask` and `geometric_mask` reject whole chains;
  4. the surrogate (`policy_loss`) is reduced by `aggregation`, and when beta > 0 the KL to the
     frozen reference in `TrainState.ema` (`kl_estimator`, k3 by default) is added with the same
     reduction.

Every variant is a function in `algorithms`; this class only wires them together.

Not here: sampling and rewards (`SampledRollout`, the scheduler), value functions (PPO).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.data.dataset import describe
from dew_lib.objectives import algorithms, routing
from dew_lib.objectives.base import LossTerms, Metrics, Objective, check_token_ids, with_perplexity
from dew_lib.objectives.batch import REQUIRED, proximal_mode
from dew_lib.objectives.lm import prompt_layout, score_targets
from dew_lib.objectives.policy import check_pretrained, check_seq_len, initial_variables
from dew_lib.objectives.scoring import support_log_probs
from dew_lib.options import choice

PACKED_FIELDS = REQUIRED
ALIGNED_FIELDS = PACKED_FIELDS + ("old_log_probs", "versions", "call_index", "session_weights",
                                  "rewards")


def _band(value, name: str) -> tuple[float, float] | None:
    if value is None:
        return None
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"GRPOObjective.{name} must be a (low, high) pair of ratios, got {value!r}") from None
    if not 0 <= low < 1 < high:
        raise ValueError(
            f"GRPOObjective.{name}=({low}, {high}) must satisfy 0 <= low < 1 < high; they bound "
            "the ratio of the training policy to the behavior policy"
        )
    return low, high


class GRPOObjective(Objective):
    """GRPO and its relatives (GSPO, CISPO, Dr.GRPO through the estimator) on packed rows.

    seq_len: the row width minus one. beta: KL coefficient to the frozen starting policy (0: no
    reference is kept). policy_loss: "ppo", "gspo" or "cispo". epsilon_low, epsilon_high: the
    ratio's clip range [1 - low, 1 + high]. dual_clip: the bound c on -A * r where A < 0 (ppo
    only; None turns it off). aggregation: "token-mean" or "session-mean".
    behavior_importance: None, a cap c (token TIS weight min(old / behavior, c)) or a (low,
    high) band (IcePop). sequence_mask, geometric_mask: (low, high) ratio bands on each chain's
    summed or mean log-ratio to the behavior policy. sampling_temperature: the temperature the
    ids were sampled at, so they are scored under the distribution that drew them.
    kl_estimator: how the KL to the reference is estimated per token ("k1", "k2" or "k3"; see
    `algorithms.KL_ESTIMATORS`). routing_replay: "none", or "rollout" to send each token of a
    mixture-of-experts policy to the experts the engine routed it to (objectives/routing.py), in
    the training forward and in rescoring; the reference and evaluation route freely.
    """

    def __init__(self, model, seq_len: int, *, beta: float = 0.0, pretrained: Any = None,
                 policy_loss: str = "ppo", epsilon_low: float = 0.2, epsilon_high: float = 0.2,
                 dual_clip: float | None = 3.0, aggregation: str = "token-mean",
                 behavior_importance: float | tuple[float, float] | None = None,
                 sequence_mask: tuple[float, float] | None = None,
                 geometric_mask: tuple[float, float] | None = None,
                 sampling_temperature: float = 1.0, kl_estimator: str = "k3", routing_replay: str = "none"):
        check_seq_len("GRPOObjective", model, seq_len)
        check_pretrained("GRPOObjective", pretrained)
        if beta < 0:
            raise ValueError(f"GRPOObjective.beta must be >= 0 (0 keeps no reference), got {beta}")
        choice("GRPOObjective.policy_loss", policy_loss, sorted(algorithms.POLICY_LOSSES))
        choice("GRPOObjective.aggregation", aggregation, sorted(algorithms.AGGREGATIONS))
        choice("GRPOObjective.kl_estimator", kl_estimator, sorted(algorithms.KL_ESTIMATORS))
        if not 0 <= epsilon_low < 1 or epsilon_high < 0:
            raise ValueError(
                f"GRPOObjective clip range needs 0 <= epsilon_low < 1 and epsilon_high >= 0, got "
                f"epsilon_low={epsilon_low}, epsilon_high={epsilon_high}"
            )
        if dual_clip is not None and not dual_clip > 1:
            raise ValueError(f"GRPOObjective.dual_clip must be > 1 or None, got {dual_clip}")
        if isinstance(behavior_importance, (int, float)):
            if not behavior_importance >= 1:
                raise ValueError(
                    f"GRPOObjective.behavior_importance={behavior_importance} as a TIS cap must be "
                    ">= 1 (a cap below 1 would shrink every on-policy token); use a (low, high) "
                    "pair for an IcePop band"
                )
            behavior_importance = float(behavior_importance)
        else:
            behavior_importance = _band(behavior_importance, "behavior_importance")
        if not sampling_temperature > 0:
            raise ValueError(
                f"GRPOObjective.sampling_temperature must be positive, got {sampling_temperature}; "
                "greedy draws carry no policy gradient"
            )
        self.model = model
        self.seq_len = seq_len
        self.beta = float(beta)
        self.pretrained = pretrained
        self.policy_loss = policy_loss
        self.clip = algorithms.Clip(float(epsilon_low), float(epsilon_high),
                                    None if dual_clip is None else float(dual_clip))
        self.aggregation = aggregation
        self.behavior_importance = behavior_importance
        self.sequence_mask = _band(sequence_mask, "sequence_mask")
        self.geometric_mask = _band(geometric_mask, "geometric_mask")
        self.sampling_temperature = float(sampling_temperature)
        self.kl_estimator = kl_estimator
        self.routing_replay = routing.check_replay("GRPOObjective", model, routing_replay)
        self.ema_decay = 1.0 if self.beta > 0 else None

    @property
    def width(self) -> int:
        """The packed row width this objective reads."""
        return self.seq_len + 1

    def init(self, key, variables=None):
        return initial_variables(self.model, self.pretrained, key, self.seq_len, variables)

    # ----- host checks -----------------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Refuse a packed batch (or a validation prompt batch) this objective cannot read."""
        if "input_ids" not in batch and "prompt" in batch:
            check_token_ids("prompt", batch["prompt"], self.model)
            return
        missing = [name for name in PACKED_FIELDS if name not in batch]
        if missing:
            raise KeyError(
                f"GRPOObjective needs the packed-rows fields {missing} (see dew_lib.rollouts.pack; a "
                f"Prompts batch must go through a rollout first); the batch has {describe(batch)}"
            )
        shape = np.shape(batch["input_ids"])
        if len(shape) != 2 or shape[1] != self.width:
            raise ValueError(
                f"batch field 'input_ids' has shape {shape}, expected [rows, seq_len + 1] = "
                f"[rows, {self.width}]; the objective's seq_len must be the packed width minus one "
                "(prompt plus response budget, less one)"
            )
        for name in ALIGNED_FIELDS:
            if name in batch and np.shape(batch[name]) != shape:
                raise ValueError(
                    f"batch field {name!r} has shape {np.shape(batch[name])}, but 'input_ids' has "
                    f"{shape}; every packed column is aligned with input_ids"
                )
        check_token_ids("input_ids", batch["input_ids"], self.model)
        mask = np.asarray(batch["response_mask"]) > 0
        behavior = np.asarray(batch["behavior_log_probs"])
        if np.any(behavior[~mask] != 0) or np.any(behavior[mask] > 1e-6) or not np.all(np.isfinite(behavior)):
            raise ValueError(
                "batch field 'behavior_log_probs' is not aligned with the sampled ids: it must hold "
                "a finite log-probability (<= 0) on every id response_mask marks and 0 elsewhere"
            )
        if isinstance(self.behavior_importance, float) and proximal_mode(batch) == "bypass":
            raise ValueError(
                "GRPOObjective(behavior_importance=<cap>) needs a proximal policy: in bypass mode "
                "the ratio already is current over behavior and a TIS weight would count that "
                "correction twice; rescore old_log_probs with packed_log_probs, pass "
                "PackedBatch.of(rows, proximal='in_update') when the batch trains once under the "
                "weights that would rescore it, or use a (low, high) band"
            )
        if "support_ids" in batch and "support_columns" not in batch:
            raise KeyError("batch has support_ids without support_columns; pack writes both")
        routing.check_routes("GRPOObjective", self.model, self.routing_replay, batch)

    # ----- scoring -----------------------------------------------------------------------------
    def target_log_probs(self, params, batch, dropout_key=None, *, replay: bool = True,
                         return_routing: bool = False):
        """log-probability of ids 1..W-1 of each row given their chain's prefix, `[R, W - 1]`,
        and with `return_routing` the forward's expert routing beside it. dropout_key: the
        training forward's (adapter dropout); rescoring and the reference pass none. replay:
        whether `routing_replay` applies (the reference passes False: it routes freely)."""
        ids = batch["input_ids"]
        inputs, targets = ids[:, :-1], ids[:, 1:]
        segments = batch["text_segment_ids"][:, :-1]
        positions = batch["text_positions"][:, :-1]
        routes = routing.replayed(batch, self.routing_replay if replay else "none")
        if "support_ids" in batch:
            return support_log_probs(self.model, params, inputs, targets, segments, positions,
                                     batch["support_ids"], batch["support_columns"],
                                     self.sampling_temperature, dropout_key, routes=routes,
                                     return_routing=return_routing)
        log_probs, _, *routed = score_targets(self.model, params, inputs, targets, segments, positions,
                                              temperature=self.sampling_temperature, dropout_key=dropout_key,
                                              routes=routes, return_routing=return_routing)
        return (log_probs, routed[0]) if return_routing else log_probs

    def packed_log_probs(self, params, batch) -> jax.Array:
        """Every id scored against its own chain's prefix, `[R, W]` aligned with input_ids.

        The first id of each chain and padding have no prefix and get 0. A scheduler that
        rescores the proximal policy stores this as `old_log_probs`; one whose batch trains
        under the weights it would rescore with passes `proximal="in_update"` instead and saves
        the pass.
        """
        return _packed_log_probs(self, params, {k: batch[k] for k in _SCORING_FIELDS if k in batch})

    # ----- the loss ----------------------------------------------------------------------------
    def terms(self, params, batch, *, step, reference, key) -> LossTerms:
        del step
        if routing.has_experts(self.model):  # log-probs [R, T], and the routing its router terms read
            log_probs, moe = self.target_log_probs(params, batch, dropout_key=key, return_routing=True)
        else:
            log_probs, moe = self.target_log_probs(params, batch, dropout_key=key), None
        mask = batch["response_mask"][:, 1:].astype(jnp.float32)
        advantages = batch["advantages"][:, 1:].astype(jnp.float32)
        behavior = batch["behavior_log_probs"][:, 1:].astype(jnp.float32)
        sessions = batch["session_index"][:, 1:]
        rows, t = mask.shape
        chains = jnp.arange(rows)[:, None] * t + batch["text_segment_ids"][:, 1:]
        mode = proximal_mode(batch)
        bypass = mode == "bypass"
        if mode == "in_update":  # the same numbers a rescoring pass with these weights would give
            old = jax.lax.stop_gradient(log_probs)
        else:
            old = behavior if bypass else batch["old_log_probs"][:, 1:].astype(jnp.float32)
        # The policy the corrections compare with behavior: the recorded or in-step old one, or
        # (bypass) the detached current one.
        proximal = jax.lax.stop_gradient(log_probs) if bypass else old

        weight = jnp.ones_like(mask)   # multiplies the surrogate
        kept = mask                    # tokens that stay in the loss and its normalizer
        metrics: Metrics = {}
        importance = self.behavior_importance
        if isinstance(importance, float):
            weight = algorithms.truncated_importance(old, behavior, importance)
            metrics["mismatch/tis_capped"] = ((mask * (weight >= importance)).sum(), mask.sum())
        elif importance is not None:
            band = algorithms.band_mask(proximal, behavior, *importance)
            if bypass:
                kept = kept * band
            else:
                weight = algorithms.band_weights(old, behavior, *importance)
            metrics["masked/behavior_band"] = ((mask * (1 - band)).sum(), mask.sum())
        for name, band, mean in (("sequence", self.sequence_mask, False),
                                 ("geometric", self.geometric_mask, True)):
            if band is not None:
                rejected = algorithms.chain_k1_mask(proximal, behavior, mask, chains, *band, mean=mean)
                kept = kept * rejected
                metrics[f"masked/{name}"] = ((mask * (1 - rejected)).sum(), mask.sum())

        surrogate = algorithms.POLICY_LOSSES[self.policy_loss](
            log_probs, old, advantages, kept, chains, self.clip)
        aggregate = algorithms.AGGREGATIONS[self.aggregation]
        pg_total, normalizer = aggregate(surrogate.loss * weight, kept, sessions)
        total = pg_total
        if self.beta > 0:
            if reference is None:
                raise ValueError("GRPOObjective(beta > 0) needs the frozen reference in TrainState.ema")
            reference_log_probs = self.target_log_probs(jax.lax.stop_gradient(reference), batch, replay=False)
            kl = algorithms.KL_ESTIMATORS[self.kl_estimator](log_probs, reference_log_probs)
            kl_total, _ = aggregate(kl, kept, sessions)
            total = pg_total + self.beta * kl_total
            metrics["kl"] = (kl_total, normalizer)
        if moe is not None:
            extra, router_metrics = routing.router_terms(self.model, moe, normalizer)
            total = total + extra
            metrics.update(router_metrics)
        tokens = kept.sum()
        ratio = jnp.exp(jnp.clip(log_probs - old, -20, 20))
        metrics.update({
            "loss": (total, normalizer),
            "pg_loss": (pg_total, normalizer),
            "clipfrac": ((surrogate.clipped * kept).sum(), tokens),
            "clipfrac_lower": ((surrogate.clipped_lower * kept).sum(), tokens),
            "ratio": ((ratio * kept).sum(), tokens),
            "advantages": ((advantages * mask).sum(), mask.sum()),
            "tokens": (tokens, jnp.ones(())),
        })
        metrics.update(algorithms.mismatch_metrics(proximal, behavior, mask))
        if "session_weights" in batch:
            per_session = batch["session_weights"][:, 1:].astype(jnp.float32) * mask
            metrics["response_length"] = (mask.sum(), per_session.sum())
            if "rewards" in batch:
                rewards = batch["rewards"][:, 1:].astype(jnp.float32)
                metrics["reward"] = ((rewards * per_session).sum(), per_session.sum())
        return LossTerms(total, normalizer, metrics)

    # ----- validation --------------------------------------------------------------------------
    def evaluate(self, params, batch) -> Metrics:
        """Prompt perplexity over real next-token transitions of a left-padded Prompts batch."""
        prompt = batch["prompt"]
        segments, positions = prompt_layout(batch["prompt_length"], prompt.shape[1])
        log_probs, top = score_targets(self.model, params, prompt[:, :-1], prompt[:, 1:],
                                       segments[:, :-1], positions[:, :-1])
        weights = (segments[:, :-1] * segments[:, 1:]).astype(jnp.float32)
        count = weights.sum()
        return {"loss": (-(log_probs * weights).sum(), count),
                "accuracy": ((top * weights).sum(), count)}

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        return with_perplexity(means)


_SCORING_FIELDS = ("input_ids", "text_segment_ids", "text_positions", "support_ids", "support_columns",
                   "routed_experts", "routed")


@functools.partial(jax.jit, static_argnums=0)
def _packed_log_probs(objective: GRPOObjective, params, batch):
    scores = objective.target_log_probs(params, batch)
    segments = batch["text_segment_ids"]
    has_prefix = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    scores = jnp.where(has_prefix, scores, 0.0)
    return jnp.pad(scores, ((0, 0), (1, 0)))

"""The DPO family's losses by name, as pure functions of summed log-probabilities (TRL 1.12).

Each paired loss takes `PairScores` (the policy's summed completion log-probs `[B, 2]`, the
frozen reference's, or None for a reference-free loss, and the completion lengths) and the
settings, and returns `PairLoss(loss, chosen_rewards, rejected_rewards)`, each `[B]`: one value
per pair, which the objective sums and divides by the pair count. With
`d = (chosen - ref_chosen) - (rejected - ref_rejected)`:

    sigmoid  -(1 - e) log s(beta d) - e log s(-beta d)    DPO; e = label_smoothing is cDPO
    ipo      (d_avg - 1 / (2 beta))^2                      d_avg: each side's log-ratio over its length
    hinge    max(0, 1 - beta d)                            SLiC
    robust   (-(1 - e) log s(beta d) + e log s(-beta d)) / (1 - 2e)    rDPO, unbiased under flips
    simpo    sigmoid on (a_chosen - a_rejected - gamma / beta), no reference; a = mean log-prob
    orpo     -beta log s(log odds(a_chosen) - log odds(a_rejected)), no reference; the objective
             adds the chosen NLL

Rewards are what TRL logs: `beta * (policy - reference)` for the reference losses and
`beta * a` (the length-normalised log-prob) for SimPO and ORPO. KTO is unpaired: `kto_loss`
takes one score per example, a label and the batch's KL baseline (`kto_baseline`).

Where TRL 1.12 differs from these names: its DPOTrainer ignores `label_smoothing` for 'sigmoid'
(it reads it only for 'robust', 'exo_pair' and 'aot'); Dew applies it as cDPO, the formula TRL's
CPOTrainer and its own DPOTrainer before 1.0 use.

Not here: the log-probabilities themselves (`lm.score_targets`), the NLL terms (they are batch
token means, which the objectives form), TRL's other loss types (exo_pair, nca_pair, bco_pair,
sppo_hard, aot, apo, discopop, sigmoid_norm, f-divergences, WPO weighting).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class PairScores(NamedTuple):
    """What a paired loss reads, axis 1 being (chosen, rejected)."""

    policy: jax.Array  # [B, 2] summed completion log-probs under the policy
    reference: jax.Array | None  # [B, 2] the same under the frozen reference; None: reference-free
    lengths: jax.Array  # [B, 2] completion targets counted in each sum


class PairLoss(NamedTuple):
    loss: jax.Array  # [B]
    chosen_rewards: jax.Array  # [B]
    rejected_rewards: jax.Array  # [B]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossSettings:
    """The scalars the losses read, under TRL's names."""

    beta: float
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


def _ratios(scores: PairScores) -> tuple[jax.Array, jax.Array]:
    """Each side's log-ratio of policy over reference, `[B]` each."""
    assert scores.reference is not None, "this loss needs the reference's log-probs"
    ratios = scores.policy - scores.reference  # [B, 2]
    return ratios[:, 0], ratios[:, 1]


def _averages(scores: PairScores) -> jax.Array:
    """Mean log-prob per completion token `[B, 2]` (TRL's `average_log_prob`)."""
    return scores.policy / scores.lengths


def _smoothed(logits: jax.Array, smoothing: float) -> jax.Array:
    """`-(1 - e) log s(x) - e log s(-x)`: the conservative sigmoid loss, plain at e = 0."""
    return -jax.nn.log_sigmoid(logits) * (1 - smoothing) - jax.nn.log_sigmoid(-logits) * smoothing


def _dpo_rewards(loss: jax.Array, chosen: jax.Array, rejected: jax.Array, beta: float) -> PairLoss:
    return PairLoss(loss, beta * chosen, beta * rejected)


def sigmoid(scores: PairScores, s: LossSettings) -> PairLoss:
    """DPO's logistic loss on the margin of log-ratios, cDPO when `label_smoothing` > 0."""
    chosen, rejected = _ratios(scores)
    return _dpo_rewards(_smoothed(s.beta * (chosen - rejected), s.label_smoothing), chosen, rejected, s.beta)


def ipo(scores: PairScores, s: LossSettings) -> PairLoss:
    """IPO's squared distance of the length-averaged margin to 1 / (2 beta); TRL divides each
    side's log-ratio by its completion length (confirmed with the IPO authors, its comment says)."""
    chosen, rejected = _ratios(scores)
    lengths = jnp.maximum(scores.lengths, 1.0)
    delta = chosen / lengths[:, 0] - rejected / lengths[:, 1]
    return _dpo_rewards((delta - 1 / (2 * s.beta)) ** 2, chosen, rejected, s.beta)


def hinge(scores: PairScores, s: LossSettings) -> PairLoss:
    """SLiC's hinge on the scaled margin: no gradient once `beta * d` reaches 1."""
    chosen, rejected = _ratios(scores)
    return _dpo_rewards(jax.nn.relu(1 - s.beta * (chosen - rejected)), chosen, rejected, s.beta)


def robust(scores: PairScores, s: LossSettings) -> PairLoss:
    """rDPO: the sigmoid loss debiased for labels flipped with probability `label_smoothing`."""
    chosen, rejected = _ratios(scores)
    logits = s.beta * (chosen - rejected)
    e = s.label_smoothing
    clean = -(1 - e) * jax.nn.log_sigmoid(logits)
    flipped = -e * jax.nn.log_sigmoid(-logits)
    return _dpo_rewards((clean - flipped) / (1 - 2 * e), chosen, rejected, s.beta)


def simpo(scores: PairScores, s: LossSettings) -> PairLoss:
    """SimPO (TRL's CPOTrainer, loss_type 'simpo'): the length-normalised log-prob margin less
    the target margin `simpo_gamma / beta`, in the (label-smoothed) sigmoid loss; no reference."""
    average = _averages(scores)  # [B, 2]
    logits = average[:, 0] - average[:, 1] - s.simpo_gamma / s.beta
    return PairLoss(_smoothed(s.beta * logits, s.label_smoothing), s.beta * average[:, 0], s.beta * average[:, 1])


def log1mexp(x: jax.Array) -> jax.Array:
    """`log(1 - exp(x))` for x <= 0, branching at -log 2 as TRL does; each branch reads only
    values on its own side, so the branch not taken cannot put a NaN in the gradient."""
    t = -math.log(2.0)
    return jnp.where(x < t, jnp.log1p(-jnp.exp(jnp.minimum(x, t))), jnp.log(-jnp.expm1(jnp.maximum(x, t))))


def odds_ratio(scores: PairScores) -> jax.Array:
    """ORPO's log odds ratio `[B]` of the mean chosen over the mean rejected log-prob."""
    average = _averages(scores)
    return (average[:, 0] - average[:, 1]) - (log1mexp(average[:, 0]) - log1mexp(average[:, 1]))


def orpo(scores: PairScores, s: LossSettings) -> PairLoss:
    """ORPO's odds-ratio term `-beta log s(log odds ratio)`; the chosen NLL is added by the
    objective, as TRL adds its batch cross-entropy."""
    average = _averages(scores)
    return PairLoss(-s.beta * jax.nn.log_sigmoid(odds_ratio(scores)), s.beta * average[:, 0], s.beta * average[:, 1])


def chosen_nll(log_probs: jax.Array, mask: jax.Array) -> jax.Array:
    """The chosen rows' NLL as TRL's cross-entropy takes it: a mean over every masked target of
    the batch (not a mean of per-row means), from log-probs and a mask `[B, T]`."""
    mask = mask.astype(log_probs.dtype)
    return -(log_probs * mask).sum() / jnp.maximum(mask.sum(), 1.0)


PAIR_LOSSES: dict[str, Callable[[PairScores, LossSettings], PairLoss]] = {
    "sigmoid": sigmoid, "ipo": ipo, "hinge": hinge, "robust": robust, "simpo": simpo, "orpo": orpo,
}
REFERENCE_FREE = frozenset({"simpo", "orpo"})  # these hold no reference copy


def kto_baseline(policy_kl: jax.Array, reference_kl: jax.Array) -> jax.Array:
    """KTO's reference point: the batch mean of policy minus reference log-probs of mismatched
    (prompt, completion) pairs, clamped at 0 and detached, as TRL's KTOTrainer computes it."""
    return jax.lax.stop_gradient(jnp.maximum(jnp.mean(policy_kl - reference_kl), 0.0))


def kto_loss(policy: jax.Array, reference: jax.Array, desirable: jax.Array, baseline: jax.Array, *, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """KTO's per-example loss and reward `[B]`: `w_d (1 - s(beta (r - z)))` for a desirable
    completion, `w_u (1 - s(beta (z - r)))` for an undesirable one, with r = policy - reference
    summed log-probs and z the baseline. TRL's loss is the mean over the batch's examples."""
    ratio = policy - reference  # [B]
    gain = jnp.where(desirable, ratio - baseline, baseline - ratio)
    weight = jnp.where(desirable, desirable_weight, undesirable_weight)
    return weight * (1 - jax.nn.sigmoid(beta * gain)), beta * ratio


__all__ = ["PAIR_LOSSES", "REFERENCE_FREE", "LossSettings", "PairLoss", "PairScores", "chosen_nll", "kto_baseline",
           "kto_loss", "log1mexp", "odds_ratio"]

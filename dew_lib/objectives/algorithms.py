"""The pieces of the GRPO family as pure functions on plain arrays, each found through a table.

Everything here takes and returns arrays (NumPy on the host, `jax.numpy` inside the step) and
knows nothing of models, so a parity script can call it on fixed tensors. Per-token arrays are
`[N, T]` with a 0/1 `mask`; a reduction to a scalar goes through an aggregation, which returns
a `(sum, normalizer)` pair so accumulation and data parallelism stay exact.

Tables:
    ADVANTAGES       group (GRPO), mean (Dr.GRPO), rloo          rewards per session -> advantage
    POLICY_LOSSES    ppo (dual clip), gspo, cispo                 per-token surrogate + clip flags
    KL_ESTIMATORS    k1, k2, k3                                   per-token KL to the reference
    AGGREGATIONS     token-mean, session-mean                     per-token values -> (sum, norm)

and the behavior corrections: `truncated_importance` (token TIS), `band_weights` (IcePop with a
recorded old policy), `band_mask` (IcePop in bypass mode) and `chain_k1_mask` (sequence and
geometric rejection). PPO's critic adds `gae` (advantages and returns over the masked tokens of
each row, observations skipped), `masked_whiten` and `clipped_value_loss`.

Conventions, with the reference they were checked against (verl's core_algos):
  * log-ratios are clamped to [-20, 20] before `exp`, as verl does;
  * the dual clip bound applies only where the advantage is negative;
  * GSPO's sequence log-ratio is the mean over the chain's sampled tokens, capped at 10 with no
    lower bound, and it has no dual clip;
  * CISPO's value contains the log-probability itself, so only its gradient is meaningful;
  * group advantages use the n - 1 standard deviation and epsilon 1e-6. A group of one has
    nothing to be compared with and gets advantage 0 under every estimator (verl gives a
    singleton its raw score), and sessions that do not train are never part of a group.

  * GAE skips unmasked positions (tool observations): the next value and the running advantage
    carry over them; the tail bootstraps from 0; returns are advantages plus values, taken
    before whitening, and whitening uses the unbiased (n - 1) variance and epsilon 1e-8;
  * the value loss is the larger of the plain and the clipped squared error, halved.

Not here: the model, sampling, packing (see `sessions`), and the choice of options (see
`GRPOObjective`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

LOG_RATIO_LIMIT = 20.0
GSPO_LOG_RATIO_CAP = 10.0
GROUP_EPSILON = 1e-6


# ----- advantages (host, per session) ----------------------------------------------------------

def _group_stats(rewards: np.ndarray, groups: np.ndarray):
    """Per-session group size, group mean and n - 1 standard deviation."""
    rewards = np.asarray(rewards, np.float64)
    groups = np.asarray(groups)
    _, index = np.unique(groups, return_inverse=True)
    count = np.bincount(index).astype(np.float64)
    total = np.bincount(index, weights=rewards)
    mean = total / count
    centred = rewards - mean[index]
    squares = np.bincount(index, weights=centred * centred)
    std = np.sqrt(squares / np.maximum(count - 1, 1))
    return count[index], mean[index], std[index]


def group_advantages(rewards, groups, epsilon: float = GROUP_EPSILON) -> np.ndarray:
    """GRPO: (r - group mean) / (group std + epsilon), with the n - 1 standard deviation."""
    count, mean, std = _group_stats(rewards, groups)
    advantages = (np.asarray(rewards, np.float64) - mean) / (std + epsilon)
    return np.where(count > 1, advantages, 0.0)


def mean_advantages(rewards, groups) -> np.ndarray:
    """Dr.GRPO: r - group mean (no division by the spread)."""
    count, mean, _ = _group_stats(rewards, groups)
    return np.where(count > 1, np.asarray(rewards, np.float64) - mean, 0.0)


def rloo_advantages(rewards, groups) -> np.ndarray:
    """RLOO: r minus the mean of the other members of its group."""
    count, mean, _ = _group_stats(rewards, groups)
    rewards = np.asarray(rewards, np.float64)
    others = (mean * count - rewards) / np.maximum(count - 1, 1)
    return np.where(count > 1, rewards - others, 0.0)


ADVANTAGES: dict[str, Callable[..., np.ndarray]] = {
    "group": group_advantages,
    "mean": mean_advantages,
    "rloo": rloo_advantages,
}


def advantage_function(name: str) -> Callable[..., np.ndarray]:
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGES)}")
    return ADVANTAGES[name]


def advantages(name: str, rewards, groups) -> np.ndarray:
    """Advantages of sessions with `rewards` `[n]` under estimator `name`; groups `[n]` ids."""
    return advantage_function(name)(rewards, groups)


# ----- policy losses (device, per token) -------------------------------------------------------

class Surrogate(NamedTuple):
    """Per-token policy loss and the clip indicators its metrics count, each `[N, T]`."""

    loss: jax.Array
    clipped: jax.Array
    clipped_lower: jax.Array


class Clip(NamedTuple):
    """Clipping settings shared by the policy losses."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    dual_clip: float | None = 3.0


def _ratio(log_probs, old_log_probs):
    return jnp.exp(jnp.clip(log_probs - old_log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def ppo_loss(log_probs, old_log_probs, advantages, mask, chains, clip: Clip) -> Surrogate:
    """The PPO surrogate with a dual clip: max(-A r, -A clip(r)), then min with -A c when A < 0."""
    del mask, chains
    ratio = _ratio(log_probs, old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - clip.epsilon_low, 1 + clip.epsilon_high)
    loss = jnp.maximum(unclipped, clipped)
    lower = jnp.zeros_like(loss, bool)
    if clip.dual_clip is not None:
        bound = -advantages * clip.dual_clip
        lower = (loss > bound) & (advantages < 0)
        loss = jnp.where(advantages < 0, jnp.minimum(loss, bound), loss)
    return Surrogate(loss, clipped > unclipped, lower)


def chain_sums(values, mask, chains):
    """Each token's chain total of `values` over sampled tokens, and the chain's sampled count.

    chains `[N, T]` holds a chain id per token (row * T + segment works); both results are
    `[N, T]`, constant over each chain.
    """
    n, t = values.shape
    flat = chains.reshape(-1)
    total = jax.ops.segment_sum((values * mask).reshape(-1), flat, num_segments=n * t + 1)
    count = jax.ops.segment_sum(mask.reshape(-1).astype(values.dtype), flat, num_segments=n * t + 1)
    return total[flat].reshape(n, t), count[flat].reshape(n, t)


def chain_mean(values, mask, chains):
    """Each token's mean of `values` over the sampled tokens of its chain."""
    total, count = chain_sums(values, mask, chains)
    return total / jnp.maximum(count, 1)


def gspo_loss(log_probs, old_log_probs, advantages, mask, chains, clip: Clip) -> Surrogate:
    """GSPO: a clipped, length-normalised sequence ratio pooled per chain, no dual clip.

    The token ratio is sg(s) * pi / sg(pi) with s the chain's mean log-ratio, so every token of a
    chain shares the sequence ratio's value while the gradient flows through its own log-prob.
    """
    sequence = chain_mean(log_probs - old_log_probs, mask, chains)
    log_ratio = jax.lax.stop_gradient(sequence) + log_probs - jax.lax.stop_gradient(log_probs)
    ratio = jnp.exp(jnp.minimum(log_ratio, GSPO_LOG_RATIO_CAP))
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - clip.epsilon_low, 1 + clip.epsilon_high)
    loss = jnp.maximum(unclipped, clipped)
    return Surrogate(loss, clipped > unclipped, jnp.zeros_like(loss, bool))


def cispo_loss(log_probs, old_log_probs, advantages, mask, chains, clip: Clip) -> Surrogate:
    """CISPO: -sg(clip(r)) * A * log pi; only the gradient is comparable across implementations."""
    del mask, chains
    ratio = _ratio(log_probs, old_log_probs)
    kept = jnp.clip(ratio, 1 - clip.epsilon_low, 1 + clip.epsilon_high)
    loss = -jax.lax.stop_gradient(kept) * advantages * log_probs
    return Surrogate(loss, kept != ratio, jnp.zeros_like(loss, bool))


POLICY_LOSSES: dict[str, Callable[..., Surrogate]] = {
    "ppo": ppo_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}


# ----- KL to the reference ---------------------------------------------------------------------

def k1(log_probs, reference_log_probs):
    """log pi - log pi_ref: unbiased, high variance, can be negative."""
    return log_probs - reference_log_probs


def k2(log_probs, reference_log_probs):
    """(log pi - log pi_ref)^2 / 2: nonnegative, biased (verl's "mse")."""
    delta = jnp.clip(log_probs - reference_log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return 0.5 * delta * delta


def k3(log_probs, reference_log_probs):
    """exp(ref - pi) - (ref - pi) - 1: nonnegative, low variance (verl's low_var_kl, clamped)."""
    delta = jnp.clip(reference_log_probs - log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return jnp.clip(jnp.exp(delta) - delta - 1, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[..., jax.Array]] = {"k1": k1, "k2": k2, "k3": k3}


# ----- aggregation -----------------------------------------------------------------------------

def token_mean(values, mask, sessions):
    """Every counted token weighs the same: (sum of values, count of tokens)."""
    del sessions
    return (values * mask).sum(), mask.sum()


def session_mean(values, mask, sessions):
    """Each session's token mean, averaged over sessions: (sum of session means, sessions).

    sessions `[N, T]` holds each token's session index (-1 off sampled ids). A session counts in
    the normalizer when it has any sampled token in the batch; one whose tokens were all masked
    adds 0 to the sum.
    """
    n, t = values.shape
    ids = jnp.where(sessions >= 0, sessions, n * t).reshape(-1)
    total = jax.ops.segment_sum((values * mask).reshape(-1), ids, num_segments=n * t + 1)[:-1]
    count = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=n * t + 1)[:-1]
    present = jax.ops.segment_sum(jnp.ones(n * t, values.dtype), ids, num_segments=n * t + 1)[:-1]
    return (total / jnp.maximum(count, 1)).sum(), (present > 0).sum().astype(values.dtype)


AGGREGATIONS: dict[str, Callable[..., tuple[jax.Array, jax.Array]]] = {
    "token-mean": token_mean,
    "session-mean": session_mean,
}


# ----- behavior corrections --------------------------------------------------------------------

def truncated_importance(old_log_probs, behavior_log_probs, cap: float):
    """Token TIS: min(exp(clip(old - behavior, -20, 20)), cap), detached."""
    weight = jnp.minimum(_ratio(old_log_probs, behavior_log_probs), cap)
    return jax.lax.stop_gradient(weight)


def band_mask(numerator_log_probs, behavior_log_probs, low: float, high: float):
    """IcePop: 1 where the ratio to the behavior policy lies in [low, high], else 0."""
    ratio = _ratio(numerator_log_probs, behavior_log_probs)
    return jax.lax.stop_gradient(((ratio >= low) & (ratio <= high)).astype(jnp.float32))


def band_weights(old_log_probs, behavior_log_probs, low: float, high: float):
    """IcePop with a recorded old policy: the ratio old / behavior inside [low, high], else 0."""
    ratio = _ratio(old_log_probs, behavior_log_probs)
    return jax.lax.stop_gradient(jnp.where((ratio >= low) & (ratio <= high), ratio, 0.0))


def chain_k1_mask(numerator_log_probs, behavior_log_probs, mask, chains, low: float, high: float,
                  mean: bool):
    """Reject whole chains whose k1 statistic leaves [log low, log high].

    The statistic is verl's rejection k1, log(pi_behavior / pi_train), summed over the chain's
    sampled tokens (`mean=False`, the sequence mask) or averaged over them (`mean=True`, the
    geometric mask); the sign matters when the band is not symmetric. Returns a `[N, T]` 0/1
    mask, constant over each chain; the bounds are inclusive.
    """
    total, count = chain_sums(behavior_log_probs - numerator_log_probs, mask, chains)
    statistic = total / jnp.maximum(count, 1) if mean else total
    kept = (statistic >= np.log(low)) & (statistic <= np.log(high))
    return jax.lax.stop_gradient(kept.astype(jnp.float32))


def mismatch_metrics(old_log_probs, behavior_log_probs, mask):
    """Trainer-engine mismatch over sampled tokens as (sum, count) pairs.

    kl: mean of behavior - old (k1 of KL(behavior || old) under behavior's samples); k3_kl: the
    k3 form of the same; ess: the normalized effective sample size of the weights old/behavior.
    """
    delta = jnp.clip(old_log_probs - behavior_log_probs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    count = mask.sum()
    weights = jnp.exp(delta) * mask
    ess = weights.sum() ** 2 / jnp.maximum((weights * weights).sum() * count, 1e-30)
    return {
        "mismatch/kl": ((-delta * mask).sum(), count),
        "mismatch/k3_kl": (((jnp.exp(delta) - delta - 1) * mask).sum(), count),
        "mismatch/ess": (ess, jnp.ones(())),
    }


# ----- the critic (PPO) ------------------------------------------------------------------------

WHITEN_EPSILON = 1e-8


def gae(rewards, values, mask, gamma: float, lam: float):
    """(advantages, returns) `[N, T]` by generalized advantage estimation along each row.

    Unmasked positions (observations, padding) are skipped: the next value and the running
    advantage pass over them unchanged, and they get the running advantage, as verl's
    `compute_gae_advantage_return` does. The row's tail bootstraps from 0.
    """
    rewards, values, mask = (jnp.asarray(x, jnp.float32) for x in (rewards, values, mask))

    def back(carry, column):
        next_value, running = carry
        reward, value, kept = column
        delta = reward + gamma * next_value - value
        advantage = delta + gamma * lam * running
        next_value = value * kept + (1 - kept) * next_value
        running = advantage * kept + (1 - kept) * running
        return (next_value, running), running

    zeros = jnp.zeros(rewards.shape[0], jnp.float32)
    _, reversed_ = jax.lax.scan(back, (zeros, zeros), (rewards.T, values.T, mask.T), reverse=True)
    advantages = reversed_.T
    return advantages, advantages + values


def masked_whiten(values, mask, epsilon: float = WHITEN_EPSILON):
    """`(values - mean) / sqrt(var + epsilon)` over the masked entries, unbiased variance."""
    values, mask = jnp.asarray(values, jnp.float32), jnp.asarray(mask, jnp.float32)
    count = mask.sum()
    mean = (values * mask).sum() / count
    var = (((values - mean) ** 2) * mask).sum() / count * (count / (count - 1))
    return (values - mean) * jax.lax.rsqrt(var + epsilon)


def clipped_value_loss(predictions, returns, old_values, clip: float):
    """Per-token `0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2)` and where the clipped
    error was the larger."""
    clipped = old_values + jnp.clip(predictions - old_values, -clip, clip)
    plain, bounded = (predictions - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * jnp.maximum(plain, bounded), (bounded > plain).astype(jnp.float32)

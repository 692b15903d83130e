"""DPOObjective: the paired DPO family (TRL's `loss_type`) over PreferencePairs batches.

Batch layout (`S` = seq_len + 1, what `PreferencePairs(seq_len=S)` loads):

    input_ids        [B, 2, S] int32   index 0 the chosen sequence, 1 the rejected one
    completion_mask  [B, 2, S] int32   1 on completion tokens (EOS included), 0 on prompt/padding

Each side's score is the sum of next-token log-probabilities over its completion targets; the
loss per pair is `preference_losses.PAIR_LOSSES[loss_type]` of those sums (sigmoid DPO and cDPO,
IPO, hinge, robust; reference-free SimPO and ORPO), summed and divided by the pair count. The
reference losses read the starting policy frozen in `TrainState.ema` (`ema_decay` is 1); SimPO
and ORPO read none, so their `ema_decay` is None and the Trainer keeps no copy. A policy that
still equals its reference has loss log 2 under sigmoid DPO.

Two losses add a chosen NLL the way TRL forms it, a token mean over the batch's chosen rows:
ORPO over prompt and completion (every target up to the last completion token), SimPO with
`cpo_alpha` over the completion (CPO's term). Each is reported per pair (mean x pairs), so under
accumulation the microbatches' means are averaged, as TRL averages them. `nll_weight` is RPO's
term: each pair's chosen NLL per token.

Validation reports the perplexity of the chosen completions under the policy, which says how
likely the preferred answers are, not how often they win.

Not here: KTO (unpaired, kto.py), TRL's other loss types (exo_pair, nca_pair, bco_pair, aot,
apo, discopop, f-divergences), the loss math itself (preference_losses.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.data.dataset import describe
from dew_lib.objectives.base import LossTerms, Metrics, Objective, check_token_ids, with_perplexity
from dew_lib.objectives.lm import score_targets
from dew_lib.objectives.policy import check_pretrained, check_seq_len, initial_variables
from dew_lib.objectives.preference_losses import (
    PAIR_LOSSES,
    REFERENCE_FREE,
    LossSettings,
    PairScores,
    chosen_nll,
    odds_ratio,
)
from dew_lib.objectives.routing import has_experts, router_terms


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta: float):
    """Per-pair sigmoid DPO loss and the implicit rewards `beta * (policy - reference)`.

    Inputs are summed completion log-probabilities `[B]`. Returns `(loss, chosen_rewards,
    rejected_rewards)`, each `[B]`.
    """
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    return -jax.nn.log_sigmoid(chosen - rejected), chosen, rejected


def check_family(owner: str, loss_type: str, beta: float, label_smoothing: float, simpo_gamma: float,
                 cpo_alpha: float, nll_weight: float) -> None:
    """Refuse settings the chosen loss cannot read, naming the option (shared with DPOOptions)."""
    if loss_type not in PAIR_LOSSES and loss_type != "kto":
        raise ValueError(f"{owner}.loss_type={loss_type!r} is not one of {sorted([*PAIR_LOSSES, 'kto'])}")
    if not beta > 0:
        raise ValueError(f"{owner}.beta must be positive, got {beta}; it scales the log-ratio to the "
                         "reference (0.1 is a common start)")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"{owner}.label_smoothing={label_smoothing} must lie in [0, 0.5): it is the "
                         "probability that a preference label is flipped")
    if label_smoothing and loss_type not in ("sigmoid", "robust", "simpo"):
        raise ValueError(f"{owner}.label_smoothing={label_smoothing} is read only by loss_type 'sigmoid' "
                         f"(cDPO), 'robust' and 'simpo'; loss_type={loss_type!r} has no label to smooth: "
                         "set label_smoothing=0")
    if simpo_gamma < 0:
        raise ValueError(f"{owner}.simpo_gamma must be >= 0 (SimPO's target margin), got {simpo_gamma}")
    if cpo_alpha < 0 or (cpo_alpha and loss_type != "simpo"):
        raise ValueError(f"{owner}.cpo_alpha={cpo_alpha} weighs CPO's chosen NLL, which only loss_type "
                         f"'simpo' adds (>= 0); with loss_type={loss_type!r} set cpo_alpha=0")
    if nll_weight < 0:
        raise ValueError(f"{owner}.nll_weight must be >= 0 (0 is plain DPO), got {nll_weight}")
    if nll_weight and loss_type in ("simpo", "orpo", "kto"):
        own = {"simpo": "its NLL is cpo_alpha", "orpo": "ORPO's loss already holds the chosen NLL",
               "kto": "KTO's examples are unpaired"}[loss_type]
        raise ValueError(f"{owner}.nll_weight={nll_weight} adds RPO's chosen NLL to the reference losses; "
                         f"with loss_type={loss_type!r} {own}: set nll_weight=0")


def family_terms(log_probs, mask, reference, *, loss_type: str, settings: LossSettings, cpo_alpha: float = 0.0):
    """`(PairLoss, nll, scores)` of a paired loss from per-token log-probs `[B, 2, T]` (each
    target's, 0 chosen, 1 rejected), their completion mask `[B, 2, T]` and the reference's summed
    log-probs `[B, 2]` (None for SimPO and ORPO). nll is the batch token mean TRL adds (ORPO's,
    or SimPO's times cpo_alpha), else None; the objective and the parity tests both call this."""
    scores = PairScores((log_probs * mask).sum(-1), reference, mask.sum(-1))  # [B, 2] each
    nll = None
    if loss_type == "orpo":  # TRL's NLL runs over prompt and completion: up to the last completion target
        nll = chosen_nll(log_probs[:, 0], (jnp.cumsum(mask[:, 0, ::-1], axis=-1) > 0)[:, ::-1])
    elif loss_type == "simpo" and cpo_alpha:
        nll = cpo_alpha * chosen_nll(log_probs[:, 0], mask[:, 0])
    return PAIR_LOSSES[loss_type](scores, settings), nll, scores


class DPOObjective(Objective):
    """A paired DPO-family loss over `PreferencePairs` batches (see the module docstring)."""

    def __init__(self, model, seq_len: int, *, beta: float = 0.1, pretrained: Any = None,
                 ema_decay: float | None = 1.0, nll_weight: float = 0.0, loss_type: str = "sigmoid",
                 label_smoothing: float = 0.0, simpo_gamma: float = 0.5, cpo_alpha: float = 0.0):
        check_seq_len("DPOObjective", model, seq_len)
        if loss_type == "kto":
            raise ValueError("DPOObjective trains pairs; loss_type='kto' reads unpaired examples: use "
                             "KTOObjective with UnpairedExamples")
        check_family("DPOObjective", loss_type, beta, label_smoothing, simpo_gamma, cpo_alpha, nll_weight)
        free = loss_type in REFERENCE_FREE
        if ema_decay != 1.0 and not (free and ema_decay is None):
            raise ValueError(
                f"DPOObjective keeps its reference frozen in TrainState.ema, so ema_decay must be "
                f"1.0; got {ema_decay}. Drop the ema_decay argument"
            )
        check_pretrained("DPOObjective", pretrained)
        self.nll_weight = float(nll_weight)
        self.model = model
        self.seq_len = seq_len
        self.beta = float(beta)
        self.loss_type = loss_type
        self.settings = LossSettings(beta=self.beta, label_smoothing=float(label_smoothing),
                                     simpo_gamma=float(simpo_gamma))
        self.cpo_alpha = float(cpo_alpha)
        self.pretrained = pretrained
        self.ema_decay = None if free else 1.0  # SimPO and ORPO hold no reference copy

    def init(self, key, variables=None):
        return initial_variables(self.model, self.pretrained, key, self.seq_len, variables)

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        width = self.seq_len + 1
        for name in ("input_ids", "completion_mask"):
            if name not in batch:
                raise KeyError(
                    f"DPOObjective needs {name!r} [B, 2, {width}] (as PreferencePairs loads); the "
                    f"batch has {describe(batch)}"
                )
            shape = np.shape(batch[name])
            if len(shape) != 3 or shape[1] != 2 or shape[2] != width:
                raise ValueError(
                    f"batch field {name!r} has shape {shape}, expected [B, 2, seq_len + 1] = "
                    f"[B, 2, {width}]; PreferencePairs.seq_len is the full row width, so use "
                    f"DPOObjective(seq_len=PreferencePairs.seq_len - 1)"
                )
        check_token_ids("input_ids", batch["input_ids"], self.model)
        mask = np.asarray(batch["completion_mask"])
        if not np.all(mask[..., 1:].sum(-1) > 0):
            row = int(np.argwhere(mask[..., 1:].sum(-1) == 0)[0][0])
            raise ValueError(
                f"pair {row} of the batch has a side with no completion target (its completion "
                "mask is 0 after the first token); every pair needs an answer to compare"
            )

    def _scores(self, params, batch, dropout_key=None, *, routing: bool = False):
        """Summed completion log-probs `[B, 2]`, the per-token ones, the argmax hits, the target
        mask and, when asked, a mixture-of-experts policy's routing (else None); only the
        policy's training forward passes `dropout_key` (adapter dropout), never the reference."""
        ids = batch["input_ids"]
        b, _, s = ids.shape
        flat = ids.reshape(2 * b, s)
        mask = batch["completion_mask"].reshape(2 * b, s)[:, 1:].astype(jnp.float32)
        log_probs, top, *routed = score_targets(self.model, params, flat[:, :-1], flat[:, 1:],
                                                dropout_key=dropout_key, return_routing=routing)  # [2B, S-1]
        summed = (log_probs * mask).sum(-1).reshape(b, 2)
        return summed, log_probs, top, mask, (routed[0] if routing else None)

    def terms(self, params, batch, *, step, reference, key) -> LossTerms:
        del step
        policy, log_probs, _, mask, moe = self._scores(params, batch, dropout_key=key,
                                                       routing=has_experts(self.model))
        ref = None
        if self.loss_type not in REFERENCE_FREE:
            if reference is None:
                raise ValueError("DPOObjective needs the frozen reference in TrainState.ema")
            ref = self._scores(jax.lax.stop_gradient(reference), batch)[0]
        b = policy.shape[0]
        (losses, chosen, rejected), nll, scores = family_terms(
            log_probs.reshape(b, 2, -1), mask.reshape(b, 2, -1), ref, loss_type=self.loss_type,
            settings=self.settings, cpo_alpha=self.cpo_alpha)
        tokens = scores.lengths  # [B, 2]
        pairs = jnp.asarray(losses.shape[0], jnp.float32)
        metrics: Metrics = {
            "loss": (losses.sum(), pairs),
            "rewards/chosen": (chosen.sum(), pairs),
            "rewards/rejected": (rejected.sum(), pairs),
            "rewards/margin": ((chosen - rejected).sum(), pairs),
            "rewards/accuracy": ((chosen > rejected).sum().astype(jnp.float32), pairs),
            "logps/chosen": (policy[:, 0].sum(), pairs),
            "logps/rejected": (policy[:, 1].sum(), pairs),
            "tokens": (tokens.sum(), jnp.ones(())),
        }
        total = losses.sum()
        if self.loss_type == "orpo":
            metrics["log_odds_chosen"] = (odds_ratio(scores).sum(), pairs)
        if nll is not None:  # a batch token mean, counted once per pair
            total = total + nll * pairs
            metrics["nll"] = (nll * pairs, pairs)
        if self.nll_weight:
            rpo = -policy[:, 0] / jnp.maximum(tokens[:, 0], 1)  # [B] chosen NLL per token
            total = total + self.nll_weight * rpo.sum()
            metrics["nll"] = (rpo.sum(), pairs)
        if moe is not None:  # a mixture-of-experts policy's router terms (objectives/routing.py)
            router, router_metrics = router_terms(self.model, moe, pairs)
            total = total + router
            metrics.update(router_metrics)
        if "nll" in metrics or moe is not None:  # the total holds more than the preference loss
            metrics["loss"] = (total, pairs)
            metrics["dpo_loss"] = (losses.sum(), pairs)
        return LossTerms(total, pairs, metrics)

    def evaluate(self, params, batch) -> Metrics:
        """Negative log-likelihood and top-1 accuracy of the chosen completions' targets."""
        _, log_probs, top, mask, _ = self._scores(params, batch)
        b = batch["input_ids"].shape[0]
        chosen_log_probs = log_probs.reshape(b, 2, -1)[:, 0]
        chosen_mask = mask.reshape(b, 2, -1)[:, 0]
        chosen_top = top.reshape(b, 2, -1)[:, 0]
        count = chosen_mask.sum()
        return {
            "loss": (-(chosen_log_probs * chosen_mask).sum(), count),
            "accuracy": ((chosen_top * chosen_mask).sum(), count),
        }

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        return with_perplexity(means)  # the chosen answers' perplexity

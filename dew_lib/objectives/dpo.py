"""DPOObjective: direct preference optimization against a frozen copy of the starting policy.

Batch layout (`S` = seq_len + 1, what `PreferencePairs(seq_len=S)` loads):

    input_ids        [B, 2, S] int32   index 0 the chosen sequence, 1 the rejected one
    completion_mask  [B, 2, S] int32   1 on completion tokens (EOS included), 0 on prompt/padding

Each side's score is the sum of next-token log-probabilities over its completion targets. With
`d = (chosen - ref_chosen) - (rejected - ref_rejected)`, the loss per pair is
`-log sigmoid(beta * d)`: TRL's sigmoid DPO loss. The reference is `TrainState.ema`, which the
Trainer freezes because this objective's `ema_decay` is 1. A policy that still equals its
reference has d = 0 and loss log 2.

Validation reports the perplexity of the chosen completions under the policy, which says how
likely the preferred answers are, not how often they win.

Not here: other preference losses (IPO, hinge, robust), label smoothing, reference-free DPO.
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
from dew_lib.objectives.routing import has_experts, router_terms


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta: float):
    """Per-pair sigmoid DPO loss and the implicit rewards `beta * (policy - reference)`.

    Inputs are summed completion log-probabilities `[B]`. Returns `(loss, chosen_rewards,
    rejected_rewards)`, each `[B]`.
    """
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    return -jax.nn.log_sigmoid(chosen - rejected), chosen, rejected


class DPOObjective(Objective):
    """Sigmoid DPO over `PreferencePairs` batches with the frozen starting policy as reference."""

    def __init__(self, model, seq_len: int, *, beta: float = 0.1, pretrained: Any = None,
                 ema_decay: float = 1.0, nll_weight: float = 0.0):
        check_seq_len("DPOObjective", model, seq_len)
        if not beta > 0:
            raise ValueError(
                f"DPOObjective.beta must be positive, got {beta}; it scales the log-ratio to the "
                "reference (0.1 is a common start)"
            )
        if ema_decay != 1.0:
            raise ValueError(
                f"DPOObjective keeps its reference frozen in TrainState.ema, so ema_decay must be "
                f"1.0; got {ema_decay}. Drop the ema_decay argument"
            )
        check_pretrained("DPOObjective", pretrained)
        if nll_weight < 0:
            raise ValueError(f"DPOObjective.nll_weight must be >= 0 (0 is plain DPO), got {nll_weight}")
        self.nll_weight = float(nll_weight)
        self.model = model
        self.seq_len = seq_len
        self.beta = float(beta)
        self.pretrained = pretrained
        self.ema_decay = 1.0

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
        policy, _, _, mask, moe = self._scores(params, batch, dropout_key=key, routing=has_experts(self.model))
        if reference is None:
            raise ValueError("DPOObjective needs the frozen reference in TrainState.ema")
        ref = self._scores(jax.lax.stop_gradient(reference), batch)[0]
        losses, chosen, rejected = dpo_loss(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], self.beta)
        pairs = jnp.asarray(losses.shape[0], jnp.float32)
        tokens = mask.reshape(-1, 2, mask.shape[-1]).sum(-1)  # [B, 2]
        nll = -policy[:, 0] / jnp.maximum(tokens[:, 0], 1)  # [B] chosen NLL per token
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
        if self.nll_weight:
            total = total + self.nll_weight * nll.sum()
            metrics["nll"] = (nll.sum(), pairs)
            metrics["loss"] = (total, pairs)
            metrics["dpo_loss"] = (losses.sum(), pairs)
        if moe is not None:  # a mixture-of-experts policy's router terms (objectives/routing.py)
            extra, router_metrics = router_terms(self.model, moe, pairs)
            total = total + extra
            metrics.update({**router_metrics, "loss": (total, pairs), "dpo_loss": (losses.sum(), pairs)})
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

"""KTOObjective: Kahneman-Tversky optimization on unpaired desirable and undesirable completions.

Batch layout (`S` = seq_len + 1, what `UnpairedExamples(seq_len=S)` loads):

    input_ids           [B, S] int32   prompt then completion, right-padded
    completion_mask     [B, S] int32   1 on completion tokens (EOS included)
    label               [B]    int32   1 desirable, 0 undesirable
    kl_input_ids        [B, S] int32   row i's prompt followed by row i-1's completion (row 0
    kl_completion_mask  [B, S] int32   takes the last row's): TRL's mismatched pairs

Each example's score is its summed completion log-prob; r = policy - reference. The reference
point z is the batch mean of policy - reference over the mismatched rows, clamped at 0 and
detached (`preference_losses.kto_baseline`), as TRL's KTOTrainer estimates the KL. The loss per
example is `desirable_weight (1 - s(beta (r - z)))` or `undesirable_weight (1 - s(beta (z - r)))`,
averaged over the batch's examples. The reference is the starting policy frozen in
`TrainState.ema`. z is a batch statistic: under gradient accumulation each microbatch has its
own, as each TRL micro-batch does, so a batch too small to hold several prompts estimates it
poorly (TRL refuses a per-device batch of 1).

Validation reports the perplexity of the desirable completions under the policy.

Not here: TRL's 'apo_zero_unpaired' loss, its desirability-balance warning (the loader reports
the counts), paired data (dpo.py).
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
from dew_lib.objectives.preference_losses import kto_baseline, kto_loss
from dew_lib.objectives.routing import has_experts, router_terms

FIELDS = ("input_ids", "completion_mask", "kl_input_ids", "kl_completion_mask")


class KTOObjective(Objective):
    """KTO over `UnpairedExamples` batches against the frozen starting policy."""

    def __init__(self, model, seq_len: int, *, beta: float = 0.1, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, pretrained: Any = None):
        check_seq_len("KTOObjective", model, seq_len)
        if not beta > 0:
            raise ValueError(f"KTOObjective.beta must be positive, got {beta}; it scales the log-ratio "
                             "to the reference (TRL's default is 0.1)")
        for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
            if not weight > 0:
                raise ValueError(f"KTOObjective.{name} must be positive, got {weight}; KTO's paper keeps "
                                 "desirable_weight x desirable count / (undesirable_weight x undesirable "
                                 "count) within [1, 4/3]")
        check_pretrained("KTOObjective", pretrained)
        self.model = model
        self.seq_len = seq_len
        self.beta = float(beta)
        self.desirable_weight = float(desirable_weight)
        self.undesirable_weight = float(undesirable_weight)
        self.pretrained = pretrained
        self.ema_decay = 1.0  # the frozen reference

    def init(self, key, variables=None):
        return initial_variables(self.model, self.pretrained, key, self.seq_len, variables)

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        width = self.seq_len + 1
        for name in (*FIELDS, "label"):
            if name not in batch:
                raise KeyError(f"KTOObjective needs {name!r} (as UnpairedExamples loads); the batch has "
                               f"{describe(batch)}")
        rows = np.shape(batch["label"])
        for name in FIELDS:
            shape = np.shape(batch[name])
            if len(shape) != 2 or shape[1] != width or shape[:1] != rows:
                raise ValueError(f"batch field {name!r} has shape {shape}, expected [B, seq_len + 1] = "
                                 f"[{rows[0] if rows else 'B'}, {width}]; UnpairedExamples.seq_len is the "
                                 "full row width, so use KTOObjective(seq_len=UnpairedExamples.seq_len - 1)")
        for name in ("input_ids", "kl_input_ids"):
            check_token_ids(name, batch[name], self.model)
        labels = np.asarray(batch["label"])
        if not np.isin(labels, (0, 1)).all():
            raise ValueError(f"batch field 'label' holds {sorted(set(labels.tolist()) - {0, 1})}; a label "
                             "is 1 (desirable) or 0 (undesirable)")
        empty = np.asarray(batch["completion_mask"])[:, 1:].sum(-1) == 0
        if empty.any():
            raise ValueError(f"example {int(np.argmax(empty))} of the batch has no completion target (its "
                             "completion mask is 0 after the first token)")

    def _summed(self, params, ids, mask, dropout_key=None, *, routing: bool = False):
        """Summed completion log-probs `[B]`, the per-token ones, the argmax hits, the target mask
        and the routing of a mixture-of-experts policy when asked."""
        weights = mask[:, 1:].astype(jnp.float32)
        log_probs, top, *routed = score_targets(self.model, params, ids[:, :-1], ids[:, 1:],
                                                dropout_key=dropout_key, return_routing=routing)  # [B, S-1]
        return (log_probs * weights).sum(-1), log_probs, top, weights, (routed[0] if routing else None)

    def terms(self, params, batch, *, step, reference, key) -> LossTerms:
        del step
        if reference is None:
            raise ValueError("KTOObjective needs the frozen reference in TrainState.ema")
        policy, _, _, mask, moe = self._summed(params, batch["input_ids"], batch["completion_mask"], key,
                                               routing=has_experts(self.model))
        frozen = jax.lax.stop_gradient(reference)
        ref = self._summed(frozen, batch["input_ids"], batch["completion_mask"])[0]
        # The baseline is detached, so the mismatched rows need no backward pass.
        policy_kl = self._summed(jax.lax.stop_gradient(params), batch["kl_input_ids"], batch["kl_completion_mask"])[0]
        reference_kl = self._summed(frozen, batch["kl_input_ids"], batch["kl_completion_mask"])[0]
        baseline = kto_baseline(policy_kl, reference_kl)
        desirable = batch["label"] > 0  # [B]
        losses, rewards = kto_loss(policy, ref, desirable, baseline, beta=self.beta,
                                   desirable_weight=self.desirable_weight,
                                   undesirable_weight=self.undesirable_weight)
        examples = jnp.asarray(losses.shape[0], jnp.float32)
        wanted = desirable.astype(jnp.float32)
        unwanted = 1.0 - wanted
        metrics: Metrics = {
            "loss": (losses.sum(), examples),
            "kl": (baseline, jnp.ones(())),
            "rewards/chosen": ((rewards * wanted).sum(), wanted.sum()),
            "rewards/rejected": ((rewards * unwanted).sum(), unwanted.sum()),
            "logps/chosen": ((policy * wanted).sum(), wanted.sum()),
            "logps/rejected": ((policy * unwanted).sum(), unwanted.sum()),
            "desirable": (wanted.sum(), examples),
            "tokens": (mask.sum(), jnp.ones(())),
        }
        total = losses.sum()
        if moe is not None:  # a mixture-of-experts policy's router terms (objectives/routing.py)
            router, router_metrics = router_terms(self.model, moe, examples)
            total = total + router
            metrics.update({**router_metrics, "loss": (total, examples), "kto_loss": (losses.sum(), examples)})
        return LossTerms(total, examples, metrics)

    def evaluate(self, params, batch) -> Metrics:
        """Negative log-likelihood and top-1 accuracy of the desirable completions' targets."""
        _, log_probs, top, mask, _ = self._summed(params, batch["input_ids"], batch["completion_mask"])
        mask = mask * (batch["label"] > 0)[:, None]
        count = mask.sum()
        return {"loss": (-(log_probs * mask).sum(), count), "accuracy": ((top * mask).sum(), count)}

    def derive(self, means: dict[str, float]) -> dict[str, float]:
        return with_perplexity(means)  # the desirable answers' perplexity


__all__ = ["KTOObjective"]

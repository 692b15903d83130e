"""Write the DPO parity fixture from TRL's own DPOTrainer loss code.

Run from the repository root with any Python 3.11:

    python3 tools/parity_dpo.py             # sigmoid DPO, TRL 1.16.0: dpo_trl.json
    python3 tools/parity_dpo.py --family    # the DPO family, TRL 1.12.0: dpo_family_trl.json

It makes (or reuses) tools/.venv-trl with the CPU build of torch and TRL at TRL_VERSION (with
--family: tools/.venv-trl-1.12 and FAMILY_VERSION, the release the family's semantics follow),
re-runs itself there, and writes the fixture under tests/fixtures/parity/. Tests never import
torch or TRL. The family's cases (sigmoid, cDPO, IPO, hinge, robust, SimPO, CPO-SimPO, ORPO and
KTO with its KL baseline) and their layout are described in tools/_parity_dpo_family.py.

How TRL is called. TRL 1.16 has no free DPO loss function: the sigmoid loss lives inside
`DPOTrainer._compute_loss(self, model, inputs, return_outputs)`. The script calls that method
unbound, with a stand-in `self` whose settings (beta, loss_type, loss_weights, f_divergence_type,
ld_alpha, use_weighting, label_smoothing) come from a real `DPOConfig`, and a stand-in model that
returns what TRL's fused LM head returns: `log_probs[b, t]` = log p(token t+1 | prefix) where the
label is kept, 0 where it is -100 (TRL masks labels outside `completion_mask`). The reference
enters through TRL's `precompute_ref_log_probs` path (`ref_chosen_logps`, `ref_rejected_logps`
in the inputs), which is the same difference of summed log-probs as a reference forward pass.
Gradients are torch autograd through TRL's code, with respect to the per-token policy log-probs.

Fixture layout (arrays are {"dtype", "shape", "data"}; see tools/_parity_io.py `load_array`):

    reference: package, version, wheel_sha256, source_sha256 of trl/trainer/dpo_trainer.py,
               torch version, the method called
    cases[]:   name, options {beta, loss_type}, inputs, outputs

    inputs (Dew's PreferencePairs layout, index 0 on axis 1 = chosen, 1 = rejected):
      token_log_probs    float32 [B, 2, S]  log p(token t | tokens < t) under the policy; the
                                             value at a position outside the mask is arbitrary
                                             and must not matter
      completion_mask    int32   [B, 2, S]  1 on completion tokens (position 0 is never one)
      reference_log_probs float32 [B, 2]    summed completion log-probs of the reference
    outputs:
      policy_log_probs   float32 [B, 2]     TRL's summed completion log-probs of the policy
      loss               float32 []         mean over pairs of -logsigmoid(beta * margin)
      metrics            {name: float}      TRL's logged batch means: rewards/chosen,
                                             rewards/rejected, rewards/accuracies,
                                             rewards/margins, logps/chosen, logps/rejected
      pair_loss, chosen_rewards, rejected_rewards, reward_accuracy   float32 [B]
                                             TRL run on each pair alone (batch of one):
                                             its loss and its logged rewards
      grad_token_log_probs float32 [B, 2, S] d loss / d token_log_probs (0 off the mask)
      grad_policy_log_probs float32 [B, 2]  d loss / d summed policy log-probs (the common value
                                             of the per-token gradient over each completion)

Cases: "beta_0.1" and "beta_0.5" on the same pairs (one pair equal to its reference, one pair
whose chosen and rejected rewards tie exactly, two pairs whose margins saturate the sigmoid),
and "policy_equals_reference" (every pair equal to its reference: loss log 2, rewards 0,
accuracy 0 because TRL counts chosen > rejected strictly).
"""

from __future__ import annotations

import math
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parity_io as io  # noqa: E402

TRL_VERSION = "1.16.0"
VENV = io.ROOT / "tools" / ".venv-trl"
FAMILY_VERSION = "1.12.0"
FAMILY_VENV = io.ROOT / "tools" / ".venv-trl-1.12"
SEED = 20260701
PAIRS, LENGTH = 6, 10


def _inputs(torch):
    """Six pairs of random completions with different prompt and completion lengths."""
    generator = torch.Generator().manual_seed(SEED)
    token_log_probs = -torch.rand(PAIRS, 2, LENGTH, generator=generator) * 3.0 - 0.05
    completion_mask = torch.zeros(PAIRS, 2, LENGTH, dtype=torch.int64)
    spans = [((2, 7), (2, 9)), ((4, 10), (4, 5)), ((1, 3), (1, 10)), ((3, 8), (3, 8)),
             ((5, 9), (5, 6)), ((2, 6), (2, 4))]  # (start, stop) of chosen and rejected
    for pair, sides in enumerate(spans):
        for side, (start, stop) in enumerate(sides):
            completion_mask[pair, side, start:stop] = 1
    policy = _summed(torch, token_log_probs, completion_mask)
    offsets = torch.randn(PAIRS, 2, generator=generator) * 2.0
    reference = policy + offsets
    reference[0] = policy[0]  # a pair equal to its reference
    # a pair whose chosen and rejected log-ratios tie (rewards equal, accuracy 0)
    reference[1, 1] = policy[1, 1] - (policy[1, 0] - reference[1, 0])
    reference[4] = policy[4] + torch.tensor([-150.0, 150.0])  # margin +300: saturated
    reference[5] = policy[5] + torch.tensor([200.0, -200.0])  # margin -400: saturated
    return token_log_probs, completion_mask, reference


def _summed(torch, token_log_probs, completion_mask):
    """Summed completion log-probs computed with TRL's own operations, in its batch layout.

    TRL sums `log_probs[:, 1:]` (zeros off the completion) of the stacked [2B, S] batch; a sum in
    another order can differ in the last bit, and "policy equals reference" needs the same bits.
    """
    pairs = token_log_probs.shape[0]
    stacked = token_log_probs.transpose(0, 1).reshape(2 * pairs, -1)
    kept = completion_mask.transpose(0, 1).reshape(2 * pairs, -1)[:, 1:] != 0
    sums = torch.where(kept, stacked[:, 1:], torch.zeros(())).sum(dim=1)
    return sums.reshape(2, pairs).transpose(0, 1).contiguous()


class _Accelerator:
    device = None  # set in main, once torch is imported

    @staticmethod
    def gather(tensor):
        return tensor

    gather_for_metrics = gather


class _FusedHead:
    """Stands in for a model called with `fused_lm_head=True`: returns the given log-probs."""

    training = True

    def __init__(self, torch, token_log_probs):
        self.torch = torch
        self.token_log_probs = token_log_probs  # [2B, S], aligned with input_ids

    def __call__(self, *, input_ids, attention_mask, labels, use_cache, fused_lm_head):
        torch = self.torch
        kept = labels[:, 1:] != -100
        log_probs = torch.where(kept, self.token_log_probs[:, 1:], torch.zeros(()))
        zeros = torch.zeros_like(log_probs)
        return SimpleNamespace(log_probs=log_probs, entropy=zeros, mean_logits=zeros,
                               is_top1=torch.zeros_like(kept), aux_loss=None)


def _trl_loss(torch, trl_self, token_log_probs, completion_mask, reference):
    """Run TRL's `_compute_loss` on pairs in Dew's [B, 2, S] layout; return loss and metrics."""
    from trl.trainer.dpo_trainer import DPOTrainer

    pairs = token_log_probs.shape[0]
    stacked = token_log_probs.transpose(0, 1).reshape(2 * pairs, -1)  # [chosen..., rejected...]
    mask = completion_mask.transpose(0, 1).reshape(2 * pairs, -1)
    model = _FusedHead(torch, stacked)
    trl_self.model = model
    trl_self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    inputs = {
        "input_ids": torch.arange(mask.numel()).reshape(mask.shape) % 50 + 3,
        "attention_mask": torch.ones_like(mask),
        "completion_mask": mask,
        "ref_chosen_logps": reference[:, 0],
        "ref_rejected_logps": reference[:, 1],
    }
    loss = DPOTrainer._compute_loss(trl_self, model, inputs, return_outputs=False)
    metrics = {key: float(values[-1]) for key, values in trl_self._metrics["train"].items()
               if key.startswith(("rewards/", "logps/"))}
    return loss, metrics


def _case(torch, name, beta, token_log_probs, completion_mask, reference):
    from trl import DPOConfig

    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(output_dir=tmp, beta=beta, report_to=[], use_cpu=True, bf16=False)
    trl_self = SimpleNamespace(
        beta=args.beta, precompute_ref_logps=True, loss_types=args.loss_type,
        loss_weights=args.loss_weights or [1.0] * len(args.loss_type), ld_alpha=args.ld_alpha,
        f_divergence_type=args.f_divergence_type,
        f_alpha_divergence_coef=args.f_alpha_divergence_coef,
        label_smoothing=args.label_smoothing, use_weighting=args.use_weighting,
        aux_loss_enabled=False, accelerator=_Accelerator, _total_train_tokens=0, _tp_size=1,
    )
    assert trl_self.loss_types == ["sigmoid"] and trl_self.f_divergence_type == "reverse_kl"

    leaf = token_log_probs.clone().requires_grad_(True)
    loss, metrics = _trl_loss(torch, trl_self, leaf, completion_mask, reference)
    loss.backward()
    grad = leaf.grad * completion_mask
    mask = completion_mask.bool()
    first = mask.float().argmax(-1, keepdim=True)
    grad_summed = grad.gather(-1, first).squeeze(-1)
    assert torch.equal(torch.where(mask, grad, grad_summed[..., None]),
                       grad_summed[..., None].expand_as(grad)), "per-token gradients differ"
    assert torch.count_nonzero(leaf.grad * (1 - completion_mask)) == 0
    policy = _summed(torch, token_log_probs, completion_mask)

    per_pair = defaultdict(list)
    for pair in range(token_log_probs.shape[0]):
        one_loss, one = _trl_loss(torch, trl_self, token_log_probs[pair:pair + 1],
                                  completion_mask[pair:pair + 1], reference[pair:pair + 1])
        per_pair["pair_loss"].append(float(one_loss))
        per_pair["chosen_rewards"].append(one["rewards/chosen"])
        per_pair["rejected_rewards"].append(one["rewards/rejected"])
        per_pair["reward_accuracy"].append(one["rewards/accuracies"])
    return {
        "name": name,
        "options": {"beta": beta, "loss_type": "sigmoid"},
        "inputs": {
            "token_log_probs": io.encode(token_log_probs),
            "completion_mask": io.encode(completion_mask.to(torch.int32)),
            "reference_log_probs": io.encode(reference),
        },
        "outputs": {
            "policy_log_probs": io.encode(policy),
            "loss": io.encode(loss.detach()),
            "metrics": metrics,
            **{key: io.encode(torch.tensor(values, dtype=torch.float32))
               for key, values in per_pair.items()},
            "grad_token_log_probs": io.encode(grad),
            "grad_policy_log_probs": io.encode(grad_summed),
        },
    }


def family() -> None:
    """The DPO family's fixture from TRL FAMILY_VERSION (tools/_parity_dpo_family.py)."""
    io.run_in_venv(__file__, FAMILY_VENV, "trl", FAMILY_VERSION, no_deps=False, extras=[])
    import _parity_dpo_family
    import torch

    torch.manual_seed(SEED)
    document = _parity_dpo_family.build(torch)
    path = io.write("dpo_family_trl.json", document)
    print(f"wrote {path.relative_to(io.ROOT)}: {len(document['cases'])} cases, "
          f"trl {document['reference']['version']}")


def main() -> None:
    if "--family" in sys.argv[1:]:
        family()
        return
    io.run_in_venv(__file__, VENV, "trl", TRL_VERSION, no_deps=False, extras=[])
    import torch
    import trl.trainer.dpo_trainer as dpo_trainer

    _Accelerator.device = torch.device("cpu")
    torch.manual_seed(SEED)
    token_log_probs, completion_mask, reference = _inputs(torch)
    policy = _summed(torch, token_log_probs, completion_mask)
    cases = [
        _case(torch, "beta_0.1", 0.1, token_log_probs, completion_mask, reference),
        _case(torch, "beta_0.5", 0.5, token_log_probs, completion_mask, reference),
        _case(torch, "policy_equals_reference", 0.1, token_log_probs, completion_mask, policy),
    ]
    equal = cases[2]["outputs"]
    assert abs(equal["loss"]["data"] - math.log(2.0)) < 1e-6, equal["loss"]
    assert equal["metrics"]["rewards/margins"] == 0.0, "the mirrored sum differs from TRL's"
    document = {
        "generator": "tools/parity_dpo.py",
        "seed": SEED,
        "reference": {
            **io.installed("trl"),
            "source_sha256": io.source_sha256(dpo_trainer),
            "versions": io.versions("torch", "transformers", "accelerate"),
            "called": "trl.trainer.dpo_trainer.DPOTrainer._compute_loss(self, model, inputs, "
                      "return_outputs) with precompute_ref_logps=True and a fused-head stand-in",
        },
        "cases": cases,
    }
    path = io.write("dpo_trl.json", document)
    print(f"wrote {path.relative_to(io.ROOT)}: {len(cases)} cases, "
          f"trl {document['reference']['version']}")


if __name__ == "__main__":
    main()

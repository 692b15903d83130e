"""Write the GRPO parity fixture from verl's core_algos and rollout-correction helpers.

Run from the repository root with any Python 3.11:

    python3 tools/parity_grpo.py

It makes (or reuses) tools/.venv-verl: the CPU build of torch, verl at VERL_VERSION installed
with --no-deps, and only what `verl.trainer.ppo.core_algos` and `rollout_corr_helper` import
(omegaconf, tensordict in verl's own range, packaging, ray, codetiming, transformers in verl's
range). It re-runs itself there and writes tests/fixtures/parity/grpo_verl.json. Tests never
import torch or verl.

Conventions of the verl side, which the inputs follow:
- every tensor is [rows, response_length] float32; `response_mask` is passed as bool, as verl's
  `workers/utils/losses.py::ppo_loss` does; `advantages` are a per-row scalar times the mask;
- `token_level_rewards` hold each row's score at position length - 1, as verl's reward managers
  write it (`reward_tensor[i, valid_response_length - 1] = score`), so a zero-length row's score
  sits in the last column, outside its mask;
- group ids are an int64 numpy array (verl passes uid strings; only equality matters);
- policy losses go through `core_algos.get_policy_loss_fn(name)` with an `ActorConfig` holding
  the clip settings; `config.global_batch_info` is empty unless a case sets it (then it is what
  verl's trainer puts there: dp_size, batch_num_tokens, global_batch_size);
- gradients are torch autograd of the returned loss with respect to `log_prob`.

Fixture layout (arrays are {"dtype", "shape", "data"}; tools/_parity_io.py `load_array` decodes):

    reference: package, version, wheel_sha256, source_sha256 of core_algos.py,
               rollout_corr_helper.py and utils/groupwise.py, other package versions,
               kl_names (verl's kl_penalty name -> k1/k2/k3/abs), functions (name -> signature)
    inputs:    shared arrays, referenced by name from the cases
      policy (rows 8, length 6): response_mask int32, old_log_prob, log_prob, ref_log_prob,
        rollout_log_prob, advantages, row_advantages [8] (float32),
        log_prob_capped (log_prob with rows 0 and 7 moved by +12 and -12: GSPO's cap)
      groups (rows 12, length 5): group_mask int32, scores [12], token_level_rewards,
        index int64 [12] (a singleton group, a group of equal scores, a zero-length row)
    cases[]: {name, kind, function, options, inputs: {argument: input name}, outputs}
      kind "policy_loss": outputs loss [], grad_log_prob [8, 6], metrics {actor/pg_clipfrac,
        actor/ppo_kl, actor/pg_clipfrac_lower}; options loss_mode, loss_agg_mode, clip_ratio,
        clip_ratio_low, clip_ratio_high, clip_ratio_c, global_batch_info, and
        rollout_is_weights (the name of a case whose `weights` output multiplies the loss)
      kind "kl": outputs kl [8, 6] (per token, unmasked), loss [] (agg_loss of kl under
        options.loss_agg_mode), grad_log_prob [8, 6]; options kl_penalty, estimator
      kind "advantage": outputs advantages [12, 5] (as returned: scalar x mask) and
        row_advantages [12] (same call with an all-ones mask, column 0: the per-row scalar,
        also for zero-length rows); options estimator, norm_adv_by_std_in_grpo, epsilon
      kind "is_weights": outputs weights [8, 6], metrics; options rollout_is,
        rollout_is_threshold (float: TIS cap; "lo_hi": IcePop band)
      kind "rejection": outputs mask int32 [8, 6], metrics; options rollout_rs,
        rollout_rs_threshold; the statistic is k1 = -log_ratio = rollout - old
      kind "correction": compute_rollout_correction_and_rejection_mask: outputs weights, mask,
        metrics (rollout_corr/*, including kl, k3_kl, training/rollout ppl, chi2, ess)
    All is_weights/rejection cases use log_ratio = old_log_prob - rollout_log_prob (what
    compute_rollout_correction_and_rejection_mask forms: log pi_train / pi_rollout).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parity_io as io  # noqa: E402

VERL_VERSION = "0.9.1"
VENV = io.ROOT / "tools" / ".venv-verl"
EXTRAS = ["omegaconf", "tensordict>=0.8.0,<=0.10.0,!=0.9.0", "packaging>=20.0", "ray>=2.41.0",
          "codetiming", "transformers>=5.5.3,<5.11,!=5.6.0"]
SEED = 20260702
ROWS, LENGTH = 8, 6
KL_NAMES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3",
            "k3": "k3", "k1+": "k1 value, k2 gradient", "k3+": "k3 value, k2 gradient"}


def _policy_inputs(torch):
    generator = torch.Generator().manual_seed(SEED)

    def normal(scale, *shape):
        return torch.randn(*shape, generator=generator) * scale

    lengths = torch.tensor([6, 4, 1, 0, 5, 3, 6, 2])
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
    old = -torch.rand(ROWS, LENGTH, generator=generator) * 2.0 - 0.05
    delta = normal(0.35, ROWS, LENGTH)
    delta[0, 1], delta[1, 0], delta[4, 2], delta[6, 5] = 1.5, -1.0, 0.9, 1.3  # ratios past c = 3
    log_prob = old + delta
    row_advantages = torch.tensor([-1.2, -0.8, 0.5, 1.0, 0.7, 0.0, -1.5, 2.0])
    advantages = row_advantages[:, None] * mask
    ref = old + normal(0.3, ROWS, LENGTH)
    ref[2, 0] = log_prob[2, 0] + 5.0   # k3: exp(5) - 6 = 142, clamped to 10
    ref[5, 1] = log_prob[5, 1] - 25.0  # k3: log-ratio clamped to -20 first
    offsets = torch.tensor([0.02, -0.3, 0.5, 0.0, 0.15, -0.05, 0.1, -0.4])
    rollout = old + offsets[:, None] + normal(0.05, ROWS, LENGTH)
    rollout[1, 2] = old[1, 2] - 1.0  # TIS weight e^1 > 2: capped, outside an IcePop band
    rollout[6, 3] = old[6, 3] + 1.0  # TIS weight e^-1 < 0.5: outside an IcePop band
    capped = log_prob.clone()
    capped[0] += 12.0
    capped[7] -= 12.0
    return {"response_mask": mask, "old_log_prob": old, "log_prob": log_prob,
            "log_prob_capped": capped, "ref_log_prob": ref, "rollout_log_prob": rollout,
            "advantages": advantages, "row_advantages": row_advantages}


def _group_inputs(torch, np):
    index = np.array([0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 3], dtype=np.int64)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.25, 0.25, 2.0, -1.0, 0.75, 0.5, 0.5, 0.5, 0.5])
    lengths = torch.tensor([5, 3, 1, 4, 2, 0, 5, 3, 4, 4, 1, 2])  # row 5: zero-length, group 1
    width = 5
    mask = torch.arange(width)[None, :] < lengths[:, None]
    rewards = torch.zeros(len(index), width)
    rewards[torch.arange(len(index)), lengths - 1] = scores  # length 0 writes column -1
    return {"group_mask": mask, "scores": scores, "token_level_rewards": rewards,
            "index": index}


class _Run:
    """Collects the cases, decoding input names into tensors for the calls."""

    def __init__(self, torch, tensors):
        self.torch = torch
        self.tensors = tensors
        self.cases = []
        self.outputs = {}

    def add(self, name, kind, function, options, inputs, outputs):
        self.outputs[name] = outputs
        self.cases.append({
            "name": name, "kind": kind, "function": function, "options": options,
            "inputs": inputs,
            "outputs": {key: value if isinstance(value, dict) else io.encode(value)
                        for key, value in outputs.items()},  # dicts are metrics: name -> float
        })


def _policy_cases(run, core_algos, ActorConfig, PolicyLossConfig):
    t = run.tensors
    mask = t["response_mask"]
    clips = {
        "vanilla": [
            dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
            dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=10.0),
        ],
        "gspo": [dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28),
                 dict(clip_ratio=3e-4, clip_ratio_low=3e-4, clip_ratio_high=4e-4)],
        "cispo": [dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28),
                  dict(clip_ratio=0.2, clip_ratio_low=1.0, clip_ratio_high=1.0)],
    }

    def case(name, mode, agg, clip, *, log_prob="log_prob", weights=None, batch_info=None):
        config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=mode),
                             **clip)
        if batch_info:
            config.global_batch_info.update(batch_info)
        leaf = t[log_prob].clone().requires_grad_(True)
        loss, metrics = core_algos.get_policy_loss_fn(mode)(
            old_log_prob=t["old_log_prob"], log_prob=leaf, advantages=t["advantages"],
            response_mask=mask, loss_agg_mode=agg, config=config,
            rollout_is_weights=None if weights is None else run.outputs[weights]["weights"],
        )
        loss.backward()
        options = {"loss_mode": mode, "loss_agg_mode": agg, **clip,
                   "global_batch_info": batch_info or {}, "rollout_is_weights": weights}
        inputs = {"old_log_prob": "old_log_prob", "log_prob": log_prob,
                  "advantages": "advantages", "response_mask": "response_mask"}
        run.add(name, "policy_loss", core_algos.get_policy_loss_fn(mode).__name__, options,
                inputs, {"loss": loss.detach(), "grad_log_prob": leaf.grad,
                         "metrics": {key: float(value) for key, value in metrics.items()}})

    for agg in ("token-mean", "seq-mean-token-mean"):
        for mode, settings in clips.items():
            for number, clip in enumerate(settings):
                case(f"{mode}_{number}_{agg}", mode, agg, clip)
    case("gspo_cap_token-mean", "gspo", "token-mean", clips["gspo"][0], log_prob="log_prob_capped")
    case("vanilla_0_token-mean_tis", "vanilla", "token-mean", clips["vanilla"][0],
         weights="tis_token_2.0")
    tokens = int(mask.sum())
    # what verl's trainer passes: the mini-batch's token count across micro-batches and ranks
    # (here twice this micro-batch's), and the configured sequence count (zero-length rows too)
    case("vanilla_0_token-mean_global_tokens", "vanilla", "token-mean", clips["vanilla"][0],
         batch_info={"dp_size": 1, "batch_num_tokens": 2 * tokens, "global_batch_size": 2 * ROWS})
    case("vanilla_0_seq-mean-token-mean_global_rows", "vanilla", "seq-mean-token-mean",
         clips["vanilla"][0], batch_info={"dp_size": 1, "batch_num_tokens": tokens,
                                          "global_batch_size": ROWS})


def _kl_cases(run, core_algos):
    t = run.tensors
    for name, estimator in KL_NAMES.items():
        for agg in ("token-mean", "seq-mean-token-mean"):
            if agg != "token-mean" and name not in ("k1", "k3"):
                continue
            leaf = t["log_prob"].clone().requires_grad_(True)
            kl = core_algos.kl_penalty(logprob=leaf, ref_logprob=t["ref_log_prob"], kl_penalty=name)
            loss = core_algos.agg_loss(loss_mat=kl, loss_mask=t["response_mask"],
                                       loss_agg_mode=agg)
            loss.backward()
            run.add(f"kl_{name}_{agg}", "kl", "kl_penalty + agg_loss",
                    {"kl_penalty": name, "estimator": estimator, "loss_agg_mode": agg},
                    {"logprob": "log_prob", "ref_logprob": "ref_log_prob",
                     "response_mask": "response_mask"},
                    {"kl": kl.detach(), "loss": loss.detach(), "grad_log_prob": leaf.grad})


def _advantage_cases(run, core_algos):
    torch = run.torch
    t = run.tensors
    variants = [("grpo", {"norm_adv_by_std_in_grpo": True}),
                ("grpo", {"norm_adv_by_std_in_grpo": False}),
                ("grpo_vectorized", {"norm_adv_by_std_in_grpo": True}),
                ("grpo_vectorized", {"norm_adv_by_std_in_grpo": False}),
                ("rloo", {}), ("rloo_vectorized", {})]
    for estimator, extra in variants:
        function = core_algos.get_adv_estimator_fn(estimator)

        def call(mask, function=function, extra=extra):
            advantages, returns = function(token_level_rewards=t["token_level_rewards"].clone(),
                                           response_mask=mask, index=t["index"], epsilon=1e-6,
                                           **extra)
            assert torch.equal(advantages, returns)
            return advantages

        advantages = call(t["group_mask"].float())
        rows = call(torch.ones_like(t["group_mask"], dtype=torch.float32))[:, 0]
        suffix = {True: "_std", False: "_no_std"}.get(extra.get("norm_adv_by_std_in_grpo"), "")
        run.add(f"advantage_{estimator}{suffix}", "advantage", function.__name__,
                {"estimator": estimator, "epsilon": 1e-6, **extra},
                {"token_level_rewards": "token_level_rewards", "response_mask": "group_mask",
                 "index": "index"},
                {"advantages": advantages, "row_advantages": rows})


def _correction_cases(run, helper):
    t = run.tensors
    mask = t["response_mask"]
    log_ratio = t["old_log_prob"] - t["rollout_log_prob"]
    inputs = {"old_log_prob": "old_log_prob", "rollout_log_prob": "rollout_log_prob",
              "response_mask": "response_mask"}
    for name, threshold in (("tis_token_2.0", 2.0), ("icepop_token_0.5_2.0", "0.5_2.0")):
        weights, metrics = helper.compute_rollout_correction_weights(
            log_ratio=log_ratio, response_mask=mask.float(), rollout_is="token",
            rollout_is_threshold=threshold)
        run.add(name, "is_weights", "compute_rollout_correction_weights",
                {"rollout_is": "token", "rollout_is_threshold": threshold}, inputs,
                {"weights": weights, "metrics": {k: float(v) for k, v in metrics.items()}})
    for option, threshold in (("seq_sum_k1", "0.5_1.5"), ("seq_sum_k1", 2.0),
                              ("seq_mean_k1", "0.8_1.25"), ("token_k1", "0.5_1.25")):
        kept, metrics = helper.compute_rollout_rejection_mask(
            log_ratio=log_ratio, response_mask=mask.float(), rollout_rs=option,
            rollout_rs_threshold=threshold)
        run.add(f"rejection_{option}_{threshold}", "rejection", "compute_rollout_rejection_mask",
                {"rollout_rs": option, "rollout_rs_threshold": threshold}, inputs,
                {"mask": kept.int(), "metrics": {k: float(v) for k, v in metrics.items()}})
    proto, kept, metrics = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=t["old_log_prob"], rollout_log_prob=t["rollout_log_prob"],
        response_mask=mask.float(), rollout_is="token", rollout_is_threshold=2.0,
        rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_1.5")
    run.add("correction_tis_2.0_seq_sum_k1_0.5_1.5", "correction",
            "compute_rollout_correction_and_rejection_mask",
            {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_sum_k1",
             "rollout_rs_threshold": "0.5_1.5"}, inputs,
            {"weights": proto.batch["rollout_is_weights"], "mask": kept.int(),
             "metrics": {k: float(v) for k, v in metrics.items()}})


def main() -> None:
    io.run_in_venv(__file__, VENV, "verl", VERL_VERSION, no_deps=True, extras=EXTRAS)
    import numpy as np
    import torch
    import verl.trainer.ppo.core_algos as core_algos
    import verl.trainer.ppo.rollout_corr_helper as helper
    import verl.utils.groupwise as groupwise
    from verl.workers.config import ActorConfig, PolicyLossConfig

    torch.manual_seed(SEED)
    tensors = {**_policy_inputs(torch), **_group_inputs(torch, np)}
    run = _Run(torch, tensors)
    _correction_cases(run, helper)  # first: the TIS case's weights feed a policy-loss case
    _policy_cases(run, core_algos, ActorConfig, PolicyLossConfig)
    _kl_cases(run, core_algos)
    _advantage_cases(run, core_algos)

    called = [core_algos.compute_policy_loss_vanilla, core_algos.compute_policy_loss_gspo,
              core_algos.compute_policy_loss_cispo, core_algos.agg_loss, core_algos.kl_penalty,
              core_algos.compute_grpo_outcome_advantage,
              core_algos.compute_grpo_vectorized_outcome_advantage,
              core_algos.compute_rloo_outcome_advantage,
              core_algos.compute_rloo_vectorized_outcome_advantage,
              helper.compute_rollout_correction_weights, helper.compute_rollout_rejection_mask,
              helper.compute_rollout_correction_and_rejection_mask]
    document = {
        "generator": "tools/parity_grpo.py",
        "seed": SEED,
        "reference": {
            **io.installed("verl"),
            "source_sha256": {**io.source_sha256(core_algos), **io.source_sha256(helper),
                              **io.source_sha256(groupwise)},
            "versions": io.versions("torch", "numpy", "tensordict", "omegaconf"),
            "kl_names": KL_NAMES,
            "functions": {f"{function.__module__}.{function.__name__}":
                          str(inspect.signature(function)) for function in called},
        },
        "inputs": {name: io.encode(value) for name, value in tensors.items()},
        "cases": run.cases,
    }
    path = io.write("grpo_verl.json", document)
    print(f"wrote {path.relative_to(io.ROOT)}: {len(run.cases)} cases, verl "
          f"{document['reference']['version']}")


if __name__ == "__main__":
    main()

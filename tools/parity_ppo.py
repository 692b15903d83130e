"""Write the PPO parity fixture from verl's core_algos: GAE, the clipped value loss, the composite.

Run from the repository root with any Python 3.11:

    python3 tools/parity_ppo.py

It makes (or reuses) tools/.venv-verl exactly as tools/parity_grpo.py does (the CPU build of
torch, verl at VERL_VERSION with --no-deps and the few packages core_algos imports), re-runs
itself there and writes tests/fixtures/parity/ppo_verl.json. Tests never import torch or verl.

The inputs are multi-turn rows: `response_mask` has gaps where a tool's answer sits between two
turns of one episode, and `token_level_rewards` holds each row's score on its last sampled token.
Every tensor is [rows, response_length] float32.

Fixture layout (arrays as in tools/_parity_io.py):

    reference: package, version, wheel_sha256, source_sha256 of core_algos.py and
               torch_functional.py, other package versions, functions (name -> signature)
    inputs: response_mask int32, token_level_rewards, values (the critic at sampling time),
            vpreds (the critic now), log_prob, old_log_prob, ref_log_prob
    cases[]: {name, kind, function, options, outputs}
      kind "gae": compute_gae_advantage_return; options gamma, lam; outputs advantages
        (whitened), returns
      kind "value_loss": compute_value_loss; options cliprange_value, loss_agg_mode; outputs
        vf_loss [], vf_clipfrac [], grad_vpreds
      kind "composite": what verl's actor and critic minimise together on one batch: the
        vanilla policy loss (clip ratios, dual clip c) on advantages from the "gae" case
        `advantages_from`, plus kl_coef * agg_loss(kl_penalty(low_var_kl)), plus vf_coef *
        the value loss on that case's returns; outputs loss [], pg_loss [], kl_loss [],
        vf_loss [], grad_log_prob, grad_vpreds
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _parity_io as io  # noqa: E402
from parity_grpo import EXTRAS, VENV, VERL_VERSION  # noqa: E402

SEED = 20261203
ROWS, LENGTH = 6, 10
# Each row: (turn lengths with a gap of observation ids between turns); row 3 sampled one id,
# row 5 nothing (an episode truncated away), rows 0, 2 and 4 are two or three turns.
TURNS = [((3, 2), 2), ((6,), 0), ((2, 1, 2), 1), ((1,), 0), ((4, 3), 3), ((), 0)]


def _inputs(torch):
    generator = torch.Generator().manual_seed(SEED)
    mask = torch.zeros(ROWS, LENGTH, dtype=torch.bool)
    rewards = torch.zeros(ROWS, LENGTH)
    scores = torch.tensor([1.0, 0.0, 1.0, -0.5, 0.25, 0.0])
    for row, (turns, gap) in enumerate(TURNS):
        column = 0
        for turn in turns:
            mask[row, column:column + turn] = True
            column += turn + gap
        if turns:
            last = int(mask[row].nonzero().max())
            rewards[row, last] = scores[row]
    values = torch.randn(ROWS, LENGTH, generator=generator) * 0.5
    vpreds = values + torch.randn(ROWS, LENGTH, generator=generator) * 0.3
    vpreds[0, 1], vpreds[4, 0] = values[0, 1] + 0.9, values[4, 0] - 0.7  # past the value clip
    old = -torch.rand(ROWS, LENGTH, generator=generator) * 2.0 - 0.05
    log_prob = old + torch.randn(ROWS, LENGTH, generator=generator) * 0.3
    log_prob[2, 0] = old[2, 0] + 1.3  # a ratio past the dual clip's reach
    ref = old + torch.randn(ROWS, LENGTH, generator=generator) * 0.3
    return {"response_mask": mask, "token_level_rewards": rewards, "values": values, "vpreds": vpreds,
            "log_prob": log_prob, "old_log_prob": old, "ref_log_prob": ref}


def main() -> None:
    io.run_in_venv(__file__, VENV, "verl", VERL_VERSION, no_deps=True, extras=EXTRAS)
    import torch
    import verl.trainer.ppo.core_algos as core_algos
    import verl.utils.torch_functional as functional
    from verl.workers.config import ActorConfig, PolicyLossConfig

    torch.manual_seed(SEED)
    t = _inputs(torch)
    mask = t["response_mask"]
    cases, gaes = [], {}

    for gamma, lam in ((1.0, 0.95), (0.97, 0.9), (1.0, 1.0)):
        advantages, returns = core_algos.compute_gae_advantage_return(
            token_level_rewards=t["token_level_rewards"], values=t["values"], response_mask=mask.float(),
            gamma=gamma, lam=lam)
        name = f"gae_{gamma}_{lam}"
        gaes[name] = (advantages, returns)
        cases.append({"name": name, "kind": "gae", "function": "compute_gae_advantage_return",
                      "options": {"gamma": gamma, "lam": lam},
                      "outputs": {"advantages": io.encode(advantages), "returns": io.encode(returns)}})

    _, returns = gaes["gae_1.0_0.95"]
    for agg in ("token-mean", "seq-mean-token-mean"):
        for clip in (0.2, 0.05):
            leaf = t["vpreds"].clone().requires_grad_(True)
            loss, clipfrac = core_algos.compute_value_loss(
                vpreds=leaf, returns=returns, values=t["values"], response_mask=mask,
                cliprange_value=clip, loss_agg_mode=agg)
            loss.backward()
            cases.append({"name": f"value_loss_{clip}_{agg}", "kind": "value_loss",
                          "function": "compute_value_loss",
                          "options": {"cliprange_value": clip, "loss_agg_mode": agg},
                          "outputs": {"vf_loss": io.encode(loss.detach()), "vf_clipfrac": io.encode(clipfrac),
                                      "grad_vpreds": io.encode(leaf.grad)}})

    for source, kl_coef, vf_coef in (("gae_1.0_0.95", 0.03, 0.5), ("gae_0.97_0.9", 0.1, 1.0)):
        advantages, returns = gaes[source]
        clip = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
        config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                             loss_agg_mode="token-mean", policy_loss=PolicyLossConfig(loss_mode="vanilla"),
                             **clip)
        log_prob = t["log_prob"].clone().requires_grad_(True)
        vpreds = t["vpreds"].clone().requires_grad_(True)
        pg_loss, _ = core_algos.get_policy_loss_fn("vanilla")(
            old_log_prob=t["old_log_prob"], log_prob=log_prob, advantages=advantages, response_mask=mask,
            loss_agg_mode="token-mean", config=config)
        kl = core_algos.kl_penalty(logprob=log_prob, ref_logprob=t["ref_log_prob"], kl_penalty="low_var_kl")
        kl_loss = core_algos.agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode="token-mean")
        vf_loss, _ = core_algos.compute_value_loss(vpreds=vpreds, returns=returns, values=t["values"],
                                                   response_mask=mask, cliprange_value=0.2,
                                                   loss_agg_mode="token-mean")
        loss = pg_loss + kl_coef * kl_loss + vf_coef * vf_loss
        loss.backward()
        cases.append({"name": f"composite_{source}", "kind": "composite", "function": "vanilla + kl + value",
                      "options": {**clip, "advantages_from": source, "kl_coef": kl_coef, "vf_coef": vf_coef,
                                  "kl_penalty": "low_var_kl", "cliprange_value": 0.2,
                                  "loss_agg_mode": "token-mean"},
                      "outputs": {name: io.encode(value.detach()) for name, value in (
                          ("loss", loss), ("pg_loss", pg_loss), ("kl_loss", kl_loss), ("vf_loss", vf_loss),
                          ("grad_log_prob", log_prob.grad), ("grad_vpreds", vpreds.grad))}})

    called = [core_algos.compute_gae_advantage_return, core_algos.compute_value_loss,
              core_algos.compute_policy_loss_vanilla, core_algos.kl_penalty, core_algos.agg_loss,
              functional.masked_whiten, functional.masked_var]
    document = {
        "generator": "tools/parity_ppo.py",
        "seed": SEED,
        "reference": {
            **io.installed("verl"),
            "source_sha256": {**io.source_sha256(core_algos), **io.source_sha256(functional)},
            "versions": io.versions("torch", "numpy", "tensordict", "omegaconf"),
            "functions": {f"{f.__module__}.{f.__name__}": str(inspect.signature(f)) for f in called},
        },
        "inputs": {name: io.encode(value.int() if value.dtype == torch.bool else value)
                   for name, value in t.items()},
        "cases": cases,
    }
    path = io.write("ppo_verl.json", document)
    print(f"wrote {path.relative_to(io.ROOT)}: {len(cases)} cases, verl {document['reference']['version']}")


if __name__ == "__main__":
    main()

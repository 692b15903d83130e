"""Preference pairs from the policy's own mistakes: the DPO stage's default for the demo task.

For each prompt the starting policy answers once, at `DPOParams.pair_temperature` (1 by default:
sampled answers show more of the policy's mistakes than greedy ones, which a strong policy rarely
makes). A wrong answer (one cut off by the budget included) becomes the rejected side, exactly as
sampled (EOS included, no retokenizing), and the task's reference solution the chosen side. Prompts the
policy already answers right give no pair. Pairs written from a fixed answer generator instead
(`DPOParams.pairs="data"`) rarely match the mistakes the policy makes, and DPO on them moves
probability away from answers the policy would not have given.

With `dpo.loss_type='kto'` the same pairs train as unpaired examples (recipes/build.py splits each
into a desirable chosen and an undesirable rejected answer), so an epoch holds twice as many.
"""

from __future__ import annotations

import json
import math
import os

from prefect import get_run_logger, task

from dew_lib.rewards import MathReward
from tasks.evaluate import draw_answers, prompt_ids
from tasks.manifests import DataManifest, PolicyRef, fingerprint
from tasks.params import DPOParams, EvalParams
from tasks.policy import load_policy
from tasks.refusals import RunRefused, retry_unless_refused
from tasks.storage import read_json, write_json, write_lines


@task(retries=1, retry_delay_seconds=1, retry_condition_fn=retry_unless_refused, task_run_name="pairs-from-policy")
def policy_pairs(params: DPOParams, data: DataManifest, start: PolicyRef, directory: str,
                 seed: int = 0) -> str:
    """Write pairs (reference chosen, the policy's wrong answer rejected); return their path."""
    logger = get_run_logger()
    key = fingerprint("pairs", params.pair_prompts, params.max_length, params.pair_temperature, seed,
                      data.fingerprint, start.fingerprint)
    path = os.path.join(directory, "pairs.jsonl")
    record = read_json(os.path.join(directory, "pairs.json"))
    if record is not None and record.get("fingerprint") == key and os.path.exists(path):
        return path
    with open(data.prompts_path, encoding="utf-8") as handle:
        rows = [json.loads(line) for _, line in zip(range(params.pair_prompts), handle, strict=False)]
    missing = [i for i, row in enumerate(rows) if "solution" not in json.loads(row.get("extra_info") or "{}")]
    if missing:
        raise RunRefused(f"{data.prompts_path} row {missing[0]} has no extra_info.solution, which "
                         "DPOParams(pairs='policy') uses as the chosen answer; give pairs_path and "
                         "pairs='data' instead")
    pretrained, variables = load_policy(start, data.tokenizer)
    tokenizer, reward = pretrained.tokenizer, MathReward()
    prompts = [prompt_ids(tokenizer, row["prompt"]) for row in rows]
    answers = draw_answers(pretrained.model, variables, tokenizer, prompts,
                           EvalParams(batch=128, max_new_tokens=params.max_length // 2),
                           temperature=params.pair_temperature, seed=seed)
    pairs = []
    for row, prompt, (text, sampled, stopped) in zip(rows, prompts, answers, strict=True):
        if stopped and reward("", text, str(row["ground_truth"]), "") >= 1.0:
            continue
        solution = json.loads(row["extra_info"])["solution"]
        chosen = tokenizer.encode(solution, add_special_tokens=False) + [tokenizer.eos_token_id]
        if len(prompt) + max(len(chosen), len(sampled)) > params.max_length:
            continue
        pairs.append({"chosen": prompt + chosen, "rejected": prompt + sampled,
                      "chosen_mask": [0] * len(prompt) + [1] * len(chosen),
                      "rejected_mask": [0] * len(prompt) + [1] * len(sampled)})
    if len(pairs) < params.batch:
        raise RunRefused(f"the starting policy got {len(rows) - len(pairs)} of {len(rows)} prompts "
                         f"right, leaving {len(pairs)} pairs, fewer than one batch of {params.batch}; "
                         "raise pair_prompts or use pairs='data'")
    write_lines(path, pairs)
    write_json(os.path.join(directory, "pairs.json"), {"fingerprint": key, "pairs": len(pairs)})
    logger.info("%d pairs from the policy's wrong answers to %d prompts", len(pairs), len(rows))
    return path


def epochs_capped(params: DPOParams, pairs_path: str) -> DPOParams:
    """`params` with `steps` cut to `max_epochs` passes over the pairs in `pairs_path`."""
    if params.max_epochs is None:
        return params
    with open(pairs_path, encoding="utf-8") as handle:
        pairs = sum(1 for line in handle if line.strip())
    examples = 2 * pairs if params.loss_type == "kto" else pairs  # KTO trains each side alone
    steps = max(1, math.ceil(params.max_epochs * examples / params.batch))
    if steps >= params.steps:
        return params
    get_run_logger().info("dpo: %d steps instead of %d: %d %s at batch %d make %g passes "
                          "(dpo.max_epochs)", steps, params.steps, examples,
                          "examples" if params.loss_type == "kto" else "pairs", params.batch, params.max_epochs)
    return params.model_copy(update={"steps": steps})

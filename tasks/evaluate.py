"""Evaluation: greedy answers to held-out prompts, scored by the task's reward, into the store."""

from __future__ import annotations

import os

import jax
import numpy as np
from prefect import get_run_logger, task

from dew_lib.rewards import MathReward
from dew_lib.sampling import Sampling, generate
from dew_lib.store import Evaluation
from flows.params import EvalParams
from tasks.data import read_eval
from tasks.manifests import DataManifest, EvalResult, PolicyRef, fingerprint
from tasks.policy import load_policy
from tasks.records import open_stage
from tasks.storage import read_json, write_json


def prompt_ids(tokenizer, prompt) -> list[int]:
    """Token ids of a prompt given as messages (chat template), text or ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return [int(i) for i in prompt]


def answer_all(model, variables, tokenizer, prompts: list[list[int]], params: EvalParams) -> list[str]:
    """Greedy answers, generated `params.batch` at a time at one compiled shape."""
    return [text for text, _, _ in draw_answers(model, variables, tokenizer, prompts, params)]


def draw_answers(model, variables, tokenizer, prompts: list[list[int]], params: EvalParams):
    """`(text, sampled ids, stopped on EOS)` of each prompt's greedy answer."""
    width = max(map(len, prompts))
    answers = []
    for start in range(0, len(prompts), params.batch):
        chunk = prompts[start:start + params.batch]
        rows = np.zeros((params.batch, width), np.int32)
        lengths = np.ones(params.batch, np.int32)
        for row, ids in enumerate(chunk):
            rows[row, width - len(ids):] = ids
            lengths[row] = len(ids)
        out = generate(model, variables, rows, lengths, key=jax.random.key(0),
                       max_new_tokens=params.max_new_tokens,
                       sampling=Sampling(temperature=0.0, eos_id=tokenizer.eos_token_id))
        tokens, counts, stopped = jax.device_get((out.tokens, out.lengths, out.stopped))
        answers += [(tokenizer.decode(tokens[i, :counts[i]], skip_special_tokens=True),
                     [int(t) for t in tokens[i, :counts[i]]], bool(stopped[i]))
                    for i in range(len(chunk))]
    return answers


@task(retries=1, retry_delay_seconds=1, task_run_name="evaluate-{stage}")
def evaluate_policy(stage: str, policy: PolicyRef, data: DataManifest, params: EvalParams,
                    directory: str, store_root: str, run: str, step: int = 0) -> EvalResult:
    """Held-out accuracy of `policy`; every answer and its score land in the store."""
    logger = get_run_logger()
    key = fingerprint("evaluate", policy.fingerprint, data.fingerprint, params)
    saved_path = os.path.join(directory, f"evaluation-{stage}.json")
    saved = read_json(saved_path)
    rows = read_eval(data.eval_path)
    reward = MathReward()
    if saved is not None and saved.get("fingerprint") == key:
        answers, cached = saved["answers"], True
    else:
        pretrained, variables = load_policy(policy, data.tokenizer)
        tokenizer = pretrained.tokenizer
        prompts = [prompt_ids(tokenizer, row["prompt"]) for row in rows]
        answers, cached = answer_all(pretrained.model, variables, tokenizer, prompts, params), False
    scores = [reward(row.get("data_source", ""), answer, str(row["ground_truth"]),
                     str(row.get("extra_info", ""))) for row, answer in zip(rows, answers, strict=True)]
    results = [Evaluation(item=i, prompt=str(row["prompt"]), answer=answer, score=score,
                          reference=str(row["ground_truth"]), correct=score >= 1.0)
               for i, (row, answer, score) in enumerate(zip(rows, answers, scores, strict=True))]
    accuracy = float(np.mean([r.correct for r in results]))
    with open_stage(store_root, run, f"eval-{stage}", "evaluate") as writer:
        writer.evaluations(results, step=step)
        writer.finish("completed", {"accuracy": accuracy})
    if not cached:
        write_json(saved_path, {"fingerprint": key, "answers": answers})
    logger.info("%s: %.1f%% of %d held-out answers correct", stage, 100 * accuracy, len(rows))
    return EvalResult(stage=stage, accuracy=accuracy, answered=len(rows), cached=cached)

"""Evaluation: answers to held-out prompts, scored by each row's reward, into the store.

Two accuracies: the greedy answer's, and the mean over `samples` answers drawn at `temperature`
per prompt (mean@k), which is what GRPO optimizes and moves first: a GRPO update raises the
chance of a right answer on prompts where the greedy answer may stay as it was.

Each row's `data_source` picks its reward (tasks/rewards.py); answers are scored on several
threads, and the programs a code reward ran land in the store's `verdicts` table beside the
answer's `evaluations` row (`update` = step, `group_id` = item).
"""

from __future__ import annotations

import datetime
import os

import jax
import numpy as np
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from dew_lib.sampling import Sampling, generate
from dew_lib.store import Evaluation
from dew_lib.train.trackers import TrackerOptions
from tasks.data import read_eval
from tasks.lifecycle import stage_trackers
from tasks.manifests import DataManifest, EvalResult, PolicyRef, fingerprint
from tasks.params import EvalParams, RewardParams, ToolParams
from tasks.policy import load_policy
from tasks.records import open_stage, stage_completed
from tasks.refusals import retry_unless_refused
from tasks.rewards import TaskReward, score_all, verdicts
from tasks.storage import read_json, write_json
from tasks.tool_task import episode_answers
from tasks.ui import run_key

TRANSCRIPTS = 3  # greedy episodes an evaluation of a tool task shows in its artifact


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


def draw_answers(model, variables, tokenizer, prompts: list[list[int]], params: EvalParams,
                 temperature: float = 0.0, seed: int = 0):
    """`(text, sampled ids, stopped on EOS)` of each prompt's answer: greedy at temperature 0.
    Every chunk has the same rows (one compiled program), no more than there are prompts."""
    width, batch = max(map(len, prompts)), min(params.batch, len(prompts))
    answers = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        rows = np.zeros((batch, width), np.int32)
        lengths = np.ones(batch, np.int32)
        for row, ids in enumerate(chunk):
            rows[row, width - len(ids):] = ids
            lengths[row] = len(ids)
        out = generate(model, variables, rows, lengths, key=jax.random.fold_in(jax.random.key(seed), start),
                       max_new_tokens=params.max_new_tokens,
                       sampling=Sampling(temperature=temperature, eos_id=tokenizer.eos_token_id))
        tokens, counts, stopped = jax.device_get((out.tokens, out.lengths, out.stopped))
        answers += [(tokenizer.decode(tokens[i, :counts[i]], skip_special_tokens=True),
                     [int(t) for t in tokens[i, :counts[i]]], bool(stopped[i]))
                    for i in range(len(chunk))]
    return answers


def _episode_answers(pretrained, variables, tokenizer_dir: str, prompts: list[list[int]], params: EvalParams,
                     tools: ToolParams) -> tuple[list[str], list[str], list[str]]:
    """(greedy replies, drawn replies, the transcript of each) of tool episodes on `prompts`."""
    model, tokenizer = pretrained.model, pretrained.tokenizer
    greedy = episode_answers(model, variables, tokenizer, tokenizer_dir, prompts, params.max_new_tokens, tools,
                             temperature=0.0, samples=1, seed=params.seed)
    drawn = episode_answers(model, variables, tokenizer, tokenizer_dir, prompts, params.max_new_tokens, tools,
                            temperature=params.temperature, samples=params.samples,
                            seed=params.seed) if params.samples else []
    return ([reply for reply, _ in greedy], [reply for reply, _ in drawn],
            [text for _, text in greedy + drawn])


def publish_transcripts(stage: str, results: list[Evaluation]) -> None:
    """A markdown artifact with the first greedy episodes of an evaluation, scored."""
    lines = [f"### {stage}: tool episodes on held-out prompts (greedy)", ""]
    for result in results:
        prompt = result.prompt if isinstance(result.prompt, str) else result.prompt[-1]["content"]
        lines += [f"**{prompt}** (reference {result.reference}; score {result.score:g})", "", "```",
                  result.detail.strip() or "(no reply)", "```", ""]
    create_markdown_artifact("\n".join(lines), key=run_key(stage, "transcripts"),
                             description=f"{stage}: tool episodes on held-out prompts")


@task(retries=1, retry_delay_seconds=1, retry_condition_fn=retry_unless_refused, task_run_name="evaluate-{stage}")
def evaluate_policy(stage: str, policy: PolicyRef, data: DataManifest, params: EvalParams,
                    directory: str, store_root: str, run: str, step: int = 0,
                    reward: RewardParams | None = None, tools: ToolParams | None = None,
                    tracking: TrackerOptions | None = None) -> EvalResult:
    """Held-out accuracy of `policy`; every answer, its score and its programs land in the store.

    reward: how answers are graded (tasks/rewards.py). Saved answers are graded again, so it is
    not part of the fingerprint that reuses them. tools: on a tool task (data.tool), each answer
    is the last reply of an episode shaped by these (tasks/tool_task.py), its transcript the
    evaluation's `detail`, and a few greedy transcripts the `<run>-<stage>-transcripts` artifact.
    tracking: the trackers that also get the held-out accuracies, as a run `<run>/eval-<stage>`
    with one point at `step`.
    """
    logger = get_run_logger()
    began = datetime.datetime.now(datetime.UTC)  # the stage is recorded once graded: its seconds start here
    episodes = (tools or ToolParams()) if data.tool is not None else None
    shaped = () if episodes is None else (episodes,)  # tool episodes: their shape changes the answers
    key = fingerprint("evaluate", policy.fingerprint, data.fingerprint, params, *shaped)
    saved_path = os.path.join(directory, f"evaluation-{stage}.json")
    saved = read_json(saved_path)
    rows = read_eval(data.eval_path)[: params.limit]  # EvalParams.limit: the first rows only
    k = params.samples
    if saved is not None and saved.get("fingerprint") == key:
        answers, drawn, cached = saved["answers"], saved["sampled"], True
        details = saved.get("details", [""] * (len(answers) + len(drawn)))
    else:
        pretrained, variables = load_policy(policy, data.tokenizer)
        tokenizer = pretrained.tokenizer
        prompts = [prompt_ids(tokenizer, row["prompt"]) for row in rows]
        if episodes is not None:
            answers, drawn, details = _episode_answers(pretrained, variables, data.tokenizer or policy.path,
                                                       prompts, params, episodes)
        else:
            answers = answer_all(pretrained.model, variables, tokenizer, prompts, params)
            drawn = [text for text, _, _ in draw_answers(  # draw j of prompt i at j * len(rows) + i
                pretrained.model, variables, tokenizer, prompts * k, params,
                temperature=params.temperature, seed=params.seed)] if k else []
            details = [""] * (len(answers) + len(drawn))
        cached = False
    graded_rows = rows * (1 + k)
    with TaskReward(reward or RewardParams()) as grader:
        scores, runs = score_all(grader, graded_rows, answers + drawn)
    results = [Evaluation(item=n % len(rows), prompt=row["prompt"], answer=answer, score=score,
                          reference=str(row["ground_truth"]), task=str(row.get("task_id", "")),
                          correct=score >= 1.0, sample=n // len(rows), detail=detail,
                          temperature=params.temperature if n >= len(rows) else 0.0)
               for n, (row, answer, score, detail) in enumerate(zip(graded_rows, answers + drawn, scores,
                                                                    details, strict=True))]
    accuracy = float(np.mean([r.correct for r in results[:len(rows)]]))
    sampled = float(np.mean([r.correct for r in results[len(rows):]])) if k else None
    if not (cached and stage_completed(store_root, run, f"eval-{stage}")):  # else recorded already
        held_out = {"greedy_accuracy": accuracy,  # held-out: not a training `accuracy`
                    **({} if sampled is None else {"sampled_accuracy": sampled})}
        with open_stage(store_root, run, f"eval-{stage}", "evaluate", started_at=began) as writer:
            writer.evaluations(results, step=step, verdicts=[verdicts(r) for r in runs])
            with stage_trackers(tracking, writer, run, f"eval-{stage}", params, directory, logger) as trackers:
                for tracker in trackers.sinks:
                    tracker.begin(step, step)
                    tracker.write(step, held_out)
            writer.finish("completed", held_out)
    if not cached:
        write_json(saved_path, {"fingerprint": key, "answers": answers, "sampled": drawn,
                                **({"details": details} if episodes is not None else {})})
    if episodes is not None:
        publish_transcripts(stage, results[:min(len(rows), TRANSCRIPTS)])
    logger.info("%s: %.1f%% of %d held-out greedy answers correct%s", stage, 100 * accuracy,
                len(rows), "" if sampled is None else
                f"; {100 * sampled:.1f}% of the {k} answers drawn per prompt at temperature "
                f"{params.temperature:g}")
    return EvalResult(stage=stage, accuracy=accuracy, sampled_accuracy=sampled, answered=len(rows),
                      cached=cached)

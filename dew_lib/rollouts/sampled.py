"""SampledRollout: GRPO's in-process rollout on the on-device sampler.

The Trainer calls it on the host before each compiled update with a `Prompts` batch
(`prompt [B, P]` left-padded, `prompt_length [B]`, UTF-8 metadata arrays). It draws `groups`
completions per prompt with `sampling.generate` (one compiled loop, raw and behavior
log-probabilities per id), decodes each completion without its EOS and padding, scores it with
`reward(data_source, completion, ground_truth, extra_info)` (verl's `compute_score` order),
turns every completion into a one-call `Session` and packs them with `pack` into
`[B * groups, P + R]` rows, the layout every GRPO batch has.

A completion that stopped on EOS is COMPLETED; one that used the whole budget is TRUNCATED and
still scored (truncation "score"), so every draw trains.

Each prompt row is a task named as the asynchronous path names it (`prompt_tasks`): the batch's
integer `task_id` when it has one, else a hash of the prompt ids and ground truth, so the same
prompt is the same `Session.task` in every batch, epoch and resume. The row's index in the batch
is the session's `group`, so groups are keyed by (task, group) and a prompt that appears twice in
one batch still makes two groups.

After a call, `last_tasks` holds the batch's tasks (one per prompt row, with its prompt ids and
reward fields: what the run store's `prompts` table records), `last_sessions` the sessions it
drew, `last_latencies` each session's own seconds from the call's start until its reward was in
(every row is generated in one lockstep draw, so sessions differ by their decoding, scoring and
wait for a scoring thread; the run store's `sessions.latency`); with `reward_details` (a function
called on the scoring thread right after each reward call, such as `CodeReward.last_runs`),
`last_reward_details[n]` holds what it returned for `last_sessions[n]`, so a caller can record
what the reward did (the programs a code reward ran) beside each session.

In a multi-process job every process draws the job's whole batch (its prompts gathered from every
process) from the same key, exactly what one process would draw on the same global devices, then
scores, packs and trains on its own rows; a session's `group` is its prompt's row in the global
batch. Drawing is repeated on every process, so more processes add no sampling throughput here;
scaled-out drawing belongs on a rollout server. `job_prompts` and `own_draws` are the two halves
around that draw, which DistillRollout shares.

Not here: multi-turn episodes, asynchronous drawing (the scheduler), remote engines.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dew_lib.objectives import algorithms
from dew_lib.objectives.batch import PackedBatch
from dew_lib.options import group_size, integer
from dew_lib.records.sessions import Call, Session, Status, Task
from dew_lib.rollouts.packing import pack
from dew_lib.rollouts.scheduler.tasks import prompt_tasks
from dew_lib.sampling import Sampling, generate
from dew_lib.train.distributed import gather_rows, own_rows

Reward = Callable[[str, str, str, str], float]


def token_text(ids: Sequence[int]) -> str:
    """The default decode: token ids separated by spaces."""
    return " ".join(str(int(i)) for i in ids)


class RewardFailed(RuntimeError):
    """A reward raised or returned a non-finite value; names the prompt row and the completion."""


def check_row_width(prompt_width: int, max_new_tokens: int, objective: Any) -> None:
    """Refuse prompts whose width plus the response budget is not the row width `objective`
    reads (its seq_len + 1), naming the seq_len that fits."""
    if prompt_width + max_new_tokens != objective.width:
        raise ValueError(
            f"prompts are {prompt_width} ids wide and max_new_tokens is {max_new_tokens}, so rows "
            f"are {prompt_width + max_new_tokens} wide, but the objective reads seq_len + 1 = "
            f"{objective.width}; set {type(objective).__name__}(seq_len={prompt_width + max_new_tokens - 1})"
        )


def job_prompts(prompt: np.ndarray, lengths: np.ndarray, repeat: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The job's whole batch of prompts to draw: every process's `prompt [B, P]` and `lengths [B]`
    gathered in process order, each row repeated `repeat` times (its draws adjacent). Every
    process must call it together, with as many rows; in one process it gathers nothing."""
    return np.repeat(gather_rows(prompt), repeat, axis=0), np.repeat(gather_rows(lengths), repeat)


def own_draws(drawn, rows: int) -> tuple:
    """This process's `rows` of a `generate` over `job_prompts`, on the host: `(tokens, raw,
    behavior, counts, stopped, routes)`, routes None unless they were asked for."""
    *host, routes = jax.device_get(tuple(drawn))
    tokens, raw, behavior, counts, stopped = (own_rows(x, rows) for x in host)
    return tokens, raw, behavior, counts, stopped, None if routes is None else own_rows(routes, rows)


class SampledRollout:
    """Draw `groups` completions per prompt, score them, and pack them for GRPOObjective.

    reward: `(data_source, completion, ground_truth, extra_info) -> float`.
    max_new_tokens: the response budget R; the objective's seq_len must be P + R - 1.
    sampling: how ids are drawn (pass eos_id so completions can stop). decode: ids -> text for
    the reward (default: ids separated by spaces; pass your tokenizer's decode for text).
    estimator: "group", "mean" (Dr.GRPO) or "rloo". workers: threads scoring completions.
    reward_details: optional `() -> Any` called on the scoring thread right after each reward
    call; its results land in `last_reward_details`, one per session (see the module docstring).
    """

    def __init__(self, objective, *, reward: Reward, groups: int = 4, max_new_tokens: int,
                 sampling: Sampling = Sampling(), decode: Callable[[Sequence[int]], str] = token_text,
                 estimator: str = "group", workers: int = 8,
                 reward_details: Callable[[], Any] | None = None):
        group_size("SampledRollout.groups", groups)
        max_new_tokens = integer("SampledRollout.max_new_tokens", max_new_tokens)
        if not callable(reward):
            raise TypeError("SampledRollout.reward must be callable as reward(data_source, "
                            "completion, ground_truth, extra_info) -> float")
        algorithms.advantage_function(estimator)
        workers = integer("SampledRollout.workers", workers)
        if reward_details is not None and not callable(reward_details):
            raise TypeError("SampledRollout.reward_details must be callable with no arguments "
                            "(e.g. CodeReward.last_runs) or None")
        self.objective = objective
        self.reward = reward
        self.groups = groups
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.decode = decode
        self.estimator = estimator
        self.workers = workers
        self.reward_details = reward_details
        self.last_tasks: list[Task] = []
        self.last_sessions: list[Session] = []
        self.last_reward_details: list[Any] = []
        self.last_latencies: list[float] = []

    def __call__(self, state, batch, key) -> PackedBatch:
        prompt = np.asarray(batch["prompt"], np.int32)
        lengths = np.asarray(batch["prompt_length"], np.int32)
        rows, width = prompt.shape
        check_row_width(width, self.max_new_tokens, self.objective)
        started = time.perf_counter()
        tasks = prompt_tasks(batch)  # each row's stable id, prompt ids and reward fields
        g = self.groups
        # Every process draws the job's whole batch, the same computation a single process runs
        # on the same global devices, and keeps its own rows (a no-op in one process).
        routing = getattr(self.objective, "routing_replay", "none") != "none"
        drawn = generate(self.objective.model, state.params, *job_prompts(prompt, lengths, g), key=key,
                         max_new_tokens=self.max_new_tokens, sampling=self.sampling, return_routes=routing)
        tokens, raw, behavior, counts, stopped, routes = own_draws(drawn, rows * g)
        first = jax.process_index() * rows  # this process's first row of the global batch

        def completion(n: int) -> str:
            ids = tokens[n, :counts[n]]
            return self.decode(ids[:-1] if stopped[n] else ids)

        texts = [completion(n) for n in range(rows * g)]

        def score(n: int) -> tuple[float, Any, float]:
            b = n // g
            data = tasks[b].data
            try:
                value = self.reward(data["data_source"], texts[n], data["ground_truth"],
                                    data["extra_info"])
                details = None if self.reward_details is None else self.reward_details()
                value = float(value)
            except Exception as error:
                raise RewardFailed(
                    f"the reward raised {type(error).__name__}: {error} on prompt row {b}, sample "
                    f"{n % g}, completion {texts[n][:200]!r}"
                ) from error
            if not math.isfinite(value):
                raise RewardFailed(
                    f"the reward returned {value} on prompt row {b}, sample {n % g}, completion "
                    f"{texts[n][:200]!r}; rewards must be finite numbers"
                )
            return value, details, time.perf_counter() - started  # this session's reward is in

        with concurrent.futures.ThreadPoolExecutor(min(self.workers, rows * g)) as pool:
            scored = list(pool.map(score, range(rows * g)))
        rewards = [value for value, _, _ in scored]
        version = int(np.asarray(jax.device_get(state.updates)))
        sessions = []
        for n in range(rows * g):
            b = n // g
            ids = tokens[n, :counts[n]]
            prompt_ids = tasks[b].data["prompt_ids"]
            call = Call(prompt_ids=prompt_ids, sampled_ids=ids,
                        behavior_log_probs=behavior[n, :counts[n]], raw_log_probs=raw[n, :counts[n]],
                        finish_reason="stop" if stopped[n] else "length", version=version,
                        routed_experts=None if routes is None else routes[n, :len(prompt_ids) + counts[n]])
            sessions.append(Session(task=tasks[b].id, group=first + b, sample=n % g, calls=(call,),
                                    status=Status.COMPLETED if stopped[n] else Status.TRUNCATED,
                                    reward=rewards[n]))
        packed = pack(sessions, self.objective.width, rows=rows * g, estimator=self.estimator,
                      truncation="score")
        proximal = None
        if getattr(self.objective, "sampling_temperature", 1.0) != 1.0:
            # The sampler's raw log-probs are untempered; the update scores the old policy (these
            # weights) at the objective's temperature so the ratio compares like with like.
            packed.pop("old_log_probs", None)
            proximal = "in_update"
        self.last_tasks = tasks
        self.last_sessions = sessions
        self.last_reward_details = [details for _, details, _ in scored]
        self.last_latencies = [seconds for _, _, seconds in scored]
        return PackedBatch.of(packed, proximal)


__all__ = ["RewardFailed", "SampledRollout", "job_prompts", "own_draws", "token_text"]

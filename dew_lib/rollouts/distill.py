"""DistillRollout: the student's own samples, or a dataset's completions, packed for DistillObjective.

The Trainer calls it on the host before each compiled update with a `Prompts`-layout batch
(`prompt [B, P]` left-padded, `prompt_length [B]`, and when `lmbda < 1` the dataset's
`completion [B, C]` right-padded ids with `completion_length [B]`, C <= max_new_tokens). As TRL's
`GKDTrainer` does, a step trains on the student's own samples with probability `lmbda` and on the
dataset's completions otherwise; the coin is drawn from the step's rollout key (the Trainer folds
the step into it), so a resumed run flips the same coins and draws the same samples. lmbda = 0
never samples and lmbda = 1 always does (TRL's `random() <= lmbda` samples on a 0 draw too).

A sampled step draws one completion per prompt with `sampling.generate` at the student's current
weights (one compiled loop, as SampledRollout draws). Either way every row becomes a one-call
`Session` packed by `pack` into `[B, P + R]` rows (the layout every RL batch has). Each session's
reward is the negative mean per-token reverse KL of its completion, log p_student - log p_teacher
at the objective's temperature, scored in one compiled pass against the teacher in
`TrainState.ema`; the batch carries `on_policy [B]` so the objective reports the share sampled.

After a sampled step `last_tasks`, `last_sessions`, `last_latencies` and `last_reward_details`
hold what SampledRollout's hold, so `RecordedRollout(rollout, sampled_sessions(rollout, writer))`
(dew_lib/recipes/recorded.py) records the sessions in the run store as GRPO's are; after a dataset
step they are empty (nothing was drawn) and `last_on_policy` is False.

With a remote teacher (`DistillObjective(teacher=RemoteTeacher(...))`) each batch also carries
`teacher_log_probs [R, W]`, the engine's log-prob of each packed id (`RemoteTeacher.sampled_log_probs`,
one request per `rows_per_request` rows), which the objective and the rewards read in place of a
local teacher's forward pass.

The teacher's context is checked when the rollout is built, not inside the objective: rows are
P + R ids (P = the objective's width less max_new_tokens), a local teacher reads P + R - 1 of them
(refused at once by the objective's own seq_len check against its max_seq_len), and a remote
scoring request holds P + R ids plus the one the engine samples, so an engine whose max_model_len
(`RemoteTeacher.context()`: given, or read from /v1/models) is under P + R + 1 is refused here,
naming both. An engine that does not say its context is not checked.

In a multi-process job (tasks/stage_job.py, dew_lib/train/distributed.py) it draws as
SampledRollout does: every process gathers every process's prompts (`job_prompts`), draws the
job's whole batch from the same key, exactly what one process draws on the same global devices,
and keeps its own rows (`own_draws`); a session's `group` is its prompt's row in the global batch.
The coin depends on the key alone, so it is the same on every process; with 0 < lmbda < 1 the
processes also compare their coins each step and all raise if they differ (their rollout keys
differ), rather than some drawing while others do not. Each process packs its own rows and, with
a remote teacher, asks the engine about those rows only; the rewards' scoring pass runs over
every process's rows gathered (one compiled pass on the global devices, which every process must
run on the same inputs) and each process keeps its own sessions' rewards. Recording every
process's sessions is the writer's part (tasks/stage_job.py `GatheredWriter`).

With `server` (any `RolloutServer`: a remote engine's client from `recipes.remote_server`, or a
`NativeRolloutServer`) the student's samples come from that server instead of `generate`. Before a
sampled step's requests the server is pushed the student's current weights, once per update (every
process passes its own copy; a `Publication` pushes from process 0 and returns on every process
once the push is done); then each process submits its own rows, one request per prompt, seeded
from the step's key by the prompt's row in the job's batch. A draw whose version is not the
pushed one is refused: the student would train on another policy's samples and call them its own.
An engine reports no raw log-probabilities, which the loss does not read.

Not here: several samples per prompt, TRL's `seq_kd` (teacher-generated completions).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dew_lib.inference.base import RolloutServer, push_weights
from dew_lib.options import integer
from dew_lib.records.sessions import Call, Session, Status, Task
from dew_lib.rollouts.packing import pack
from dew_lib.rollouts.sampled import check_row_width, job_prompts, own_draws, token_text
from dew_lib.rollouts.scheduler.tasks import prompt_tasks
from dew_lib.sampling import Sampling, generate
from dew_lib.train.distributed import every_process, gather_rows, local_copy, own_rows

COLUMNS = ("input_ids", "text_segment_ids", "text_positions", "response_mask", "session_index",
           "session_weights")
# What the rewards' scoring pass reads (teacher_log_probs: a remote teacher's, when the rows hold them).
SCORED = ("input_ids", "text_segment_ids", "text_positions", "response_mask", "teacher_log_probs")


class DistillRollout:
    """Pack the student's samples (probability `lmbda`) or the dataset's completions for
    DistillObjective.

    max_new_tokens: the response budget R; the objective's seq_len must be P + R - 1.
    sampling: how the student draws (pass eos_id so completions can stop; its temperature is
    TRL's generation temperature). lmbda: the share of steps trained on the student's samples.
    decode: ids -> text, for the run store's prompts (default: ids separated by spaces).
    server: a RolloutServer that draws the student's samples in place of `generate` (it samples
    as it was built to; pass it the same Sampling); `close()` closes it.
    """

    def __init__(self, objective, *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 lmbda: float = 1.0, decode: Callable[[Sequence[int]], str] = token_text,
                 server: RolloutServer | None = None):
        max_new_tokens = integer("DistillRollout.max_new_tokens", max_new_tokens)
        if not 0.0 <= lmbda <= 1.0:
            raise ValueError(f"DistillRollout.lmbda must lie in [0, 1] (the share of steps trained on "
                             f"the student's own samples), got {lmbda}")
        if getattr(objective, "loss", None) == "reverse_kl" and lmbda < 1.0:
            raise ValueError(
                f"DistillRollout(lmbda={lmbda}) trains some steps on dataset completions, but "
                "DistillObjective(loss='reverse_kl') is a policy gradient on the student's own samples "
                "and is biased on tokens it did not draw; use lmbda=1.0, or loss='jsd' for the mix")
        check_teacher_context(objective, max_new_tokens)
        self.objective = objective
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.lmbda = float(lmbda)
        self.decode = decode
        self.server = server
        self._pushed: int | None = None  # the update whose weights the server holds
        self.last_on_policy = False
        self.last_tasks: list[Task] = []
        self.last_sessions: list[Session] = []
        self.last_latencies: list[float] = []
        self.last_reward_details: list[Any] = []

    def on_policy(self, key: jax.Array) -> bool:
        """Whether the step with rollout key `key` trains on the student's samples."""
        if self.lmbda in (0.0, 1.0):
            return self.lmbda == 1.0
        return float(jax.random.uniform(jax.random.fold_in(key, 1))) < self.lmbda

    def __call__(self, state, batch, key) -> dict[str, np.ndarray]:
        prompt = np.asarray(batch["prompt"], np.int32)
        lengths = np.asarray(batch["prompt_length"], np.int32)
        rows, width = prompt.shape
        check_row_width(width, self.max_new_tokens, self.objective)
        started = time.perf_counter()
        tasks = prompt_tasks(batch)
        sampled = self._agreed(self.on_policy(key))
        latencies = None
        if sampled and self.server is not None:
            calls, latencies = self._served(state, tasks, key)
            finished = [call.finish_reason == "stop" for call in calls]
        elif sampled:  # the job's whole batch on every process, each keeping its own rows
            drawn = generate(self.objective.model, state.params, *job_prompts(prompt, lengths),
                             key=jax.random.fold_in(key, 0), max_new_tokens=self.max_new_tokens,
                             sampling=self.sampling)
            tokens, raw, behavior, counts, stopped, _ = own_draws(drawn, rows)
            calls = [Call(prompt_ids=tasks[n].data["prompt_ids"], sampled_ids=tokens[n, :counts[n]],
                          behavior_log_probs=behavior[n, :counts[n]], raw_log_probs=raw[n, :counts[n]],
                          finish_reason="stop" if stopped[n] else "length", version=_version(state))
                     for n in range(rows)]
            finished = [bool(s) for s in stopped]
        else:
            calls = self._dataset_calls(batch, tasks)
            finished = [True] * rows
        first = jax.process_index() * rows  # this process's first row of the global batch
        sessions = [Session(task=tasks[n].id, group=first + n, sample=0, calls=(calls[n],),
                            status=Status.COMPLETED if finished[n] else Status.TRUNCATED, reward=0.0)
                    for n in range(rows)]
        # The layout does not depend on rewards (no advantage is read); the rewards come from it.
        packed = pack(sessions, self.objective.width, rows=rows, estimator="mean", truncation="score")
        out = {name: packed[name] for name in COLUMNS}
        out["on_policy"] = np.full(rows, sampled, np.int32)
        if getattr(self.objective, "remote", False):  # the engine scores what this process packed
            out["teacher_log_probs"] = self.objective.teacher.sampled_log_probs(out)
        rewards = self._rewards(state, out, rows)
        sessions = [dataclasses.replace(s, reward=r) for s, r in zip(sessions, rewards, strict=True)]
        seconds = time.perf_counter() - started
        self.last_on_policy = sampled
        self.last_tasks = tasks if sampled else []
        self.last_sessions = sessions if sampled else []
        # A lockstep draw finishes every row together; a server's rows each finish on their own.
        self.last_latencies = (latencies or [seconds] * rows) if sampled else []
        self.last_reward_details = [None] * len(self.last_sessions)
        return out

    def _served(self, state, tasks: list[Task], key: jax.Array) -> tuple[list[Call], list[float]]:
        """This process's rows drawn by the server at the student's current weights, and the
        seconds each took."""
        assert self.server is not None
        version = _version(state)
        if self._pushed != version:  # every process, so a multi-process Publication can agree
            push_weights(self.server, local_copy(state.params), version)
            self._pushed = version
        first = jax.process_index() * len(tasks)
        seeds = np.asarray(jax.random.randint(jax.random.fold_in(key, 0), (first + len(tasks),), 0,
                                              np.iinfo(np.int32).max))[first:]
        started = time.perf_counter()
        done_at: dict[int, float] = {}
        futures = []

        def timed(n: int) -> Callable[[Any], float]:
            return lambda _: done_at.setdefault(n, time.perf_counter())

        for n, (task, seed) in enumerate(zip(tasks, seeds, strict=True)):
            future = self.server.submit(task.data["prompt_ids"], self.max_new_tokens, seed=int(seed))
            future.add_done_callback(timed(n))
            futures.append(future)
        try:
            draws = [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        for task, draw in zip(tasks, draws, strict=True):
            if draw.version != version:
                raise RuntimeError(
                    f"the rollout server drew task {task.id} with weights version {draw.version}, but it was "
                    f"pushed the student's update {version} first: its samples are not the student's own. "
                    "Check that the engine reloads what is pushed (its weight-update endpoint)")
            if draw.ids.size > self.max_new_tokens:
                raise RuntimeError(f"the rollout server drew {draw.ids.size} ids for task {task.id}, over "
                                   f"DistillRollout.max_new_tokens={self.max_new_tokens}")
        calls = [Call(prompt_ids=task.data["prompt_ids"], sampled_ids=draw.ids,
                      behavior_log_probs=draw.behavior_log_probs, raw_log_probs=draw.raw_log_probs,
                      finish_reason=draw.finish_reason, version=draw.version)
                 for task, draw in zip(tasks, draws, strict=True)]
        return calls, [done_at.get(n, time.perf_counter()) - started for n in range(len(tasks))]

    def close(self) -> None:
        """Close the server that draws the student's samples, if any."""
        close = getattr(self.server, "close", None)
        if close is not None:
            close()

    def _agreed(self, sampled: bool) -> bool:
        """`sampled`, once every process of a job has flipped the same coin (a coin of lmbda 0 or
        1 cannot differ, and one process has none to compare)."""
        if self.lmbda in (0.0, 1.0) or jax.process_count() == 1:
            return sampled
        coins = every_process(sampled)
        if len(set(coins)) > 1:
            raise RuntimeError(
                f"DistillRollout(lmbda={self.lmbda}) flipped different coins on the processes of this job "
                f"({coins}, by process): their rollout keys differ, so they would not draw one batch; "
                "give every process's Trainer the same key")
        return sampled

    def _dataset_calls(self, batch, tasks: list[Task]) -> list[Call]:
        for name in ("completion", "completion_length"):
            if name not in batch:
                raise KeyError(
                    f"DistillRollout(lmbda={self.lmbda}) trains some steps on the dataset's completions, "
                    f"so every batch needs 'completion' [B, C] (right-padded ids) and "
                    f"'completion_length' [B]; the batch lacks {name!r} (has {sorted(batch)}); "
                    "use lmbda=1.0 to train on the student's samples alone")
        completion = np.asarray(batch["completion"], np.int32)
        counts = np.asarray(batch["completion_length"], np.int32)
        if counts.min(initial=1) < 1 or counts.max(initial=0) > min(completion.shape[1], self.max_new_tokens):
            raise ValueError(f"completion_length must lie in [1, {min(completion.shape[1], self.max_new_tokens)}] "
                             f"(the completion width and max_new_tokens), got {counts.tolist()}")
        return [Call(prompt_ids=tasks[n].data["prompt_ids"], sampled_ids=completion[n, :counts[n]],
                     behavior_log_probs=np.zeros(counts[n], np.float32), finish_reason="stop")
                for n in range(len(tasks))]

    def _rewards(self, state, rows: dict[str, np.ndarray], count: int) -> list[float]:
        """Each session's negative mean per-token reverse KL (one row per session here). The
        scoring pass reads every process's rows (the same inputs on every process, as the compiled
        pass on the job's devices needs); this process keeps its own."""
        if getattr(self.objective, "remote", False):
            teacher = None  # its log-probs are in rows
        else:
            teacher = state.ema if getattr(state, "ema", None) is not None else self.objective.teacher
        whole = {name: gather_rows(rows[name]) for name in SCORED if name in rows}
        kl = own_rows(np.asarray(jax.device_get(_sampled_kl(self.objective, state.params, teacher, whole)),
                                 np.float64), len(rows["input_ids"]))
        mask = rows["response_mask"][:, 1:]
        sessions = rows["session_index"][:, 1:]
        totals = np.zeros(count)
        tokens = np.zeros(count)
        np.add.at(totals, sessions[mask > 0], kl[mask > 0])
        np.add.at(tokens, sessions[mask > 0], 1.0)
        return [float(-t / max(n, 1.0)) for t, n in zip(totals, tokens, strict=True)]


def check_teacher_context(objective, max_new_tokens: int) -> None:
    """Refuse a remote teacher whose engine cannot hold a scoring request of the rows this
    rollout packs: the prompt width plus max_new_tokens, plus the one id the engine samples."""
    if not getattr(objective, "remote", False):
        return  # a local teacher's max_seq_len was checked against seq_len by the objective
    prompt_width = objective.width - max_new_tokens
    needed = objective.width + 1
    context = objective.teacher.context()
    if context is not None and context < needed:
        raise ValueError(
            f"the remote teacher ({objective.teacher.engine}) has max_model_len={context}, but each row it "
            f"scores is the prompt width {prompt_width} plus DistillRollout.max_new_tokens={max_new_tokens} "
            f"= {objective.width} ids, and the request samples one more: it needs max_model_len >= {needed}. "
            f"Serve the teacher with a longer context (vLLM --max-model-len, dew serve --capacity) or "
            f"shorten max_new_tokens or the prompts")


@functools.partial(jax.jit, static_argnums=0)
def _sampled_kl(objective, params, teacher, rows):
    return objective.sampled_kl(params, teacher, rows)


def _version(state) -> int:
    return int(np.asarray(jax.device_get(state.updates)))


__all__ = ["DistillRollout", "check_teacher_context"]

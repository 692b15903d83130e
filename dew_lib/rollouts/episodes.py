"""EpisodeRollout: multi-turn tool episodes, collected in lock step and trained with GRPO.

The Trainer calls it before each update with a batch of integer `task_id` rows. For each task it
runs `groups` episodes, each in an environment from `environment(task, identity)` (entered on the
calling thread, so subprocess workers die with it), and samples every turn from the policy bound
once to the Trainer's params (`policy.bind(state.params)`, a `TextGeneration`):

- each round samples all slots together at fixed shapes (`max_prompt_tokens` wide, a budget of
  `max_new_tokens`) with the round's own key; a finished slot stays in place with an inert
  context whose draw is thrown away, so how many turns other episodes take never changes what a
  slot draws;
- EOS ends an action; an action that used its whole budget without EOS is TRUNCATED and never
  sent to the environment; a context longer than `max_prompt_tokens` truncates the episode (what
  was recorded stays whole); after `max_turns` model calls a running episode is TRUNCATED;
- the environment says when the episode ends (COMPLETED, TRUNCATED); the verifier scores
  COMPLETED and TRUNCATED episodes while their environment is still entered; then every
  environment is released, and an episode whose release fails is thrown out (not trained, not in
  its group's baseline);
- an environment or policy that raises, an ERROR observation, a verifier that raises or returns
  a non-finite reward: `EpisodeFailure`; a cancellation (asyncio's or concurrent.futures', or a
  CANCELLED observation): `EpisodeCancelled`. Either aborts the whole collection before any
  update, after every environment was released under the original exception; both carry the
  partial episode that failed.

Each episode becomes a `Session` whose calls are its actions (`session_of`), and the sessions are
packed by the one packer every GRPO path uses into `B * groups * max_turns` rows of
`max_prompt_tokens + max_new_tokens` ids (set `GRPOObjective(seq_len=max_prompt_tokens +
max_new_tokens - 1)`): only sampled ids carry loss mass, advantages are relative within a task's
group, truncated episodes are masked and left out of the baseline (or, with `truncation="score"`
or `"zero"`, trained on their verifier's reward or on 0). Episodes keep the identity of
the binding that sampled them; `project` refuses to pack episodes of two bindings together.

With `journal=EpisodeJournal(directory)` (journal.py) a collection survives a killed process: each
round's draws are committed before its tool calls, each tool's answer with the environment's
`get_state()` snapshot before that slot's next call, and a restarted `collect` at the same clocks
rebuilds the collection from them (answered turns as recorded, environments reset then given
their last snapshot, saved draws reused) and runs again only the tool calls left unanswered.
In a multi-process job each process runs its own rows' episodes, drawn together, and journals
its own; a restarted job restores the rounds every process saved (episode_pool.py).

Not here: the records (`dew_lib.records.episodes`), one running episode's slot and its helpers
(episode_slots.py), subprocess environments (`subprocess_environment.py`), episodes on a rollout
server (`sources.EnvironmentSource`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dew_lib.objectives import algorithms
from dew_lib.objectives.batch import PackedBatch
from dew_lib.options import group_size, integer
from dew_lib.records.episodes import (
    Action,
    EnvironmentFactory,
    Episode,
    EpisodeId,
    EpisodeStatus,
    Observation,
    Transition,
    Verifier,
    check_action,
)
from dew_lib.records.sessions import TRUNCATION, Call, Session, Status, Task
from dew_lib.rollouts.episode_pool import agreed, check_cohort, cohort, together
from dew_lib.rollouts.episode_slots import (
    Slot,
    SlotError,
    describe,
    each,
    enter_environment,
    observed,
    snapshot_environment,
)
from dew_lib.rollouts.journal import EpisodeJournal, PendingDraw, Restored, Unjournaled, collection_identity
from dew_lib.rollouts.packing import pack
from dew_lib.sampling import Sampling
from dew_lib.train.distributed import every_process

_SESSION_STATUS = {EpisodeStatus.COMPLETED: Status.COMPLETED, EpisodeStatus.TRUNCATED: Status.TRUNCATED,
                   EpisodeStatus.CANCELLED: Status.CANCELLED, EpisodeStatus.ERROR: Status.INFRA_ERROR}


class EpisodeFailure(RuntimeError):
    """A collection stopped because an episode failed; `episode` is that episode so far (status
    ERROR), and `__cause__` the original exception when there was one."""

    def __init__(self, message: str, episode: Episode):
        super().__init__(message)
        self.episode = episode


class EpisodeCancelled(EpisodeFailure):
    """A collection stopped because an episode was cancelled (status CANCELLED); `__cause__` is
    the original cancellation, or None when the environment reported CANCELLED itself."""


@dataclasses.dataclass(frozen=True, eq=False)
class EpisodeResult:
    """One collected episode and the session it trains as (`session.reward` is the verifier's)."""

    episode: Episode
    session: Session


def session_of(episode: Episode, *, group: int, reward: float | None = None) -> Session:
    """`episode` as a session whose calls are its actions, for `pack`."""
    calls = []
    for transition in episode.transitions:
        action = transition.action
        if action.behavior_log_probs is None:
            raise ValueError(f"turn {action.step} of task {episode.task.id!r} has no behavior "
                             "log-probabilities; only actions sampled with likelihoods can train")
        calls.append(Call(prompt_ids=action.context, sampled_ids=action.tokens,
                          behavior_log_probs=action.behavior_log_probs,
                          raw_log_probs=action.raw_log_probs,
                          finish_reason="stop" if action.terminated else "length",
                          version=action.policy_step, routed_experts=action.routed_experts))
    identity = episode.identity
    return Session(task=episode.task.id, group=group, sample=identity.sample, attempt=identity.attempt,
                   calls=tuple(calls), status=_SESSION_STATUS[episode.status], reward=reward,
                   detail=episode.detail)


def project(results: Sequence[EpisodeResult], *, width: int, rows: int,
            estimator: str = "group", truncation: str = "mask") -> PackedBatch:
    """Pack the sessions of `results` into `[rows, width]`, truncated ones as `truncation` says
    (`pack`'s "mask", "score" or "zero"); refuses episodes sampled under different policy bindings."""
    origins = {r.episode.origin for r in results}
    if len(origins) > 1:
        raise ValueError(f"these episodes come from {len(origins)} policy bindings; project each "
                         "collection on its own (their likelihoods belong to different weights)")
    packed = pack([r.session for r in results], width, rows=rows, estimator=estimator, truncation=truncation)
    packed.setdefault("old_log_probs", np.zeros((rows, width), np.float32))  # none trained: same columns
    return PackedBatch.of(packed)


class EpisodeRollout:
    """Collect `groups` episodes per task row and pack them for GRPOObjective (module docstring).

    policy: a `TextGeneration` (anything with `bind(snapshot)` returning a callable with its
    signature). environment: `(task, identity) -> Environment`. verifier: `(task, episode) ->
    float`. sampling: how turns are drawn; its `eos_id` ends an action. record: optional, called
    with every `EpisodeResult` of a collection that finished, and with the failed episode's when
    one aborts it. workers: threads that run environment steps, resets and verifiers at once.
    estimator: the group baseline ("group", "mean" or "rloo"). journal: an `EpisodeJournal` that
    makes collections resumable; its environments need `get_state()` and `set_state(bytes)`.
    truncation: how truncated episodes train: "mask" (not at all), "score" (on their verifier's
    reward, as verl and TRL grade a reply cut at its length) or "zero" (on reward 0).

    After a collection, `last_results` holds its results and `last_latencies` each episode's own
    seconds from the collection's start to its end (its last answer, or the round that truncated
    it), before the verifiers, which score every episode once all have ended.
    """

    def __init__(self, policy, environment: EnvironmentFactory, verifier: Verifier, *,
                 max_prompt_tokens: int, max_new_tokens: int, max_turns: int, groups: int,
                 sampling: Sampling = Sampling(), record: Callable[[EpisodeResult], Any] | None = None,
                 workers: int = 8, estimator: str = "group", journal: EpisodeJournal | None = None,
                 truncation: str = "mask"):
        if not callable(getattr(policy, "bind", None)):
            raise TypeError("EpisodeRollout.policy must have bind(snapshot), e.g. "
                            "dew_lib.inference.TextGeneration(model, variables)")
        for name, value in (("environment", environment), ("verifier", verifier)):
            if not callable(value):
                raise TypeError(f"EpisodeRollout.{name} must be callable")
        if record is not None and not callable(record):
            raise TypeError("EpisodeRollout.record must be callable with an EpisodeResult, or None")
        if not sampling.eos_ids:
            raise ValueError("EpisodeRollout.sampling needs eos_id: EOS is what ends an action")
        self.max_prompt_tokens = integer("EpisodeRollout.max_prompt_tokens", max_prompt_tokens)
        self.max_new_tokens = integer("EpisodeRollout.max_new_tokens", max_new_tokens)
        self.max_turns = integer("EpisodeRollout.max_turns", max_turns)
        self.groups = group_size("EpisodeRollout.groups", groups)
        self.workers = integer("EpisodeRollout.workers", workers)
        algorithms.advantage_function(estimator)
        if truncation not in TRUNCATION:
            raise ValueError(f"EpisodeRollout.truncation must be one of {TRUNCATION}, got {truncation!r}")
        if journal is not None and not isinstance(journal, EpisodeJournal):
            raise TypeError(f"EpisodeRollout.journal must be an EpisodeJournal or None, got {type(journal).__name__}")
        self.journal = journal
        self.policy, self.environment, self.verifier = policy, environment, verifier
        self.sampling, self.record, self.estimator = sampling, record, estimator
        self.truncation = truncation
        self.last_results: list[EpisodeResult] = []
        self.last_latencies: list[float | None] = []

    @property
    def width(self) -> int:
        """Ids per packed row: the objective's seq_len + 1."""
        return self.max_prompt_tokens + self.max_new_tokens

    def rows(self, tasks: int) -> int:
        """Packed rows of a batch of `tasks` task rows: one per task, sample and turn."""
        return tasks * self.groups * self.max_turns

    def __call__(self, state, batch: Mapping[str, Any], key: jax.Array) -> PackedBatch:
        results = self.collect(state.params, batch, key, step=int(state.step),
                               policy_step=int(state.updates))
        return project(results, width=self.width, rows=self.rows(len(results) // self.groups),
                       estimator=self.estimator, truncation=self.truncation)

    def collect(self, snapshot: Any, batch: Mapping[str, Any], key: jax.Array, *, step: int = 0,
                policy_step: int = 0) -> list[EpisodeResult]:
        """Run every episode of `batch` under one binding of `snapshot`; the results in task,
        then sample order. step: the attempted-work clock (episode identities); policy_step: the
        committed update clock (each action's version)."""
        started = time.perf_counter()
        tasks = _tasks(batch)
        check_cohort(self, len(tasks))
        log = self._log(snapshot, tasks, key, step, policy_step)
        restored = agreed(log)
        policy = self.policy.bind(snapshot)
        first = jax.process_index() * len(tasks)  # this process's first task row of the job's batch
        seeds = _seeds(key, len(tasks) * jax.process_count(), self.groups)[first:first + len(tasks)]
        slots = [Slot(task, EpisodeId(task=task.id, group=first + b, sample=g, attempt=0,
                                       seed=int(seeds[b, g]), step=step), index=(first + b) * self.groups + g)
                 for b, task in enumerate(tasks) for g in range(self.groups)]
        opened: list[Slot] = []
        try:
            with concurrent.futures.ThreadPoolExecutor(min(self.workers, len(slots))) as pool:
                def enter():
                    for slot in slots:  # on this thread: a worker process dies with the thread that started it
                        slot.manager, slot.environment = enter_environment(slot, self.environment, log.journaled)
                        opened.append(slot)
                    each(pool, slots, "reset", self._reset)
                    snapshots = restored.snapshots()  # each restored slot resumes from its last answer
                    each(pool, [s for s in slots if s.index in snapshots], "set_state",
                         lambda s: s.environment.set_state(snapshots[s.index]))

                together(enter, "entering the environments")
                for turn in range(self.max_turns):
                    if not self._turn(pool, policy, slots, turn, jax.random.fold_in(key, turn), policy_step,
                                      log, restored):
                        break
                for slot in slots:
                    if slot.status is EpisodeStatus.RUNNING:
                        slot.end(EpisodeStatus.TRUNCATED, f"max_turns={self.max_turns} reached")
                together(lambda: each(pool, [s for s in slots if s.status in _SCORED], "verifier",
                                       lambda s: self._verify(s, policy.binding)), "scoring the episodes")
        except BaseException as error:
            self._abort(opened, policy.binding, error)
            raise
        results = [self._release(slot, policy.binding) for slot in slots]
        log.finished([slot.reward for slot in slots])
        self.last_results = results
        self.last_latencies = [None if s.ended is None else s.ended - started for s in slots]
        if self.record is not None:
            for result in results:
                self.record(result)
        return results

    def _log(self, snapshot, tasks: list[Task], key, step: int, policy_step: int):
        """The journal's log of this collection (a restored one when the journal holds it
        unfinished), or a log that keeps nothing without a journal."""
        if self.journal is None:
            return Unjournaled()
        identity = collection_identity(snapshot, key, step=step, policy_step=policy_step,
                                       tasks=[t.id for t in tasks], groups=self.groups,
                                       max_prompt_tokens=self.max_prompt_tokens,
                                       max_new_tokens=self.max_new_tokens, max_turns=self.max_turns,
                                       sampling=self.sampling)
        return self.journal.open_collection(identity)

    # ----- the steps of a collection -----------------------------------------------------------
    def _reset(self, slot: Slot) -> None:
        slot.first = observed(slot, "reset", slot.environment.reset())
        self._observe(slot, slot.first)

    def _observe(self, slot: Slot, observation: Observation) -> None:
        """Take an observation: the next context, or how the episode ended."""
        if observation.status is EpisodeStatus.RUNNING:
            slot.context = observation.context
        elif observation.status is EpisodeStatus.ERROR:
            raise SlotError(slot, "environment", None, f"the environment reported an error: {observation.detail}")
        elif observation.status is EpisodeStatus.CANCELLED:
            raise SlotError(slot, "environment", None, f"the environment cancelled it: {observation.detail}",
                            cancelled=True)
        else:
            slot.end(observation.status, observation.detail)

    def _turn(self, pool, policy, slots: list[Slot], turn: int, key, policy_step: int, log,
              restored: Restored) -> bool:
        """Draw one action for every running slot (the journal's saved draws of the round when it
        has them, else sampled and saved before any tool call) and send the finished ones to
        their environments; False when no slot was running."""
        for slot in slots:
            if slot.status is EpisodeStatus.RUNNING and slot.context.size > self.max_prompt_tokens:
                slot.end(EpisodeStatus.TRUNCATED, f"the context of {slot.context.size} ids exceeds "
                         f"max_prompt_tokens={self.max_prompt_tokens}")
        running = [s.status is EpisodeStatus.RUNNING for s in slots]
        if not any(every_process(any(running))):  # a process whose episodes ended draws on for the others
            return False
        draws = restored.round(turn, {s.index: s.context for s, live in zip(slots, running, strict=True) if live})
        if draws is None:
            draws = self._sample(policy, slots, running, key)
            log.pending(turn, draws)

        def answer():
            sent = []
            for n, slot in enumerate(slots):
                if not running[n]:
                    continue
                action = draws[slot.index].action(turn, policy_step)
                check_action(action, self.sampling.eos_ids)
                if action.terminated:
                    sent.append((slot, action))
                else:
                    slot.transitions.append(Transition(action, None))
                    slot.end(EpisodeStatus.TRUNCATED, f"turn {turn} used its whole budget of "
                             f"{self.max_new_tokens} ids without EOS")
            each(pool, sent, "step", lambda pair: self._step(*pair, log, restored))

        together(answer, f"turn {turn} of the episodes")
        return True

    def _sample(self, policy, slots: list[Slot], running: list[bool], key) -> dict[int, PendingDraw]:
        """One policy call for the whole cohort (finished slots read an inert context and their
        draw is dropped): slot index -> its draw."""
        inert = np.zeros(1, np.int32)
        contexts = cohort([s.context if live else inert for s, live in zip(slots, running, strict=True)],
                           self.max_prompt_tokens)
        try:
            drawn = policy(contexts, max_new_tokens=self.max_new_tokens, key=key, sampling=self.sampling,
                           width=self.max_prompt_tokens)
        except BaseException as error:
            raise SlotError(slots[running.index(True) if any(running) else 0], "policy", error, str(error)) from error
        routes = getattr(drawn, "routes", None)  # [cohort, P + R, layers, k], each real prompt first
        draws = {}
        for live, slot in zip(running, slots, strict=True):
            if live:
                n, count = slot.index, int(drawn.lengths[slot.index])  # its row of the job's cohort
                context = np.asarray(slot.context)
                routed = None if routes is None else routes[n, :context.size + count]
                draws[slot.index] = PendingDraw(context, drawn.tokens[n, :count], drawn.log_probs[n, :count],
                                                drawn.behavior_log_probs[n, :count], bool(drawn.stopped[n]), routed)
        return draws

    def _step(self, slot: Slot, action: Action, log, restored: Restored) -> None:
        """Send the action to the environment and commit its answer with a snapshot; a turn the
        journal already holds is taken from it instead (the environment has its snapshot)."""
        done = restored.turns.get((action.step, slot.index))
        if done is not None:
            slot.transitions.append(Transition(action, done.observation, done.seconds))
            self._observe(slot, done.observation)
            return
        started = time.perf_counter()
        observation = observed(slot, "step", slot.environment.step(action))
        transition = Transition(action, observation, time.perf_counter() - started)
        if log.journaled and observation.status not in _UNRECORDED:  # a failure is retried, not replayed
            log.completed(slot.index, transition, snapshot_environment(slot))
        slot.transitions.append(transition)
        self._observe(slot, observation)

    def _verify(self, slot: Slot, origin: int) -> None:
        reward = self.verifier(slot.task, slot.episode(origin))
        try:
            reward = float(reward)
        except (TypeError, ValueError) as error:
            raise SlotError(slot, "verifier", error, f"the verifier returned {reward!r}, not a number") from error
        if not math.isfinite(reward):
            raise SlotError(slot, "verifier", None, f"the verifier returned {reward}; rewards must be finite")
        slot.reward = reward

    def _release(self, slot: Slot, origin: int) -> EpisodeResult:
        """Leave the slot's environment; an episode whose release fails is thrown out."""
        try:
            slot.manager.__exit__(None, None, None)
        except Exception as error:  # noqa: BLE001 - the episode is thrown out, the others train
            episode = slot.episode(origin)
            detail = f"thrown out: releasing its environment failed: {describe(error)}"
            session = dataclasses.replace(session_of(episode, group=slot.identity.group),
                                          status=Status.INFRA_ERROR, detail=detail)
            return EpisodeResult(slot.episode(origin, EpisodeStatus.ERROR, detail), session)
        episode = slot.episode(origin)
        return EpisodeResult(episode, session_of(episode, group=slot.identity.group, reward=slot.reward))

    def _abort(self, opened: list[Slot], origin: int, error: BaseException) -> None:
        """Release every environment under the exception that stopped the collection (the
        original one; the wrapper when the episode failed without one), then raise an episode's
        failure as EpisodeFailure or EpisodeCancelled; anything else, such as KeyboardInterrupt,
        passes through as it is."""
        wrapper = None
        if isinstance(error, SlotError):
            slot = error.slot
            status = EpisodeStatus.CANCELLED if error.cancelled else EpisodeStatus.ERROR
            episode = slot.episode(origin, status, error.detail)
            message = (f"the episode of task {slot.task.id!r} (sample {slot.identity.sample}) "
                       f"{'was cancelled' if error.cancelled else 'failed'} in its {error.where}: "
                       f"{error.detail}; the collection stopped before any update")
            wrapper = (EpisodeCancelled if error.cancelled else EpisodeFailure)(message, episode)
        original = error.error if isinstance(error, SlotError) else error
        under = original if original is not None else wrapper
        for slot in reversed(opened):
            try:
                slot.manager.__exit__(type(under), under, under.__traceback__)
            except Exception as release:  # noqa: BLE001 - the original failure is what gets raised
                (wrapper or error).add_note(f"releasing the environment of task {slot.task.id!r} sample "
                                            f"{slot.identity.sample} also failed: {describe(release)}")
        if wrapper is None:
            return
        if self.record is not None:
            group = wrapper.episode.identity.group
            self.record(EpisodeResult(wrapper.episode, session_of(wrapper.episode, group=group)))
        raise wrapper from original


_SCORED = (EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED)
_UNRECORDED = (EpisodeStatus.ERROR, EpisodeStatus.CANCELLED)


def _tasks(batch: Mapping[str, Any]) -> list[Task]:
    if "task_id" not in batch:
        raise KeyError(f"EpisodeRollout reads integer task_id rows; the batch has {sorted(batch)}")
    ids = np.asarray(batch["task_id"]).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"batch['task_id'] must hold integers, got {ids.dtype}")
    columns = {k: np.asarray(v) for k, v in batch.items()}
    return [Task(str(int(t)), {k: v[b] for k, v in columns.items()}) for b, t in enumerate(ids)]


def _seeds(key: jax.Array, tasks: int, groups: int) -> np.ndarray:
    """Environment seeds, one per episode, from the collection's key."""
    data = np.asarray(jax.random.key_data(key)).reshape(-1).astype(np.uint32)
    return np.random.SeedSequence([int(x) for x in data]).generate_state(tasks * groups).reshape(tasks, groups)


__all__ = ["EpisodeCancelled", "EpisodeFailure", "EpisodeResult", "EpisodeRollout", "project", "session_of"]

"""Session sources that draw from a RolloutServer: single-turn prompts and in-process environments.

Both implement `SessionSource`: `submit(task, group=, sample=, attempt=, seed=)` returns a
`Future[Session]` at once and `cancel(future)` asks that session to stop. Neither raises through
the future for an outcome of the rollout: every way a session can end becomes a `Status`.

PromptSource draws one completion per sample and scores its decoded text on a thread pool as the
draw finishes, so scoring overlaps generation and the trainer's update:

    draw ended on EOS                          COMPLETED, scored
    draw used its whole budget                 TRUNCATED, scored
    the draw failed, or the reward raised or   INFRA_ERROR, with the error in `detail`
    returned a non-finite value
    cancelled before its session resolved      CANCELLED (the draw is withdrawn from the server)

EnvironmentSource runs one episode per sample on a worker thread (see `episodes`): every turn
submits the observation's context to the server, so turns of different sessions share the
engine's batch, and each call keeps the version the server reports for it.

    the environment reports COMPLETED          COMPLETED, verified
    a response hit max_new_tokens without EOS  TRUNCATED (not sent to the environment), verified
    a context longer than max_prompt_tokens,   TRUNCATED, verified
    max_turns calls made, or the environment
    reports TRUNCATED
    the environment raises (entering, reset,   INFRA_ERROR, unverified
    step or release) or reports ERROR; a
    failed draw; a verifier that raises or
    returns a non-finite value
    cancel, or the environment reports         CANCELLED, unverified
    CANCELLED

`cancel` stops a session at its next turn, and mid-draw: the draw in flight is cancelled on the
server, and the environment is released (its context manager exited) before the future resolves.
A thread stuck inside an environment's own `step` cannot be interrupted; environments bound
their own step time.

Not here: scheduling (scheduler.py), retries (the scheduler resubmits failed attempts),
subprocess environments, remote gateways.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from typing import Any

import numpy as np

from dew_lib.options import integer
from dew_lib.records.episodes import (
    Action,
    EnvironmentFactory,
    Episode,
    EpisodeId,
    EpisodeStatus,
    Observation,
    Transition,
    Verifier,
)
from dew_lib.records.sessions import Call, Session, Status, Task
from dew_lib.rollouts.sampled import Reward, token_text


def _call(prompt, draw) -> Call:
    return Call(prompt_ids=prompt, sampled_ids=draw.ids, behavior_log_probs=draw.behavior_log_probs,
                raw_log_probs=draw.raw_log_probs, finish_reason=draw.finish_reason,
                version=draw.version, routed_experts=draw.routed_experts, support=draw.support)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


class _Live:
    """A session in progress: whether it was asked to stop, and the draw it waits on."""

    __slots__ = ("cancelled", "draw", "lock")

    def __init__(self):
        self.cancelled = False
        self.draw: Future | None = None
        self.lock = threading.Lock()

    def waiting_on(self, draw: Future) -> bool:
        """Record the draw in flight; False (and the draw withdrawn) if cancel came first."""
        with self.lock:
            self.draw = draw
            if self.cancelled:
                draw.cancel()
                return False
        return True

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            draw = self.draw
        if draw is not None:
            draw.cancel()


class _Source:
    """What both sources share: the futures they hand out and cancel."""

    def __init__(self, workers: int, name: str):
        workers = integer(f"{name}.workers", workers)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._live: dict[Future, _Live] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _start(self) -> tuple[Future, _Live]:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        future: Future[Session] = Future()
        live = _Live()
        with self._lock:
            self._live[future] = live
        return future, live

    def _resolve(self, future: Future, session: Session) -> None:
        with self._lock:
            self._live.pop(future, None)
        if future.set_running_or_notify_cancel():
            future.set_result(session)

    def _fail(self, future: Future, error: BaseException) -> None:
        """A bug in the source itself: the future raises, which the scheduler propagates."""
        with self._lock:
            self._live.pop(future, None)
        if future.set_running_or_notify_cancel():
            future.set_exception(error)

    def cancel(self, future: Future) -> None:
        """Ask the session behind `future` to stop at its next turn (also mid-draw)."""
        with self._lock:
            live = self._live.get(future)
        if live is not None:
            live.cancel()

    def close(self) -> None:
        """Cancel every session in progress and wait for the workers to finish."""
        self._closed = True
        with self._lock:
            live = list(self._live.values())
        for item in live:
            item.cancel()
        self._pool.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PromptSource(_Source):
    """One completion per sample from `server`, scored by `reward` on a thread pool.

    reward: `(data_source, completion, ground_truth, extra_info) -> float` (MathReward,
    CodeReward). decode: sampled ids (EOS removed) -> the text the reward reads.
    max_new_tokens: the response budget. workers: threads scoring completions. Tasks carry
    `prompt_ids` and the reward fields in their data (`prompt_tasks` builds them).
    reward_details: optional `() -> Any` called on the scoring thread right after each reward
    call (e.g. `TaskReward.last_runs`, the programs a code reward ran); `pop_details(session)`
    hands its result over once, keyed by the session's task, group, sample and attempt.
    """

    def __init__(self, server, reward: Reward, *, decode: Callable[[Sequence[int]], str] = token_text,
                 max_new_tokens: int, workers: int = 8,
                 reward_details: Callable[[], Any] | None = None):
        if not callable(getattr(server, "submit", None)):
            raise TypeError("PromptSource.server must be a RolloutServer (submit, load)")
        if not callable(reward):
            raise TypeError("PromptSource.reward must be callable as reward(data_source, completion, "
                            "ground_truth, extra_info) -> float")
        max_new_tokens = integer("PromptSource.max_new_tokens", max_new_tokens)
        if reward_details is not None and not callable(reward_details):
            raise TypeError("PromptSource.reward_details must be callable with no arguments "
                            f"(e.g. TaskReward.last_runs), got {type(reward_details).__name__}")
        super().__init__(workers, "PromptSource")
        self.server, self.reward, self.decode = server, reward, decode
        self.max_new_tokens = max_new_tokens
        self.reward_details = reward_details
        self._details: dict[tuple, Any] = {}

    def pop_details(self, session: Session) -> Any:
        """What reward_details returned when `session` was scored (None if it was not), once."""
        key = (session.task, session.group, session.sample, session.attempt)
        with self._lock:
            return self._details.pop(key, None)

    def submit(self, task: Task, *, group: int, sample: int, attempt: int,
               seed: int) -> Future[Session]:
        if "prompt_ids" not in task.data:
            raise KeyError(f"PromptSource reads task.data['prompt_ids'] (prompt_tasks puts it there); "
                           f"task {task.id!r} has {sorted(task.data)}")
        prompt = np.asarray(task.data["prompt_ids"], np.int32)
        labels: dict[str, Any] = dict(task=task.id, group=group, sample=sample, attempt=attempt)
        future, live = self._start()
        try:
            draw = self.server.submit(prompt, self.max_new_tokens, seed=int(seed))
        except BaseException:
            with self._lock:
                self._live.pop(future, None)
            raise
        live.waiting_on(draw)
        draw.add_done_callback(lambda done: self._pool.submit(self._score, future, live, done, task,
                                                              prompt, labels))
        return future

    def _score(self, future, live: _Live, draw_future: Future, task: Task, prompt, labels) -> None:
        try:
            self._resolve(future, self._session(live, draw_future, task, prompt, labels))
        except BaseException as error:  # noqa: BLE001 - a bug here must reach the scheduler
            self._fail(future, error)

    def _session(self, live, draw_future, task, prompt, labels) -> Session:
        if draw_future.cancelled() or live.cancelled:
            return Session(**labels, status=Status.CANCELLED, detail="cancelled while drawing")
        error = draw_future.exception()
        if error is not None:
            return Session(**labels, status=Status.INFRA_ERROR, detail=f"draw failed: {_describe(error)}")
        draw = draw_future.result()
        call = _call(prompt, draw)
        ids = draw.ids[:-1] if draw.eos else draw.ids
        try:
            completion = self.decode(ids)
            reward = float(self.reward(task.data.get("data_source", ""), completion,
                                       task.data.get("ground_truth", ""),
                                       task.data.get("extra_info", "")))
            if self.reward_details is not None:
                details = self.reward_details()
                with self._lock:
                    self._details[tuple(labels.values())] = details
        except Exception as failure:  # noqa: BLE001 - a failed verifier is an infrastructure failure
            return Session(**labels, calls=(call,), status=Status.INFRA_ERROR,
                           detail=f"reward failed: {_describe(failure)}")
        if not math.isfinite(reward):
            return Session(**labels, calls=(call,), status=Status.INFRA_ERROR,
                           detail=f"reward returned {reward}; rewards must be finite")
        if live.cancelled:
            return Session(**labels, calls=(call,), status=Status.CANCELLED,
                           detail="cancelled while scoring")
        return Session(**labels, calls=(call,), reward=reward,
                       status=Status.COMPLETED if draw.eos else Status.TRUNCATED,
                       detail="" if draw.eos else f"used the whole budget of {self.max_new_tokens} ids")


class EnvironmentSource(_Source):
    """One episode per sample through `environment` on worker threads, drawing from `server`.

    environment: `(task, identity) -> Environment`, a context manager entered for the session.
    verifier: `(task, episode) -> float`, called while the environment is still entered, for
    COMPLETED and TRUNCATED episodes. max_prompt_tokens: the longest context the model may read
    (a longer one truncates the episode). max_new_tokens: the budget of each turn. max_turns:
    model calls per episode. workers: episodes run at once (the server batches their turns).
    keep_episodes: keep each session's `Episode` (its transitions: what the run store's `turns`
    rows hold) until `pop_episode(session)` takes it.
    """

    def __init__(self, server, environment: EnvironmentFactory, verifier: Verifier, *,
                 max_prompt_tokens: int, max_new_tokens: int, max_turns: int, workers: int = 8,
                 keep_episodes: bool = False):
        if not callable(getattr(server, "submit", None)):
            raise TypeError("EnvironmentSource.server must be a RolloutServer (submit, load)")
        for name, value in (("environment", environment), ("verifier", verifier)):
            if not callable(value):
                raise TypeError(f"EnvironmentSource.{name} must be callable")
        max_prompt_tokens, max_new_tokens, max_turns = (
            integer(f"EnvironmentSource.{name}", value) for name, value in
            (("max_prompt_tokens", max_prompt_tokens), ("max_new_tokens", max_new_tokens), ("max_turns", max_turns)))
        super().__init__(workers, "EnvironmentSource")
        self.server, self.environment, self.verifier = server, environment, verifier
        self.max_prompt_tokens, self.max_new_tokens, self.max_turns = (
            max_prompt_tokens, max_new_tokens, max_turns)
        self.keep_episodes = bool(keep_episodes)
        self._episodes: dict[tuple, Episode] = {}

    def pop_episode(self, session: Session) -> Episode | None:
        """The episode behind `session` (None when it never reset, or episodes are not kept), once."""
        key = (session.task, session.group, session.sample, session.attempt)
        with self._lock:
            return self._episodes.pop(key, None)

    def submit(self, task: Task, *, group: int, sample: int, attempt: int,
               seed: int) -> Future[Session]:
        future, live = self._start()
        identity = EpisodeId(task=task.id, group=group, sample=sample, attempt=attempt, seed=int(seed))
        self._pool.submit(self._run, future, live, task, identity)
        return future

    def _run(self, future, live: _Live, task: Task, identity: EpisodeId) -> None:
        try:
            self._resolve(future, self._episode(live, task, identity))
        except BaseException as error:  # noqa: BLE001 - a bug here must reach the scheduler
            self._fail(future, error)

    def _episode(self, live: _Live, task: Task, identity: EpisodeId) -> Session:
        labels: dict[str, Any] = dict(task=task.id, group=identity.group, sample=identity.sample,
                                      attempt=identity.attempt)
        if live.cancelled:
            return Session(**labels, status=Status.CANCELLED, detail="cancelled before it started")
        calls: list[Call] = []
        outcome: dict[str, Any] = {}
        try:
            with self.environment(task, identity) as env:
                status, detail, first, transitions = self._turns(env, live, identity, calls)
                outcome.update(status=status, detail=detail)
                if self.keep_episodes:
                    kept = Episode(task, identity, _EPISODE_STATUS[status], detail, first, tuple(transitions))
                    with self._lock:
                        self._episodes[tuple(labels.values())] = kept
                if status in (Status.COMPLETED, Status.TRUNCATED):
                    episode = Episode(task, identity, EpisodeStatus(status.value), detail, first,
                                      tuple(transitions))
                    try:
                        reward = float(self.verifier(task, episode))
                    except Exception as error:  # noqa: BLE001 - a verifier crash is infrastructure
                        outcome.update(status=Status.INFRA_ERROR, detail=f"verifier failed: {_describe(error)}")
                    else:
                        if math.isfinite(reward):
                            outcome["reward"] = reward
                        else:
                            outcome.update(status=Status.INFRA_ERROR,
                                           detail=f"verifier returned {reward}; rewards must be finite")
        except Exception as error:  # noqa: BLE001 - entering, reset, step or release failed
            where = "released" if outcome else "running"
            return Session(**labels, calls=tuple(calls), status=Status.INFRA_ERROR,
                           detail=f"environment failed while {where}: {_describe(error)}")
        return Session(**labels, calls=tuple(calls), **outcome)

    def _turns(self, env, live: _Live, identity: EpisodeId, calls: list[Call]):
        """Run the model and the environment in turns: (status, detail, first, transitions)."""
        observation = first = _observation(env.reset(), "reset")
        transitions: list[Transition] = []
        for turn in range(self.max_turns + 1):
            if observation.status is not EpisodeStatus.RUNNING:
                return _terminal(observation), observation.detail, first, transitions
            if live.cancelled:
                return Status.CANCELLED, f"cancelled before turn {turn}", first, transitions
            context = observation.context
            if context.size > self.max_prompt_tokens:
                return (Status.TRUNCATED, f"the context of {context.size} ids exceeds "
                        f"max_prompt_tokens={self.max_prompt_tokens}", first, transitions)
            if turn == self.max_turns:
                return Status.TRUNCATED, f"max_turns={self.max_turns} reached", first, transitions
            seed = int(np.random.SeedSequence([identity.seed, turn]).generate_state(1)[0])
            draw_future = self.server.submit(context, self.max_new_tokens, seed=seed)
            if not live.waiting_on(draw_future):
                return Status.CANCELLED, f"cancelled at turn {turn}", first, transitions
            try:
                draw = draw_future.result()
            except CancelledError:
                return Status.CANCELLED, f"cancelled while drawing turn {turn}", first, transitions
            except Exception as error:  # noqa: BLE001 - a failed draw is an infrastructure failure
                return Status.INFRA_ERROR, f"draw failed: {_describe(error)}", first, transitions
            calls.append(_call(context, draw))
            action = Action(context=context, tokens=draw.ids, terminated=draw.eos, step=turn,
                            raw_log_probs=draw.raw_log_probs, behavior_log_probs=draw.behavior_log_probs,
                            policy_step=draw.version)
            if not draw.eos:
                transitions.append(Transition(action, None))
                return (Status.TRUNCATED, f"turn {turn} used its whole budget of "
                        f"{self.max_new_tokens} ids", first, transitions)
            if live.cancelled:
                transitions.append(Transition(action, None))
                return Status.CANCELLED, f"cancelled after turn {turn}", first, transitions
            started = time.perf_counter()
            observation = _observation(env.step(action), "step")
            transitions.append(Transition(action, observation, time.perf_counter() - started))
        raise AssertionError("unreachable: the turn limit ends the loop")


def _observation(value, where: str) -> Observation:
    if not isinstance(value, Observation):
        raise TypeError(f"the environment's {where} returned {type(value).__name__}, not an Observation")
    return value


_EPISODE_STATUS = {Status.COMPLETED: EpisodeStatus.COMPLETED, Status.TRUNCATED: EpisodeStatus.TRUNCATED,
                   Status.CANCELLED: EpisodeStatus.CANCELLED, Status.INFRA_ERROR: EpisodeStatus.ERROR}


def _terminal(observation: Observation) -> Status:
    return {EpisodeStatus.COMPLETED: Status.COMPLETED, EpisodeStatus.TRUNCATED: Status.TRUNCATED,
            EpisodeStatus.CANCELLED: Status.CANCELLED, EpisodeStatus.ERROR: Status.INFRA_ERROR}[
        observation.status]


__all__ = ["EnvironmentSource", "PromptSource"]

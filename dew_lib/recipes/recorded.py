"""Rollouts recorded in the run store: one wrapper for every kind of rollout, and what each kind
writes.

`RecordedRollout(rollout, record)` is what the Trainer calls in place of `rollout`: it times the
call and hands the rollout's state, batch and seconds to `record`, which reads what the rollout
just drew (its `last_*` attributes) and writes it through the stage's `StageWriter`. Each
session's `latency` is its own (`last_latencies`: a lockstep draw finishes every row together, so
the call's seconds would give every session of an update the same number). The batch
reaches the Trainer unchanged. The recorders here are the text rollouts'; the image stages'
(`FlowRollout` samples and previews) lives with their task (tasks/flow_train.py).

Not here: the asynchronous scheduler's records, which it logs itself as it settles each session
(`ScheduledRollout`, scheduled.py, writes them through the same `StageWriter` methods).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dew_lib.rollouts import prompt_tasks

Verdicts = Callable[[Sequence[Any]], Sequence[Any]]  # a reward's program runs -> Verdict rows
Record = Callable[[Any, Any, float], None]  # (state, batch, seconds the draw took)


class RecordedRollout:
    """`rollout`, with each call's draw written by `record(state, batch, seconds)`."""

    def __init__(self, rollout, record: Record):
        self.rollout, self.record = rollout, record

    def __call__(self, state, batch, key):
        started = time.perf_counter()
        packed = self.rollout(state, batch, key)
        self.record(state, batch, time.perf_counter() - started)
        return packed

    def close(self) -> None:
        """Close what the rollout holds open (a distill rollout's server), if it holds anything."""
        close = getattr(self.rollout, "close", None)
        if close is not None:
            close()


def updates(state) -> int:
    """The update the drawn rollouts train first (one host read of the counter per draw)."""
    return int(jax.device_get(state.updates))


def sampled_sessions(rollout, writer, verdicts: Verdicts | None = None) -> Record:
    """A SampledRollout's draw: the prompt of every task not recorded yet (its `last_tasks`,
    decoded with its `decode`), then every session, with the verdict of every program a code
    reward ran for it (`last_reward_details`, turned into rows by `verdicts`), under one update."""

    def record(state, batch, seconds: float) -> None:
        update, sessions, runs = updates(state), rollout.last_sessions, rollout.last_reward_details
        writer.prompts(rollout.last_tasks, update=update, decode=rollout.decode)
        writer.sessions(sessions, update=update, latencies=rollout.last_latencies, causes="admitted",
                        truncation="score",
                        verdicts=[verdicts(r or ()) for r in runs] if runs and verdicts else None)

    return record


def episode_sessions(rollout, writer, decode=None) -> Record:
    """An EpisodeRollout's (or a PPORollout's over one) collection, written once under the
    update that first trains it: each task's prompt (first time only), each episode's session
    with its calls, and its turns. A PPO pass over a collection already written writes nothing."""
    episodes = getattr(rollout, "episodes", rollout)
    written: list[Any] = [None]  # the collection written last

    def record(state, batch, seconds: float) -> None:
        results = episodes.last_results
        if results is written[0]:
            return
        written[0] = results
        update = updates(state)
        writer.prompts(prompt_tasks(batch), update=update, decode=decode)
        writer.sessions([r.session for r in results], update=update, latencies=episodes.last_latencies,
                        causes="admitted", truncation="mask", episodes=[r.episode for r in results])

    return record


__all__ = ["RecordedRollout", "episode_sessions", "sampled_sessions"]

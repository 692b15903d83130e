"""The in-process environment protocol of tool episodes: what an environment and a verifier see.

An environment runs one episode of one task. The factory you hand to a source,
`environment(task, identity) -> Environment`, returns an object used as a context manager:
entering acquires whatever the episode needs (a workspace, a sandbox), leaving releases it,
whatever happened inside. Inside, `reset()` returns the first `Observation` (the exact context
token ids the model reads first) and `step(action)` takes a finished model turn (`Action`) and
returns the next observation: the exact next context while the episode runs, or a terminal
status. The environment does the decoding, tool-call validation, chat formatting, execution and
timeouts; nothing here runs generated code.

`Observation.status` tells the outcomes apart: RUNNING (the model acts next), COMPLETED,
TRUNCATED (a limit the environment enforces), CANCELLED and ERROR (the environment failed). A
verifier, `verifier(task, episode) -> float`, scores an `Episode`: its terminal status, detail
and every `Transition(action, observation)`, so it can grade finished and truncated outcomes
differently. It runs while the environment is still entered, so it can inspect what the
episode left behind.

Not here: running episodes (`dew_lib.rollouts.sources.EnvironmentSource`), the lock-step `EpisodeRollout`,
subprocess environments and journals.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from dew_lib.records.ids import token_ids
from dew_lib.records.sessions import Task


class EpisodeStatus(str, enum.Enum):
    """Where an episode stands after an observation."""

    RUNNING = "running"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclasses.dataclass(frozen=True, eq=False)
class Observation:
    """What the environment says after a reset or a step.

    context: the exact token ids the model reads next (required while RUNNING; a terminal
    observation may leave it empty). status: see `EpisodeStatus`. detail: free text for people
    and verifiers (an error message, a tool's result summary).
    """

    context: Any = ()
    status: EpisodeStatus = EpisodeStatus.RUNNING
    detail: str = ""

    def __post_init__(self):
        object.__setattr__(self, "status", EpisodeStatus(self.status))
        context = token_ids(self.context, "Observation.context")
        if self.status is EpisodeStatus.RUNNING and context.size == 0:
            raise ValueError("Observation.context is empty while the episode is RUNNING; the model "
                             "needs a context to act on (return a terminal status to end the episode)")
        object.__setattr__(self, "context", context)
        object.__setattr__(self, "detail", str(self.detail))


@dataclasses.dataclass(frozen=True, eq=False)
class Action:
    """A finished model turn: the context it read, the ids it sampled (EOS included when EOS
    ended the turn), whether EOS ended it, and which turn of the episode it was (from 0)."""

    context: np.ndarray
    tokens: np.ndarray
    terminated: bool
    step: int


@dataclasses.dataclass(frozen=True, eq=False)
class Transition:
    """One action and the observation the environment answered with (None when the action
    was not sent to the environment: a response cut off by its token budget)."""

    action: Action
    observation: Observation | None


@dataclasses.dataclass(frozen=True)
class EpisodeId:
    """Which episode an environment runs: the task, the scheduler's group, sample and attempt,
    and a seed for anything random the environment does."""

    task: str
    group: int
    sample: int
    attempt: int
    seed: int


@dataclasses.dataclass(frozen=True, eq=False)
class Episode:
    """What a verifier scores: the task, the identity, how the episode ended (COMPLETED or
    TRUNCATED when a verifier is called), why, the first observation and every transition."""

    task: Task
    identity: EpisodeId
    status: EpisodeStatus
    detail: str
    first: Observation
    transitions: tuple[Transition, ...]


class Environment(Protocol):
    """One episode's environment; a context manager (enter acquires, exit releases)."""

    def __enter__(self) -> Environment: ...

    def __exit__(self, *exc) -> Any: ...

    def reset(self) -> Observation: ...

    def step(self, action: Action) -> Observation: ...


EnvironmentFactory = Callable[[Task, EpisodeId], Environment]
Verifier = Callable[[Task, Episode], float]

__all__ = ["Action", "Environment", "EnvironmentFactory", "Episode", "EpisodeId", "EpisodeStatus",
           "Observation", "Transition", "Verifier"]

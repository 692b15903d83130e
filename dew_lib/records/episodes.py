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

Not here: running episodes (`dew_lib.rollouts.sources.EnvironmentSource` on a rollout server,
the lock-step `dew_lib.rollouts.episodes.EpisodeRollout`), subprocess environments, journals.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
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
    ended the turn), whether EOS ended it, and which turn of the episode it was (from 0).

    raw_log_probs and behavior_log_probs: one per sampled id, the raw policy's and the sampler's
    after temperature and filters, when the policy reports them (a lock-step `EpisodeRollout`
    always does; they become the session's call). policy_step: the trainer updates committed
    when it was sampled (the call's version). routed_experts: on a mixture of experts sampled
    with routing, `[context + tokens, layers, top_k]` the experts each id went through (the last
    sampled id, never fed, holds zeros), for routing replay.
    """

    context: np.ndarray
    tokens: np.ndarray
    terminated: bool
    step: int
    raw_log_probs: np.ndarray | None = None
    behavior_log_probs: np.ndarray | None = None
    policy_step: int = 0
    routed_experts: np.ndarray | None = None

    def __post_init__(self):
        context = token_ids(self.context, "Action.context")
        if context.size == 0:
            raise ValueError("Action.context is empty; an action is sampled from a context")
        object.__setattr__(self, "context", context)
        object.__setattr__(self, "tokens", token_ids(self.tokens, "Action.tokens"))
        if not isinstance(self.terminated, bool | np.bool_):
            raise TypeError(f"Action.terminated must be a bool, got {type(self.terminated).__name__}")
        object.__setattr__(self, "terminated", bool(self.terminated))
        for name in ("raw_log_probs", "behavior_log_probs"):
            value = getattr(self, name)
            if value is None:
                continue
            value = np.asarray(value, np.float32).reshape(-1)
            if value.shape != self.tokens.shape:
                raise ValueError(f"Action.{name} has {value.size} entries for {self.tokens.size} "
                                 "sampled ids; the policy reports one per sampled id")
            if not np.all(np.isfinite(value)):
                raise ValueError(f"Action.{name} holds a non-finite value")
            object.__setattr__(self, name, value)
        if self.routed_experts is not None:
            routed = np.asarray(self.routed_experts)
            ids = context.size + self.tokens.size
            if routed.ndim != 3 or routed.shape[0] != ids or not np.issubdtype(routed.dtype, np.integer):
                raise ValueError(f"Action.routed_experts must be integer expert ids [context + tokens = {ids}, "
                                 f"layers, top_k], got {routed.dtype} {routed.shape}")
            object.__setattr__(self, "routed_experts", routed)


def check_action(action: Action, eos_ids: tuple[int, ...]) -> None:
    """Refuse an action whose termination flag disagrees with the configured EOS ids (see
    `check_termination`). Live, imported and journal-restored actions all pass here."""
    check_termination(action.tokens, action.terminated, eos_ids, f"turn {action.step}")


def check_termination(tokens: np.ndarray, terminated: bool, eos_ids: Sequence[int], where: str) -> None:
    """Refuse sampled ids whose termination flag disagrees with the EOS ids: ids that EOS ended
    must end on an EOS id, and no id may follow an EOS. where names the ids in the message."""
    tokens = np.asarray(tokens)
    eos = np.isin(tokens, np.asarray(eos_ids, np.int32)) if len(eos_ids) else np.zeros(tokens.shape, bool)
    first = int(np.argmax(eos)) if eos.any() else -1
    if first >= 0 and first != tokens.size - 1:
        raise ValueError(f"{where} has {tokens.size - 1 - first} ids after EOS "
                         f"{int(tokens[first])}; sampling ends at its EOS")
    if terminated and first < 0:
        raise ValueError(f"{where} says EOS ended it but its last id is not one of the "
                         f"EOS ids {list(eos_ids)}")
    if not terminated and first >= 0:
        raise ValueError(f"{where} ends on EOS {int(tokens[first])} but says EOS did not "
                         "end it")


@dataclasses.dataclass(frozen=True, eq=False)
class Transition:
    """One action and the observation the environment answered with (None when the action
    was not sent to the environment: a response cut off by its token budget). seconds: how
    long the environment took to answer (None when it was not asked)."""

    action: Action
    observation: Observation | None
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class EpisodeId:
    """Which episode an environment runs: the task, its group and sample, the scheduler's
    attempt (resubmissions), a seed for anything random the environment does, and the training
    step that attempted it (the attempted-work clock of a lock-step `EpisodeRollout`; 0 from a
    rollout server's `EnvironmentSource`). An environment with outside effects keys them by it."""

    task: str
    group: int
    sample: int
    attempt: int
    seed: int
    step: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class Episode:
    """What a verifier scores: the task, the identity, how the episode ended (COMPLETED or
    TRUNCATED when a verifier is called), why, the first observation and every transition.
    `origin` names the policy binding that sampled it; episodes of different bindings are never
    projected into one batch (`dew_lib.rollouts.episodes.project`)."""

    task: Task
    identity: EpisodeId
    status: EpisodeStatus
    detail: str
    first: Observation
    transitions: tuple[Transition, ...]
    origin: Any = dataclasses.field(default=None, repr=False, compare=False)


class Environment(Protocol):
    """One episode's environment; a context manager (enter acquires, exit releases)."""

    def __enter__(self) -> Environment: ...

    def __exit__(self, *exc) -> Any: ...

    def reset(self) -> Observation: ...

    def step(self, action: Action) -> Observation: ...


EnvironmentFactory = Callable[[Task, EpisodeId], Environment]
Verifier = Callable[[Task, Episode], float]

__all__ = ["Action", "check_action", "check_termination", "Environment", "EnvironmentFactory", "Episode", "EpisodeId",
           "EpisodeStatus", "Observation", "Transition", "Verifier"]

"""What a rollout leaves behind: engine calls, sessions, their statuses, and the task they served.

A `Call` is one engine request: the prompt ids it read, the ids it sampled (EOS included on a
natural stop), the engine's behavior log-probabilities for them and the policy version it was
submitted under. A `Session` is one harness session (one sample of one task): its calls in
submission order, a `Status`, the verifier's reward and its components. A `SessionSource` turns
a `Task` into futures of sessions. These records are exactly what the run store keeps and what
`dew_lib.rollouts.pack` trains on.

Statuses: COMPLETED and AGENT_ERROR train on their reward; INFRA_ERROR and CANCELLED never train
and take no part in the baseline; TRUNCATED follows the `truncation` policy ("mask": dropped like
an infrastructure failure; "score": trained on its reward; "zero": trained on reward 0).

Not here: packing sessions into batches (`dew_lib.rollouts.packing`), drawing them (sources, the
scheduler), and any retokenizing: ids are kept exactly as the engine reported them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from dew_lib.records.ids import token_ids


class Status(str, enum.Enum):
    """How a session ended."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    AGENT_ERROR = "agent_error"
    INFRA_ERROR = "infra_error"
    CANCELLED = "cancelled"


TRUNCATION = ("mask", "score", "zero")
FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Call:
    """One engine request and what it sampled.

    prompt_ids: every id the engine read. sampled_ids: the ids it drew, EOS included on a natural
    stop. behavior_log_probs: one engine-reported log-probability per sampled id.
    raw_log_probs: the raw (untempered, unfiltered) policy's, when the engine has them.
    finish_reason: "stop" (EOS), "length" (budget) or "abort". version: the policy version
    served when the request was submitted. routed_experts: `[len(prompt_ids) +
    len(sampled_ids), layers, top_k]` expert ids, when the engine reports routing. support: for
    each sampled id, the ids the sampler kept (top-k/top-p support), when recorded.
    """

    prompt_ids: Any
    sampled_ids: Any
    behavior_log_probs: Any
    finish_reason: str = "stop"
    version: int = 0
    raw_log_probs: Any = None
    routed_experts: Any = None
    support: Sequence[Any] | None = None

    def __post_init__(self):
        prompt = token_ids(self.prompt_ids, "Call.prompt_ids")
        sampled = token_ids(self.sampled_ids, "Call.sampled_ids")
        if prompt.size == 0:
            raise ValueError("Call.prompt_ids is empty; a call needs the context it was sampled from")
        behavior = np.asarray(self.behavior_log_probs, np.float32).reshape(-1)
        if behavior.shape != sampled.shape:
            raise ValueError(
                f"Call.behavior_log_probs has {behavior.size} entries for {sampled.size} sampled "
                "ids; the engine must report one log-probability per sampled id"
            )
        if not np.all(np.isfinite(behavior)):
            raise ValueError("Call.behavior_log_probs holds a non-finite value")
        raw = None
        if self.raw_log_probs is not None:
            raw = np.asarray(self.raw_log_probs, np.float32).reshape(-1)
            if raw.shape != sampled.shape:
                raise ValueError(
                    f"Call.raw_log_probs has {raw.size} entries for {sampled.size} sampled ids"
                )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Call.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        routed = None
        if self.routed_experts is not None:
            routed = np.asarray(self.routed_experts)
            if routed.ndim != 3 or routed.shape[0] != prompt.size + sampled.size:
                raise ValueError(
                    f"Call.routed_experts has shape {routed.shape}; expected [prompt + sampled ids "
                    f"= {prompt.size + sampled.size}, layers, top_k]"
                )
        support = None
        if self.support is not None:
            support = tuple(token_ids(kept, "Call.support") for kept in self.support)
            if len(support) != sampled.size:
                raise ValueError(
                    f"Call.support has {len(support)} entries for {sampled.size} sampled ids"
                )
            for j, (token, kept) in enumerate(zip(sampled, support, strict=True)):
                if token not in kept:
                    raise ValueError(
                        f"Call.support[{j}] does not contain the id sampled there ({int(token)}); "
                        "a support must list every id the sampler could have drawn"
                    )
        for name, value in (("prompt_ids", prompt), ("sampled_ids", sampled),
                            ("behavior_log_probs", behavior), ("raw_log_probs", raw),
                            ("routed_experts", routed), ("support", support)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "version", int(self.version))


@dataclasses.dataclass(frozen=True)
class Task:
    """What a source works on: an id (the run store's key) and its payload."""

    id: str
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Session:
    """One sample of one task: its calls, how it ended and its reward.

    group and sample place it in its GRPO group; attempt counts resubmissions of the sample.
    reward is None when the verifier never ran. components break the reward down by name.
    """

    task: str
    group: int = 0
    sample: int = 0
    attempt: int = 0
    calls: tuple[Call, ...] = ()
    status: Status = Status.COMPLETED
    reward: float | None = None
    components: Mapping[str, float] = dataclasses.field(default_factory=dict)
    detail: str = ""

    def __post_init__(self):
        object.__setattr__(self, "status", Status(self.status))
        object.__setattr__(self, "calls", tuple(self.calls))
        object.__setattr__(self, "task", str(self.task))


class SessionSource(Protocol):
    """Draws sessions for tasks; a future per sample."""

    def submit(self, task: Task, *, group: int, sample: int, attempt: int,
               seed: int) -> concurrent.futures.Future[Session]: ...

    def cancel(self, future: concurrent.futures.Future[Session]) -> None:
        """Ask the session behind `future` to stop at its next turn (also mid-draw)."""


def status_trains(status: Status, truncation: str) -> bool:
    """Whether sessions that ended with `status` train under `truncation`."""
    if status in (Status.COMPLETED, Status.AGENT_ERROR):
        return True
    if status is Status.TRUNCATED:
        return truncation != "mask"
    return False


def check_truncation(truncation: str) -> None:
    """Refuse a truncation policy other than TRUNCATION's."""
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")

"""The slots of an EpisodeRollout: one running episode each, and the helpers that touch them.

A `Slot` holds one episode while it runs (its environment, context, transitions and end); a
`SlotError` carries what went wrong in one slot back to the collection, which turns it into
`EpisodeFailure` or `EpisodeCancelled`. The helpers enter an environment, snapshot it for the
journal, check what it returned, and run one piece of work on many slots at once.

Not here: the collection and its turns (episodes.py), the failures a caller sees (episodes.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dew_lib.records.episodes import EnvironmentFactory, Episode, EpisodeId, EpisodeStatus, Observation, Transition
from dew_lib.records.sessions import Task

CANCELLATIONS = (asyncio.CancelledError, concurrent.futures.CancelledError)


@dataclasses.dataclass(eq=False)
class Slot:
    """One episode while it runs: its environment, where it stands and what it did."""

    task: Task
    identity: EpisodeId
    index: int = 0  # the slot's place in the collection: task * groups + sample
    manager: Any = None  # what the factory returned: entered, and exited on release
    environment: Any = None  # what entering it gave: reset and step go here
    first: Observation | None = None
    context: np.ndarray | None = None
    transitions: list[Transition] = dataclasses.field(default_factory=list)
    status: EpisodeStatus = EpisodeStatus.RUNNING
    detail: str = ""
    reward: float | None = None
    ended: float | None = None  # time.perf_counter() when it ended

    def end(self, status: EpisodeStatus, detail: str) -> None:
        self.status, self.detail, self.ended = status, detail, time.perf_counter()

    def episode(self, origin: int, status: EpisodeStatus | None = None, detail: str | None = None) -> Episode:
        first = self.first or Observation(status=EpisodeStatus.ERROR, detail="never reset")
        return Episode(self.task, self.identity, status or self.status,
                       self.detail if detail is None else detail, first, tuple(self.transitions), origin)


class SlotError(Exception):
    """What went wrong in one slot, kept with the slot."""

    def __init__(self, slot: Slot, where: str, error: BaseException | None, detail: str = "", *,
                 cancelled: bool = False):
        super().__init__(detail)
        self.slot, self.where, self.error, self.detail = slot, where, error, detail
        self.cancelled = cancelled or isinstance(error, CANCELLATIONS)


def enter_environment(slot: Slot, factory: EnvironmentFactory, snapshots: bool):
    """(the context manager, the environment it gave) for the slot; what `__enter__` returns is
    the environment unless that is None. snapshots: refuse an environment without get_state and
    set_state (a journal needs them) before it runs anything."""
    try:
        manager = factory(slot.task, slot.identity)
        entered = manager.__enter__()
    except BaseException as error:
        raise SlotError(slot, "environment", error, f"entering failed: {describe(error)}") from error
    environment = manager if entered is None else entered
    missing = [m for m in ("get_state", "set_state") if not callable(getattr(environment, m, None))]
    if snapshots and missing:
        manager.__exit__(None, None, None)
        raise TypeError(f"EpisodeRollout.journal needs environments with get_state() -> bytes and "
                        f"set_state(bytes), and {type(environment).__name__} has no {' or '.join(missing)}; "
                        "add them (the snapshot must hold what later steps and the verifier read) or "
                        "drop the journal")
    return manager, environment


def snapshot_environment(slot: Slot) -> bytes:
    """The environment's state after an answer, for the journal."""
    state = slot.environment.get_state()
    if not isinstance(state, (bytes, bytearray)):
        raise SlotError(slot, "environment", None,
                        f"get_state() returned {type(state).__name__}; a journal snapshot is bytes")
    return bytes(state)


def each(pool, items: Sequence[Any], where: str, work: Callable[[Any], None]) -> None:
    """Run `work` on every item at once and wait for all; the first failure (in item order) is
    raised as the slot's error once every item finished."""
    futures = [pool.submit(work, item) for item in items]
    concurrent.futures.wait(futures)
    for item, future in zip(items, futures, strict=True):
        error = future.exception()
        if error is None:
            continue
        if isinstance(error, SlotError):
            raise error
        slot = item[0] if isinstance(item, tuple) else item
        raise SlotError(slot, where, error, f"{where} raised {describe(error)}") from error


def observed(slot: Slot, where: str, value: Any) -> Observation:
    """`value` if the environment's `where` returned an Observation, else the slot's error."""
    if not isinstance(value, Observation):
        raise SlotError(slot, "environment", None,
                        f"the environment's {where} returned {type(value).__name__}, not an Observation")
    return value


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__

"""Admission: which complete groups of a batch train, in the order they completed.

A complete group is admitted when its chains fit the batch's `[rows, width]` beside the groups
admitted before it, and cut otherwise, so a batch never fails for a group that happened to
finish late. A group whose chains need more rows than the batch has on their own is a sizing
error and raises, whatever order the groups finish in.

Not here: waiting for groups to complete and recording the cut ones (scheduler.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from dew_lib.rollouts.packing import chain_lengths, rows_needed
from dew_lib.rollouts.scheduler.states import Group, GroupState, TaskBatch


def trained_sessions(groups: Sequence[Group], size: int) -> list:
    """The first `size` finished sessions of each group, in group order: what `pack` trains."""
    return [sample.session for group in groups for sample in group.finished[:size]]


def completed(batch: TaskBatch) -> list[Group]:
    """The batch's COMPLETE groups, in the order they completed."""
    return sorted((g for g in batch.groups if g.state is GroupState.COMPLETE), key=lambda g: g.order)


def placement(group: Group, admitted: Sequence[Group], *, size: int, width: int, rows: int,
              truncation: str) -> GroupState:
    """ADMITTED when `group` fits beside `admitted`, else CUT; raises when it cannot fit alone."""
    sessions = trained_sessions([group], size)
    alone = rows_needed(chain_lengths(sessions, width, truncation), width)
    if alone > rows:
        raise ValueError(
            f"the group of task {group.task.id!r} packs into {alone} rows of width {width} on its "
            f"own, more than rows={rows}; size rows for the chains a group can split into (up to "
            "groups x calls per session)")
    together = trained_sessions(admitted, size) + sessions
    if rows_needed(chain_lengths(together, width, truncation), width) > rows:
        return GroupState.CUT
    return GroupState.ADMITTED

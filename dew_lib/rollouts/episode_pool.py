"""The process pool of an EpisodeRollout: what every process of a multi-process job shares.

Each process runs the episodes of its own task rows in its own environments. Every turn, the
processes sample the job's whole cohort together: each gathers every process's contexts (inert
ones for finished slots), draws all of them from the round's key, exactly what one process draws
on the same global devices, and keeps its own rows; the turns go on while any process has a
running episode, and every process must collect the same shape (checked before each collection).
After each phase that can fail (entering and resetting the environments, a
turn's tool calls, the verifier) the processes agree: a failure on one raises on all of them,
and each releases its own environments on the way out.

Not here: the collection itself (episodes.py). A journal is refused in a multi-process job: its
restored rounds are one process's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from dew_lib.train.distributed import every_process, gather_rows, raise_together


def cohort(contexts: list[np.ndarray], width: int) -> list[np.ndarray]:
    """Every process's contexts in process order (this process's own in one process): each
    turn samples the job's whole cohort, as one process would on the same devices."""
    if jax.process_count() == 1:
        return contexts
    padded = np.zeros((len(contexts), width), np.int32)
    for row, context in enumerate(contexts):
        padded[row, :len(context)] = context
    lengths = gather_rows(np.array([len(c) for c in contexts], np.int32))
    return [row[:length] for row, length in zip(gather_rows(padded), lengths, strict=True)]


def check_journal(journal) -> None:
    """Refuse a journal in a multi-process job: its restored rounds would be one process's."""
    if journal is not None and jax.process_count() > 1:
        raise ValueError(f"EpisodeRollout.journal restores one process's collection; this job has "
                         f"{jax.process_count()} processes. Leave journal=None in a multi-process job")


def check_cohort(rollout, tasks: int) -> None:
    """Refuse, on every process together, a cohort whose shape differs between processes: the
    turns would otherwise gather different shapes, or stop at different rounds."""
    if jax.process_count() == 1:
        return
    shape = {"tasks": tasks, "groups": rollout.groups, "max_turns": rollout.max_turns,
             "max_prompt_tokens": rollout.max_prompt_tokens, "max_new_tokens": rollout.max_new_tokens,
             "sampling": repr(rollout.sampling)}
    shapes = every_process(shape)
    differ = [f"{name} ({', '.join(str(s[name]) for s in shapes)})" for name in shape
              if len({s[name] for s in shapes}) > 1]
    if differ:
        raise ValueError(f"the processes' EpisodeRollouts differ in {'; '.join(differ)}, by process; "
                         "every process must collect the same cohort shape")


def together(work: Callable[[], None], what: str) -> None:
    """Run `work`; in a multi-process job every process then learns whether any failed, and all
    raise (the failed one its own error), so no process waits for a turn that will not come."""
    if jax.process_count() == 1:
        return work()
    try:
        work()
    except BaseException as error:  # noqa: BLE001 - raised below, with the other processes'
        raise_together(error, what)
    raise_together(None, what)


__all__ = ["check_cohort", "check_journal", "cohort", "together"]

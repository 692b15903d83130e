"""The process pool of an EpisodeRollout: what every process of a multi-process job shares.

Each process runs the episodes of its own task rows in its own environments. Every turn, the
processes sample the job's whole cohort together: each gathers every process's contexts (inert
ones for finished slots), draws all of them from the round's key, exactly what one process draws
on the same global devices, and keeps its own rows; the turns go on while any process has a
running episode, and every process must collect the same shape (checked before each collection).
After each phase that can fail (entering and resetting the environments, a
turn's tool calls, the verifier) the processes agree: a failure on one raises on all of them,
and each releases its own environments on the way out.

With journals (one per process, `rank-<i>.sqlite`), a restarted job restores only the rounds
every process's journal saved (`agreed`), so the cohort's draws stay collective.

Not here: the collection itself (episodes.py), the journal (journal.py).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import jax
import numpy as np

from dew_lib.rollouts.journal_records import Restored
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


def agreed(log) -> Restored:
    """What the processes restore of a collection together: in one process, all its journal
    holds; in a job, the rounds every process's journal saved, a process whose episodes all
    ended counting every later round as saved (it draws nothing in them). A process killed
    between two commits leaves the others a round ahead (or done: a finished collection starts
    over), and a round one process restores and another draws would meet the other process's
    cohort draw with no partner; the later rounds are dropped, to be drawn and answered again."""
    restored = log.restored()
    if jax.process_count() == 1:
        return restored
    saved = restored.rounds()
    common = min(every_process(saved if restored.runs_on() else sys.maxsize))
    if common < saved:
        restored = log.keep_rounds(common)
    return dataclasses.replace(restored, shared=common)


def check_cohort(rollout, tasks: int) -> None:
    """Refuse, on every process together, a cohort whose shape differs between processes: the
    turns would otherwise gather different shapes, or stop at different rounds."""
    if jax.process_count() == 1:
        return
    shape = {"tasks": tasks, "groups": rollout.groups, "max_turns": rollout.max_turns,
             "journal": rollout.journal is not None,
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


__all__ = ["agreed", "check_cohort", "cohort", "together"]

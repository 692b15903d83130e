"""RolloutScheduler: asynchronous GRPO, with rollouts drawn ahead of the update that trains them.

The scheduler is the Trainer's `rollout` for any `SessionSource`. Train on
`scheduler.tasks(dataset)`: that stream numbers and registers every task batch it yields. When the
trainer hands the scheduler batch i (with its state), the scheduler

  1. pushes the state's weights through `weights.load(params, updates)` when the served version
     is `sync_every` updates behind (always on its first call);
  2. cancels in-flight rollouts whose submission is already more than `max_lag` updates behind,
     and resubmits them;
  3. reads batches i + 1 .. i + ahead from the wrapped stream and submits them under the served
     version (batch i itself was submitted `ahead` calls earlier; on the first call after the
     stream opens it is submitted now);
  4. waits until batch i's groups are admitted, cut, abandoned or surplus, handling every
     rollout that finishes meanwhile, of any batch (see "Asynchronous GRPO" in docs/rl.md);
  5. packs the admitted groups into fixed `[rows, width]` rows with `pack` and returns them as a
     `PackedBatch(proximal="in_update")`: the proximal policy is the state's weights, which the
     update trains with, so the update scores it in its own forward pass (the numbers
     `GRPOObjective.packed_log_probs` would give, without a second pass over the batch).

Dew's Trainer reads one batch per step and no further, so the scheduler reads the `ahead` batches
after the current one from the wrapped stream itself; the trainer then receives exactly those
batches, in order. The data position a checkpoint stores is still the trainer's count of consumed
batches, so a resumed run re-reads the batches that were in flight, and opening the stream again
cancels everything the previous stream left running.

Group ids are the scheduler's: `position * tasks_per_batch + index` for the batch's position in
the stream and the task's index in it, so a resumed run gives a re-read task the group id it had
before, and sessions the previous run finished can be matched and reused (`reuse`).

Everything runs on the trainer's thread. Sources resolve futures on their own threads; a
done-callback only queues the future, and the scheduler handles it while it waits or at the
next call.

Beside it: group states (states.py), the fit decision (admission.py), the task stream (stream.py),
what a finished attempt means (outcomes.py), what a call recorded (ledger.py), the checks (validation.py).

A multi-process trainer runs one scheduler per process on its own source and task rows, packing
its own `rows` (docs/distributed.md). Every process pushes at the same updates with its own copy of
the weights, and each call ends in one agreement: a failure on any process raises on all of them.

Not here: drawing sessions (`dew_lib.rollouts.sources`), packing and advantages (packing.py), the
loss (`dew_lib.objectives.grpo`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from dew_lib.data.dataset import Batch, Dataset
from dew_lib.inference.base import Publisher, push_weights
from dew_lib.objectives.batch import PackedBatch
from dew_lib.records.scheduler import SchedulerRecord, SessionLog
from dew_lib.records.sessions import Session, SessionSource, Status, Task
from dew_lib.rollouts.packing import pack
from dew_lib.rollouts.scheduler.admission import completed, placement
from dew_lib.rollouts.scheduler.ledger import Ledger
from dew_lib.rollouts.scheduler.outcomes import Offers, check_reward, let_go, noted_stale, outcome, reusable, stale
from dew_lib.rollouts.scheduler.states import Attempt, Group, GroupState, Sample, TaskBatch, attempt_seed, key_words
from dew_lib.rollouts.scheduler.stream import ScheduledDataset, TaskReader, TaskStream
from dew_lib.rollouts.scheduler.tasks import task_ids
from dew_lib.rollouts.scheduler.validation import check_options
from dew_lib.train.distributed import local_copy, raise_together


class RolloutScheduler:
    """Train on complete rollout groups from source, ahead task batches early.

    objective: the GRPOObjective being trained (its update scores the proximal policy).
    source: a SessionSource. weights: a Publisher (a RolloutServer is one).
    width, rows: the packed batch shape `[rows, width]`; width must be the objective's
    seq_len + 1. tasks: turns one registered batch into its tasks (`task_ids`, `prompt_tasks`).
    groups: rollouts admitted per task. oversample: extra rollouts run per group; the first
    `groups` to finish are admitted. admit: admit only the first `admit` groups of a batch to
    complete (None: all). max_lag: the most updates a rollout's oldest call may be behind the
    update that trains it. ahead: task batches submitted before the trainer reaches them.
    sync_every: push weights when the served version is this many updates behind.
    max_attempts: failed attempts per sample before its group is abandoned. timeout: seconds
    from submission after which a running rollout is cancelled and counted as a failed attempt.
    estimator, truncation, support_capacity: `pack`'s. proximal: the policy the ratio compares
    with, "in_update" (the weights the update trains; step 5) or "bypass" (none: the ratio is
    current over behavior, verl's bypass mode). log: receives a SchedulerRecord per call.
    session_log: receives a SessionLog per call (every session the call settled, with its cause),
    for the run store.

    Construction refuses max_lag < ahead + sync_every - 1 (a first submission can be that stale
    when consumed) and, with proximal="in_update", lag without the objective's
    behavior_importance (bypass refuses a TIS cap instead). `rows` and the source
    are this process's (see the module).
    """

    def __init__(self, objective, source: SessionSource, weights: Publisher, *, width: int,
                 rows: int, tasks: Callable[[Batch], Sequence[Task]] = task_ids, groups: int = 4,
                 oversample: int = 0, admit: int | None = None, max_lag: int = 1, ahead: int = 1,
                 sync_every: int = 1, max_attempts: int = 3, timeout: float | None = None,
                 estimator: str = "group", truncation: str = "mask",
                 support_capacity: int | None = None, proximal: str = "in_update",
                 log: Callable[[SchedulerRecord], None] | None = None,
                 session_log: Callable[[SessionLog], None] | None = None):
        check_options(objective, source, weights, width=width, rows=rows, tasks=tasks,
                      groups=groups, oversample=oversample, admit=admit, max_lag=max_lag,
                      ahead=ahead, sync_every=sync_every, max_attempts=max_attempts,
                      timeout=timeout, estimator=estimator, truncation=truncation, proximal=proximal)
        self.objective, self.source, self.weights = objective, source, weights
        self.width, self.rows, self.task_fn = width, rows, tasks
        self.groups, self.oversample, self.admit = groups, oversample, admit
        self.max_lag, self.ahead, self.sync_every = max_lag, ahead, sync_every
        self.max_attempts, self.timeout = max_attempts, timeout
        self.estimator, self.truncation, self.support_capacity = estimator, truncation, support_capacity
        self.proximal = proximal
        self.log, self.session_log = log, session_log

        self._events: queue.SimpleQueue[Attempt] = queue.SimpleQueue()
        self._reader = TaskReader(tasks, groups + oversample)
        self._served: int | None = None
        self._updates = 0
        self._key_words: list[int] = [0]
        self._order = itertools.count()
        self._offers = Offers()
        self._broken: BaseException | None = None
        self._closed = self._closing = False
        self._ledger = Ledger(session_log)

    # ----- the stream --------------------------------------------------------------------------
    def tasks(self, dataset: Dataset) -> Dataset:
        """dataset with a training stream that registers each task batch ahead of the step.

        Opening the stream again, as a resume does, cancels every rollout the previous stream
        left in flight.
        """
        if not isinstance(dataset, Dataset):
            raise TypeError(f"RolloutScheduler.tasks wraps a dew_lib Dataset, got {type(dataset).__name__}")
        return ScheduledDataset(train=dataset.train, val=dataset.val, records=dataset.records,
                                 batch=dataset.batch, scheduler=self, inner=dataset)

    def _open(self, inner: Iterator[Batch], position: int) -> Iterator[Batch]:
        self._check_open()
        self._cancel_all()
        self._broken = None
        return TaskStream(self, self._reader.open(inner, position))

    def _next_batch(self, generation: int) -> Batch:
        self._check_open()
        return self._reader.next(generation)

    def _stream_state(self, generation: int) -> Any:
        return self._reader.state(generation)

    # ----- resume ------------------------------------------------------------------------------
    def reuse(self, sessions: Iterable[Any]) -> int:
        """Offer sessions a previous run of this stage finished (Sessions, or the store's
        StoredSession rows); returns how many distinct samples were offered. When the resumed
        stream re-reads a task, a sample with an offered session of the same task, group id and
        sample index is not drawn again if the session is admissible (COMPLETED, AGENT_ERROR, or
        TRUNCATED with what the truncation policy needs), every call's version is at most the
        trainer's updates (drawn from weights the resumed state descends from) and its oldest
        call is within max_lag of them; anything else is drawn again, and admission checks the
        lag again as for any rollout.
        """
        return self._offers.add(sessions, self.truncation)

    # ----- the trainer's call ------------------------------------------------------------------
    def __call__(self, state, batch: Batch, key) -> PackedBatch:
        self._check_open()
        if self._broken is not None:
            raise RuntimeError("the scheduler failed on an earlier call and cancelled its work; open "
                               "the task stream again (resume the trainer) to continue") from self._broken
        current = self._reader.given
        if current is None or batch is not current.data:
            raise ValueError("RolloutScheduler got a batch its task stream did not just yield; train "
                             "on scheduler.tasks(dataset) so the scheduler sees every batch first")
        self._reader.given = None
        self._updates = updates = int(np.asarray(jax.device_get(state.updates)))
        self._key_words = key_words(key)
        self._ledger.reset()
        try:
            self._push(state.params, updates)
            self._cancel_stale_in_flight(updates)
            while len(self._reader.ahead) < self.ahead:
                try:
                    self._reader.ahead.append(self._reader.read())
                except StopIteration:
                    break
            for pending in (current, *self._reader.ahead):
                if not pending.submitted:
                    self._submit_batch(pending)
            self._drain()
            self._recheck_finished(updates)
            self._check_timeouts()
            started = time.perf_counter()
            admitted = self._admit(current)
            waited = time.perf_counter() - started
            del self._reader.batches[current.position]
            sessions, latencies = self._ledger.admit(admitted, self.groups, self.truncation,
                                                     position=current.position, max_attempts=self.max_attempts)
            packed = pack(sessions, self.width, rows=self.rows, estimator=self.estimator,
                          truncation=self.truncation, support_capacity=self.support_capacity)
            packed.pop("old_log_probs", None)  # an engine's raw likelihoods are behavior, not proximal
            packed = PackedBatch.of(packed, proximal=self.proximal)
            self._drain()  # what finished while packing counts in this record
        except BaseException as error:
            failure = error
            self._stop(error)
        else:
            failure = None
        try:  # every process ends each call here, failed or not: a failure on one raises on all
            raise_together(failure, f"the rollouts of the batch at position {current.position}")
        except BaseException as error:
            if failure is None:  # another process failed: this one stops its work too
                self._stop(error)
            raise
        record = self._ledger.record(updates, sessions, packed, latencies, groups=len(admitted),
                                     waited=waited, truncation=self.truncation)
        self.last_record = record
        self._ledger.flush(self._updates, self._reader.batches.values())
        if self.log is not None:
            self.log(record)
        return packed

    def close(self, timeout: float = 10.0) -> None:
        """Cancel every rollout in flight and draw nothing new; the source belongs to the caller,
        who may have closed it already. Rollouts that finished before the call are recorded as
        pending (a resumed run can train them), failed ones as abandoned, stale ones as
        discarded, the cancelled ones as cancelled once their source reports them, for which
        close waits up to `timeout` seconds (a source that has not reported by then leaves them
        unrecorded)."""
        if self._closed:
            return
        self._closing = True  # from here on a failed or stale rollout is recorded, never drawn again
        try:
            self._drain()
        finally:
            running = self._in_flight()
            self._cancel_all()
            concurrent.futures.wait([a.future for a in running], timeout=timeout)
            self._drain()
            self._ledger.flush(self._updates, self._reader.batches.values())
        self._closed = True
        self._reader.generation += 1
        self._reader.batches.clear()
        self._reader.ahead.clear()

    def __enter__(self) -> RolloutScheduler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stop(self, error: BaseException) -> None:
        """After a failed call: cancel the batch's work and record it; a later call refuses."""
        self._broken = error
        try:
            self._cancel_all()
            self._drain()  # every attempt is cancelled now, so this only records them
            self._ledger.flush(self._updates, self._reader.batches.values())
        except Exception as later:  # noqa: BLE001 - the first failure is the one to raise
            error.add_note(f"while cancelling the batch's work: {type(later).__name__}: {later}")

    def _check_open(self):
        if self._closed:
            raise RuntimeError("the RolloutScheduler is closed; build a new one")

    # ----- weights -----------------------------------------------------------------------------
    def _push(self, params, updates: int) -> None:
        served = self._served
        if served is None or not 0 <= updates - served < self.sync_every:
            push_weights(self.weights, local_copy(params), updates)
            self._served = updates

    # ----- submission --------------------------------------------------------------------------
    def _submit_batch(self, batch: TaskBatch) -> None:
        batch.submitted = True
        for group in batch.groups:
            for sample in group.samples:
                stored = self._offers.take(group.task.id, group.id, sample.index)
                if stored is not None and reusable(stored, self._updates, self.max_lag):
                    sample.attempt = stored.attempt
                    sample.session = stored
                    group.finished.append(sample)
                    if len(group.finished) == self.groups:
                        self._complete(group)
                        break
                    continue
                self._launch(sample)

    def _launch(self, sample: Sample) -> None:
        group = sample.group
        if self._served is None:  # every call pushes before it submits
            raise RuntimeError("RolloutScheduler submitted a rollout before its first weight push")
        attempt = Attempt(sample, sample.attempt, time.perf_counter(), self._served)
        future = self.source.submit(group.task, group=group.id, sample=sample.index,
                                    attempt=sample.attempt, seed=attempt_seed(self._key_words, sample))
        if not isinstance(future, Future):
            raise TypeError(f"the source's submit returned {type(future).__name__}, not a "
                            "concurrent.futures.Future of a Session")
        attempt.future = future
        sample.current = attempt
        future.add_done_callback(lambda _, a=attempt: self._events.put(a))

    def _cancel(self, attempt: Attempt, recorded_as: str = "cancelled") -> None:
        """Cancel an attempt; its report, whenever it comes, is recorded as `recorded_as`."""
        attempt.cancelled, attempt.recorded_as = True, recorded_as
        if attempt.sample.current is attempt:
            attempt.sample.current = None
        self.source.cancel(attempt.future)

    def _in_flight(self) -> list[Attempt]:
        return [s.current for b in self._reader.batches.values() for g in b.groups for s in g.samples
                if s.current is not None]

    def _cancel_all(self) -> None:
        for attempt in self._in_flight():
            self._cancel(attempt)

    def _cancel_stale_in_flight(self, updates: int) -> None:
        for attempt in self._in_flight():
            if not attempt.cancelled and updates - attempt.version > self.max_lag:
                self._cancel(attempt)
                self._ledger.cancelled += 1
                self._fail(attempt.sample, "stale", None, None)
                if attempt.sample.given_up:  # its last attempt: the report is no retry's
                    attempt.recorded_as = "abandoned"

    def _resubmit(self, sample: Sample, cause: str) -> None:
        self._ledger.resubmitted[cause] += 1
        sample.attempt += 1
        self._launch(sample)

    # ----- outcomes ----------------------------------------------------------------------------
    def _drain(self, timeout: float | None = None) -> None:
        """Handle every finished rollout queued; wait up to `timeout` seconds for the first."""
        try:
            attempt = self._events.get(timeout=timeout) if timeout is not None else self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(attempt)
            try:
                attempt = self._events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, attempt: Attempt) -> None:
        sample, group = attempt.sample, attempt.sample.group
        latency = time.perf_counter() - attempt.submitted
        if attempt.cancelled or sample.current is not attempt:
            self._ledger.session(let_go(attempt, self._updates, self.max_lag), attempt.recorded_as, latency, False)
            return
        sample.current = None  # finished, whatever it says: nothing left to cancel
        session = outcome(attempt)
        status = session.status
        if status in (Status.INFRA_ERROR, Status.CANCELLED):
            self._fail(sample, status.value, session, latency)
            return
        if status is Status.TRUNCATED and self.truncation == "score" and session.reward is None:
            self._fail(sample, "unscored", session, latency)
            return
        check_reward(session, group.task.id, sample.index)
        if stale(session, self._updates, self.max_lag, attempt.version):
            self._fail(sample, "stale", session, latency, recorded_as="discarded")
            return
        sample.session, sample.latency, sample.logged = session, latency, None
        group.finished.append(sample)
        if len(group.finished) == self.groups:
            self._complete(group)

    def _fail(self, sample: Sample, cause: str, session: Session | None, latency, *,
              recorded_as: str = "resubmitted") -> None:
        """A failed attempt, a stale one included: drawn again up to max_attempts (its session
        recorded as `recorded_as`), then given up, and its group abandoned when too few samples
        are left. Once close began nothing is drawn: the session is recorded and left there."""
        sample.failures += 1
        group = sample.group
        if self._closing:
            if session is not None:
                self._ledger.session(session, "discarded" if cause == "stale" else "abandoned",
                                      latency, False)
            return
        if sample.failures < self.max_attempts:
            if session is not None:
                self._ledger.session(session, recorded_as, latency, False)
            self._resubmit(sample, cause)
            return
        sample.given_up = True
        if session is not None:
            if cause == "stale":
                session = noted_stale(session, self._updates, self.max_lag, self.max_attempts)
            self._ledger.session(session, "abandoned", latency, False)
        if group.state.open and sum(not s.given_up for s in group.samples) < self.groups:
            self._abandon(group)

    def _complete(self, group: Group) -> None:
        group.move(GroupState.COMPLETE)
        group.order = next(self._order)
        for sample in group.samples:  # the oversampled stragglers
            if sample.current is not None:
                self._cancel(sample.current)
                self._ledger.cancelled += 1

    def _settle(self, group: Group, state: GroupState, cause: str) -> None:
        """End a group that will not train: cancel what runs and record what finished, both
        under `cause` (what runs, when its report comes, even one that had already finished)."""
        group.move(state)
        for sample in group.samples:
            if sample.current is not None:
                self._cancel(sample.current, recorded_as=cause)
                self._ledger.cancelled += 1
        for sample in group.finished:
            self._ledger.sample(sample, cause)
        group.finished = []

    def _abandon(self, group: Group) -> None:
        self._ledger.abandoned += 1
        self._settle(group, GroupState.ABANDONED, "abandoned")

    def _recheck_finished(self, updates: int) -> None:
        """Discard finished rollouts that became too stale while they waited."""
        for batch in list(self._reader.batches.values()):
            for group in batch.groups:
                if not group.state.open:
                    continue
                for sample in list(group.finished):
                    if not group.state.open:  # abandoned by an earlier sample's last attempt
                        break
                    if stale(sample.session, updates, self.max_lag, updates):
                        group.finished.remove(sample)
                        session, sample.session = sample.session, None
                        if group.state is GroupState.COMPLETE:
                            group.move(GroupState.RUNNING)
                        self._fail(sample, "stale", session, sample.latency, recorded_as="discarded")

    def _check_timeouts(self) -> tuple[bool, float | None]:
        """Cancel rollouts past their deadline: (whether any was, seconds until the next one)."""
        if self.timeout is None:
            return False, None
        now = time.perf_counter()
        fired, next_deadline = False, None
        for attempt in self._in_flight():
            left = attempt.submitted + self.timeout - now
            if left <= 0:
                fired = True
                self._cancel(attempt)
                self._fail(attempt.sample, "timeout", None, None)
                if attempt.sample.given_up:  # its last attempt: the report is no retry's
                    attempt.recorded_as = "abandoned"
            else:
                next_deadline = left if next_deadline is None else min(next_deadline, left)
        return fired, next_deadline

    # ----- admission ---------------------------------------------------------------------------
    def _admit(self, batch: TaskBatch) -> list[Group]:
        target = len(batch.groups) if self.admit is None else self.admit
        if target > len(batch.groups):
            raise ValueError(f"RolloutScheduler.admit={self.admit} exceeds the {len(batch.groups)} "
                             "tasks of a batch; lower admit or raise the batch size")
        admitted: list[Group] = []
        while True:
            self._drain()
            for group in completed(batch):
                if len(admitted) == target:
                    break
                self._place(group, admitted)
            open_groups = [g for g in batch.groups if g.state.open]
            if len(admitted) == target or not open_groups:
                break
            fired, wait = self._check_timeouts()
            if not fired:  # block until a rollout finishes or the next deadline passes
                self._drain(timeout=1.0 if wait is None else min(wait + 1e-3, 1.0))
        for group in batch.groups:
            if group.state.open:
                self._settle(group, GroupState.SURPLUS, "cancelled")
        return admitted

    def _place(self, group: Group, admitted: list[Group]) -> None:
        """Admit a complete group when its chains fit the rows beside the admitted ones; else cut."""
        state = placement(group, admitted, size=self.groups, width=self.width, rows=self.rows,
                          truncation=self.truncation)
        if state is GroupState.CUT:
            self._ledger.cut += 1
            for sample in group.finished:
                self._ledger.sample(sample, "cut")
            group.finished = []
        else:
            admitted.append(group)
        group.move(state)


__all__ = ["RolloutScheduler"]

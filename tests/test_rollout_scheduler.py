"""RolloutScheduler: admission by status, retries, truncation, stragglers, staleness, timeouts,
cut groups, failures, reopened streams, weight pushes and reuse, on a fake source whose every
rollout ends when the test says; then a Trainer through multi-turn environments on the native
server, and a SIGKILLed training process resumed without losing or repeating work."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from concurrent.futures import Future

import jax
import numpy as np
import pytest

from dew_lib import models
from dew_lib.data.dataset import Dataset, Partition
from dew_lib.objectives import GRPOObjective, algorithms
from dew_lib.records import Call, Session, Status, Task
from dew_lib.rollouts import RolloutScheduler, prompt_tasks, task_ids

KEY = np.array([0, 7], np.uint32)
WIDTH = 12


def objective() -> GRPOObjective:
    """A GRPOObjective of the packed width on a model the fake sources never run."""
    model = models.build("causal_transformer", vocab_size=16, emb_features=8, num_layers=1,
                         num_heads=1, mlp_features=8, max_seq_len=WIDTH)
    return GRPOObjective(model, WIDTH - 1, behavior_importance=2.0)


def session(reward=1.0, status=Status.COMPLETED, version=0, sampled=(3, 4)):
    call = Call(prompt_ids=[1, 2], sampled_ids=list(sampled), behavior_log_probs=[-1.0] * len(sampled),
                version=version, finish_reason="stop" if status is Status.COMPLETED else "length")
    return Session(task="ignored", calls=(call,), status=status, reward=reward)


class FakeSource:
    """A SessionSource and Publisher whose rollouts end as `plan` says.

    plan(task_id, sample, attempt, version) returns a Session (the future resolves at once), an
    exception (the future raises) or None (held until `release` or cancel; a cancelled one
    resolves CANCELLED, as a real source does). `version` is the served version at submission.
    """

    def __init__(self, plan):
        self.plan = plan
        self.version = 0
        self.loads: list[int] = []
        self.submitted: list[tuple] = []
        self.cancelled: list[tuple] = []
        self.held: dict[tuple, Future] = {}
        self.labels: dict[Future, tuple] = {}

    def load(self, variables, version):
        self.loads.append(version)
        self.version = version

    def submit(self, task, *, group, sample, attempt, seed):
        label = (task.id, group, sample, attempt)
        self.submitted.append(label + (self.version,))
        future = Future()
        self.labels[future] = label
        outcome = self.plan(task.id, sample, attempt, self.version)
        if outcome is None:
            self.held[label] = future
        elif isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return future

    def cancel(self, future):
        label = self.labels[future]
        self.cancelled.append(label)
        if self.held.pop(label, None) is not None:
            future.set_result(Session(task=label[0], status=Status.CANCELLED))

    def release(self, label, outcome):
        self.held.pop(label).set_result(outcome)


def state(updates):
    return types.SimpleNamespace(params={}, updates=np.int32(updates))


def batches(*rows):
    return [{"task_id": np.array(r, np.int64)} for r in rows]


def scheduler(source, *, data, logs=None, records=None, **options):
    options.setdefault("rows", 8)
    options.setdefault("groups", 2)
    sched = RolloutScheduler(objective(), source, source, width=WIDTH,
                             log=None if records is None else records.append,
                             session_log=None if logs is None else logs.append, **options)
    dataset = Dataset(train=lambda partition: iter(data), batch=len(data[0]["task_id"]))
    return sched, sched.tasks(dataset).stream(Partition(), 0)


def step(sched, stream, updates):
    return sched(state(updates), next(stream), KEY)


def by_cause(logs):
    out = {}
    for log in logs:
        for s, cause in zip(log.sessions, log.causes, strict=True):
            out.setdefault(cause, []).append((s.task, s.sample, s.attempt, s.status.value))
    return out


def trained_sessions(packed):
    """Rows of each packed session: {session_index: reward}."""
    mask = packed["response_mask"] > 0
    return {int(i): float(r) for i, r in zip(packed["session_index"][mask], packed["rewards"][mask])}


# ----- admission ------------------------------------------------------------------------------

def test_admission_by_status_and_exact_advantages():
    outcomes = {(0, 0): session(1.0), (1, 0): session(0.0, Status.AGENT_ERROR),
                (2, 0): session(1.0, Status.TRUNCATED), (3, 0): session(None, Status.INFRA_ERROR),
                (3, 1): session(0.0), (4, 0): session(None, Status.CANCELLED), (4, 1): session(1.0)}
    source = FakeSource(lambda task, sample, attempt, version: outcomes[sample, attempt])
    logs, records = [], []
    sched, stream = scheduler(source, data=batches([7]), groups=5, logs=logs, records=records,
                              ahead=0, max_lag=0)
    sched.objective.behavior_importance = None  # max_lag=0 needs no correction
    packed = step(sched, stream, 0)
    record = records[0]
    assert record.groups == 1 and dict(record.resubmitted) == {"infra_error": 1, "cancelled": 1}
    assert (record.cancelled, record.abandoned, record.cut) == (0, 0, 0)
    # COMPLETED, AGENT_ERROR and the two retried samples train; the TRUNCATED one is masked.
    assert trained_sessions(packed) == {0: 1.0, 1: 0.0, 3: 0.0, 4: 1.0}
    expected = algorithms.advantages("group", np.array([1.0, 0.0, 0.0, 1.0]), np.zeros(4, np.int32))
    mask = packed["response_mask"] > 0
    got = {int(i): float(a) for i, a in zip(packed["session_index"][mask], packed["advantages"][mask])}
    assert got == pytest.approx(dict(zip([0, 1, 3, 4], expected, strict=True)))
    # The proximal policy is the weights the update trains with: scored in the update itself.
    assert "old_log_probs" not in packed and packed.proximal == "in_update"
    causes = by_cause(logs)
    assert sorted(causes["resubmitted"]) == [("7", 3, 0, "infra_error"), ("7", 4, 0, "cancelled")]
    assert sorted(causes["admitted"]) == [("7", 0, 0, "completed"), ("7", 1, 0, "agent_error"),
                                          ("7", 2, 0, "truncated"), ("7", 3, 1, "completed"),
                                          ("7", 4, 1, "completed")]
    admitted = [t for log in logs for c, t in zip(log.causes, log.trained, strict=True) if c == "admitted"]
    assert sorted(admitted) == [False, True, True, True, True]
    assert record.metrics["sessions/truncated"] == pytest.approx(0.2)


@pytest.mark.parametrize("truncation, trained", [("mask", {0: 0.0}), ("score", {0: 0.0, 1: 1.0}),
                                                 ("zero", {0: 0.0, 1: 0.0})])
def test_truncation_modes(truncation, trained):
    outcomes = {0: session(0.0), 1: session(1.0, Status.TRUNCATED)}
    source = FakeSource(lambda task, sample, attempt, version: outcomes[sample])
    sched, stream = scheduler(source, data=batches([1]), truncation=truncation)
    assert trained_sessions(step(sched, stream, 0)) == trained


def test_an_unscored_truncation_under_score_is_a_failed_attempt():
    def plan(task, sample, attempt, version):
        return session(None, Status.TRUNCATED) if (sample, attempt) == (1, 0) else session(0.5)

    records = []
    source = FakeSource(plan)
    sched, stream = scheduler(source, data=batches([1]), truncation="score", records=records)
    assert trained_sessions(step(sched, stream, 0)) == {0: 0.5, 1: 0.5}
    assert dict(records[0].resubmitted) == {"unscored": 1}


def test_retries_then_abandonment_after_max_attempts():
    def plan(task, sample, attempt, version):
        return session(None, Status.INFRA_ERROR) if task == "5" and sample == 0 else session(1.0 * sample)

    logs, records = [], []
    source = FakeSource(plan)
    sched, stream = scheduler(source, data=batches([5, 6]), max_attempts=3, logs=logs, records=records)
    packed = step(sched, stream, 0)
    assert [s[:4] for s in source.submitted if s[0] == "5" and s[2] == 0] == [
        ("5", 0, 0, 0), ("5", 0, 0, 1), ("5", 0, 0, 2)]
    record = records[0]
    assert record.groups == 1 and record.abandoned == 1
    assert dict(record.resubmitted) == {"infra_error": 2}
    assert set(trained_sessions(packed)) == {0, 1}  # only task 6's group
    causes = by_cause(logs)
    assert sorted(causes["abandoned"]) == [("5", 0, 2, "infra_error"), ("5", 1, 0, "completed")]
    assert len(causes["resubmitted"]) == 2


def test_a_batch_with_every_group_abandoned_raises():
    source = FakeSource(lambda *_: session(None, Status.INFRA_ERROR))
    sched, stream = scheduler(source, data=batches([1]), max_attempts=1)
    with pytest.raises(RuntimeError, match="no group .* could be admitted"):
        step(sched, stream, 0)


def test_oversample_admits_the_first_to_finish_and_cancels_the_straggler():
    source = FakeSource(lambda task, sample, attempt, version: None if sample == 1 else session(sample))
    logs, records = [], []
    sched, stream = scheduler(source, data=batches([3]), oversample=1, logs=logs, records=records)
    packed = step(sched, stream, 0)
    assert trained_sessions(packed) == {0: 0.0, 1: 2.0}  # samples 0 and 2
    assert source.cancelled == [("3", 0, 1, 0)] and records[0].cancelled == 1
    assert by_cause(logs)["cancelled"] == [("3", 1, 0, "cancelled")]


def test_admit_takes_the_first_complete_groups_and_cancels_the_rest():
    def plan(task, sample, attempt, version):
        return None if task == "0" else session(float(sample))

    logs, records = [], []
    source = FakeSource(plan)
    sched, stream = scheduler(source, data=batches([0, 1, 2]), admit=2, logs=logs, records=records)
    packed = step(sched, stream, 0)
    assert records[0].groups == 2 and records[0].cancelled == 2
    assert sorted(source.cancelled) == [("0", 0, 0, 0), ("0", 0, 1, 0)]
    tasks = {s.task for log in logs for s, c in zip(log.sessions, log.causes, strict=True) if c == "admitted"}
    assert {t.task for log in logs for t in log.sessions if t.task != "0"} == tasks == {"1", "2"}
    assert len(trained_sessions(packed)) == 4


def test_groups_are_admitted_in_completion_order_not_batch_order():
    source = FakeSource(lambda task, sample, attempt, version: None if task != "2" or sample == 9
                        else session(1.0))
    records = []
    sched, stream = scheduler(source, data=batches([0, 1, 2]), admit=1, records=records)
    packed = step(sched, stream, 0)
    assert records[0].groups == 1 and records[0].cancelled == 4  # tasks 0 and 1, two samples each
    assert sorted({label[0] for label in source.cancelled}) == ["0", "1"]
    assert len(trained_sessions(packed)) == 2


# ----- staleness, timeouts, pushes --------------------------------------------------------------

def test_a_finished_rollout_older_than_max_lag_is_discarded_and_drawn_again():
    def plan(task, sample, attempt, version):  # the first answer carries a call two versions old
        return session(1.0, version=version - 2 if attempt == 0 else version)

    logs, records = [], []
    source = FakeSource(plan)
    source.version = 5
    sched, stream = scheduler(source, data=batches([1]), logs=logs, records=records)
    step(sched, stream, 5)
    assert dict(records[0].resubmitted) == {"stale": 2} and records[0].lag == 0
    assert sorted(by_cause(logs)["discarded"]) == [("1", 0, 0, "completed"), ("1", 1, 0, "completed")]


def test_rollouts_that_keep_coming_back_stale_are_abandoned_after_max_attempts():
    # Task 7's engine always answers from weights two versions old: without a bound the trainer
    # call would draw it again forever.
    def plan(task, sample, attempt, version):
        return session(1.0, version=version - 2 if task == "7" else version)

    logs, records = [], []
    source = FakeSource(plan)
    source.version = 5
    sched, stream = scheduler(source, data=batches([7, 8]), max_attempts=3, logs=logs, records=records)
    packed = step(sched, stream, 5)
    assert [s[3] for s in source.submitted if s[0] == "7"] == [0, 0, 1, 1, 2, 2]
    assert records[0].abandoned == 1 and dict(records[0].resubmitted) == {"stale": 4}
    assert len(trained_sessions(packed)) == 2  # task 8's group
    causes = by_cause(logs)
    assert sorted(causes["discarded"]) == [("7", 0, 0, "completed"), ("7", 0, 1, "completed"),
                                           ("7", 1, 0, "completed"), ("7", 1, 1, "completed")]
    # sample 0's third stale answer gives it up, which abandons the group: sample 1's third
    # answer, back already but handled after, is a failed attempt of the abandoned group too
    assert causes["abandoned"] == [("7", 0, 2, "completed"), ("7", 1, 2, "completed")]
    assert "cancelled" not in causes
    details = [s.detail for log in logs for s, c in zip(log.sessions, log.causes, strict=True) if c == "abandoned"]
    assert all(d.startswith("stale: drawn under version 3, 2 updates behind update 5") for d in details)


def test_rollouts_that_waited_past_the_bound_are_discarded_at_consumption():
    source = FakeSource(lambda task, sample, attempt, version: session(1.0, version=version))
    logs, records = [], []
    sched, stream = scheduler(source, data=batches([1], [2]), logs=logs, records=records)
    step(sched, stream, 0)   # batch [2] is drawn ahead under version 0 and waits
    assert by_cause(logs)["pending"] == [("2", 0, 0, "completed"), ("2", 1, 0, "completed")]
    step(sched, stream, 3)   # consumed at updates 3: lag 3 > max_lag 1
    assert dict(records[1].resubmitted) == {"stale": 2}
    assert records[1].version == 3 and records[1].lag == 0
    assert [s[3:] for s in source.submitted if s[0] == "2"] == [(0, 0), (0, 0), (1, 3), (1, 3)]


def test_in_flight_rollouts_past_the_bound_are_cancelled_before_any_wait():
    source = FakeSource(lambda task, sample, attempt, version: None if attempt == 0 and task == "2"
                        else session(1.0, version=version))
    records = []
    sched, stream = scheduler(source, data=batches([1], [2]), records=records)
    step(sched, stream, 0)
    assert len(source.held) == 2  # batch [2] runs ahead
    step(sched, stream, 4)       # submitted at version 0, now 4 > 1 behind: cancelled, drawn again
    assert sorted(source.cancelled) == [("2", 1, 0, 0), ("2", 1, 1, 0)]
    assert records[1].cancelled == 2 and dict(records[1].resubmitted) == {"stale": 2}
    assert source.loads == [0, 4]
    assert [s for s in source.submitted if s[0] == "2" and s[3] == 1] == [("2", 1, 0, 1, 4), ("2", 1, 1, 1, 4)]


def test_a_rollout_past_its_timeout_is_cancelled_and_counted_as_a_failed_attempt():
    source = FakeSource(lambda task, sample, attempt, version: None if (sample, attempt) == (0, 0) else session(1.0))
    records = []
    sched, stream = scheduler(source, data=batches([1]), timeout=0.05, records=records)
    step(sched, stream, 0)
    assert dict(records[0].resubmitted) == {"timeout": 1} and source.cancelled == [("1", 0, 0, 0)]
    assert records[0].waited > 0


def test_timeouts_exhaust_attempts_and_abandon_the_group():
    source = FakeSource(lambda task, sample, attempt, version: None if (task, sample) == ("1", 0) else session(1.0))
    records, logs = [], []
    sched, stream = scheduler(source, data=batches([1, 2]), timeout=0.02, max_attempts=2, records=records,
                              logs=logs)
    step(sched, stream, 0)
    assert records[0].abandoned == 1 and dict(records[0].resubmitted) == {"timeout": 1}
    assert records[0].groups == 1
    # the first timeout is cancelled and drawn again; the second, its sample's last attempt, is
    # given up with its group
    assert {cause: sorted(r for r in found if r[0] == "1") for cause, found in by_cause(logs).items()} == {
        "cancelled": [("1", 0, 0, "cancelled")], "abandoned": [("1", 0, 1, "cancelled"), ("1", 1, 0, "completed")],
        "admitted": []}


@pytest.mark.parametrize("reports", [(0, 1), (1, 0), (0,)], ids=["0-then-1", "1-then-0", "1-still-running"])
def test_every_failed_attempt_of_an_abandoned_group_is_abandoned_whatever_the_order_of_reports(reports):
    """Task 1's two samples fail with max_attempts=1. The failure the scheduler handles first gives
    its sample up and abandons the group; the other sample's attempt, failed already but handled
    after, or still running and cancelled then, is a failed attempt of the same abandoned group."""
    class Reporting(FakeSource):  # task 1's failures end, in `reports` order, once task 2 is submitted
        def submit(self, task, **labels):
            if task.id == "2" and labels["sample"] == 0:
                for sample in reports:
                    self.release(("1", 0, sample, 0), session(None, Status.INFRA_ERROR))
            return super().submit(task, **labels)

    source = Reporting(lambda task, sample, attempt, version: None if task == "1" else session(1.0))
    logs, records = [], []
    sched, stream = scheduler(source, data=batches([1, 2]), max_attempts=1, logs=logs, records=records)
    step(sched, stream, 0)
    assert records[0].abandoned == 1 and records[0].groups == 1
    other = "infra_error" if len(reports) == 2 else "cancelled"  # a running one comes back cancelled
    task_1 = {cause: sorted(r for r in found if r[0] == "1") for cause, found in by_cause(logs).items()}
    assert task_1 == {"abandoned": [("1", 0, 0, "infra_error"), ("1", 1, 0, other)], "admitted": []}


def test_weights_are_pushed_every_sync_every_updates():
    source = FakeSource(lambda task, sample, attempt, version: session(1.0, version=version))
    sched, stream = scheduler(source, data=batches(*[[i] for i in range(6)]), sync_every=2, max_lag=2)
    for updates in range(5):
        step(sched, stream, updates)
    assert source.loads == [0, 2, 4]


def test_a_push_that_does_not_move_the_version_is_tried_once_more_then_raises():
    source = FakeSource(lambda *_: session(1.0))
    source.load = lambda variables, version: source.loads.append(version)  # version stays 0
    sched, stream = scheduler(source, data=batches([1], [2]))
    step(sched, stream, 0)
    with pytest.raises(RuntimeError, match="did not move the publisher's version"):
        step(sched, stream, 1)
    assert source.loads == [0, 1, 1]


def test_construction_refuses_a_bound_below_ahead_plus_sync_every_minus_one():
    source = FakeSource(lambda *_: None)
    with pytest.raises(ValueError, match=r"max_lag=1 is below ahead \+ sync_every - 1 = 2"):
        RolloutScheduler(objective(), source, source, width=WIDTH, rows=4, ahead=2)
    RolloutScheduler(objective(), source, source, width=WIDTH, rows=4, ahead=2, sync_every=2, max_lag=3)
    unweighted = objective()
    unweighted.behavior_importance = None
    with pytest.raises(ValueError, match="behavior_importance"):
        RolloutScheduler(unweighted, source, source, width=WIDTH, rows=4)
    RolloutScheduler(unweighted, source, source, width=WIDTH, rows=4, ahead=0, max_lag=0)
    with pytest.raises(ValueError, match="seq_len"):
        RolloutScheduler(objective(), source, source, width=WIDTH + 1, rows=4)


# ----- shape, failures, streams -----------------------------------------------------------------

def test_a_group_whose_chains_do_not_fit_beside_the_admitted_ones_is_cut():
    # Each session is one chain of 2 + 5 = 7 ids, so a row of 12 holds one: a group takes 2 rows.
    source = FakeSource(lambda task, sample, attempt, version: session(float(sample), sampled=(3, 4, 5, 6, 7)))
    logs, records = [], []
    sched, stream = scheduler(source, data=batches([1, 2]), rows=3, logs=logs, records=records)
    packed = step(sched, stream, 0)
    assert records[0].cut == 1 and records[0].groups == 1 and packed["input_ids"].shape == (3, WIDTH)
    assert sorted(by_cause(logs)["cut"]) == [("2", 0, 0, "completed"), ("2", 1, 0, "completed")]
    alone, stream = scheduler(source, data=batches([1]), rows=1)
    with pytest.raises(ValueError, match="on its own, more than rows=1"):
        step(alone, stream, 0)


def test_a_source_that_raises_propagates_after_the_batch_work_is_cancelled():
    def plan(task, sample, attempt, version):
        return RuntimeError("the harness crashed") if (task, sample) == ("2", 0) else None

    source = FakeSource(plan)
    sched, stream = scheduler(source, data=batches([1, 2], [3, 4]))
    with pytest.raises(RuntimeError, match="the harness crashed"):
        step(sched, stream, 0)
    assert not source.held  # everything in flight was cancelled, the read-ahead batch included
    assert len(source.cancelled) == 3 + 4
    with pytest.raises(RuntimeError, match="failed on an earlier call"):
        sched(state(0), {"task_id": np.array([9])}, KEY)


def test_reopening_the_stream_cancels_what_the_old_one_left_running():
    source = FakeSource(lambda task, sample, attempt, version: None if task == "2" else session(1.0))
    data = batches([1], [2], [3])
    sched, stream = scheduler(source, data=data)
    step(sched, stream, 0)
    assert len(source.held) == 2
    reopened = sched.tasks(Dataset(train=lambda p: iter(data), batch=1)).stream(Partition(), 1)
    assert not source.held and sorted(source.cancelled) == [("2", 1, 0, 0), ("2", 1, 1, 0)]
    with pytest.raises(RuntimeError, match="replaced by a newer one"):
        next(stream)
    source.plan = lambda *_: session(1.0)
    sched(state(1), next(reopened), KEY)  # batch [2] again, from position 1: same group id
    assert [s[1] for s in source.submitted if s[0] == "2"] == [1, 1, 1, 1]


class Seekable:
    """An inner stream that says where it stands, as the data loader's does."""

    def __init__(self, data):
        self.data, self.position = data, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.position += 1
        return self.data[self.position - 1]

    def state(self):
        return {"batch": self.position}


def test_the_stream_state_is_where_the_trainer_stands_not_where_the_read_ahead_is():
    source = FakeSource(lambda *_: session(1.0))
    data = batches([1], [2], [3], [4])
    sched = RolloutScheduler(objective(), source, source, width=WIDTH, rows=8, groups=2, ahead=2, max_lag=2)
    inner = Dataset(train=lambda p: Seekable(data), batch=1)
    stream = sched.tasks(inner).stream(Partition(), 0)
    assert stream.state() == {"batch": 0}
    step(sched, stream, 0)  # batches 1 and 2 were read ahead for submission
    assert stream.state() == {"batch": 1}  # a checkpoint now resumes at the trainer's batch
    step(sched, stream, 1)
    assert stream.state() == {"batch": 2}


def test_a_batch_the_stream_did_not_yield_is_refused():
    source = FakeSource(lambda *_: session(1.0))
    sched, stream = scheduler(source, data=batches([1]))
    with pytest.raises(ValueError, match="train on scheduler.tasks"):
        sched(state(0), {"task_id": np.array([1])}, KEY)


def test_close_cancels_everything_in_flight():
    source = FakeSource(lambda task, sample, attempt, version: None if task == "2" else session(1.0))
    sched, stream = scheduler(source, data=batches([1], [2]))
    step(sched, stream, 0)
    sched.close()
    assert not source.held and len(source.cancelled) == 2


def test_close_records_what_finished_before_it_as_pending_for_a_resumed_run():
    source = FakeSource(lambda task, sample, attempt, version: None if task == "2" else session(1.0))
    logs = []
    sched, stream = scheduler(source, data=batches([1], [2]), logs=logs)
    step(sched, stream, 0)
    source.release(("2", 1, 0, 0), session(0.5))  # finished after the call, before close
    sched.close()
    assert by_cause(logs[-1:]) == {"pending": [("2", 0, 0, "completed")],
                                   "cancelled": [("2", 1, 0, "cancelled")]}


def test_close_waits_for_the_source_to_report_what_it_cancelled():
    import threading

    class LateSource(FakeSource):  # reports a cancelled rollout from another thread, later
        def cancel(self, future):
            label = self.labels[future]
            self.cancelled.append(label)
            held = self.held.pop(label)
            threading.Timer(0.2, lambda: held.set_result(Session(task=label[0], status=Status.CANCELLED))).start()

    source = LateSource(lambda task, sample, attempt, version: None if task == "2" else session(1.0))
    logs = []
    sched, stream = scheduler(source, data=batches([1], [2]), logs=logs)
    step(sched, stream, 0)
    sched.close()
    # the two cancellations arrive on two timer threads, in either order
    reported = {cause: sorted(rows) for cause, rows in by_cause(logs[-1:]).items()}
    assert reported == {"cancelled": [("2", 0, 0, "cancelled"), ("2", 1, 0, "cancelled")]}


def test_close_after_the_caller_closed_its_source_draws_nothing_and_does_not_raise():
    class ClosingSource(FakeSource):  # a source that, like PromptSource, refuses work once closed
        closed = False

        def submit(self, task, **labels):
            if self.closed:
                raise RuntimeError("ClosingSource is closed")
            return super().submit(task, **labels)

        def close(self):  # ends what runs as CANCELLED sessions, as a real source does
            self.closed = True
            for label in list(self.held):
                self.release(label, Session(task=label[0], status=Status.CANCELLED))

    source = ClosingSource(lambda task, sample, attempt, version: None if task == "2" else session(1.0))
    logs = []
    sched, stream = scheduler(source, data=batches([1], [2]), logs=logs)
    step(sched, stream, 0)
    submitted = len(source.submitted)
    source.close()
    sched.close()
    assert len(source.submitted) == submitted
    assert by_cause(logs[-1:]) == {"abandoned": [("2", 0, 0, "cancelled"), ("2", 1, 0, "cancelled")]}


# ----- reuse ------------------------------------------------------------------------------------

def test_offered_sessions_replace_draws_within_the_bound():
    source = FakeSource(lambda task, sample, attempt, version: session(0.0, version=version))
    logs = []
    sched, stream = scheduler(source, data=batches([1], [2]), logs=logs)
    group = 0  # position 0, one task per batch
    fresh = dataclasses_replace(session(1.0, version=2), task="1", group=group, sample=0, attempt=1)
    too_new = dataclasses_replace(session(1.0, version=4), task="1", group=group, sample=1)
    too_old = dataclasses_replace(session(1.0, version=0), task="2", group=1, sample=0)
    failed = dataclasses_replace(session(None, Status.INFRA_ERROR, version=3), task="2", group=1, sample=1)
    assert sched.reuse([fresh, too_new, too_old, failed]) == 3
    packed = step(sched, stream, 3)
    assert trained_sessions(packed) == {0: 1.0, 1: 0.0}  # sample 0 reused with its reward
    assert [s[:4] for s in source.submitted] == [("1", 0, 1, 0), ("2", 1, 0, 0), ("2", 1, 1, 0)]
    assert sched.last_record.metrics["sessions/reused"] == 1.0
    admitted = [(s.sample, s.attempt, lat) for log in logs
                for s, c, lat in zip(log.sessions, log.causes, log.latencies, strict=True) if c == "admitted"]
    assert sorted(admitted, key=lambda x: x[0])[0] == (0, 1, None)


def dataclasses_replace(s, **changes):
    import dataclasses

    return dataclasses.replace(s, **changes)


# ----- tasks ------------------------------------------------------------------------------------

def test_task_ids_and_prompt_tasks():
    assert task_ids({"task_id": np.array([4, 17])}) == [Task("4", {"task_id": 4}), Task("17", {"task_id": 17})]
    with pytest.raises(KeyError, match="task_id"):
        task_ids({"prompt": np.zeros((1, 2))})
    text = np.zeros((2, 4), np.int32)
    text[0, :3] = list(b"1/2")
    batch = {"prompt": np.array([[0, 5, 6], [7, 8, 9]], np.int32), "prompt_length": np.array([2, 3]),
             "ground_truth": text}
    first, second = prompt_tasks(batch)
    np.testing.assert_array_equal(first.data["prompt_ids"], [5, 6])
    assert first.data["ground_truth"] == "1/2" and second.data["ground_truth"] == ""
    assert len(first.id) == 16 and first.id != second.id
    assert prompt_tasks(batch)[0].id == first.id  # the same prompt is the same task every time
    assert [t.id for t in prompt_tasks({**batch, "task_id": np.array([3, 4])})] == ["3", "4"]


# ----- integration ------------------------------------------------------------------------------

class CountingTool:
    """Two turns: the model acts, the tool appends [10, 11]; the model answers, the episode ends."""

    def __init__(self, task):
        self.task = task

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def reset(self):
        from dew_lib.records import Observation

        return Observation([1, 3 + int(self.task.id) % 4])

    def step(self, action):
        from dew_lib.records import EpisodeStatus, Observation

        if action.step == 0:
            return Observation([*action.context, *action.tokens, 10, 11])
        return Observation(status=EpisodeStatus.COMPLETED)


def answer_is_even(task, episode):
    return float(episode.transitions[-1].action.tokens[0] % 2 == 0)


@pytest.mark.slow
def test_a_trainer_runs_through_multi_turn_environments_on_the_native_server():
    import itertools

    import optax
    from conftest import tiny_model

    from dew_lib import Trainer
    from dew_lib.inference import NativeRolloutServer, Server, ServeTask
    from dew_lib.objectives import GRPOObjective
    from dew_lib.rollouts import EnvironmentSource
    from dew_lib.sampling import Sampling

    model = tiny_model(vocab_size=16)
    objective = GRPOObjective(model, seq_len=15, behavior_importance=2.0)
    variables = objective.init(jax.random.key(0))
    before = jax.tree.map(np.array, variables)
    task = ServeTask(model=model, variables=variables, sampling=Sampling(temperature=1.0, eos_id=2))
    records = []
    data = Dataset(train=lambda p: ({"task_id": np.array([2 * i, 2 * i + 1])} for i in itertools.count()),
                   batch=2)
    with NativeRolloutServer(Server.from_task(task, slots=8, capacity=16, steps=4)) as server, \
            EnvironmentSource(server, lambda task, identity: CountingTool(task), answer_is_even,
                              max_prompt_tokens=10, max_new_tokens=6, max_turns=2, workers=8) as source:
        scheduler = RolloutScheduler(objective, source, server, width=16, rows=8, groups=4,
                                     truncation="score", log=records.append)
        trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(1), rollout=scheduler)
        state = trainer.fit(scheduler.tasks(data), steps=3, log_every=1, sinks=[])
        scheduler.close()
        assert server.version == 2  # pushed before each of the three calls
    assert [r.updates for r in records] == [0, 1, 2] and all(r.groups == 2 for r in records)
    assert all(0 <= r.lag <= 1 for r in records) and records[1].version == 0  # drawn one batch ahead
    merged = [r.metrics["calls_per_chain"] for r in records]
    assert max(merged) > 1.0, merged  # completed two-turn episodes merge into one chain
    changed = jax.tree.map(lambda a, b: not np.allclose(a, b), before, jax.device_get(state.params))
    assert any(jax.tree.leaves(changed))


@pytest.mark.slow
def test_resume_after_sigkill_reuses_finished_sessions_and_loses_or_repeats_none(tmp_path):
    import json
    import time

    from dew_lib.store import Store

    worker = os.path.join(os.path.dirname(__file__), "scheduler_worker.py")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    first = subprocess.Popen([sys.executable, worker, str(tmp_path), "--run", "1", "--hang-at", "3"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = tmp_path / "hanging"
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "the worker never reached step 3"
        time.sleep(0.1)
    first.send_signal(signal.SIGKILL)
    first.wait()
    second = subprocess.run([sys.executable, worker, str(tmp_path), "--run", "2"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    lines = second.stdout.splitlines()
    # Batch 3 was admitted and batch 4 finished before the kill; neither is drawn again.
    assert "offered 8" in lines and "step 3 reused 4" in lines and "step 4 reused 4" in lines
    assert "step 5 reused 0" in lines

    draws = [json.loads(line) for line in (tmp_path / "draws.jsonl").read_text().splitlines()]
    by_run = {run: {(d["group"], d["sample"]) for d in draws if d["run"] == run} for run in (1, 2)}
    assert {g for g, _ in by_run[1]} == set(range(10))       # batches 0-4, two tasks each
    assert {g for g, _ in by_run[2]} == set(range(10, 14))   # batches 5-6 only
    assert len(draws) == len(by_run[1]) + len(by_run[2])     # nothing drawn twice

    store = Store(tmp_path / "project")
    _, trained = store.rows("SELECT s.group_id, s.sample, count(*), any_value(c.sampled_ids[1]) "
                            "FROM sessions s JOIN calls c USING (session_uid) WHERE s.trained "
                            "GROUP BY ALL ORDER BY ALL")
    assert [(g, s) for g, s, *_ in trained] == [(g, s) for g in range(12) for s in range(2)]
    assert all(count == 1 for _, _, count, _ in trained)     # trained once each, none lost
    drawn_by = {g: 10 + (1 if g < 10 else 2) for g in range(12)}
    assert all(first_id == drawn_by[g] for g, _, _, first_id in trained)

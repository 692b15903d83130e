"""EpisodeJournal: a collection stopped after a round resumes exactly as if it had never stopped.

The square tool of tests/test_tool_episodes.py, in process and as a worker process
(tests/tool_workers/journal_square.py), with a call counter that only get_state/set_state carry
across a restart. A collection is interrupted by an environment that raises in a chosen round;
the restarted collection reuses the saved draws (fewer policy calls), takes answered turns from
the journal (no second tool call) and must equal an uninterrupted collection in every action,
likelihood, observation, reward and packed array. Then what the journal refuses.
"""

import itertools
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from test_tool_episodes import MODEL, SAMPLING, P, R, Square, T, tasks, trained_policy, verify

from dew_lib import Dataset, Trainer
from dew_lib.inference import TextGeneration
from dew_lib.objectives import GRPOObjective
from dew_lib.records.episodes import Observation
from dew_lib.rollouts import (
    EpisodeFailure,
    EpisodeJournal,
    EpisodeRollout,
    JournalBusy,
    JournalMismatch,
    SubprocessEnvironment,
    project,
)
from dew_lib.sampling import Sampling
from dew_lib.sandbox import SandboxLimits

WORKER = Path(__file__).resolve().parent / "tool_workers" / "journal_square.py"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def protocol():
    return trained_policy()


class Counted(Square):
    """The square tool with a per-episode call counter in its answers ("call #n") that only
    get_state/set_state carry over; `raise_at` makes the first step of that turn raise once."""

    answered, restored, raise_at, journal = [], [], None, None

    def reset(self):
        self.calls = 0
        return super().reset()

    def step(self, action):
        if Counted.journal is not None:  # the round's draws are on disk before any tool runs
            assert _saved_draw(Counted.journal, action.step, self.identity)
        if Counted.raise_at == action.step:
            Counted.raise_at = None
            raise OSError("the machine went away")
        self.calls += 1
        answer = super().step(action)
        Counted.answered.append((self.identity.task, self.identity.sample, action.step))
        return Observation(answer.context, answer.status, f"{answer.detail} call #{self.calls}")

    def get_state(self):
        return json.dumps({"calls": self.calls}).encode()

    def set_state(self, state):
        self.calls = json.loads(state)["calls"]
        Counted.restored.append((self.identity.task, self.identity.sample, self.calls))


@pytest.fixture(autouse=True)
def fresh():
    Counted.answered, Counted.restored, Counted.raise_at, Counted.journal = [], [], None, None
    yield
    assert Square.opened == Square.released  # every environment entered was released


def _saved_draw(path, turn, identity):
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        row = db.execute("SELECT count(*) FROM draws WHERE collection = (SELECT max(id) FROM collections) "
                         "AND turn = ? AND slot = ?", (turn, identity.group * 4 + identity.sample)).fetchone()
    return row[0] == 1


class Policy:
    """TextGeneration that counts the turns it samples."""

    def __init__(self):
        self.inner, self.calls = TextGeneration(MODEL), 0

    def bind(self, snapshot):
        bound = self.inner.bind(snapshot)

        def sample(*args, **kwargs):
            self.calls += 1
            return bound(*args, **kwargs)

        sample.binding = bound.binding
        return sample


def rollout(environment=Counted, journal=None, policy=None, **options):
    settings = dict(max_prompt_tokens=P, max_new_tokens=R, max_turns=T, groups=4, sampling=SAMPLING)
    return EpisodeRollout(policy or Policy(), environment, verify, journal=journal, **{**settings, **options})


def played(results):
    """Everything an episode recorded, as comparable values."""
    return [(r.episode.status, r.episode.detail, r.session.reward, r.session.status,
             [(t.action.context.tolist(), t.action.tokens.tolist(), t.action.raw_log_probs.tolist(),
               t.action.behavior_log_probs.tolist(), t.action.terminated, t.action.policy_step,
               t.observation and (t.observation.context.tolist(), t.observation.status, t.observation.detail))
              for t in r.episode.transitions]) for r in results]


def same_batch(a, b, rows):
    x, y = project(a, width=P + R, rows=rows), project(b, width=P + R, rows=rows)
    assert sorted(x) == sorted(y)
    for name in x:
        np.testing.assert_array_equal(np.asarray(x[name]), np.asarray(y[name]), err_msg=name)


BATCH, KEY, CLOCKS = tasks(3, 7), jax.random.key(11), dict(step=5, policy_step=4)


def test_a_collection_stopped_in_a_round_resumes_as_if_it_never_stopped(protocol, tmp_path):
    straight_policy = Policy()
    straight = rollout(policy=straight_policy).collect(protocol, BATCH, KEY, **CLOCKS)
    straight_answers = sorted(Counted.answered)
    assert any(len(r.episode.transitions) > 1 for r in straight)  # a second round ran tools

    Counted.answered, Counted.raise_at = [], 1
    journal = EpisodeJournal(tmp_path / "journal")
    Counted.journal = journal.path
    first = Policy()
    with pytest.raises(EpisodeFailure, match="the machine went away"):
        rollout(journal=journal, policy=first).collect(protocol, BATCH, KEY, **CLOCKS)
    assert first.calls == 2  # rounds 0 and 1 were drawn
    journal.close()  # as a dying process would
    before = list(Counted.answered)
    assert before and any(step == 0 for _, _, step in before)

    again, resumed = Policy(), EpisodeJournal(tmp_path / "journal")
    results = rollout(journal=resumed, policy=again).collect(protocol, BATCH, KEY, **CLOCKS)
    assert played(results) == played(straight)
    same_batch(results, straight, rows=2 * 4 * T)
    assert again.calls == straight_policy.calls - 2  # rounds 0 and 1 came from the journal
    assert sorted(Counted.answered) == straight_answers  # every tool call answered exactly once
    # each slot the tool had answered got its counter back (set_state) before anything else ran
    assert sorted(Counted.restored) == sorted({(t, s, sum(a[:2] == (t, s) for a in before)) for t, s, _ in before})
    (record, ) = resumed.collections()
    assert record["finished"] and record["rewards"] == [r.session.reward for r in results]
    db = sqlite3.connect(resumed.path)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert resumed._db.execute("PRAGMA synchronous").fetchone() == (2,)  # FULL
    db.close()
    resumed.close()


def test_a_tool_worker_resumes_from_its_snapshot(protocol, tmp_path):
    """The same through SubprocessEnvironment: the worker's counter comes back by set_state,
    and its audit log shows every answered call once."""

    def workers(audit):
        return SubprocessEnvironment((sys.executable, str(WORKER)), SandboxLimits(wall_seconds=60),
                                     env={"AUDIT": str(audit)})

    class Breaking:
        """A worker environment whose first step of turn 1 fails in the parent, before the call."""

        armed = True

        def __init__(self, task, identity):
            self.inner = workers(tmp_path / "audit")(task, identity)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def step(self, action):
            if action.step == 1 and Breaking.armed:
                Breaking.armed = False
                raise ConnectionError("lost the worker")
            return self.inner.step(action)

    straight = rollout(workers(tmp_path / "straight")).collect(protocol, BATCH, KEY, **CLOCKS)
    with EpisodeJournal(tmp_path / "journal") as journal:
        with pytest.raises(EpisodeFailure, match="lost the worker"):
            rollout(Breaking, journal).collect(protocol, BATCH, KEY, **CLOCKS)
    with EpisodeJournal(tmp_path / "journal") as journal:
        results = rollout(workers(tmp_path / "audit"), journal).collect(protocol, BATCH, KEY, **CLOCKS)
    assert played(results) == played(straight)  # "call #n" included: the counters came back
    same_batch(results, straight, rows=2 * 4 * T)
    lines = (tmp_path / "audit").read_text().splitlines()
    calls = [line for line in lines if line.startswith("step ")]
    assert len(calls) == len(set(calls))  # no answered call ran twice
    assert sorted(calls) == sorted((tmp_path / "straight").read_text().splitlines())
    restores = [line.split() for line in lines if line.startswith("restore ")]
    answered_in_round_0 = {(r.episode.identity.task, str(r.episode.identity.sample)) for r in results
                           if r.episode.transitions and r.episode.transitions[0].observation}
    assert answered_in_round_0 and {(task, sample) for _, task, sample, _ in restores} == answered_in_round_0


def test_a_journal_refuses_a_different_collection_at_the_same_clocks(protocol, tmp_path):
    with EpisodeJournal(tmp_path / "journal") as journal:
        Counted.raise_at = 0
        with pytest.raises(EpisodeFailure):
            rollout(journal=journal).collect(protocol, BATCH, KEY, **CLOCKS)
        opened = Square.opened
        perturbed = jax.tree.map(lambda x: x + 1e-3, protocol)
        refusals = [((perturbed, BATCH, KEY), {}, r"under a different policy \(policy: digest [0-9a-f]{16} there"),
                    ((protocol, tasks(3, 8), KEY), {}, r"for different tasks \(tasks: \['3', '7'\] there"),
                    ((protocol, BATCH, jax.random.key(12)), {}, "with a different key"),
                    ((protocol, BATCH, KEY), {"sampling": Sampling(temperature=0.7, eos_id=1)},
                     "under different sampling"),
                    ((protocol, BATCH, KEY), {"max_turns": T + 1}, "with a different max_turns")]
        for args, options, message in refusals:
            with pytest.raises(JournalMismatch, match=message) as refused:
                rollout(journal=journal, **options).collect(*args, **CLOCKS)
            assert str(tmp_path / "journal") in str(refused.value)
            assert "use a new journal directory per run" in str(refused.value)
        assert Square.opened == opened  # refused before any environment was entered
        policy = Policy()
        resumed = rollout(journal=journal, policy=policy).collect(protocol, BATCH, KEY, **CLOCKS)
    straight_policy = Policy()
    assert played(resumed) == played(rollout(policy=straight_policy).collect(protocol, BATCH, KEY, **CLOCKS))
    assert policy.calls == straight_policy.calls - 1 >= 1  # round 0 from the journal, later rounds sampled


def test_one_writer_per_journal(tmp_path):
    directory = tmp_path / "journal"
    with EpisodeJournal(directory):
        with pytest.raises(JournalBusy, match=str(directory)):
            EpisodeJournal(directory)
        other = subprocess.run([sys.executable, "-c", "import sys; from dew_lib.rollouts import EpisodeJournal; "
                                "EpisodeJournal(sys.argv[1])", str(directory)],
                               capture_output=True, text=True, cwd=ROOT,
                               env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
        assert other.returncode != 0 and "JournalBusy" in other.stderr and str(directory) in other.stderr
        with EpisodeJournal(directory, rank=1) as other_rank:  # another rank's file
            assert other_rank.path.endswith("rank-1.sqlite")
    EpisodeJournal(directory).close()  # free again once closed


def test_a_journal_of_the_first_schema_opens_with_a_column_for_routes(tmp_path):
    """A version-1 journal (no routes) left by an older Dew gains the column and keeps its rows;
    an unknown version is refused by name."""
    directory = tmp_path / "journal"
    EpisodeJournal(directory).close()
    path = directory / "rank-0.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("ALTER TABLE draws DROP COLUMN routed_experts")
        db.execute("PRAGMA user_version = 1")
    EpisodeJournal(directory).close()
    with sqlite3.connect(path) as db:
        assert "routed_experts" in [row[1] for row in db.execute("PRAGMA table_info(draws)")]
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        db.execute("PRAGMA user_version = 7")
    with pytest.raises(ValueError, match="schema version 7"):
        EpisodeJournal(directory)


def test_a_finished_collection_is_never_replayed(protocol, tmp_path):
    with EpisodeJournal(tmp_path / "journal") as journal:
        policy = Policy()
        first = rollout(journal=journal, policy=policy).collect(protocol, BATCH, KEY, **CLOCKS)
        calls, answered = policy.calls, len(Counted.answered)
        again = rollout(journal=journal, policy=policy).collect(protocol, BATCH, KEY, **CLOCKS)
        assert policy.calls == 2 * calls and len(Counted.answered) == 2 * answered  # collected afresh
        assert played(again) == played(first) and not Counted.restored
        # a different policy at the same clocks after the collection finished: a new collection
        perturbed = jax.tree.map(lambda x: x + 1e-2, protocol)
        other = rollout(journal=journal).collect(perturbed, BATCH, KEY, **CLOCKS)
        assert played(other) == played(rollout().collect(perturbed, BATCH, KEY, **CLOCKS))
        records = journal.collections()
        assert [r["finished"] for r in records] == [True] * 3
        assert [r["draws"] > 0 for r in records] == [False, False, True]  # finished turns are let go


def test_a_journal_needs_environments_with_snapshots(protocol, tmp_path):
    rollout(Square).collect(protocol, BATCH, KEY)  # without a journal, none needed
    with EpisodeJournal(tmp_path / "journal") as journal:
        with pytest.raises(TypeError, match="Square has no get_state or set_state"):
            rollout(Square, journal).collect(protocol, BATCH, KEY)
    with pytest.raises(TypeError, match="EpisodeJournal"):
        rollout(journal=str(tmp_path))


def test_training_stopped_in_a_collection_resumes_to_the_same_parameters(protocol, tmp_path):
    """Trainer + GRPO: a collection that breaks in step 2 of 3; the restarted fit resumes from
    the step-2 checkpoint, the journal supplies the broken collection's first round."""

    class Breaking(Counted):
        """Raises in the first step of round 1 of the collection at step 2."""

        def step(self, action):
            if self.identity.step == 2 and action.step == 1:
                Breaking.environment = Counted  # once
                raise OSError("killed")
            return super().step(action)

    Breaking.environment = Breaking

    def fit(directory, journal=None):
        objective = GRPOObjective(MODEL, seq_len=P + R - 1, pretrained=protocol)
        data = Dataset(train=lambda part: (tasks(i % 10, (i + 3) % 10) for i in itertools.count()), batch=2)
        collect = rollout(lambda task, identity: Breaking.environment(task, identity), journal)
        trainer = Trainer(objective, optax.adam(5e-4), key=jax.random.key(0), rollout=collect)
        return trainer.fit(data, steps=3, log_every=1, directory=directory, checkpoint_every=1, sinks=[])

    Breaking.environment = Counted
    straight = fit(None)
    answered = sorted(Counted.answered)
    Counted.answered, Breaking.environment = [], Breaking
    with EpisodeJournal(tmp_path / "journal") as journal:
        with pytest.raises(EpisodeFailure, match="killed"):
            fit(str(tmp_path / "checkpoints"), journal)
        resumed = fit(str(tmp_path / "checkpoints"), journal)
        assert [r["step"] for r in journal.collections()] == [0, 1, 2]
    assert sorted(Counted.answered) == answered
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_answers_committed_at_once_from_many_threads_all_land(tmp_path):
    import concurrent.futures

    from dew_lib.records.episodes import Action, Transition
    from dew_lib.rollouts.journal import collection_identity

    identity = collection_identity({"w": np.ones(3, np.float32)}, KEY, step=0, policy_step=0, tasks=["1"],
                                   groups=64, max_prompt_tokens=P, max_new_tokens=R, max_turns=T, sampling=SAMPLING)
    action = Action(context=[15, 6], tokens=[2, 6, 1], terminated=True, step=0)
    with EpisodeJournal(tmp_path / "journal") as journal:
        log = journal.open_collection(identity)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda slot: log.completed(slot, Transition(action, Observation([15, slot]), 0.5),
                                                     bytes([slot])), range(64)))
    with EpisodeJournal(tmp_path / "journal") as journal:
        restored = journal.open_collection(identity).restored()
    assert sorted(restored.turns) == [(0, slot) for slot in range(64)]
    assert all(done.snapshot == bytes([slot]) and done.observation.context.tolist() == [15, slot]
               for (_, slot), done in restored.turns.items())

"""EpisodeRollout on a square tool: the policy calls `CALL d`, the environment answers with the
last digit of d*d plus the episode's secret (drawn from its seed, so only the tool knows the
answer), the policy answers `ANSWER r`. What an episode records, which ids train, every way
an episode ends or fails, resource cleanup, resume, and a policy that learns to use the tool."""

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from dew_lib import Dataset, Trainer, models
from dew_lib.inference import TextGeneration
from dew_lib.objectives import GRPOObjective, LMObjective, loss
from dew_lib.records.episodes import Action, Observation, check_action
from dew_lib.rollouts import (
    EpisodeCancelled,
    EpisodeFailure,
    EpisodeResult,
    EpisodeRollout,
    SubprocessEnvironment,
    ToolFailure,
    project,
    session_of,
)
from dew_lib.sampling import Sampling
from dew_lib.sandbox import SandboxLimits
from dew_lib.train.sinks import MemorySink

PAD, EOS, CALL, ANSWER, RESULT, QUERY = 0, 1, 2, 3, 4, 15
P, R, T = 12, 3, 3  # context ids, ids per turn, turns
MODEL = models.build("causal_transformer", vocab_size=16, emb_features=32, num_layers=2, num_heads=4,
                     mlp_features=64, max_seq_len=16)
SAMPLING = Sampling(temperature=1.0, eos_id=EOS)
WORKERS = Path(__file__).resolve().parent / "tool_workers"


def digit(d):
    return 5 + d


def square(k, identity):
    return (k * k + identity.seed) % 10


class Square:
    """One episode of task n: the context is `QUERY n`; `CALL k EOS` gets `RESULT square(k)`,
    `ANSWER v EOS` ends it, anything else ends it unanswered. Counts what it opened and released."""

    opened, released, steps = 0, 0, []

    def __init__(self, task, identity):
        self.n, self.identity, self.inside = int(task.id), identity, False

    def __enter__(self):
        Square.opened += 1
        self.inside = True
        return self

    def __exit__(self, *exc):
        Square.released += 1
        self.inside = False
        self.exc = exc[0]

    def reset(self):
        return Observation([QUERY, digit(self.n)])

    def step(self, action):
        Square.steps.append((self.n, action.tokens.tolist()))
        said = action.tokens[:-1].tolist()
        if len(said) == 2 and said[0] == CALL and 5 <= said[1] < 15:
            k = said[1] - 5
            reply = [RESULT, digit(square(k, self.identity))]
            return Observation(np.concatenate([action.context, action.tokens, reply]), detail=f"square({k})")
        if len(said) == 2 and said[0] == ANSWER:
            return Observation(status="completed", detail=f"answered {said[1] - 5}")
        return Observation(status="completed", detail="no call and no answer")


def verify(task, episode):
    """1 for the answer the tool would give on the task's number, else 0."""
    return float(episode.detail == f"answered {square(int(task.id), episode.identity)}")


@pytest.fixture(autouse=True)
def counts():
    Square.opened, Square.released, Square.steps = 0, 0, []
    yield
    assert Square.opened == Square.released  # every environment entered was released


def trained_policy(steps=600):
    """A policy that knows the protocol but calls the tool only half the time: SFT on episodes
    `QUERY d CALL d EOS RESULT r ANSWER r EOS` (any r) and on guesses `QUERY d ANSWER g EOS`."""
    called = [[QUERY, digit(d), CALL, digit(d), EOS, RESULT, digit(r), ANSWER, digit(r), EOS]
              for d in range(10) for r in range(10)]
    guessed = [[QUERY, digit(d), ANSWER, digit(g), EOS] for d in range(10) for g in range(10)]
    texts = np.array([row + [PAD] * (13 - len(row)) for row in called + guessed], np.int32)
    rng = np.random.default_rng(0)
    data = Dataset(train=lambda part: iter(lambda: {"text": texts[rng.choice(len(texts), 16)]}, None), batch=16)
    return Trainer(LMObjective(MODEL, seq_len=12, ema_decay=None), optax.adam(3e-3),
                   key=jax.random.key(0)).fit(data, steps=steps).params


@pytest.fixture(scope="module")
def protocol():
    return trained_policy()


def rollout(environment=Square, verifier=verify, policy=None, **options):
    settings = dict(max_prompt_tokens=P, max_new_tokens=R, max_turns=T, groups=4, sampling=SAMPLING)
    return EpisodeRollout(policy or TextGeneration(MODEL), environment, verifier, **{**settings, **options})


def tasks(*ids):
    return {"task_id": np.array(ids, np.int32)}


def test_each_turn_is_a_call_with_its_likelihoods_and_only_sampled_ids_train(protocol):
    collector = rollout()
    results = collector.collect(protocol, tasks(3, 7), jax.random.key(1), step=5, policy_step=4)
    assert [(r.episode.identity.task, r.episode.identity.group, r.episode.identity.sample, r.episode.identity.step)
            for r in results] == [(t, b, g, 5) for b, t in enumerate("37") for g in range(4)]
    finished = [r for r in results if r.episode.status.value == "completed"]
    assert len(finished) >= 6
    for result in finished:
        episode, session = result.episode, result.session
        actions = [t.action.tokens.tolist() for t in episode.transitions]
        assert [c.sampled_ids.tolist() for c in session.calls] == actions
        for call, transition in zip(session.calls, episode.transitions, strict=True):
            assert call.prompt_ids.tolist() == transition.action.context.tolist()  # the exact context
            assert call.version == 4 and call.finish_reason == "stop" and call.sampled_ids[-1] == EOS
            np.testing.assert_allclose(call.raw_log_probs, call.behavior_log_probs, atol=1e-6)  # temperature 1
        assert session.reward == verify(episode.task, episode)
    batch = project(results, width=P + R, rows=collector.rows(2))
    assert batch["input_ids"].shape == (2 * 4 * T, P + R)
    for n, result in enumerate(results):
        row_ids = batch["input_ids"][batch["session_index"] == n]
        sampled = [i for c in result.session.calls for i in c.sampled_ids.tolist()]
        assert row_ids.tolist() == (sampled if result.episode.status.value == "completed" else [])
    # the tool's answer (RESULT r) and the task (QUERY n) are context, never targets
    observed = batch["input_ids"][(batch["response_mask"] == 0) & (batch["text_segment_ids"] > 0)]
    assert {RESULT, QUERY} <= set(observed.tolist())
    assert not ({RESULT, QUERY} & set(batch["input_ids"][batch["response_mask"] == 1].tolist()))
    # a tempered sampler reports its own likelihoods beside the raw policy's
    tempered = rollout(sampling=Sampling(temperature=0.5, eos_id=EOS)).collect(protocol, tasks(3), jax.random.key(1))
    call = tempered[0].session.calls[0]
    assert np.abs(call.behavior_log_probs - call.raw_log_probs).max() > 0.1


def test_the_loss_and_its_gradient_depend_only_on_sampled_ids(protocol):
    collector = rollout()
    objective = GRPOObjective(MODEL, seq_len=P + R - 1)
    batch = dict(project(collector.collect(protocol, tasks(2, 5), jax.random.key(3)), width=P + R,
                         rows=collector.rows(2)))
    batch["advantages"] = np.where(batch["response_mask"] == 1, 1.0, 0.0).astype(np.float32)
    scrambled = dict(batch)
    context = batch["response_mask"] == 0  # observations, prompts and padding
    rng = np.random.default_rng(0)
    for name in ("advantages", "old_log_probs", "behavior_log_probs", "rewards"):
        scrambled[name] = np.where(context, rng.normal(size=context.shape), batch[name]).astype(np.float32)

    def value_and_grad(b):
        return jax.value_and_grad(lambda p: loss(objective, p, b)[0])(protocol)

    (a, grads), (b, scrambled_grads) = value_and_grad(batch), value_and_grad(scrambled)
    assert a == b
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(scrambled_grads), strict=True):
        np.testing.assert_array_equal(x, y)
    # and it is the loss's own gradient, not zero: along it the loss moves at |g|^2 (a central
    # difference over a step of length 0.01; a zero gradient makes the step infinite and fails)
    squared = sum(float(np.sum(np.square(x))) for x in jax.tree.leaves(grads))
    step = 0.01 / np.sqrt(squared)

    def along(t):
        return float(loss(objective, jax.tree.map(lambda p, g: p + t * g, protocol, grads), batch)[0])

    np.testing.assert_allclose((along(step) - along(-step)) / (2 * step), squared, rtol=1e-3)


class Silent(Square):
    """Task 0 ends at once (no turns); the others run as usual."""

    def reset(self):
        if self.n == 0:
            return Observation(status="completed", detail="nothing to do")
        return super().reset()


def test_a_slot_draws_the_same_whatever_the_other_slots_do(protocol):
    usual = rollout().collect(protocol, tasks(0, 4), jax.random.key(2))
    quiet = rollout(Silent, lambda task, episode: 0.0).collect(protocol, tasks(0, 4), jax.random.key(2))
    assert [len(r.episode.transitions) for r in quiet[:4]] == [0] * 4
    for a, b in zip(usual[4:], quiet[4:], strict=True):
        assert [t.action.tokens.tolist() for t in a.episode.transitions] == \
               [t.action.tokens.tolist() for t in b.episode.transitions]


class Verbose(Square):
    """Answers a call with a context too long to read (task 1) or keeps asking (task 2)."""

    def step(self, action):
        if self.n == 1:
            return Observation(np.concatenate([action.context, action.tokens, [RESULT] * P]))
        if self.n == 2:
            return Observation(np.concatenate([action.context, action.tokens, [RESULT, digit(4)]]))
        return super().step(action)


def test_budgets_turns_and_long_contexts_truncate_and_truncated_episodes_do_not_train(protocol):
    collector = rollout(Verbose, max_turns=2)
    results = collector.collect(protocol, tasks(1, 2), jax.random.key(0))
    assert {r.episode.status.value for r in results} == {"truncated"}
    long = [r.episode for r in results if "exceeds max_prompt_tokens=12" in r.episode.detail]
    assert long and all(e.task.id == "1" and e.transitions[-1].observation.context.size > P  # recorded whole
                        for e in long)
    assert any(r.episode.detail == "max_turns=2 reached" and len(r.episode.transitions) == 2 for r in results[4:])
    batch = project(results, width=P + R, rows=collector.rows(2))
    assert batch["response_mask"].sum() == 0  # all truncated: masked, nothing trains
    assert "old_log_probs" in batch  # the same columns every step: one compiled update
    short = rollout(max_new_tokens=1).collect(protocol, tasks(3), jax.random.key(0))
    assert {r.episode.detail for r in short} == {"turn 0 used its whole budget of 1 ids without EOS"}
    assert Square.steps == [] or all(n != 3 for n, _ in Square.steps)  # never sent to the tool
    assert all(r.episode.transitions[0].observation is None for r in short)


def test_truncated_episodes_are_left_out_of_the_group_baseline():
    from dew_lib.records.episodes import Episode, EpisodeId, Transition
    from dew_lib.records.sessions import Task
    from dew_lib.rollouts import EpisodeResult, session_of

    def result(sample, status, reward, origin=1):
        action = Action(context=[QUERY, 5], tokens=[CALL, EOS] if status == "completed" else [CALL, CALL],
                        terminated=status == "completed", step=0, raw_log_probs=[-1.0, -1.0],
                        behavior_log_probs=[-1.0, -1.0])
        episode = Episode(Task("0"), EpisodeId("0", 0, sample, 0, 0), status, "", Observation([QUERY, 5]),
                          (Transition(action, None),), origin)
        return EpisodeResult(episode, session_of(episode, group=0, reward=reward))

    batch = project([result(0, "completed", 1.0), result(1, "completed", 0.0), result(2, "truncated", 5.0)],
                    width=8, rows=3)
    advantages = sorted(set(batch["advantages"][batch["response_mask"] == 1].tolist()))
    assert advantages == pytest.approx([-0.7071, 0.7071], abs=1e-4)
    with pytest.raises(ValueError, match="2 policy bindings"):
        project([result(0, "completed", 1.0), result(1, "completed", 0.0, origin=2)], width=8, rows=2)
    # "score" trains the truncated episode on its verifier's reward (5.0), "zero" on 0
    group = [result(0, "completed", 1.0), result(1, "completed", 0.0), result(2, "truncated", 5.0)]
    for truncation, rewards in (("score", [1.0, 0.0, 5.0]), ("zero", [1.0, 0.0, 0.0])):
        batch = project(group, width=8, rows=3, truncation=truncation)
        assert batch["response_mask"].sum() == 6
        trained = batch["response_mask"] == 1
        assert [float(batch["rewards"][trained & (batch["session_index"] == n)][0]) for n in range(3)] == rewards
    with pytest.raises(ValueError, match="truncation must be one of"):
        rollout(truncation="keep")


class Failing(Square):
    """Fails (or cancels) on task 6's first step in the way `how` says."""

    how = "raise"

    def step(self, action):
        if self.n == 6:
            if Failing.how == "raise":
                raise OSError("the tool's disk is full")
            if Failing.how == "error":
                return Observation(status="error", detail="tool crashed")
            if Failing.how == "asyncio":
                raise asyncio.CancelledError("shutting down")
            if Failing.how == "futures":
                raise concurrent.futures.CancelledError()
            if Failing.how == "observed":
                return Observation(status="cancelled", detail="user stopped it")
        return super().step(action)


@pytest.mark.parametrize("how, kind, cause", [("raise", EpisodeFailure, OSError), ("error", EpisodeFailure, None),
                                              ("asyncio", EpisodeCancelled, asyncio.CancelledError),
                                              ("futures", EpisodeCancelled, concurrent.futures.CancelledError),
                                              ("observed", EpisodeCancelled, None)])
def test_a_failing_or_cancelled_episode_aborts_the_collection_and_releases_everything(protocol, how, kind, cause):
    Failing.how = how
    entered = []
    recorded = []

    def factory(task, identity):
        entered.append(Failing(task, identity))
        return entered[-1]

    with pytest.raises(kind) as raised:
        rollout(factory, record=recorded.append).collect(protocol, tasks(5, 6), jax.random.key(0))
    failure = raised.value
    assert failure.episode.task.id == "6" and failure.episode.status.value == (
        "cancelled" if kind is EpisodeCancelled else "error")
    assert type(failure.__cause__) is cause if cause else failure.__cause__ is None
    # a turn whose step raised never completed; one the environment answered is kept with its answer
    assert len(failure.episode.transitions) == (0 if cause else 1)
    assert [r.episode.task.id for r in recorded] == ["6"]
    assert all(not env.inside for env in entered) and len(entered) == 8
    assert {env.exc for env in entered} == {cause or kind}  # released under the original exception


def test_verifier_failures_abort_and_the_verifier_runs_inside_the_environment(protocol):
    inside = []

    def watching(task, episode):
        inside.append(all(env.inside for env in entered))
        return 1.0

    entered = []

    def factory(task, identity):
        entered.append(Square(task, identity))
        return entered[-1]

    rollout(factory, watching).collect(protocol, tasks(1), jax.random.key(0))
    assert inside and all(inside)
    with pytest.raises(EpisodeFailure, match="verifier returned nan"):
        rollout(verifier=lambda task, episode: float("nan")).collect(protocol, tasks(1), jax.random.key(0))
    with pytest.raises(EpisodeFailure, match="ZeroDivisionError") as raised:
        rollout(verifier=lambda task, episode: 1 / 0).collect(protocol, tasks(1), jax.random.key(0))
    assert isinstance(raised.value.__cause__, ZeroDivisionError)


class Leaky(Square):
    def __exit__(self, *exc):
        super().__exit__(*exc)
        if self.identity.sample == 1:
            raise RuntimeError("could not delete the workspace")


def test_an_episode_whose_release_fails_is_thrown_out_and_the_rest_train(protocol):
    results = rollout(Leaky).collect(protocol, tasks(2), jax.random.key(0))
    assert [r.session.status.value for r in results][1] == "infra_error"
    assert "could not delete the workspace" in results[1].session.detail
    batch = project(results, width=P + R, rows=rollout().rows(1))
    assert not np.any(batch["session_index"] == 1)


def noting_pids(factory, pids):
    """`factory`, appending each worker's pid to `pids` while it is entered."""

    @contextlib.contextmanager
    def counted(task, identity):
        with factory(task, identity) as environment:
            pids.append(environment.pid)
            yield environment

    return counted


def test_a_cohort_of_tool_workers_plays_exactly_as_the_in_process_tool(protocol, tmp_path):
    audit = tmp_path / "audit"
    workers = SubprocessEnvironment((sys.executable, str(WORKERS / "square_tool.py")),
                                    SandboxLimits(wall_seconds=60), env={"AUDIT": str(audit)})
    pids = []
    counted = noting_pids(workers, pids)

    key = jax.random.key(4)
    remote = rollout(counted, groups=8).collect(protocol, tasks(*range(4)), key)
    local = rollout(groups=8).collect(protocol, tasks(*range(4)), key)
    assert [(r.episode.status, r.episode.detail, r.session.reward) for r in remote] == \
           [(r.episode.status, r.episode.detail, r.session.reward) for r in local]
    for a, b in zip(remote, local, strict=True):
        assert [(t.action.tokens.tolist(), t.observation and t.observation.context.tolist())
                for t in a.episode.transitions] == \
               [(t.action.tokens.tolist(), t.observation and t.observation.context.tolist())
                for t in b.episode.transitions]
        assert all(t.seconds is not None and t.seconds > 0 for t in a.episode.transitions if t.observation)
    assert len(pids) == 32 and not any(_alive(pid) for pid in pids)  # every worker reaped
    called = [r for r in remote if r.episode.transitions and r.episode.transitions[0].observation
              and r.episode.transitions[0].observation.detail.startswith("square")]
    assert len(audit.read_text().splitlines()) == sum(
        t.observation is not None and t.observation.detail.startswith("square")
        for r in remote for t in r.episode.transitions) >= len(called) > 0


@pytest.mark.parametrize("how, says", [("hang", "deadline"), ("crash", "exit"), ("flood", "bytes"),
                                       ("malformed", "context"), ("raise", "the calculator is broken")])
def test_a_misbehaving_tool_worker_aborts_the_collection_and_every_worker_is_reaped(protocol, how, says):
    workers = SubprocessEnvironment((sys.executable, str(WORKERS / "square_tool.py")),
                                    SandboxLimits(wall_seconds=5, max_output_bytes=1 << 16), env={"MISBEHAVE": how})
    pids = []
    counted = noting_pids(workers, pids)

    with pytest.raises(EpisodeFailure) as raised:
        rollout(counted).collect(protocol, tasks(5, 6), jax.random.key(0))
    assert raised.value.episode.task.id == "6" and isinstance(raised.value.__cause__, ToolFailure)
    assert says in str(raised.value.__cause__).lower()
    assert len(pids) == 8 and not any(_alive(pid) for pid in pids)


def test_a_cancellation_mid_draw_stops_the_collection_and_releases_every_environment(protocol):
    class Interrupted(TextGeneration):
        def bind(self, snapshot):
            bound = super().bind(snapshot)

            def sample(*args, **kwargs):
                raise asyncio.CancelledError("stopped while drawing")

            sample.binding = bound.binding
            return sample

    with pytest.raises(EpisodeCancelled) as raised:
        rollout(policy=Interrupted(MODEL)).collect(protocol, tasks(1, 2), jax.random.key(0))
    assert isinstance(raised.value.__cause__, asyncio.CancelledError)
    assert Square.opened == Square.released == 8


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def test_bad_actions_and_settings_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="1 ids after EOS"):
        check_action(Action(context=[1], tokens=[CALL, EOS, CALL], terminated=True, step=0), (EOS,))
    with pytest.raises(ValueError, match="says EOS ended it"):
        check_action(Action(context=[1], tokens=[CALL], terminated=True, step=0), (EOS,))
    with pytest.raises(ValueError, match="non-finite"):
        Action(context=[1], tokens=[CALL], terminated=False, step=0, raw_log_probs=[np.nan])
    with pytest.raises(TypeError, match="integer token ids"):
        Action(context=[1], tokens=[True], terminated=False, step=0)
    with pytest.raises(ValueError, match="groups"):
        rollout(groups=1)
    with pytest.raises(ValueError, match="eos_id"):
        rollout(sampling=Sampling(temperature=1.0))
    with pytest.raises(KeyError, match="task_id"):
        rollout().collect({}, {"prompt": np.zeros((1, 2), np.int32)}, jax.random.key(0))


def fit(policy, steps, directory=None, resume_from=None, rate=5e-4, batch=10, log=None, truncation="mask"):
    objective = GRPOObjective(MODEL, seq_len=P + R - 1, pretrained=policy)
    data = Dataset(train=lambda part: itertools.repeat(tasks(*range(batch))), batch=batch)
    trainer = Trainer(objective, optax.adam(rate), key=jax.random.key(0),
                      rollout=rollout(groups=8, truncation=truncation))
    return trainer.fit(data, steps=steps, log_every=5, directory=directory, checkpoint_every=2,
                       sinks=[log] if log else [])


def test_training_resumed_from_a_checkpoint_makes_the_same_updates(protocol, tmp_path):
    straight = fit(protocol, 4, batch=2)
    fit(protocol, 2, directory=str(tmp_path), batch=2)
    resumed = fit(protocol, 4, directory=str(tmp_path), batch=2)
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_policy_learns_to_call_the_tool_and_answer(protocol):
    """A guess is right one time in ten, the tool's answer always: GRPO learns to call it.
    Episodes cut for rambling train on reward 0: with the default "mask" nothing pushes against
    them, and the first-turn mass taken from guesses drifts onto ids that are neither call nor
    answer (a third of first turns after 40 steps) while the trained reward still climbs."""

    def calls(params):
        results = rollout(groups=8).collect(params, tasks(*range(10)), jax.random.key(9))
        return np.mean([r.episode.transitions[0].action.tokens[0] == CALL for r in results])

    log = MemorySink()
    state = fit(protocol, 40, log=log, truncation="zero")
    rewards = [value for _, value in log.series("reward")]
    assert rewards[0] < 0.75 and rewards[-1] > rewards[0] + 0.25, rewards
    assert calls(protocol) < 0.7 and calls(state.params) > 0.9
    assert log.history[-1][1]["compilations"] == 1


def test_episodes_land_in_the_run_store_with_a_row_per_turn(protocol, tmp_path):
    from dew_lib.store import Store

    results = rollout(Failing).collect(protocol, tasks(4, 5), jax.random.key(5))
    with Store(tmp_path).writer("r") as run, run.stage("tools", kind="grpo") as stage:
        stage.sessions([r.session for r in results], update=3, episodes=[r.episode for r in results])
    store = Store(tmp_path)
    per_episode = store.rows("SELECT t.task, t.sample, count(*) AS turns, any_value(s.status) FROM turns t "
                             "JOIN sessions s USING (session_uid) GROUP BY ALL ORDER BY ALL")[1]
    assert per_episode == sorted((r.session.task, r.session.sample, len(r.episode.transitions), r.session.status.value)
                                 for r in results if r.episode.transitions)
    rows = store.rows("SELECT task, sample, turn, action_ids, terminated, status, detail, seconds FROM turns "
                      "ORDER BY task, sample, turn")[1]
    expected = sorted((r.session.task, r.session.sample, t.action.step, t.action.tokens.tolist(), t.action.terminated,
                       t.observation and t.observation.status.value, t.observation and t.observation.detail,
                       t.seconds) for r in results for t in r.episode.transitions)
    assert rows == expected
    answers = store.rows("SELECT detail, count(*) FROM turns WHERE status = 'completed' GROUP BY detail")[1]
    assert sum(n for _, n in answers) == sum(r.episode.status.value == "completed" for r in results)


def test_the_readme_turn_queries_answer_on_recorded_episodes(protocol, tmp_path):
    import re

    from dew_lib.store import Store

    Failing.how = "error"
    collector = rollout(Failing)
    with Store(tmp_path).writer("r") as run, run.stage("tools", kind="grpo") as stage:
        for update, batch in enumerate((tasks(4, 5), tasks(6, 7))):
            try:
                results = collector.collect(protocol, batch, jax.random.key(update))
            except EpisodeFailure as failure:  # a collection the tool broke: record what it did
                results = [EpisodeResult(failure.episode, session_of(failure.episode, group=0))]
            stage.sessions([r.session for r in results], update=update, episodes=[r.episode for r in results])
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"turns per episode.*?```sql\n(.*?)```", readme, re.S).group(1)
    per_update, errors = [q.strip() for q in block.split(";") if q.strip()]
    store = Store(tmp_path)
    assert [row[2:4] for row in store.rows(per_update)[1]] == [(0, 8), (1, 1)]
    assert [row[2:4] for row in store.rows(errors)[1]] == [("tool crashed", 1)]

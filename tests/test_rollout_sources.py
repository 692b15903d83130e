"""PromptSource and EnvironmentSource: every way a session ends becomes a status, cancel stops a
session at its next turn and mid-draw and releases its environment; on a fake server whose draws
end when the test says, and on the native server."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from dew_lib.inference import Draw, NativeRolloutServer, Server, ServeTask
from dew_lib.records import EpisodeStatus, Observation, Status, Task
from dew_lib.rollouts import EnvironmentSource, PromptSource
from dew_lib.sampling import Sampling

EOS = 2


def draw(ids, eos=True, version=3):
    return Draw(ids=np.array(ids, np.int32), behavior_log_probs=np.full(len(ids), -0.5),
                raw_log_probs=np.full(len(ids), -0.25), eos=eos, version=version)


class FakeServer:
    """A RolloutServer whose answer(prompt, turn) gives a Draw, an exception or None (held until
    the test releases it; cancelling a held draw cancels its future, as the native server does)."""

    def __init__(self, answer):
        self.answer = answer
        self.requests: list[tuple[list[int], int, int]] = []
        self.held: list[Future] = []
        self.submitted = threading.Event()

    def submit(self, prompt_ids, max_new_tokens, *, seed=None):
        self.requests.append((list(map(int, prompt_ids)), max_new_tokens, seed))
        future = Future()
        outcome = self.answer(list(map(int, prompt_ids)))
        if outcome is None:
            self.held.append(future)
        elif isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        self.submitted.set()
        return future

    def load(self, variables, version):
        pass


TASK = Task("4", {"prompt_ids": np.array([5, 6]), "data_source": "toy", "ground_truth": "9",
                  "extra_info": ""})


def submit(source, task=TASK, sample=0):
    return source.submit(task, group=1, sample=sample, attempt=0, seed=11)


# ----- PromptSource ---------------------------------------------------------------------------

def test_prompt_source_scores_decoded_text_and_records_the_call():
    seen = []

    def reward(data_source, completion, ground_truth, extra_info):
        seen.append((data_source, completion, ground_truth))
        return 1.0 if completion == "9 9" else 0.0

    with PromptSource(FakeServer(lambda p: draw([9, 9, EOS])), reward, max_new_tokens=4) as source:
        session = submit(source).result(timeout=10)
    assert session.status is Status.COMPLETED and session.reward == 1.0
    assert (session.task, session.group, session.sample) == ("4", 1, 0)
    assert seen == [("toy", "9 9", "9")]  # EOS is not part of the text
    (call,) = session.calls
    np.testing.assert_array_equal(call.prompt_ids, [5, 6])
    np.testing.assert_array_equal(call.sampled_ids, [9, 9, EOS])
    np.testing.assert_array_equal(call.raw_log_probs, [-0.25] * 3)
    assert call.version == 3 and call.finish_reason == "stop"


def test_prompt_source_hands_over_what_the_reward_reported_for_each_session():
    scored = threading.local()

    def reward(data_source, completion, ground_truth, extra_info):
        scored.text = completion  # what a code reward's last_runs keeps: per scoring thread
        return 1.0

    with PromptSource(FakeServer(lambda p: draw([9, EOS])), reward, max_new_tokens=4,
                      reward_details=lambda: ("ran", scored.text)) as source:
        session = submit(source, sample=3).result(timeout=10)
    assert source.pop_details(session) == ("ran", "9")
    assert source.pop_details(session) is None  # handed over once


@pytest.mark.parametrize("outcome, reward, status, detail", [
    (draw([9, 9, 9, 9], eos=False), lambda *a: 0.5, Status.TRUNCATED, "whole budget"),
    (RuntimeError("engine died"), lambda *a: 1.0, Status.INFRA_ERROR, "draw failed: RuntimeError: engine died"),
    (draw([9, EOS]), lambda *a: 1 / 0, Status.INFRA_ERROR, "reward failed: ZeroDivisionError"),
    (draw([9, EOS]), lambda *a: float("nan"), Status.INFRA_ERROR, "reward returned nan"),
], ids=["truncated", "draw-fails", "reward-raises", "reward-nan"])
def test_prompt_source_statuses(outcome, reward, status, detail):
    with PromptSource(FakeServer(lambda p: outcome), reward, max_new_tokens=4) as source:
        session = submit(source).result(timeout=10)
    assert session.status is status and detail in session.detail
    assert session.reward == (0.5 if status is Status.TRUNCATED else None)


def test_prompt_source_cancel_withdraws_the_draw_in_flight():
    server = FakeServer(lambda p: None)
    with PromptSource(server, lambda *a: 1.0, max_new_tokens=4) as source:
        future = submit(source)
        assert not future.done()
        source.cancel(future)
        session = future.result(timeout=10)
    assert server.held[0].cancelled()
    assert session.status is Status.CANCELLED and session.calls == ()


@pytest.mark.slow
def test_prompt_source_on_the_native_server():
    model = tiny_model()
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    task = ServeTask(model=model, variables=variables, sampling=Sampling(temperature=1.0, eos_id=EOS))
    with NativeRolloutServer(Server.from_task(task, slots=1, capacity=24, steps=4)) as native, \
            PromptSource(native, lambda *a: 0.25, max_new_tokens=6, workers=2) as source:
        first, queued = submit(source), submit(source, sample=1)
        source.cancel(queued)  # one slot: the second waits in the queue and is withdrawn there
        done = first.result(timeout=120)
        assert queued.result(timeout=120).status is Status.CANCELLED
        expected = native.submit([5, 6], 6, seed=11).result(timeout=120)
    (call,) = done.calls
    np.testing.assert_array_equal(call.sampled_ids, expected.ids)
    np.testing.assert_allclose(call.behavior_log_probs, expected.behavior_log_probs, atol=1e-6)
    assert done.status is (Status.COMPLETED if expected.eos else Status.TRUNCATED) and done.reward == 0.25


# ----- EnvironmentSource ----------------------------------------------------------------------

class SquareTool:
    """Turn 0: the model acts; the tool appends [20, 21] to the context. Turn 1: the model
    answers and the episode completes. Records its life cycle in `events`."""

    def __init__(self, task, identity, events, *, fail_step=False, end=EpisodeStatus.COMPLETED,
                 step_gate=None, fail_exit=False):
        self.task, self.identity, self.events = task, identity, events
        self.fail_step, self.end, self.step_gate, self.fail_exit = fail_step, end, step_gate, fail_exit

    def __enter__(self):
        self.events.append("enter")
        return self

    def __exit__(self, *exc):
        self.events.append("exit")
        if self.fail_exit:
            raise OSError("could not remove the workspace")

    def reset(self):
        return Observation([1, *self.task.data["prompt_ids"]])

    def step(self, action):
        self.events.append(("step", action.step, action.tokens.tolist()))
        if self.step_gate is not None:
            self.step_gate()
        if self.fail_step:
            raise RuntimeError("tool crashed")
        if action.step == 0:
            return Observation([*action.context, *action.tokens, 20, 21])
        return Observation(status=self.end, detail="answered")


def environment(events, **options):
    return lambda task, identity: SquareTool(task, identity, events, **options)


def verify(task, episode):
    return float(len(episode.transitions)) + (0.5 if episode.status is EpisodeStatus.TRUNCATED else 0.0)


def run_episode(answer, *, verifier=verify, max_prompt_tokens=16, max_new_tokens=4, max_turns=4, **env):
    events = []
    server = FakeServer(answer)
    with EnvironmentSource(server, environment(events, **env), verifier, max_prompt_tokens=max_prompt_tokens,
                           max_new_tokens=max_new_tokens, max_turns=max_turns, workers=2) as source:
        session = submit(source).result(timeout=10)
    return session, events, server


def test_a_two_turn_episode_completes_with_merging_calls_and_its_verifier_reward():
    session, events, server = run_episode(lambda p: draw([7, EOS]))
    assert session.status is Status.COMPLETED and session.reward == 2.0
    assert [c.prompt_ids.tolist() for c in session.calls] == [[1, 5, 6], [1, 5, 6, 7, EOS, 20, 21]]
    assert events == ["enter", ("step", 0, [7, EOS]), ("step", 1, [7, EOS]), "exit"]
    assert len({seed for *_, seed in server.requests}) == 2  # each turn draws with its own seed


def test_a_source_that_keeps_episodes_hands_each_over_once_with_its_timed_turns():
    server = FakeServer(lambda p: draw([7, EOS]))
    with EnvironmentSource(server, environment([]), verify, max_prompt_tokens=16, max_new_tokens=4,
                           max_turns=4, keep_episodes=True) as source:
        session = submit(source).result(timeout=10)
        episode = source.pop_episode(session)
        assert source.pop_episode(session) is None
    assert episode.status.value == "completed" and episode.identity.task == session.task
    assert [t.action.tokens.tolist() for t in episode.transitions] == [c.sampled_ids.tolist() for c in session.calls]
    assert all(t.seconds is not None and t.seconds >= 0 for t in episode.transitions)


@pytest.mark.parametrize("answer, limits, detail", [
    (lambda p: draw([7, 7, 7, 7], eos=False), {}, "turn 0 used its whole budget of 4 ids"),
    (lambda p: draw([7, EOS]), {"max_prompt_tokens": 5}, "context of 7 ids exceeds max_prompt_tokens=5"),
    (lambda p: draw([7, EOS]), {"max_turns": 1}, "max_turns=1 reached"),
], ids=["token-budget", "context", "turns"])
def test_limits_truncate_and_the_verifier_still_scores(answer, limits, detail):
    session, events, _ = run_episode(answer, **limits)
    assert session.status is Status.TRUNCATED and detail in session.detail
    assert session.reward == len(session.calls) + 0.5
    assert events[-1] == "exit" and all(e[1] == 0 for e in events if isinstance(e, tuple))
    if "budget" in detail:  # a cut-off response is never sent to the tool
        assert not any(isinstance(e, tuple) for e in events)


def test_environment_truncation_and_cancellation_statuses():
    session, _, _ = run_episode(lambda p: draw([7, EOS]), end=EpisodeStatus.TRUNCATED)
    assert session.status is Status.TRUNCATED and session.reward == 2.5
    session, _, _ = run_episode(lambda p: draw([7, EOS]), end=EpisodeStatus.CANCELLED)
    assert session.status is Status.CANCELLED and session.reward is None


@pytest.mark.parametrize("options, detail", [
    ({"fail_step": True}, "environment failed while running: RuntimeError: tool crashed"),
    ({"end": EpisodeStatus.ERROR}, "answered"),
    ({"verifier": lambda task, episode: 1 / 0}, "verifier failed: ZeroDivisionError"),
    ({"verifier": lambda task, episode: float("inf")}, "verifier returned inf"),
    ({"fail_exit": True}, "environment failed while released: OSError"),
], ids=["step-raises", "reports-error", "verifier-raises", "verifier-inf", "release-fails"])
def test_infrastructure_failures(options, detail):
    session, events, _ = run_episode(lambda p: draw([7, EOS]), **options)
    assert session.status is Status.INFRA_ERROR and detail in session.detail
    assert session.reward is None and events[-1] == "exit"


def test_a_failed_draw_is_an_infrastructure_failure():
    session, events, _ = run_episode(lambda p: RuntimeError("engine died"))
    assert session.status is Status.INFRA_ERROR and "draw failed" in session.detail
    assert events == ["enter", "exit"]


def test_cancel_mid_draw_withdraws_the_draw_and_releases_the_environment():
    events = []
    server = FakeServer(lambda p: draw([7, EOS]) if len(p) == 3 else None)  # turn 1 hangs
    with EnvironmentSource(server, environment(events), verify, max_prompt_tokens=16,
                           max_new_tokens=4, max_turns=4) as source:
        future = submit(source)
        while len(server.held) < 1:  # turn 1's draw is in flight
            server.submitted.wait(timeout=10)
            server.submitted.clear()
        source.cancel(future)
        session = future.result(timeout=10)
    assert server.held[0].cancelled()
    assert session.status is Status.CANCELLED and "while drawing turn 1" in session.detail
    assert len(session.calls) == 1 and events[-1] == "exit"


def test_cancel_stops_the_session_at_its_next_turn():
    events, entered, go = [], threading.Event(), threading.Event()

    def gate():
        entered.set()
        go.wait(timeout=10)

    server = FakeServer(lambda p: draw([7, EOS]))
    with EnvironmentSource(server, environment(events, step_gate=gate), verify, max_prompt_tokens=16,
                           max_new_tokens=4, max_turns=4) as source:
        future = submit(source)
        entered.wait(timeout=10)  # the tool is running turn 0's step
        source.cancel(future)
        go.set()
        session = future.result(timeout=10)
    assert session.status is Status.CANCELLED and "before turn 1" in session.detail
    assert len(server.requests) == 1 and events[-1] == "exit"

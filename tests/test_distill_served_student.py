"""A distilled student that draws its samples on a rollout server instead of in its trainer: the
native server in process, and `dew serve` over real HTTP on 127.0.0.1 standing in for vLLM, each
pushed the student's weights before every sampled step.

What makes the samples the student's own: every draw reports the update it was pushed, and its
behavior log-probs are the student's own log-probs of the drawn ids at that update.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_distill import STUDENT, P, R, objective, stream

from dew_lib.inference import NativeRolloutServer, Server, ServeTask
from dew_lib.models.pretrained import Pretrained, load_pretrained
from dew_lib.objectives.lm import score_targets
from dew_lib.recipes import RemoteEngine, remote_server
from dew_lib.recipes.recorded import RecordedRollout
from dew_lib.records.draw import Draw
from dew_lib.rollouts.distill import DistillRollout
from dew_lib.sampling import Sampling
from dew_lib.serve import ServedPolicy, create_app, running
from dew_lib.train.trainer import Trainer

SAMPLING = Sampling(temperature=1.0)


def drawn_by_update(rollout):
    """`rollout` recorded: (update, params, sessions) of every call, params as a host copy."""
    calls = []

    def record(state, batch, seconds):
        params = jax.tree.map(np.array, jax.device_get(state.params))
        calls.append((int(state.updates), params, list(rollout.last_sessions)))

    return RecordedRollout(rollout, record), calls


def own_log_probs(params, session):
    """The student's log-probs of the session's sampled ids after its prompt, at `params`."""
    call = session.calls[0]
    ids = np.concatenate([call.prompt_ids, call.sampled_ids]).astype(np.int32)
    scored, _ = score_targets(STUDENT, params, jnp.asarray(ids[None, :-1]), jnp.asarray(ids[None, 1:]))
    return np.asarray(scored)[0, len(call.prompt_ids) - 1:]


def test_the_native_server_draws_the_students_own_samples_at_every_update():
    obj = objective(loss="reverse_kl")
    params = jax.jit(obj.init)(jax.random.key(0))
    task = ServeTask(model=STUDENT, variables=params, sampling=SAMPLING)
    server = NativeRolloutServer(Server.from_task(task, slots=4, capacity=P + R, steps=3))
    rollout, calls = drawn_by_update(DistillRollout(obj, max_new_tokens=R, sampling=SAMPLING, server=server))
    trainer = Trainer(obj, optax.adam(3e-2), key=jax.random.key(0), rollout=rollout)
    try:
        trainer.fit(stream(rows=4), steps=3, log_every=3, sinks=[])
    finally:
        rollout.close()
    assert [update for update, _, _ in calls] == [0, 1, 2]
    assert server.version == 2  # pushed before each sampled step's draws
    for update, params, sessions in calls:
        assert len(sessions) == 4 and all(s.calls[0].version == update for s in sessions)
        for session in sessions:  # drawn at temperature 1 from exactly the update's weights
            np.testing.assert_allclose(session.calls[0].behavior_log_probs, own_log_probs(params, session),
                                       rtol=1e-4, atol=1e-4)
    # The updates moved the weights, so the later draws came from other weights than the first.
    assert not np.allclose(calls[0][1]["params"]["lm_head"]["kernel"], calls[-1][1]["params"]["lm_head"]["kernel"])


class Stale:
    """A rollout server whose engine never reloads: every draw says version 0."""

    def __init__(self):
        self.loads = []

    def submit(self, prompt_ids, max_new_tokens, *, seed=None):
        from concurrent.futures import Future

        future = Future()
        future.set_result(Draw(ids=np.array([3, 4]), behavior_log_probs=np.array([-1.0, -1.0]), raw_log_probs=None,
                               eos=False, version=0))
        return future

    def load(self, variables, version):
        self.loads.append(version)


def test_samples_drawn_from_older_weights_than_were_pushed_are_refused():
    obj = objective(loss="reverse_kl")
    stale = Stale()
    trainer = Trainer(obj, optax.adam(3e-2), key=jax.random.key(0),
                      rollout=DistillRollout(obj, max_new_tokens=R, server=stale))
    with pytest.raises(RuntimeError, match="drew task .* with weights version 0, but it was pushed the student's "
                                           "update 1 first: its samples are not the student's own"):
        trainer.fit(stream(rows=4), steps=2, log_every=1, sinks=[])
    assert stale.loads == [0, 1]


@pytest.mark.slow
def test_the_student_draws_on_dew_serve_pushed_every_update(tmp_path):
    """The student served by `dew serve` from a launch directory holding other weights: the first
    push replaces them, each step's draws carry the update pushed before them, and the engine
    ends up serving the last push (in bf16, as SafetensorsReload writes it)."""
    pretrained = Pretrained.from_model(STUDENT)
    launch = tmp_path / "launch"
    pretrained.save(jax.jit(STUDENT.init)(jax.random.key(9), jnp.zeros((1, 8), jnp.int32)), launch,
                    dtype=jnp.bfloat16)
    obj = objective(loss="reverse_kl")
    policy = ServedPolicy.load(launch, slots=4, capacity=16, sampling=SAMPLING, steps=4, served_model_name="student")
    try:
        with running(create_app(policy, dev_endpoints=True)) as url:
            server = remote_server(RemoteEngine(url=url, directory=str(launch)), pretrained)(SAMPLING)
            rollout, calls = drawn_by_update(DistillRollout(obj, max_new_tokens=R, sampling=SAMPLING, server=server))
            trainer = Trainer(obj, optax.adam(3e-2), key=jax.random.key(0), rollout=rollout)
            try:
                state = trainer.fit(stream(rows=4), steps=3, log_every=3, sinks=[])
            finally:
                rollout.close()
            assert policy.weight_version == "2"
    finally:
        policy.close()
    assert [update for update, _, _ in calls] == [0, 1, 2]
    for update, _, sessions in calls:
        assert len(sessions) == 4 and all(s.calls[0].version == update for s in sessions)
        assert all(s.calls[0].raw_log_probs is None for s in sessions)  # an engine reports behavior only
    _, served = load_pretrained(launch)
    last = calls[-1][1]
    bf16 = jax.tree.map(lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float32), last)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a, np.float32), b), served, bf16))
    assert not jax.tree.all(jax.tree.map(np.array_equal, jax.device_get(state.params), last))  # it trained on

"""On-policy distillation: TRL's generalized JSD, prime-rl's OPD gradient, the lmbda mix, and a
tiny student that moves towards a different tiny teacher.

The fixture (tests/fixtures/parity/distill_trl.json) is written by `python3
tools/parity_distill.py` from TRL 1.12's `GKDTrainer.generalized_jsd_loss`, in float64; the
parity tests run Dew's loss in float64 too and hold it to 1e-12 relative.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model

from dew_lib.data.dataset import Dataset
from dew_lib.objectives import DistillObjective, loss
from dew_lib.objectives.distill import generalized_jsd, generalized_jsd_loss, opd_surrogate
from dew_lib.recipes.recorded import RecordedRollout, sampled_sessions
from dew_lib.rollouts import distill as distill_rollouts
from dew_lib.rollouts.distill import DistillRollout
from dew_lib.store import Store
from dew_lib.train.trainer import Trainer

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "parity", "distill_trl.json")
with open(FIXTURE) as handle:
    TRL = json.load(handle)
CASES = {case["name"]: case for case in TRL["cases"]}
P, R, VOCAB = 4, 6, 16
STUDENT = tiny_model(vocab_size=VOCAB, num_layers=1, max_seq_len=16)
TEACHER = tiny_model(vocab_size=VOCAB, emb_features=32, num_layers=2, max_seq_len=16)


def array(spec):
    return np.asarray(spec["data"], spec["dtype"]).reshape(spec["shape"])


def sharp_teacher(scale=20.0):
    """A teacher whose next-token distributions are far from a fresh student's near-uniform ones."""
    variables = jax.jit(TEACHER.init)(jax.random.key(7), jnp.zeros((1, 8), jnp.int32))
    head = variables["params"]["lm_head"]
    return {"params": {**variables["params"], "lm_head": jax.tree.map(lambda w: w * scale, head)}}


TEACHER_VARIABLES = sharp_teacher()


def objective(**options):
    options = {"teacher_model": TEACHER, "teacher": TEACHER_VARIABLES, **options}
    return DistillObjective(STUDENT, P + R - 1, **options)


OBJECTIVE = objective(beta=0.5, temperature=2.0)  # shared, so the tests share its compilations
PARAMS = jax.jit(OBJECTIVE.init)(jax.random.key(0))


def prompts(seed, rows=4, completions=True):
    rng = np.random.default_rng(seed)
    batch = {"prompt": rng.integers(1, VOCAB, (rows, P)).astype(np.int32),
             "prompt_length": rng.integers(2, P + 1, rows).astype(np.int32)}
    if completions:
        batch["completion"] = rng.integers(1, VOCAB, (rows, R)).astype(np.int32)
        batch["completion_length"] = rng.integers(1, R + 1, rows).astype(np.int32)
    return batch


class State:
    """What a rollout reads of a TrainState."""

    def __init__(self, params, ema, updates=0):
        self.params, self.ema, self.updates = params, ema, jnp.int32(updates)


# ----- parity with TRL --------------------------------------------------------------------------

def test_the_fixture_records_trl_1_12_and_its_source():
    reference = TRL["reference"]
    assert reference["package"] == "trl" and reference["version"] == "1.12.0"
    assert "trl/experimental/gkd/gkd_trainer.py" in reference["source_sha256"]
    assert {(c["options"]["beta"], c["options"]["temperature"], c["options"]["labels"]) for c in TRL["cases"]} == {
        (b, t, m) for b in (0.0, 0.5, 1.0) for t in (1.0, 2.0) for m in (True, False)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_generalized_jsd_matches_trl_in_float64(name):
    case, inputs = CASES[name], TRL["inputs"]
    options = case["options"]
    labels = array(inputs["labels"])
    mask = jnp.asarray(labels != -100) if options["labels"] else None
    with jax.enable_x64(True):
        student, teacher = (jnp.asarray(array(inputs[k])) for k in ("student_logits", "teacher_logits"))
        value, grad = jax.value_and_grad(lambda s: generalized_jsd_loss(
            s, teacher, mask, beta=options["beta"], temperature=options["temperature"]))(student)
        assert value.dtype == jnp.float64
        np.testing.assert_allclose(value, array(case["outputs"]["loss"]), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(grad, array(case["outputs"]["grad_student_logits"]), rtol=1e-10, atol=1e-15)
    # In float32, as the objective runs: measured within 3e-7 relative of TRL's float64 loss.
    value = generalized_jsd_loss(jnp.asarray(array(inputs["student_logits"]), jnp.float32),
                                 jnp.asarray(array(inputs["teacher_logits"]), jnp.float32), mask,
                                 beta=options["beta"], temperature=options["temperature"])
    np.testing.assert_allclose(value, array(case["outputs"]["loss"]), rtol=2e-6)


def test_beta_ends_are_the_two_kls_and_equal_distributions_give_zero():
    rng = np.random.default_rng(0)
    s, t = (jnp.asarray(rng.normal(size=(2, 3, 7)), jnp.float32) for _ in range(2))
    ls, lt = jax.nn.log_softmax(s), jax.nn.log_softmax(t)
    np.testing.assert_allclose(generalized_jsd(s, t, 0.0), (jnp.exp(lt) * (lt - ls)).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(generalized_jsd(s, t, 1.0), (jnp.exp(ls) * (ls - lt)).sum(-1), rtol=1e-5)
    for beta in (0.0, 0.3, 1.0):
        np.testing.assert_allclose(generalized_jsd(s, s, beta), 0.0, atol=1e-6)


def test_opd_gradient_is_the_sampled_reverse_kl_times_the_score():
    rng = np.random.default_rng(1)
    student = jnp.asarray(-rng.uniform(0.1, 3.0, (2, 5)), jnp.float32)
    teacher = jnp.asarray(-rng.uniform(0.1, 3.0, (2, 5)), jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, (2, 5)), jnp.float32)

    def total(s):
        per_token, _ = opd_surrogate(s, teacher, mask)
        return (per_token * mask).sum()

    value, grad = jax.value_and_grad(total)(student)
    np.testing.assert_allclose(value, ((student - teacher) * mask).sum(), rtol=1e-6)
    np.testing.assert_allclose(grad, (student - teacher) * mask, rtol=1e-6, atol=1e-7)


# ----- the objective on packed rows -------------------------------------------------------------

def test_the_jsd_objective_is_trls_loss_on_the_models_logits():
    obj, params = OBJECTIVE, PARAMS
    batch = DistillRollout(obj, max_new_tokens=R, lmbda=0.0)(State(params, obj.teacher), prompts(0),
                                                             jax.random.key(0))
    mean, metrics = jax.jit(lambda p, b: loss(obj, p, b, reference=obj.teacher))(params, batch)
    ids = jnp.asarray(batch["input_ids"])
    segments, positions = jnp.asarray(batch["text_segment_ids"]), jnp.asarray(batch["text_positions"])
    logits = [jax.jit(m.apply)(v, ids[:, :-1], segments[:, :-1], positions[:, :-1])
              for m, v in ((STUDENT, params), (TEACHER, obj.teacher))]
    expected = generalized_jsd_loss(*logits, jnp.asarray(batch["response_mask"][:, 1:]), beta=0.5, temperature=2.0)
    np.testing.assert_allclose(mean, expected, rtol=2e-5)
    sampled_kl = jax.jit(obj.sampled_kl)(params, obj.teacher, batch)
    np.testing.assert_allclose(metrics["kl"], sampled_kl.sum() / batch["response_mask"][:, 1:].sum(), rtol=1e-4)
    assert metrics["tokens"] == batch["response_mask"][:, 1:].sum() and metrics["on_policy"] == 0


def test_vocabulary_mismatch_is_refused_naming_both_sizes():
    other = tiny_model(vocab_size=VOCAB + 8, max_seq_len=16)
    with pytest.raises(ValueError, match=r"student's vocab_size is 16 and the teacher's is 24.*tokenizer"):
        DistillObjective(STUDENT, P + R - 1, teacher_model=other,
                         teacher={"params": {}})


def test_a_batch_that_is_not_packed_rows_is_refused_naming_the_fields():
    with pytest.raises(KeyError, match=r"packed-rows fields.*DistillRollout"):
        OBJECTIVE.check_batch(prompts(0))
    batch = DistillRollout(OBJECTIVE, max_new_tokens=R, lmbda=0.0)(State(PARAMS, OBJECTIVE.teacher), prompts(0),
                                                                   jax.random.key(0))
    OBJECTIVE.check_batch(batch)
    with pytest.raises(ValueError, match="'on_policy' has shape"):
        OBJECTIVE.check_batch({**batch, "on_policy": batch["on_policy"][:2]})


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="loss must be one of"):
        objective(loss="forward_kl")
    with pytest.raises(ValueError, match="beta must lie in"):
        objective(beta=1.5)
    with pytest.raises(ValueError, match="lmbda=0.5.*reverse_kl"):
        DistillRollout(objective(loss="reverse_kl"), max_new_tokens=R, lmbda=0.5)
    with pytest.raises(KeyError, match="'completion'"):
        packed_rollout = DistillRollout(objective(), max_new_tokens=R, lmbda=0.0)
        packed_rollout(State(None, None), prompts(0, completions=False), jax.random.key(0))


# ----- the data path ----------------------------------------------------------------------------

def test_lmbda_zero_never_samples_and_one_always_does(monkeypatch):
    obj, params = OBJECTIVE, PARAMS
    state = State(params, obj.teacher)
    drawn = []
    real = distill_rollouts.generate
    monkeypatch.setattr(distill_rollouts, "generate", lambda *a, **k: drawn.append(1) or real(*a, **k))
    never = DistillRollout(obj, max_new_tokens=R, lmbda=0.0)
    always = DistillRollout(obj, max_new_tokens=R, lmbda=1.0)
    for step in range(3):
        key = jax.random.fold_in(jax.random.key(5), step)
        assert not never(state, prompts(step), key)["on_policy"].any() and len(drawn) == step
        assert never.last_sessions == [] and not never.last_on_policy
        assert always(state, prompts(step), key)["on_policy"].all() and len(drawn) == step + 1
        assert len(always.last_sessions) == 4
    half = DistillRollout(obj, max_new_tokens=R, lmbda=0.5)
    keys = [jax.random.fold_in(jax.random.key(5), step) for step in range(16)]
    coins = [half.on_policy(k) for k in keys]
    assert 0 < sum(coins) < 16 and coins == [half.on_policy(k) for k in keys]  # a seeded coin per step


def test_a_step_is_drawn_again_exactly_and_recorded_with_its_kl_reward(tmp_path):
    obj, params = OBJECTIVE, PARAMS
    state = State(params, obj.teacher, updates=3)
    rollout = DistillRollout(obj, max_new_tokens=R, lmbda=1.0)
    key = jax.random.key(11)
    first = rollout(state, prompts(0), key)
    again = rollout(state, prompts(0), key)
    assert all(np.array_equal(first[k], again[k]) for k in first)  # what resume relies on

    store = Store(tmp_path)
    with store.writer("run") as run, run.stage("distill", kind="distill") as writer:
        RecordedRollout(rollout, sampled_sessions(rollout, writer))(state, prompts(0), key)
    sessions = sorted((row[1] for row in store.read_sessions("run", "distill")), key=lambda s: s.group)
    assert [row[0] for row in store.read_sessions("run", "distill")] == [3] * 4
    assert store.rows("SELECT count(*) FROM prompts")[1] == [(4,)]
    kl = np.asarray(jax.jit(obj.sampled_kl)(params, obj.teacher, first))
    mask = first["response_mask"][:, 1:] > 0
    expected = [-kl[first["session_index"][:, 1:] == n].mean() for n in range(4)]
    np.testing.assert_allclose([s.reward for s in sessions], expected, rtol=1e-5, atol=1e-6)
    assert all(s.calls[0].version == 3 for s in sessions) and mask.sum() == sum(
        s.calls[0].sampled_ids.size for s in sessions)


# ----- a tiny distillation run ------------------------------------------------------------------

def held_out_kl(obj, params, seed=99):
    """Mean exact reverse KL(student || teacher) per position over the student's own samples of
    held-out prompts (one fixed draw per call)."""
    rollout = DistillRollout(obj, max_new_tokens=R, lmbda=1.0)
    batch = rollout(State(params, obj.teacher), prompts(seed, rows=8, completions=False), jax.random.key(seed))
    total, count = jax.jit(obj.evaluate)(params, batch)["reverse_kl"]
    return float(total / count)


def stream(rows=8):
    def train(partition):
        rng = np.random.default_rng(3)  # reopened on resume: the same batches again
        while True:
            yield prompts(int(rng.integers(1 << 30)), rows=rows)

    return Dataset(train=train, batch=rows)


@pytest.mark.slow  # about 20 s each on two idle cores: three compilations (sampler, update, scoring)
@pytest.mark.parametrize("options, lmbda", [({"loss": "jsd", "beta": 0.5}, 0.5),
                                            ({"loss": "reverse_kl"}, 1.0)])
def test_the_students_kl_to_the_teacher_falls(options, lmbda):
    obj = objective(**options)
    trainer = Trainer(obj, optax.adam(3e-2), key=jax.random.key(0),
                      rollout=DistillRollout(obj, max_new_tokens=R, lmbda=lmbda))
    before = held_out_kl(obj, jax.jit(obj.init)(trainer.init_key))  # where fit starts
    state = trainer.fit(stream(), steps=40, log_every=40, sinks=[])
    after = held_out_kl(obj, state.params)
    assert after < 0.6 * before, (before, after)
    assert trainer.compilations["train_step"] == 1  # sampled and dataset steps share one shape
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state.ema, obj.teacher))


@pytest.mark.slow  # three trainers compile their own updates
def test_a_resumed_run_flips_the_same_coins_and_ends_bit_for_bit_equal(tmp_path):
    def trainer():
        return Trainer(OBJECTIVE, optax.adam(3e-2), key=jax.random.key(0),
                       rollout=DistillRollout(OBJECTIVE, max_new_tokens=R, lmbda=0.5))

    first = trainer()
    coins = [first.rollout.on_policy(jax.random.fold_in(first.rollout_key, step)) for step in range(4)]
    assert False in coins[2:] and True in coins[2:]  # the resumed steps hold both kinds
    whole = first.fit(stream(rows=4), steps=4, log_every=4, sinks=[])
    directory = str(tmp_path / "checkpoints")
    trainer().fit(stream(rows=4), steps=2, log_every=2, directory=directory, sinks=[])
    resumed = trainer().fit(stream(rows=4), steps=4, log_every=4, directory=directory, sinks=[])
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), whole.params, resumed.params))

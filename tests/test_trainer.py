"""Trainer invariants on tiny float32 models: accumulation, EMA, resume, compilation, errors."""

import functools
import io
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model

from dew_lib import Dataset, LMObjective, Trainer, TrainingDiverged
from dew_lib.models.decoder import unstack_layers
from dew_lib.objectives import LossTerms, Objective
from dew_lib.train.checkpoint import CheckpointMismatch, Checkpoints
from dew_lib.train.sinks import LineLog, MemorySink, ProgressBar

MODEL = tiny_model()


def padded_batches(seed, rows, width=9, count=12):
    """Batches whose rows carry different amounts of padding, so normalizers differ."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        text = rng.integers(1, 32, size=(rows, width)).astype(np.int32)
        real = rng.integers(2, width + 1, size=rows)
        segments = (np.arange(width)[None] < real[:, None]).astype(np.int32)
        out.append({"text": text * segments, "text_segment_ids": segments})
    return out


def dataset(batches, batch_size):
    return Dataset(train=lambda partition: iter(batches), batch=batch_size)


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


OPTIMIZERS = {"sgd": optax.sgd, "adam": optax.adam}


TRAINERS = {}  # (optimizer, accumulate, ema_decay) -> the module's Trainer for that setting


def new_trainer(optimizer=("sgd", 0.5), accumulate=1, ema_decay=None):
    """A Trainer of LMObjective on MODEL, the optimizer given as (name, learning rate)."""
    name, rate = optimizer
    return Trainer(LMObjective(MODEL, seq_len=8, ema_decay=ema_decay), OPTIMIZERS[name](rate),
                   key=jax.random.key(0), accumulate=accumulate)


def shared_trainer(optimizer=("sgd", 0.5), accumulate=1, ema_decay=None):
    """One Trainer per setting for the whole module: a fit starts from the trainer's initial state
    and keeps nothing of earlier fits, so every fit of one setting runs the programs its first fit
    compiled instead of compiling them again."""
    settings = (optimizer, accumulate, ema_decay)
    if settings not in TRAINERS:
        TRAINERS[settings] = new_trainer(*settings)
    return TRAINERS[settings]


def fit(batches, batch_size, steps, optimizer=("sgd", 0.5), accumulate=1, ema_decay=None, fresh=False, **kwargs):
    """`steps` steps of the module's Trainer for these settings (a new one when `fresh`)."""
    trainer = (new_trainer if fresh else shared_trainer)(optimizer, accumulate, ema_decay)
    kwargs.setdefault("sinks", [])
    return trainer, trainer.fit(dataset(batches, batch_size), steps=steps, log_every=2, **kwargs)


@functools.cache
def start_params():
    """The parameters every Trainer here starts from: one model, one key, whatever the setting."""
    trainer = shared_trainer()
    return jax.jit(trainer.objective.init)(trainer.init_key)


def test_one_compilation_per_batch_shape():
    """Fresh trainers, counted from nothing; the other tests then reuse them (first in the module
    so that they are the first of their settings)."""
    trainer, _ = fit(padded_batches(0, rows=4), 4, steps=10, fresh=True)
    assert trainer.compilations["train_step"] == 1
    TRAINERS.setdefault((("sgd", 0.5), 1, None), trainer)
    trainer, _ = fit(padded_batches(0, rows=4), 4, steps=10, accumulate=2, fresh=True)
    assert trainer.compilations["train_step"] == 2  # accumulate-only and update steps
    TRAINERS.setdefault((("sgd", 0.5), 2, None), trainer)


def test_the_initial_state_is_fit_s_start_from_the_one_compiled_init():
    trainer = new_trainer()
    state = trainer.initial_state()
    assert int(state.step) == 0 and trainer.compilations["init"] == 1
    for got, want in zip(leaves(state.params), leaves(start_params()), strict=True):
        np.testing.assert_array_equal(got, want)
    trainer.initial_state()
    trainer.fit(dataset(padded_batches(0, rows=4), 4), steps=1, sinks=[])
    assert trainer.compilations["init"] == 1  # neither a second initial_state nor fit compiles it again


@pytest.mark.parametrize("optimizer", [("sgd", 0.5), ("adam", 1e-2)], ids=["sgd", "adam"])
def test_accumulating_microbatches_equals_one_large_batch(optimizer):
    micro = padded_batches(0, rows=4, count=6)
    joined = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(micro[::2], micro[1::2])]
    # Adam in the resume tests' setting (its EMA changes no parameter): the programs compiled once
    ema_decay = 0.99 if optimizer[0] == "adam" else None
    _, accumulated = fit(micro, 4, steps=6, optimizer=optimizer, accumulate=2, ema_decay=ema_decay)
    _, whole = fit(joined, 8, steps=3, optimizer=optimizer, ema_decay=ema_decay)
    assert int(accumulated.step) == 6 and int(accumulated.updates) == 3
    assert int(whole.step) == 3 and int(whole.updates) == 3
    for a, b in zip(leaves(accumulated.params), leaves(whole.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_ema_follows_its_decay_and_none_turns_it_off():
    batches = padded_batches(1, rows=4)
    _, state = fit(batches, 4, steps=1, ema_decay=0.9)
    start = start_params()  # compiled: eagerly, its many small operations would compile one by one
    expected = jax.tree.map(lambda p0, p1: 0.9 * p0 + 0.1 * p1, start, state.params)
    for a, b in zip(leaves(state.ema), leaves(expected)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    _, state = fit(batches, 4, steps=1, ema_decay=None)
    assert state.ema is None
    _, state = fit(batches, 4, steps=3, ema_decay=1.0)  # a frozen reference
    for a, b in zip(leaves(state.ema), leaves(start)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_validation_runs_every_eval_every_steps():
    batches = padded_batches(2, rows=4)
    data = Dataset(train=lambda p: itertools.cycle(batches), val=lambda p: batches[:2], batch=4)
    sink = MemorySink()
    shared_trainer(("adam", 1e-2), 1, 0.99).fit(  # the resume tests' setting: compiled once
        data, steps=6, log_every=3, eval_every=3, sinks=[sink])
    evaluated = sink.series("val/perplexity")
    assert [step for step, _ in evaluated] == [3, 6]
    loss = dict(sink.series("val/loss"))[3]
    np.testing.assert_allclose(np.exp(loss), dict(evaluated)[3], rtol=1e-6)


@pytest.mark.parametrize("accumulate, stop", [(1, 3), (2, 3), (2, 4)])
def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path, accumulate, stop):
    batches = padded_batches(3, rows=4)
    _, whole = fit(batches, 4, steps=6, optimizer=("adam", 1e-2), accumulate=accumulate,
                   ema_decay=0.99)
    _, first = fit(batches, 4, steps=stop, optimizer=("adam", 1e-2), accumulate=accumulate,
                   ema_decay=0.99, directory=str(tmp_path))
    assert int(first.step) == stop
    _, resumed = fit(batches, 4, steps=6, optimizer=("adam", 1e-2), accumulate=accumulate,
                     ema_decay=0.99, directory=str(tmp_path))
    assert int(resumed.step) == 6 and int(resumed.updates) == 6 // accumulate
    for a, b in zip(leaves(resumed), leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_with_one_subtree_per_layer_resumes_stacked(tmp_path):
    """Checkpoints written before the layers were stacked (`layers_0`, `layers_1`, ... in the
    params, EMA and Adam moments) restore into the stacked layout and train on identically."""
    batches = padded_batches(3, rows=4)
    run = dict(optimizer=("adam", 1e-2), ema_decay=0.99)
    _, whole = fit(batches, 4, steps=6, **run)
    fit(batches, 4, steps=3, directory=str(tmp_path / "stacked"), **run)
    stacked = Checkpoints(tmp_path / "stacked")
    state, info = stacked.restore(3, shared_trainer(("adam", 1e-2), 1, 0.99).abstract_state())
    old = unstack_layers(state)
    assert "layers_1" in old.params["params"] and "layers_1" in old.opt_state[0].mu["params"]
    per_layer = Checkpoints(tmp_path / "per_layer")
    per_layer.save(3, old, info)
    _, resumed = fit(batches, 4, steps=6, directory=str(tmp_path / "per_layer"), **run)
    for a, b in zip(leaves(resumed), leaves(whole), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_from_another_optimizer_is_refused(tmp_path):
    batches = padded_batches(4, rows=4)
    fit(batches, 4, steps=2, directory=str(tmp_path))  # sgd(0.5), the programs the other tests compiled
    with pytest.raises(CheckpointMismatch, match="optimizer"):
        fit(batches, 4, steps=4, optimizer=("adam", 1e-2), directory=str(tmp_path))
    with pytest.raises(CheckpointMismatch, match="accumulate"):
        fit(batches, 4, steps=4, accumulate=2, directory=str(tmp_path))


class Poisoned(Objective):
    """A quadratic objective whose loss turns NaN on batches that carry `poison`."""

    def init(self, key, variables=None):
        return {"params": {"w": jnp.ones((3,))}}

    def check_batch(self, batch):
        pass

    def terms(self, params, batch, *, step, reference, key):
        total = jnp.sum((params["params"]["w"] - batch["x"]) ** 2) / batch["poison"][0]
        return LossTerms(total, jnp.ones(()), {"loss": (total, jnp.ones(()))})

    def evaluate(self, params, batch):
        return {}


def test_a_nan_loss_stops_with_its_step_and_keeps_the_last_good_checkpoint(tmp_path):
    def batches(partition):
        for step in itertools.count(1):
            yield {"x": np.full((2, 3), 2.0, np.float32),
                   "poison": np.full((2,), 0.0 if step == 5 else 1.0, np.float32)}

    trainer = Trainer(Poisoned(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(TrainingDiverged, match="step 5") as caught:
        trainer.fit(Dataset(train=batches, batch=2), steps=10, log_every=1, checkpoint_every=2,
                    directory=str(tmp_path), sinks=[])
    assert caught.value.step == 5
    assert "loss" in caught.value.last_metrics
    assert caught.value.checkpoint.endswith("/4")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["2", "4"]


def test_the_rollout_output_is_what_the_update_trains_on():
    real = padded_batches(5, rows=4)
    calls = []

    def rollout(state, batch, key):
        calls.append((int(state.step), batch["index"]))
        return real[batch["index"]]

    raw = Dataset(train=lambda p: ({"index": i} for i in itertools.count()), batch=4)
    # no EMA, as in `fit` below: the same update compiled alike, so the parameters agree to the bit
    trainer = Trainer(LMObjective(MODEL, seq_len=8, ema_decay=None), optax.sgd(0.5), key=jax.random.key(0),
                      rollout=rollout)
    state = trainer.fit(raw, steps=4, log_every=2, sinks=[])
    assert calls == [(0, 0), (1, 1), (2, 2), (3, 3)]
    _, plain = fit(real, 4, steps=4)
    for a, b in zip(leaves(state.params), leaves(plain.params)):
        np.testing.assert_array_equal(a, b)


def test_a_stream_that_ends_early_says_so():
    with pytest.raises(ValueError, match="ended after 3 batches, before steps=5"):
        fit(padded_batches(0, rows=4, count=3), 4, steps=5)


def test_progress_bar_and_line_log_show_progress():
    stream = io.StringIO()
    fit(padded_batches(0, rows=4), 4, steps=4, sinks=[ProgressBar(stream), LineLog(stream)])
    text = stream.getvalue()
    assert "4/4" in text and "loss=" in text and "step/s" in text


class Hooks(MemorySink):
    """Records every hook fit calls, in order, with the step each names."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def begin(self, first_step, total_steps):
        self.calls.append(("begin", first_step, total_steps))

    def before_step(self, step, state):
        self.calls.append(("before_step", step, int(state.step)))

    def checkpoint(self, step, path):
        self.calls.append(("checkpoint", step, path.rsplit("/", 1)[-1]))


def test_sinks_hear_every_hook_from_where_a_resumed_fit_starts(tmp_path):
    fit(padded_batches(6, rows=4), 4, steps=2, directory=str(tmp_path))
    hooks = Hooks()
    fit(padded_batches(6, rows=4), 4, steps=4, directory=str(tmp_path), checkpoint_every=2, sinks=[hooks])
    assert hooks.calls == [("begin", 2, 4), ("before_step", 2, 2), ("before_step", 3, 3), ("checkpoint", 4, "4")]
    assert [step for step, _ in hooks.history] == [4] and hooks.notes[0][1].startswith("resuming from")


def test_what_is_not_an_objective_or_a_sink_is_refused_before_training():
    class Duck:
        def write(self, step, metrics):
            pass

    with pytest.raises(TypeError, match="subclass Objective"):
        Trainer(object(), optax.sgd(0.1), key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"Duck is not a sink: it lacks \['begin', 'before_step', 'checkpoint', "
                                        r"'note', 'close'\]; subclass dew_lib.train.sinks.Sink"):
        fit(padded_batches(6, rows=4), 4, steps=1, sinks=[Duck()])


def test_a_metric_nothing_counted_has_no_mean():
    from dew_lib.objectives import average

    windows = [{"loss": (np.float32(3.0), np.float32(2.0)), "clipfrac": (np.float32(0.0), np.float32(0.0))},
               {"loss": (np.float32(1.0), np.float32(2.0)), "clipfrac": (np.float32(0.0), np.float32(0.0))}]
    assert average(windows) == {"loss": 1.0}

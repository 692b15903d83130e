"""The native rollout server: draws equal `generate`, slots are independent, weights swap between
calls, and every way a request can end (finish, cancel, close, a failing loop) resolves its future."""

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on_host_devices, tiny_model

from dew_lib.inference import Draw, NativeRolloutServer, RolloutServer, Server, ServerClosed, ServeTask
from dew_lib.objectives.lm import token_log_probs
from dew_lib.sampling import Sampling, generate

MODEL = tiny_model(max_seq_len=48)
GREEDY = Sampling(temperature=0.0)
FILTERED = Sampling(temperature=0.7, top_k=5, top_p=0.9, eos_id=(3, 7))
PROMPTS = [np.array(p, np.int32) for p in ([5, 6, 7, 8, 9, 10], [11], [12, 13, 14], list(range(1, 21)))]


@functools.cache
def variables():
    """MODEL's weights, made once, on first use, not at import: every xdist worker imports every
    module, and made eagerly at import they compiled op by op with all of XLA's optimizations."""
    return jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


@functools.cache
def blank():
    """variables() with a zero output head (made once, compiled whole)."""
    return jax.jit(lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "lm_head" in jax.tree_util.keystr(path) else x, tree))(variables())


@jax.jit
def scaled(tree, by):
    """Every leaf times `by`: one program for the tree, not one per leaf shape."""
    return jax.tree.map(lambda x: x * by, tree)


def server(sampling=GREEDY, *, slots=3, capacity=40, steps=4, dtype=None):
    task = ServeTask(model=MODEL, variables=variables(), sampling=sampling, dtype=dtype)
    return Server.from_task(task, slots=slots, capacity=capacity, steps=steps)


def run(engine):
    """Step until every request in `engine` is done; the draws by request name."""
    draws = {}
    while engine.busy:
        draws.update(engine.step())
    return draws


def reference(prompt, budget, seed, sampling, weights=None):
    """Row 0 of `generate` over a one-row batch, left-padded to 20 ids where the budget allows
    (one compile per budget)."""
    width = max(len(prompt), min(20, MODEL.max_seq_len - budget))
    padded = np.zeros((1, width), np.int32)
    padded[0, width - len(prompt):] = prompt
    out = generate(MODEL, variables() if weights is None else weights, padded, [len(prompt)], key=jax.random.key(seed),
                   max_new_tokens=budget, sampling=sampling)
    n = int(out.lengths[0])
    return (np.asarray(out.tokens[0, :n]), np.asarray(out.log_probs[0, :n]),
            np.asarray(out.behavior_log_probs[0, :n]), bool(out.stopped[0]))


@pytest.mark.parametrize("sampling", [GREEDY, FILTERED], ids=["greedy", "filtered"])
def test_draws_equal_generate_while_sharing_the_batch(sampling):
    engine = server(sampling)
    for name, prompt in enumerate(PROMPTS[:3]):
        engine.add(name, prompt, 12, seed=110 + name)
    draws = run(engine)
    for name, prompt in enumerate(PROMPTS[:3]):
        ids, raw, behavior, eos = reference(prompt, 12, 110 + name, sampling)
        np.testing.assert_array_equal(draws[name].ids, ids)
        np.testing.assert_allclose(draws[name].raw_log_probs, raw, atol=1e-5)
        np.testing.assert_allclose(draws[name].behavior_log_probs, behavior, atol=1e-5)
        assert draws[name].eos == eos and draws[name].version == 0
    if sampling is FILTERED:
        assert any(d.eos for d in draws.values()), "seeds chosen so that a draw stops on EOS"
        assert all(d.ids[-1] in (3, 7) for d in draws.values() if d.eos)
    else:
        assert all(np.all(d.behavior_log_probs == 0) for d in draws.values())


def test_raw_log_probs_equal_a_full_forward_rescoring():
    engine = server(FILTERED)
    for name, prompt in enumerate(PROMPTS[:3]):
        engine.add(name, prompt, 16, seed=name)
    draws = run(engine)
    rows = np.zeros((3, 40), np.int32)  # prompt + draw, right-padded: one forward for all three
    for name, prompt in enumerate(PROMPTS[:3]):
        ids = np.concatenate([prompt, draws[name].ids])
        rows[name, :len(ids)] = ids
    segments = (np.arange(39)[None] < [[len(p) + len(draws[n]) - 1] for n, p in enumerate(PROMPTS[:3])])
    logits = jax.jit(MODEL.apply)(variables(), rows[:, :-1], segments.astype(np.int32))
    scores = np.asarray(token_log_probs(logits, rows[:, 1:]))
    for name, prompt in enumerate(PROMPTS[:3]):
        expected = scores[name, len(prompt) - 1:len(prompt) - 1 + len(draws[name])]
        np.testing.assert_allclose(draws[name].raw_log_probs, expected, atol=2e-5)


def test_a_draw_does_not_depend_on_its_slot_its_neighbours_or_steps_per_call():
    alone = server(FILTERED, slots=1, steps=1)
    alone.add("x", PROMPTS[0], 20, seed=9)
    expected = run(alone)["x"]
    crowded = server(FILTERED, slots=3, steps=4)
    for name, prompt in enumerate(PROMPTS[2:]):
        crowded.add(name, prompt, 20, seed=name)
    crowded.add("x", PROMPTS[0], 20, seed=9)  # the last free slot, joining busy neighbours
    assert crowded._by_key["x"].slot == 2
    got = run(crowded)["x"]
    np.testing.assert_array_equal(got.ids, expected.ids)
    np.testing.assert_allclose(got.raw_log_probs, expected.raw_log_probs, atol=1e-6)
    np.testing.assert_allclose(got.behavior_log_probs, expected.behavior_log_probs, atol=1e-6)


def test_requests_join_and_leave_slots_and_the_server_compiles_once():
    """Nine requests of four prompt lengths and several budgets through three slots: each draw equals
    that request served alone, with one decode compilation and one prefill per shape bucket."""
    alone = server(FILTERED, slots=1, steps=1)
    rng = np.random.default_rng(0)
    requests = [(PROMPTS[i % 4], int(rng.integers(1, 15)), 50 + i) for i in range(9)]
    expected = []
    for prompt, budget, seed in requests:
        alone.add("x", prompt, budget, seed=seed)
        expected.append(run(alone)["x"])
    with NativeRolloutServer(server(FILTERED)) as native:
        futures = [native.submit(p, b, seed=s) for p, b, s in requests]
        draws = [f.result(timeout=120) for f in futures]
        compilations = native.server.compilations
    for draw, want, (_, budget, _) in zip(draws, expected, requests, strict=True):
        np.testing.assert_array_equal(draw.ids, want.ids)
        np.testing.assert_allclose(draw.raw_log_probs, want.raw_log_probs, atol=1e-6)
        assert len(draw) == budget or draw.eos
    assert len({len(d) for d in draws}) > 3, "requests leave the batch at different steps"
    # One decode; a prefill per width bucket (prompts of <= 16 ids and of 20 ids) and count of
    # requests joining together (1 to 3).
    assert compilations["decode"] == 1 and 2 <= compilations["prefill"] <= 2 * 3


def test_requests_added_between_two_steps_share_one_prefill(monkeypatch):
    from dew_lib.inference import slot_steps as serving

    shapes = []
    prefill = serving.prefill
    monkeypatch.setattr(serving, "prefill", lambda *args: shapes.append(args[5].shape) or prefill(*args))
    engine = server(GREEDY, slots=4)
    for name, prompt in enumerate(PROMPTS[:3]):
        engine.add(name, prompt, 6, seed=name)
    draws = run(engine)
    assert shapes == [(4, 16)]  # three joiners padded to four rows, their prompts to 16 ids
    for name, prompt in enumerate(PROMPTS[:3]):
        np.testing.assert_array_equal(draws[name].ids, reference(prompt, 6, name, GREEDY)[0])


def test_a_call_ends_as_soon_as_a_request_finishes_and_its_slot_takes_the_next():
    engine = server(GREEDY, slots=3, steps=4)
    engine.add("short", PROMPTS[0], 2)
    engine.add("long", PROMPTS[1], 12)
    assert [name for name, _ in engine.step()] == ["short"]  # after one decode step, not four
    assert len(engine._by_key["long"].ids) == 2 and engine.free == 2
    engine.add("next", PROMPTS[2], 3)
    draws = run(engine)
    assert sorted(draws) == ["long", "next"] and len(draws["long"]) == 12
    np.testing.assert_array_equal(draws["long"].ids, reference(PROMPTS[1], 12, 0, GREEDY)[0])


def test_cancel_frees_the_slot_for_the_next_request():
    engine = server(GREEDY, slots=1, steps=1)
    engine.add("long", PROMPTS[0], 30)
    assert engine.step() == [] and engine.free == 0
    assert engine.cancel("long") and engine.free == 1
    assert not engine.cancel("long")
    engine.add("next", PROMPTS[1], 5)
    draws = run(engine)
    assert list(draws) == ["next"]
    np.testing.assert_array_equal(draws["next"].ids, reference(PROMPTS[1], 5, 0, GREEDY)[0])


def test_cancelled_futures_free_their_slots_and_never_resolve():
    with NativeRolloutServer(server(GREEDY, slots=1, steps=1)) as native:
        queued_then_cancelled = [native.submit(PROMPTS[0], 30) for _ in range(3)]
        for future in queued_then_cancelled:
            assert future.cancel()
        short = native.submit(PROMPTS[1], 4)
        assert len(short.result(timeout=60)) == 4
        assert all(f.cancelled() for f in queued_then_cancelled)
        assert native.server.free == 1 and not native.server.busy


def test_requests_that_do_not_fit_are_refused_with_the_capacity():
    engine = server(GREEDY, capacity=24)
    with pytest.raises(ValueError, match="too long for the server's capacity=24"):
        engine.check(np.ones(25, np.int32), 1, None)
    with pytest.raises(ValueError, match="too long for the server's capacity=24"):
        engine.check(np.ones(24, np.int32), 1, None)
    with pytest.raises(ValueError, match="lower max_new_tokens to 4"):
        engine.check(np.ones(20, np.int32), 5, None)
    with pytest.raises(ValueError, match=r"\[0, 32\), the model's vocabulary"):
        engine.check([1, 32], 2, None)
    with pytest.raises(ValueError, match="seed"):
        engine.check([1, 2], 2, 2**32)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.check([1, 2], 0, None)
    with pytest.raises(ValueError, match="nonempty"):
        engine.check([], 2, None)
    with pytest.raises(ValueError, match="max_seq_len=48"):
        server(GREEDY, capacity=49)
    with pytest.raises(ValueError, match="slots"):
        server(GREEDY, slots=0)
    with pytest.raises(ValueError, match="ServeTask.sampling"):
        ServeTask(model=MODEL, variables=variables(), sampling={"temperature": 0})
    with pytest.raises(ValueError, match="ServeTask"):
        Server.from_task(object(), slots=1, capacity=8)


def test_a_weight_swap_lands_between_two_calls_and_draws_keep_the_oldest_version():
    """v1 has a zero output head, so greedy picks id 0 with log-prob -log(32) from the swap on."""
    engine = server(GREEDY)
    engine.add("before", PROMPTS[0], 12)
    assert engine.step() == []  # the prefill's id and four decoded ids under v0
    engine.reload(blank(), 1)
    engine.add("after", PROMPTS[1], 6)
    draws = run(engine)
    v0 = reference(PROMPTS[0], 12, 0, GREEDY)[0]
    np.testing.assert_array_equal(draws["before"].ids[:5], v0[:5])
    np.testing.assert_array_equal(draws["before"].ids[5:], 0)
    np.testing.assert_allclose(draws["before"].raw_log_probs[5:], -np.log(32), rtol=1e-6)
    assert draws["before"].version == 0
    np.testing.assert_array_equal(draws["after"].ids, 0)
    assert draws["after"].version == 1


def test_load_during_a_draw_keeps_its_version_and_serves_later_submissions_new_weights(monkeypatch):
    """The loop is held at its third call while `load` hands the weights over, so the push lands
    after 1 + 3 * 4 ids of the running draw, whatever the machine's timing."""
    engine = server(GREEDY, steps=4)
    calls, third, resume = [], threading.Event(), threading.Event()
    step = engine.step

    def held_step():
        calls.append(1)
        if len(calls) == 3:
            third.set()
            assert resume.wait(60)
        return step()

    monkeypatch.setattr(engine, "step", held_step)
    with NativeRolloutServer(engine) as native:
        running = native.submit(PROMPTS[1], 39)
        assert third.wait(60)
        native.load(blank(), 7)  # returns without waiting for the call in flight
        assert native.version == 7
        resume.set()
        later = native.submit(PROMPTS[2], 5).result(timeout=60)
        draw = running.result(timeout=60)
    assert later.version == 7 and np.all(later.ids == 0)
    assert draw.version == 0
    v0 = reference(PROMPTS[1], 39, 0, GREEDY)[0]
    np.testing.assert_array_equal(draw.ids[:13], v0[:13])
    np.testing.assert_array_equal(draw.ids[13:], 0)


def test_load_casts_to_the_served_dtype_and_keeps_its_own_copy():
    engine = server(GREEDY, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(engine.variables)} == {jnp.dtype(jnp.bfloat16)}
    fresh = scaled(variables(), 1.5)  # float32, like a trainer's params
    with NativeRolloutServer(engine) as native:
        native.load(fresh, 1)
        for leaf in jax.tree.leaves(fresh):
            leaf.delete()  # a trainer donating its state must not break the server
        draw = native.submit(PROMPTS[0], 8).result(timeout=60)
        served = native.server.variables
        with pytest.raises(ValueError, match=r"\['params'\]\['embed_tokens'\]\['embedding'\] has shape"):
            native.load(jax.tree.map(lambda x: jnp.zeros((2,) + x.shape[1:], x.dtype), variables()), 2)
        assert native.version == 1
    assert {x.dtype for x in jax.tree.leaves(served)} == {jnp.dtype(jnp.bfloat16)}
    bf16 = jax.jit(lambda tree: jax.tree.map(lambda x: (x * 1.5).astype(jnp.bfloat16), tree))(variables())
    assert draw.version == 1
    np.testing.assert_array_equal(draw.ids, reference(PROMPTS[0], 8, 0, GREEDY, bf16)[0])


def test_the_server_keeps_its_own_copy_of_the_task_weights():
    own = jax.tree.map(jnp.copy, variables())  # eager: new buffers (compiled, a copy could hand back its input)
    engine = Server.from_task(ServeTask(model=MODEL, variables=own, sampling=GREEDY), slots=3,
                              capacity=40, steps=4)
    for leaf in jax.tree.leaves(own):
        leaf.delete()  # as a trainer's donated update would
    engine.add(0, PROMPTS[0], 12)
    np.testing.assert_array_equal(run(engine)[0].ids, reference(PROMPTS[0], 12, 0, GREEDY)[0])


REPLICATED_LOAD = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from conftest import run_on_host_devices, tiny_model
from dew_lib.inference import NativeRolloutServer, Server, ServeTask
from dew_lib.sampling import Sampling

model = tiny_model(max_seq_len=48)
variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))  # compiled whole
engine = Server.from_task(ServeTask(model=model, variables=variables, sampling=Sampling(temperature=0.0)),
                          slots=2, capacity=40, steps=4)
# A trainer's parameters: replicated over both devices, and donated by every update.
replicated = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec())
params = jax.device_put(jax.jit(lambda tree: jax.tree.map(lambda x: x * 1.5, tree))(variables), replicated)
update = jax.jit(lambda tree: jax.tree.map(lambda x: x + 1.0, tree), donate_argnums=0)
with NativeRolloutServer(engine) as native:
    native.load(params, 1)
    params = update(params)
    draw = native.submit(np.arange(5, 11, dtype=np.int32), 8).result(timeout=60)
    print(sum(leaf.is_deleted() for leaf in jax.tree.leaves(native.server.variables)), draw.version, len(draw.ids))
"""


def test_weights_loaded_from_a_replicated_trainer_state_survive_its_donation():
    """An array replicated over several devices put on one of them shares that device's buffer
    (JAX 0.10), so a trainer's next donated update used to delete the served weights."""
    assert run_on_host_devices(REPLICATED_LOAD, devices=2).split() == ["0", "1", "8"]


def test_close_fails_every_pending_future_and_refuses_new_work():
    native = NativeRolloutServer(server(GREEDY, slots=1, steps=1))
    futures = [native.submit(PROMPTS[0], 30) for _ in range(4)]
    native.close()
    for future in futures:
        assert future.done()
        if future.exception() is not None:
            assert isinstance(future.exception(), ServerClosed)
    assert isinstance(futures[-1].exception(), ServerClosed)  # still queued behind one slot
    with pytest.raises(ServerClosed):
        native.submit(PROMPTS[0], 2)
    with pytest.raises(ServerClosed):
        native.load(variables(), 1)
    native.close()  # twice is fine


def test_an_exception_in_the_loop_reaches_every_future(monkeypatch):
    engine = server(GREEDY, slots=1, steps=1)
    calls = []

    def broken_step():
        calls.append(1)
        raise FloatingPointError("device fell over")

    monkeypatch.setattr(engine, "step", broken_step)
    native = NativeRolloutServer(engine)
    futures = [native.submit(PROMPTS[0], 5) for _ in range(3)]
    for future in futures:
        with pytest.raises(FloatingPointError, match="device fell over"):
            future.result(timeout=60)
    with pytest.raises(ServerClosed, match="loop failed") as raised:
        native.submit(PROMPTS[0], 5)
    assert isinstance(raised.value.__cause__, FloatingPointError)
    with pytest.raises(ServerClosed):
        native.load(variables(), 1)
    native.close()
    assert calls == [1]


def test_a_failed_weight_swap_fails_the_pending_draws(monkeypatch):
    engine = server(GREEDY, slots=1, steps=1)

    def broken_reload(*args, **kwargs):
        raise MemoryError("no room for the new weights")

    monkeypatch.setattr(engine, "reload", broken_reload)
    native = NativeRolloutServer(engine)
    with native._lock:  # both handed over before the loop's next turn
        native.load(variables(), 1)
        future = native.submit(PROMPTS[0], 3)
    with pytest.raises(MemoryError, match="no room"):
        future.result(timeout=60)
    with pytest.raises(ServerClosed, match="loop failed"):
        native.load(variables(), 2)
    native.close()


def test_native_server_is_a_rollout_server_and_callbacks_see_the_draw():
    seen = threading.Event()
    with NativeRolloutServer(server(GREEDY, slots=1, steps=1)) as native:
        assert isinstance(native, RolloutServer)
        future = native.submit([1, 2, 3], 3, seed=5)
        future.add_done_callback(lambda f: seen.set())
        draw = future.result(timeout=60)
    assert seen.wait(5) and isinstance(draw, Draw) and draw.finish_reason == "length"


def test_draw_checks_its_fields():
    draw = Draw(ids=[4, 3], behavior_log_probs=[-0.5, -0.1], raw_log_probs=None, eos=True, version=2)
    assert draw.ids.dtype == np.int32 and draw.finish_reason == "stop" and len(draw) == 2
    with pytest.raises(ValueError, match="behavior_log_probs must hold one entry per sampled id"):
        Draw(ids=[4, 3], behavior_log_probs=[-0.5], raw_log_probs=None, eos=True, version=2)
    with pytest.raises(ValueError, match="raw_log_probs must be finite"):
        Draw(ids=[4], behavior_log_probs=[0.0], raw_log_probs=[np.nan], eos=False, version=0)
    with pytest.raises(ValueError, match="version"):
        Draw(ids=[4], behavior_log_probs=[0.0], raw_log_probs=None, eos=False, version=True)
    with pytest.raises(ValueError):
        draw.ids[0] = 1  # read-only


def test_an_idle_server_waits_without_spinning():
    with NativeRolloutServer(server(GREEDY, slots=1, steps=1)) as native:
        native.submit([1, 2], 2).result(timeout=60)
        before = time.process_time()
        time.sleep(0.3)
        assert time.process_time() - before < 0.1

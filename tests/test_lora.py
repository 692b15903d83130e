"""Low-rank adapters: PEFT's initialisation and scale, a fresh adapter changes nothing, the
Trainer trains the adapters alone (base bit for bit unchanged, optimizer state for the adapters
only), and DPO's frozen reference is the base with its adapters off, no copy kept."""

import functools
import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import fit_adapters, lm_batches, pairs_batch, run_on_host_devices, tiny_model

from dew_lib import Dataset, LMObjective, Trainer
from dew_lib.data import Loading
from dew_lib.models import lora
from dew_lib.objectives import DPOObjective, loss
from dew_lib.sampling import Sampling, generate
from dew_lib.train.sinks import MemorySink

MODEL = tiny_model()  # 2 layers, width 16, 4 heads of 4, 2 KV heads, MLP 32, vocabulary 32
IDS = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])
EVERY = lora.LoRA(rank=4, alpha=8, targets="all-linear")


@functools.cache
def base():
    """MODEL's weights, made once, on first use, not at import: every xdist worker imports every
    module, and compiles at import would run with all of XLA's optimizations (conftest.py turns
    them off per module)."""
    return jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


# The tests below compare forwards and losses of a handful of models many times over. Compiled
# once per model (or objective) here, each is one program for the whole module; called eagerly,
# every call traced the layers' scan anew and compiled it again, op by op around it.
@functools.partial(jax.jit, static_argnums=0)
def logits(model, variables, rngs=None):
    """`model`'s logits on IDS (with adapter dropout when `rngs` holds a dropout key)."""
    return model.apply(variables, IDS, rngs=rngs)


@functools.partial(jax.jit, static_argnums=0)
def compiled_loss(objective, params, batch, reference=None, key=None):
    """`dew_lib.objectives.loss`, compiled once per objective."""
    return loss(objective, params, batch, reference=reference, key=key)


@functools.partial(jax.jit, static_argnums=0)
def evaluated(objective, params, batch):
    """`objective.evaluate`, compiled once per objective."""
    return objective.evaluate(params, batch)


def adapted(config=EVERY, key=1):
    return lora.attach(MODEL, base(), config, jax.random.key(key))


def nudged(variables, by=0.1):
    """Every adapter leaf moved off its start, so the adapters change the outputs."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x + by if lora.is_adapter(p) else x, variables)


def test_options_expand_all_linear_scale_as_peft_and_refuse_what_they_cannot_read():
    assert EVERY.targets == lora.TARGETS and EVERY.scale == 2.0  # alpha / r
    assert lora.LoRA(rank=16, alpha=8, rslora=True).scale == 2.0  # alpha / sqrt(r)
    assert lora.LoRA(targets=("v_proj", "q_proj")).targets == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="LoRA.targets must name projections among q_proj.*got \\('lm_head',\\)"):
        lora.LoRA(targets=("lm_head",))
    with pytest.raises(ValueError, match="LoRA.rank must be a whole number >= 1, got 0"):
        lora.LoRA(rank=0)


def test_adapters_start_as_peft_draws_them_and_change_no_logit():
    model, variables = adapted()
    layers = variables["params"]["layers"]
    for name in lora.TARGETS:
        a, b = layers[name]["lora_a"], layers[name]["lora_b"]
        bound = 1 / math.sqrt(a.shape[1])  # Kaiming-uniform(a=sqrt 5) over the input width
        assert a.shape[0] == 2 and a.shape[2] == 4 and b.shape == (2, 4, layers[name]["kernel"].shape[2])
        assert 0.5 * bound < float(jnp.abs(a).max()) <= bound and not jnp.any(b)
    np.testing.assert_array_equal(logits(model, variables), logits(MODEL, base()))
    # the model's own init makes the same leaves (their shapes: traced, not run)
    fresh = jax.eval_shape(model.init, jax.random.key(3), IDS)
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, variables)
    with pytest.raises(ValueError, match="already has adapters"):
        lora.attach(model, variables, EVERY, jax.random.key(0))


@pytest.mark.parametrize("layout", [dict(), dict(scan_layers=False), dict(remat=True)],
                         ids=["scanned", "looped", "remat"])
def test_an_adapter_adds_its_low_rank_product_in_every_layout(layout):
    """Against the merged kernel W + s A B, which is what the adapter computes."""
    model, variables = adapted()
    model = model.clone(**layout)
    moved = nudged(variables)
    merged = jax.tree.map(lambda x: x, base())
    layers = dict(merged["params"]["layers"])
    for name in lora.TARGETS:
        part = moved["params"]["layers"][name]
        product = jnp.einsum("lir,lro->lio", part["lora_a"], part["lora_b"])
        layers[name] = {**layers[name], "kernel": part["kernel"] + EVERY.scale * product}
    merged = {"params": {**merged["params"], "layers": layers}}
    np.testing.assert_allclose(logits(model, moved), logits(MODEL.clone(**layout), merged), atol=2e-5)
    grads = jax.jit(jax.grad(lambda v: model.apply(v, IDS).sum()))(moved)
    assert all(jnp.any(g != 0) for g in jax.tree.leaves(lora.split(grads["params"])[0]))


def test_switched_off_adapters_give_the_base_logits_exactly():
    model, variables = adapted()
    moved = nudged(variables)
    assert not np.array_equal(logits(model, moved), logits(MODEL, base()))
    np.testing.assert_array_equal(logits(model, lora.without_adapters(moved)), logits(MODEL, base()))


def test_sampling_draws_through_the_adapters():
    model, variables = adapted()
    prompt, lengths = np.array([[0, 0, 5, 6], [7, 8, 9, 10]]), [2, 4]
    draw = dict(key=jax.random.key(2), max_new_tokens=6, sampling=Sampling(temperature=0.0))
    fresh = generate(model, variables, prompt, lengths, **draw)
    np.testing.assert_array_equal(fresh.tokens, generate(MODEL, base(), prompt, lengths, **draw).tokens)
    moved = generate(model, nudged(variables, 0.3), prompt, lengths, **draw)
    assert not np.array_equal(moved.tokens, fresh.tokens)


def test_training_moves_only_the_adapters_and_the_optimizer_keeps_moments_for_them_alone():
    model, variables = adapted(lora.LoRA(rank=2, targets=("q_proj", "v_proj")))
    state, sink = fit_adapters(model, variables)
    trained, frozen = lora.split(state.params)
    start_adapters, start_base = lora.split(variables)
    for after, before in zip(jax.tree.leaves(frozen), jax.tree.leaves(start_base), strict=True):
        np.testing.assert_array_equal(after, before)
    assert all(jnp.any(a != b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(start_adapters)))
    moments = state.opt_state[0].mu
    assert jax.tree.map(jnp.shape, moments) == {"params": {"layers": {
        "q_proj": {"lora_a": (2, 16, 2), "lora_b": (2, 2, 16)}, "v_proj": {"lora_a": (2, 16, 2), "lora_b": (2, 2, 8)}}}}
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(moments))
    assert adapter_bytes / sum(x.nbytes for x in jax.tree.leaves(base())) < 0.06
    losses = [value for _, value in sink.series("loss")]
    assert losses[-1] < losses[0]


def test_dpo_s_reference_is_the_base_with_adapters_off_and_no_copy_is_kept():
    model, variables = adapted()
    objective = DPOObjective(model, seq_len=3, beta=0.1, pretrained=variables)
    batch = pairs_batch()
    value, _ = compiled_loss(objective, variables, batch, reference=lora.without_adapters(variables))
    np.testing.assert_allclose(value, np.log(2.0), rtol=1e-6)  # a fresh adapter: the policy is its reference
    sink = MemorySink()
    trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(1))
    state = trainer.fit(Dataset(train=lambda p: itertools.repeat(batch), batch=8), steps=6, log_every=3,
                        sinks=[sink])
    assert state.ema is None  # DPO without adapters keeps a whole frozen copy here
    margins = [m for _, m in sink.series("rewards/margin")]
    assert margins[-1] > margins[0] > 0
    # the reference the update scored against: the base model's log-probs, to the bit
    np.testing.assert_array_equal(logits(model, lora.without_adapters(state.params)), logits(MODEL, base()))


def test_adapters_split_over_an_fsdp_mesh_train_as_on_one_device():
    out = run_on_host_devices("""
        import itertools, json
        import jax, jax.numpy as jnp, numpy as np, optax
        from conftest import lm_batches, tiny_model
        from dew_lib import Dataset, LMObjective, Trainer
        from dew_lib.models import lora
        from dew_lib.train.mesh import MeshSpec

        model = tiny_model()
        base = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
        model, variables = lora.attach(model, base, lora.LoRA(rank=4, targets="all-linear"), jax.random.key(1))
        batches = list(lm_batches(0, 8, 9, count=3))
        states = {}
        for name, mesh in (("data", MeshSpec(data=4)), ("fsdp", MeshSpec(fsdp=4))):
            trainer = Trainer(LMObjective(model, seq_len=8, pretrained=variables, ema_decay=None),
                              optax.adamw(1e-2), key=jax.random.key(0), mesh=mesh)
            states[name] = trainer.fit(Dataset(train=lambda p: iter(batches), batch=8), steps=3, sinks=[])
        b = states["fsdp"].params["params"]["layers"]["q_proj"]["lora_a"]
        error = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in
                    zip(jax.tree.leaves(states["data"].params), jax.tree.leaves(states["fsdp"].params)))
        share = b.addressable_shards[0].data.size / b.size
        print(json.dumps({"error": error, "split": str(b.sharding.spec), "share": share}))
        """, devices=4, timeout=300)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["error"] < 1e-5
    assert report["split"] == "P(None, 'fsdp')" and report["share"] == 0.25


def test_a_hugging_face_checkpoint_of_an_adapted_model_holds_the_adapters_folded_in(tmp_path):
    import dataclasses

    from dew_lib.models import Pretrained, load_pretrained

    model, variables = adapted()
    moved = nudged(variables)
    plain = Pretrained.from_model(MODEL)
    with pytest.raises(ValueError, match="hold LoRA adapters but the Pretrained's model has none"):
        plain.save(moved, tmp_path / "refused", dtype=None)
    dataclasses.replace(plain, model=model).save(moved, tmp_path / "merged", dtype=None)
    loaded = load_pretrained(tmp_path / "merged", tokenizer=False)
    assert loaded.model.lora is None and not lora.has_adapters(loaded.variables)
    np.testing.assert_allclose(logits(loaded.model, loaded.variables), logits(model, moved), atol=2e-5)


def test_ppo_trains_the_policy_s_adapters_and_its_critic_s_adapters_and_value_head():
    """What `PPOObjective.trainable` marks (tests/test_lora_stages.py trains it)."""
    from dew_lib.models.partitioning import path_names
    from dew_lib.objectives import PPOObjective, ValueHead

    model, variables = adapted(lora.LoRA(rank=2, targets=("q_proj",)))
    objective = PPOObjective(model, seq_len=8, critic=ValueHead(model), pretrained=variables, beta=0.1)
    marks = objective.trainable(jax.eval_shape(objective.init, jax.random.key(0)))
    assert {"/".join(path_names(path)) for path, trains in jax.tree_util.tree_leaves_with_path(marks) if trains} == {
        "policy/params/layers/q_proj/lora_a", "policy/params/layers/q_proj/lora_b",
        "critic/params/backbone/layers/q_proj/lora_a", "critic/params/backbone/layers/q_proj/lora_b",
        "critic/params/value/kernel", "critic/params/value/bias"}
    # a policy without adapters trains whole, so its frozen reference is a copy, as without LoRA
    whole = PPOObjective(MODEL, seq_len=8, critic=ValueHead(model), pretrained=base(), beta=0.1)
    state = Trainer(whole, optax.adam(1e-3), key=jax.random.key(0)).abstract_state()  # shapes, nothing computed
    assert jax.tree.map(jnp.shape, state.ema) == jax.tree.map(jnp.shape, base())
    assert jax.tree.map(jnp.shape, state.opt_state[0].mu["policy"]) == jax.tree.map(jnp.shape, base())
    with pytest.raises(ValueError, match="PPOObjective.critic holds LoRA adapters but is a CausalTransformer"):
        Trainer(PPOObjective(model, seq_len=8, critic=model, pretrained=variables), optax.adam(1e-3),
                key=jax.random.key(0))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_trains_the_adapters_against_the_base_and_keeps_no_reference_copy(mode):
    """Through the recipe the pipeline uses, drawing its rollouts from the adapted policy."""
    from dew_lib.data import Prompts
    from dew_lib.recipes import GRPOOptions, build_grpo

    model, variables = adapted(lora.LoRA(rank=2, targets=("q_proj", "o_proj", "down_proj")))
    records = tuple(json.dumps({"prompt": [3, 4, 5], "ground_truth": "1"}) for _ in range(4))
    data = Prompts(records=records, max_prompt_len=4, loading=Loading(seed=None))
    options = GRPOOptions(steps=3, batch=2, groups=4, max_new_tokens=4, beta=0.05, mode=mode, slots=8)
    built = build_grpo(model, variables, data, options, reward=lambda source, text, truth, extra: len(text) / 16,
                       eos_id=2)
    try:
        trainer = Trainer(built.objective, optax.adam(1e-2), key=jax.random.key(0), rollout=built.rollout)
        state = trainer.fit(built.dataset, steps=3, log_every=1, sinks=[])
    finally:
        built.close()
    assert state.ema is None and built.objective.ema_decay == 1.0  # a frozen reference, kept as the base
    trained, frozen = lora.split(state.params)
    for after, before in zip(jax.tree.leaves(frozen), jax.tree.leaves(lora.split(variables)[1]), strict=True):
        np.testing.assert_array_equal(after, before)
    assert any(jnp.any(leaf != 0) for leaf in jax.tree.leaves(trained["params"]["layers"]["o_proj"]["lora_b"]))
    np.testing.assert_array_equal(logits(model, lora.without_adapters(state.params)), logits(MODEL, base()))


# ----- adapter dropout -------------------------------------------------------------------------

DROPPING = lora.LoRA(rank=4, alpha=8, targets="all-linear", dropout=0.5)


def test_dropout_is_a_probability_below_one():
    assert lora.LoRA().dropout == 0.0 and lora.LoRA(dropout=0.1).dropout == 0.1
    for bad in (1.0, -0.1, True):
        with pytest.raises(ValueError, match="LoRA.dropout must be a probability with 0 <= dropout < 1"):
            lora.LoRA(dropout=bad)


def test_dropout_zeroes_about_p_of_the_units_and_scales_the_rest_by_one_over_one_minus_p():
    x = jnp.ones((400, 500))
    seen = lora.dropped(x, jax.random.key(0), 0.25)
    assert abs(float(jnp.mean(seen == 0)) - 0.25) < 0.005
    assert set(np.unique(np.asarray(seen)).tolist()) == {0.0, float(np.float32(4 / 3))}
    assert lora.dropped(x, jax.random.key(0), 0.0) is x


def test_a_fresh_adapter_under_dropout_still_changes_no_logit():
    """B = 0: whatever reaches A, the adapter adds (dropped x A) 0 = 0."""
    model, variables = adapted(DROPPING)
    dropped = logits(model, variables, rngs={"dropout": jax.random.key(5)})
    np.testing.assert_array_equal(dropped, logits(MODEL, base()))


def test_training_drops_reproducibly_by_key_and_evaluation_never_does():
    model, variables = adapted(DROPPING)
    moved = nudged(variables)
    batch = next(lm_batches(0, 4, 9))
    objective = LMObjective(model, seq_len=8, ema_decay=None)
    plain = LMObjective(model.clone(lora=EVERY), seq_len=8, ema_decay=None)  # same adapters, dropout 0
    value = lambda o, key: float(compiled_loss(o, moved, batch, key=jax.random.key(key))[0])  # noqa: E731
    sums = evaluated(objective, moved, batch)["loss"]
    unmasked = float(sums[0] / sums[1])
    assert value(plain, 1) == value(plain, 2) == unmasked  # p = 0: the training loss is the evaluation loss
    assert value(objective, 1) == value(objective, 1)  # the same key, the same masks
    assert len({value(objective, 1), value(objective, 2), unmasked}) == 3
    np.testing.assert_array_equal(evaluated(objective, moved, batch)["loss"], evaluated(plain, moved, batch)["loss"])


@pytest.mark.parametrize("layout", [dict(scan_layers=False), dict(remat=True)], ids=["looped", "remat"])
def test_every_layout_drops_the_same_units(layout):
    model, variables = adapted(DROPPING)
    moved, rngs = nudged(variables), {"dropout": jax.random.key(5)}
    np.testing.assert_allclose(logits(model.clone(**layout), moved, rngs), logits(model, moved, rngs), atol=1e-6)


def test_each_layer_draws_its_own_mask():
    """Two identical layers whose outputs are zero (o_proj, down_proj and B at zero) see the same
    input, so the gradients of their o_proj adapters' B agree exactly unless their masks differ."""
    config = lora.LoRA(rank=4, targets=("o_proj",), dropout=0.5)
    model, variables = adapted(config)
    layers = jax.tree.map(lambda x: jnp.stack([x[0], x[0]]), variables["params"]["layers"])
    for name in ("o_proj", "down_proj"):
        layers[name] = {**layers[name], "kernel": jnp.zeros_like(layers[name]["kernel"])}
    twins = {"params": {**variables["params"], "layers": layers}}

    @jax.jit
    def grad_b(rngs):
        grads = jax.grad(lambda v: model.apply(v, IDS, rngs=rngs)[..., 3].sum())(twins)
        return grads["params"]["layers"]["o_proj"]["lora_b"]

    same = grad_b(None)
    np.testing.assert_array_equal(same[0], same[1])
    assert jnp.any(same[0] != 0)
    dropped = grad_b({"dropout": jax.random.key(5)})
    assert not np.allclose(dropped[0], dropped[1], atol=1e-3)


def test_dpo_drops_in_the_policy_s_forward_only():
    """Policy and reference are the same params: without dropout the loss is log 2 exactly; with it
    the policy's scores move and the reference's do not."""
    batch = pairs_batch()
    for config, at_log_2 in ((EVERY, True), (DROPPING, False)):
        model, variables = adapted(config)
        moved = nudged(variables)
        objective = DPOObjective(model, seq_len=3, beta=0.1)
        value, _ = compiled_loss(objective, moved, batch, reference=moved, key=jax.random.key(3))
        assert (float(value) == pytest.approx(np.log(2.0), rel=1e-6)) == at_log_2


def test_grpo_drops_in_the_policy_s_forward_only():
    """The KL to a reference that equals the policy is 0 without dropout and not with it."""
    from dew_lib.objectives import GRPOObjective
    from dew_lib.records.sessions import Call, Session
    from dew_lib.rollouts.packing import pack

    call = Call(prompt_ids=np.array([3, 4]), sampled_ids=np.array([5, 6, 7]),
                behavior_log_probs=np.full(3, -1.0), raw_log_probs=np.full(3, -1.0))
    batch = pack([Session(task="t", group=0, sample=i, calls=(call,), reward=float(i)) for i in range(2)], 8)
    plain = GRPOObjective(MODEL.clone(lora=EVERY), seq_len=7)  # the same adapters, dropout 0: compiled once
    for config, drops in ((EVERY, False), (DROPPING, True)):
        model, variables = adapted(config)
        moved = nudged(variables)
        objective = GRPOObjective(model, seq_len=7, beta=0.1)
        _, metrics = compiled_loss(objective, moved, batch, reference=moved, key=jax.random.key(3))
        kl = float(metrics["kl"])
        assert (kl > 1e-6) == drops and kl >= 0
        np.testing.assert_array_equal(objective.packed_log_probs(moved, batch), plain.packed_log_probs(moved, batch))


def test_sampling_never_drops():
    model, variables = adapted(DROPPING)
    moved = nudged(variables, 0.3)
    prompt, lengths = np.array([[0, 0, 5, 6], [7, 8, 9, 10]]), [2, 4]
    draw = dict(key=jax.random.key(2), max_new_tokens=6, sampling=Sampling(temperature=1.0))
    np.testing.assert_array_equal(generate(model, moved, prompt, lengths, **draw).tokens,
                                  generate(model.clone(lora=EVERY), moved, prompt, lengths, **draw).tokens)

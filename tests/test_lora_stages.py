"""LoRA in PPO and Flow-GRPO: the policy trains its adapters alone (its base bit for bit as it
started), PPO's critic trains its own adapters and value head or, without adapters, all of it,
the optimizer state covers what trains and nothing else, and the frozen reference each update
scores against is the base with its adapters off, no copy kept."""

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model

from dew_lib import Dataset, Field, InputSpec, Trainer, models, presets
from dew_lib.diffusion import FlowGRPOObjective, FlowRollout
from dew_lib.models import dit, lora
from dew_lib.objectives import GRPOObjective, PPOObjective, ValueHead, loss
from dew_lib.objectives.ppo import critic_from_policy
from dew_lib.train.sinks import MemorySink

MODEL = tiny_model()  # 2 layers, width 16, 4 heads of 4, 2 KV heads, MLP 32, vocabulary 32
CONFIG = lora.LoRA(rank=2, targets=("q_proj", "v_proj"))
ADAPTED = MODEL.clone(lora=CONFIG)  # the model lora.attach makes
SEQ = 8
SCORER = GRPOObjective(MODEL, SEQ)  # the base's log-probs, compiled once for the module
ADAPTER_SHAPES = {"layers": {"q_proj": {"lora_a": (2, 16, 2), "lora_b": (2, 2, 16)},
                             "v_proj": {"lora_a": (2, 16, 2), "lora_b": (2, 2, 8)}}}


# The weights are made on first use, not at import: every xdist worker imports every module, and
# compiles at import would run with all of XLA's optimizations (conftest.py turns them off per module).
@functools.cache
def base():
    """MODEL's weights."""
    return jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


@functools.cache
def policy():
    """The base with the policy's fresh adapters (ADAPTED's variables)."""
    return lora.attach(MODEL, base(), CONFIG, jax.random.key(1))[1]


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def every_leaf_moved(after, before) -> bool:
    return all(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True))


# critic_from_policy initializes a whole critic to keep its value head: compiled, not op by op
critic_variables = jax.jit(critic_from_policy, static_argnums=(0, 2), static_argnames="share_base")


@functools.cache
def ppo_batch():
    """Four packed rows of nine ids, the last five sampled, as a rollout under the base would
    give them (bypass: the behavior log-probs are the base's). Made once; no test writes into it."""
    rng = np.random.default_rng(0)
    rows, width = 4, SEQ + 1
    mask = np.zeros((rows, width), np.int32)
    mask[:, 4:] = 1
    batch = dict(input_ids=rng.integers(1, 32, (rows, width)).astype(np.int32),
                 text_segment_ids=np.ones((rows, width), np.int32),
                 text_positions=np.tile(np.arange(width, dtype=np.int32), (rows, 1)), response_mask=mask,
                 session_index=np.repeat(np.arange(rows, dtype=np.int32)[:, None], width, axis=1),
                 advantages=(rng.normal(size=(rows, width)) * mask).astype(np.float32),
                 returns=(rng.normal(size=(rows, width)) * mask).astype(np.float32),
                 old_values=np.zeros((rows, width), np.float32))
    scores = SCORER.packed_log_probs(base(), {k: jnp.asarray(v) for k, v in batch.items()})
    return {**batch, "behavior_log_probs": np.where(mask > 0, np.asarray(scores), 0).astype(np.float32)}


def critic(own_adapters: bool):
    """A ValueHead on the base decoder; with its own adapters (drawn apart from the policy's)."""
    if own_adapters:
        head = ValueHead(ADAPTED)
        return head, critic_variables(head, lora.attach(MODEL, base(), CONFIG, jax.random.key(2))[1], SEQ)
    head = ValueHead(MODEL)
    return head, critic_variables(head, base(), SEQ)


@pytest.mark.parametrize("own_adapters", [True, False], ids=["critic-adapters", "critic-whole"])
def test_ppo_trains_the_policy_s_adapters_and_the_critic_against_the_base(own_adapters):
    head, critic_start = critic(own_adapters)
    objective = PPOObjective(ADAPTED, SEQ, critic=head, critic_variables=critic_start, pretrained=policy(),
                             beta=0.05)
    batch = ppo_batch()
    sink = MemorySink()
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    data = Dataset(train=lambda p: itertools.repeat(batch), batch=4)
    state = trainer.fit(data, steps=3, log_every=1, sinks=[sink])
    assert state.ema is None and objective.ema_decay == 1.0  # a frozen reference, kept as the base

    policy_adapters, policy_base = lora.split(state.params["policy"])
    assert same(policy_base, lora.split(policy())[1])
    assert every_leaf_moved(policy_adapters, lora.split(policy())[0])
    critic_params = state.params["critic"]["params"]
    assert every_leaf_moved(critic_params["value"], critic_start["params"]["value"])  # started at 0
    moments = jax.tree.map(jnp.shape, state.opt_state[0].mu)
    if own_adapters:
        critic_adapters, critic_base = lora.split(critic_params["backbone"])
        assert same(critic_base, lora.split(critic_start["params"]["backbone"])[1])
        assert every_leaf_moved(critic_adapters, lora.split(critic_start["params"]["backbone"])[0])
        critic_moments = {"params": {"backbone": ADAPTER_SHAPES, "value": {"kernel": (16, 1), "bias": (1,)}}}
    else:
        assert every_leaf_moved(critic_params["backbone"]["layers"], critic_start["params"]["backbone"]["layers"])
        critic_moments = jax.tree.map(jnp.shape, critic_start)
    assert moments == {"policy": {"params": ADAPTER_SHAPES}, "critic": critic_moments}

    # the reference: the base's log-probs to the bit, and what a further step's KL is taken against
    off = lora.without_adapters(state.params["policy"])
    base_scores = SCORER.packed_log_probs(base(), batch)
    np.testing.assert_array_equal(objective.actor.packed_log_probs(off, batch), base_scores)
    assert not np.array_equal(objective.actor.packed_log_probs(state.params["policy"], batch), base_scores)
    kl = [value for _, value in sink.series("kl")]
    assert abs(kl[0]) < 1e-12 and kl[-1] > 1e-6  # fresh adapters: the policy is its reference (see below)
    _, expected = jax.jit(functools.partial(loss, objective))(state.params, batch, reference=off)
    trainer.fit(data, steps=4, log_every=1, sinks=[sink], state=state)
    np.testing.assert_allclose(sink.series("kl")[-1][1], expected["kl"], rtol=1e-5)


def test_a_critic_on_the_policy_s_base_trains_as_one_on_a_copy_and_the_state_keeps_one_base():
    """share_base: the critic's subtree holds its adapters and value head alone and reads the
    policy's frozen base; three PPO steps give what a critic on a copy of that base gives."""
    head = ValueHead(ADAPTED)
    start = lora.attach(MODEL, base(), CONFIG, jax.random.key(2))[1]  # the critic's adapters, drawn apart
    batch = ppo_batch()
    states, objectives = {}, {}
    for shared in (False, True):
        objective = PPOObjective(ADAPTED, SEQ, critic=head, pretrained=policy(), beta=0.05,
                                 critic_variables=critic_variables(head, start, SEQ, share_base=shared))
        assert objective.shares_base == shared
        data = Dataset(train=lambda p: itertools.repeat(batch), batch=4)
        states[shared] = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0)).fit(data, steps=3, log_every=1,
                                                                                         sinks=[])
        objectives[shared] = objective
    shared, copied = states[True], states[False]
    backbone = shared.params["critic"]["params"]["backbone"]
    assert lora.split(backbone)[1] == {} and jax.tree.map(jnp.shape, backbone) == ADAPTER_SHAPES

    def nbytes(tree):
        return sum(leaf.nbytes for leaf in jax.tree.leaves(tree))

    assert nbytes(shared.params["critic"]) < 0.1 * nbytes(copied.params["critic"])
    assert jax.tree.map(jnp.shape, shared.opt_state[0].mu) == jax.tree.map(jnp.shape, copied.opt_state[0].mu)
    as_copied = objectives[True].critic_params(shared.params)  # the shared critic, base and all
    assert same(lora.split(as_copied["params"]["backbone"])[1], lora.split(policy()["params"])[1])
    for a, b in zip(jax.tree.leaves(as_copied), jax.tree.leaves(copied.params["critic"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(shared.params["policy"]), jax.tree.leaves(copied.params["policy"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert not same(lora.split(as_copied["params"]["backbone"])[0], lora.split(start["params"])[0])  # they trained
    fields = {k: jnp.asarray(batch[k]) for k in ("input_ids", "text_segment_ids", "text_positions")}
    np.testing.assert_allclose(jax.jit(objectives[True].packed_values)(as_copied, fields),  # what PPORollout reads
                               jax.jit(objectives[False].packed_values)(copied.params["critic"], fields),
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="share_base=True.* no adapters, so every weight of the policy trains"):
        critic_from_policy(ValueHead(MODEL), base(), SEQ, share_base=True)


INPUTS = InputSpec(Field("image", (4, 4, 1)))
DIT = models.SimpleDiT(output_channels=1, patch_size=2, emb_features=8, num_layers=1, num_heads=2, mlp_ratio=2)
SOURCE = {"image": np.zeros((2, 4, 4, 1), np.uint8)}
DIT_CONFIG = dit.DiTLoRA(rank=2, alpha=4, targets="all-linear")
DIT_ADAPTER_SHAPES = {"params": {"blocks_0": {
    "qkv": {"lora_a": (8, 2), "lora_b": (2, 24)}, "attention_out": {"lora_a": (8, 2), "lora_b": (2, 8)},
    "mlp_in": {"lora_a": (8, 2), "lora_b": (2, 16)}, "mlp_out": {"lora_a": (16, 2), "lora_b": (2, 8)}}}}


@functools.cache
def trained_dit():
    """A DiT whose gates and output are off zero (a fresh one predicts 0 whatever its adapters).
    Made once; no test writes into it."""
    fresh = jax.jit(DIT.init)(jax.random.key(0), jnp.zeros((1, 4, 4, 1)), jnp.zeros((1,)))
    leaves, tree = jax.tree.flatten(fresh)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@functools.partial(jax.jit, static_argnums=0)
def velocity(model, variables):
    """`model`'s velocity at two noisy images, compiled once per model (the tests compare many)."""
    x = jax.random.normal(jax.random.key(3), (2, 4, 4, 1))
    return model.apply(variables, x, jnp.array([0.9, 0.4]))


def test_dit_adapters_start_as_nothing_add_their_low_rank_product_and_fold_into_the_kernels():
    assert DIT_CONFIG.targets == dit.TARGETS and DIT_CONFIG.scale == 2.0
    with pytest.raises(ValueError, match="DiTLoRA.targets must name projections among qkv.*got \\('q_proj',\\)"):
        dit.DiTLoRA(targets=("q_proj",))
    dit_base = trained_dit()
    model, variables = dit.attach(DIT, dit_base, DIT_CONFIG, jax.random.key(1))
    np.testing.assert_array_equal(velocity(model, variables), velocity(DIT, dit_base))
    fresh = jax.eval_shape(model.init, jax.random.key(3), jnp.zeros((1, 4, 4, 1)), jnp.zeros((1,)))  # shapes only
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, variables)
    moved = jax.tree_util.tree_map_with_path(lambda p, x: x + 0.2 if lora.is_adapter(p) else x, variables)
    assert not np.allclose(velocity(model, moved), velocity(DIT, dit_base), atol=1e-3)
    np.testing.assert_array_equal(velocity(model, lora.without_adapters(moved)), velocity(DIT, dit_base))
    plain, folded = dit.merged(model, moved)
    assert plain.lora is None and not lora.has_adapters(folded)
    np.testing.assert_allclose(velocity(plain, folded), velocity(model, moved), atol=2e-5)
    with pytest.raises(TypeError, match="SimpleDiT.lora must be a dew_lib.models.dit.DiTLoRA"):
        velocity(DIT.clone(lora=CONFIG), dit_base)


def test_flow_grpo_trains_the_dit_s_adapters_alone_against_its_base():
    dit_base = trained_dit()
    model, variables = dit.attach(DIT, dit_base, DIT_CONFIG, jax.random.key(1))
    objective = FlowGRPOObjective(model, presets.Flow()(), INPUTS, guidance=None, steps=5, beta=0.1,
                                  clip_range=0.2, pretrained=variables)
    trainer = Trainer(objective, optax.adam(1e-2), key=jax.random.key(0))
    start = jax.jit(trainer.initial_state)()
    batch = FlowRollout(objective, lambda images, _: images.mean(axis=(1, 2, 3)), groups=4, steps=5,
                        train_steps=2)(start, SOURCE, jax.random.key(2))
    data = Dataset(train=lambda p: itertools.repeat(batch), batch=8)
    sink = MemorySink()
    state = trainer.fit(data, steps=3, log_every=1, sinks=[sink])
    assert state.ema is None and objective.ema_decay == 1.0

    adapters, frozen = lora.split(state.params)
    assert same(frozen, lora.split(variables)[1])
    assert every_leaf_moved(adapters, lora.split(variables)[0])
    assert jax.tree.map(jnp.shape, state.opt_state[0].mu) == DIT_ADAPTER_SHAPES

    off = lora.without_adapters(state.params)
    np.testing.assert_array_equal(velocity(model, off), velocity(DIT, dit_base))
    kl = [value for _, value in sink.series("kl")]
    # 0 at the start but for the last bits: the step compiles the policy's adapter and its base
    # (where B is a constant zero) into different programs
    assert abs(kl[0]) < 1e-12 and kl[-1] > 1e-6
    _, expected = jax.jit(objective.loss)(state.params, batch, reference=off)
    trainer.fit(data, steps=4, log_every=1, sinks=[sink], state=state)
    np.testing.assert_allclose(sink.series("kl")[-1][1], expected["kl"], rtol=1e-5)


def test_the_dit_s_adapters_drop_reproducibly_by_key_in_training_and_never_in_evaluation():
    """DiTLoRA.dropout, from flow_grpo's lora group: a forward given a dropout key drops on the
    adapters' path (the same key, the same drop); one given none, or a fresh adapter, drops nothing."""
    from dew_lib.recipes import FlowGRPOOptions

    options = FlowGRPOOptions(lora=dict(rank=2, alpha=4, targets="all-linear", dropout=0.5))
    model, variables = options.lora.attach(DIT, trained_dit(), jax.random.key(1))
    assert model.lora.dropout == 0.5 and model.lora == dataclasses.replace(DIT_CONFIG, dropout=0.5)
    x, t = jax.random.normal(jax.random.key(3), (2, 4, 4, 1)), jnp.array([0.9, 0.4])

    @functools.partial(jax.jit, static_argnums=0)
    def apply(model, params, rngs):
        return model.apply(params, x, t, rngs=rngs)

    def forward(params, key=None):
        return apply(model, params, None if key is None else {"dropout": jax.random.key(key)})

    np.testing.assert_array_equal(forward(variables, 1), forward(variables))  # B = 0: nothing to drop
    moved = jax.tree_util.tree_map_with_path(lambda p, v: v + 0.2 if lora.is_adapter(p) else v, variables)
    evaluated = forward(moved)
    np.testing.assert_array_equal(evaluated, apply(model.clone(lora=DIT_CONFIG), moved, None))  # no key: no drop
    np.testing.assert_array_equal(forward(moved, 1), forward(moved, 1))
    assert not np.allclose(forward(moved, 1), forward(moved, 2), atol=1e-5)
    assert not np.allclose(forward(moved, 1), evaluated, atol=1e-5)

    # Flow-GRPO's training forward draws from the step's key; its loss view (evaluation) from none
    objective = FlowGRPOObjective(model, presets.Flow()(), INPUTS, guidance=None, steps=5, beta=0.1,
                                  pretrained=moved)
    start = jax.jit(Trainer(objective, optax.adam(1e-2), key=jax.random.key(0)).initial_state)()
    batch = FlowRollout(objective, lambda images, _: images.mean(axis=(1, 2, 3)), groups=4, steps=5,
                        train_steps=2)(start, SOURCE, jax.random.key(2))
    reference = lora.without_adapters(moved)

    @functools.partial(jax.jit, static_argnums=0)
    def pg_terms(objective, key):
        return objective.terms(moved, batch, step=0, reference=reference, key=key).metrics["pg_loss"][0]

    def pg_loss(key):
        return float(pg_terms(objective, None if key is None else jax.random.key(key)))

    assert pg_loss(1) == pg_loss(1) and pg_loss(1) != pg_loss(2) and pg_loss(1) != pg_loss(None)
    assert pg_loss(None) == pg_loss(None)
    plain = FlowGRPOObjective(model.clone(lora=DIT_CONFIG), presets.Flow()(), INPUTS, guidance=None, steps=5,
                              beta=0.1, pretrained=moved)
    assert float(pg_terms(plain, jax.random.key(1))) == pg_loss(None)


def test_an_objective_s_trainable_marks_are_checked_before_anything_compiles():
    from dew_lib import LMObjective

    class Marks(LMObjective):
        def __init__(self, marks):
            super().__init__(ADAPTED, seq_len=SEQ, pretrained=policy(), ema_decay=None)
            self.marks = marks

        def trainable(self, params):
            return self.marks(params)

    with pytest.raises(ValueError, match="Marks.trainable marks no leaf: there is nothing to train"):
        Trainer(Marks(lambda params: jax.tree.map(lambda _: False, params)), optax.adam(1e-3), key=jax.random.key(0))
    with pytest.raises(ValueError, match="Marks.trainable must return a tree shaped like the params"):
        Trainer(Marks(lambda params: {"params": True}), optax.adam(1e-3), key=jax.random.key(0))
    with pytest.raises(TypeError, match="Marks.trainable must mark each leaf with a Python bool"):
        Trainer(Marks(lambda params: jax.tree.map(lambda x: jnp.ones((), bool), params)), optax.adam(1e-3),
                key=jax.random.key(0))


def test_ppo_drops_on_the_policy_s_and_the_critic_s_adapters_in_training_only():
    """With adapter dropout, PPO's training forward drops on both adapters (the critic with a mask
    of its own); evaluating the critic's values passes no key and drops nothing."""
    dropping = lora.LoRA(rank=2, targets=("q_proj", "v_proj"), dropout=0.5)
    model, variables = lora.attach(MODEL, base(), dropping, jax.random.key(1))
    moved = jax.tree_util.tree_map_with_path(lambda p, x: x + 0.3 if lora.is_adapter(p) else x, variables)
    head = ValueHead(model)
    objective = PPOObjective(model, SEQ, critic=head, critic_variables=critic_variables(head, moved, SEQ),
                             pretrained=moved, beta=0.0)
    params = jax.jit(objective.init)(jax.random.key(0))
    head_moved = jax.tree_util.tree_map_with_path(  # the value head starts at zero: move it too
        lambda p, x: x if "backbone" in jax.tree_util.keystr(p) else x + 0.3, params["critic"])
    params = {**params, "critic": head_moved}
    batch = {k: jnp.asarray(v) for k, v in ppo_batch().items()}
    critic_values = jax.jit(objective.values)
    values = critic_values(params["critic"], batch)
    np.testing.assert_array_equal(values, critic_values(params["critic"], batch))  # no key: nothing dropped
    assert not np.allclose(values, critic_values(params["critic"], batch, jax.random.key(3)), atol=1e-5)
    terms = jax.jit(lambda key: objective.terms(params, batch, step=0, reference=None, key=key).metrics)

    def metric(name, key):
        return float(terms(jax.random.key(key))[name][0])

    for name in ("pg_loss", "critic/vf_loss"):  # the training forward drops, reproducibly by key
        assert metric(name, 1) == metric(name, 1) and metric(name, 1) != metric(name, 2)

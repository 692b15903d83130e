"""Mixture-of-experts layers: dropless grouped dispatch, routing, the router's losses, decode.

Compiling is most of this module's time, so the models' programs are compiled once and shared:
`logits_of`, `routed_hidden` and `square_grads` are jitted with the model static, and tests that
run an equal model on equal shapes reuse one program; `variables` and `mixed_variables` are
initialised once per module.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from dew_lib.models import moe
from dew_lib.models.decoder import KVCache
from dew_lib.sampling import Sampling, generate

EXPERTS, TOP_K = 4, 2


def moe_model(**overrides):
    return tiny_model(**{**dict(experts=EXPERTS, experts_per_token=TOP_K, expert_features=24), **overrides})


def init(model, seed=0):
    """`model`'s parameters, compiled as one program (op by op, a model's first took seconds more)."""
    return jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def logits_of(model, variables, ids):
    """The model's logits, one compiled program per model (equal models share it) and shape."""
    return model.apply(variables, ids)


@functools.partial(jax.jit, static_argnums=0)
def routed_hidden(model, variables, ids, segments=None, positions=None, routes=None, routed=None):
    """The hidden states and the `moe.Routing`, replaying `routes` where `routed`, compiled as `logits_of`."""
    return model.apply(variables, ids, segments, positions, method=model.hidden, routes=routes, routed=routed,
                       return_routing=True)


@functools.partial(jax.jit, static_argnums=0)
def square_grads(model, variables, ids):
    """The gradients of the logits' mean square by every parameter, compiled as `logits_of`."""
    return jax.grad(lambda p: (model.apply(p, ids) ** 2).mean())(variables)


@pytest.fixture(scope="module")
def variables():
    """The parameters of `moe_model()`, which most tests run."""
    return init(moe_model())


@pytest.fixture(scope="module")
def mixed_variables():
    """The parameters of a 3-layer model whose layer 1 is dense."""
    return init(moe_model(num_layers=3, dense_layers=(1,)))


def every_expert(x, experts, weights, gate, up, down):
    """The dense reference: every expert on every row, masked by the routing weights."""
    hidden = jax.nn.silu(jnp.einsum("tx,exm->tem", x, gate)) * jnp.einsum("tx,exm->tem", x, up)
    out = jnp.einsum("tem,emx->tex", hidden, down)
    mix = (jax.nn.one_hot(experts, gate.shape[0]) * weights[..., None]).sum(1)
    return jnp.einsum("tex,te->tx", out, mix)


def grouped(*args):
    return moe.grouped_mlp(*args, block=16)


@functools.partial(jax.jit, static_argnums=0)
def forward_and_grads(mlp, x, experts, weights, gate, up, down):
    """`mlp`'s output and the gradients of its sum of squares by the rows and the experts' weights
    (one program per `mlp`: both skews below run it)."""
    def loss(x, weights, gate, up, down):
        return (mlp(x, experts, weights, gate, up, down) ** 2).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3, 4))(x, weights, gate, up, down)
    return mlp(x, experts, weights, gate, up, down), grads


@pytest.mark.parametrize("skew", ["balanced", "all on expert 2"])
def test_grouped_dispatch_equals_every_expert_masked_forward_and_gradients(skew):
    keys = jax.random.split(jax.random.key(0), 5)
    tokens, width, hidden = 100, 8, 12  # 200 slots: the groups need padding to whole blocks
    x = jax.random.normal(keys[0], (tokens, width))
    gate, up = (jax.random.normal(k, (EXPERTS, width, hidden)) for k in keys[1:3])
    down = jax.random.normal(keys[3], (EXPERTS, hidden, width))
    logits = jax.random.normal(keys[4], (tokens, EXPERTS))
    if skew != "balanced":  # every token's first choice is expert 2
        logits = logits.at[:, 2].add(100.0)
    experts, weights, _ = moe.route(logits, TOP_K, True)
    assert skew == "balanced" or bool((experts[:, 0] == 2).all())

    args = (x, experts, weights, gate, up, down)
    out, ours = forward_and_grads(grouped, *args)
    expected, reference = forward_and_grads(every_expert, *args)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    for a, b in zip(ours, reference, strict=True):  # float32 sums of terms as large as the leaf's largest (~1e4)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * float(np.abs(b).max()))


def test_routing_is_the_top_k_of_the_router_softmax_renormalised():
    logits = jnp.asarray([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 0.1, 0.4]])
    experts, weights, probabilities = moe.route(logits, 2, True)
    assert experts.tolist() == [[1, 2], [0, 1]]  # a tie goes to the lower index
    p = np.exp([1.0, 3.0, 2.0, 0.0]) / np.exp([1.0, 3.0, 2.0, 0.0]).sum()
    np.testing.assert_allclose(weights[0], [p[1] / (p[1] + p[2]), p[2] / (p[1] + p[2])], rtol=1e-6)
    _, raw, _ = moe.route(logits, 2, False)
    np.testing.assert_allclose(raw[0], [p[1], p[2]], rtol=1e-6)
    routes, routed = jnp.asarray([[3, 0], [2, 3]]), jnp.asarray([True, False])
    forced, forced_weights, _ = moe.route(logits, 2, True, routes, routed)
    assert forced.tolist() == [[3, 0], [0, 1]]
    np.testing.assert_allclose(forced_weights[0], [p[3] / (p[3] + p[0]), p[0] / (p[3] + p[0])], rtol=1e-6)


def transformers_aux_loss(logits, k, mask=None):
    """transformers' load_balancing_loss_func in numpy: every layer's router logits `[T, E]`
    concatenated, the top-k one-hot mean per (k, E) times the mean probability per E, summed,
    times E; with an attention mask, the means over real tokens."""
    logits = np.concatenate(logits)
    probabilities = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities /= probabilities.sum(-1, keepdims=True)
    chosen = np.argsort(-probabilities, axis=-1, kind="stable")[:, :k]
    one_hot = np.eye(logits.shape[-1])[chosen]  # [T, k, E]
    weight = np.ones(len(logits)) if mask is None else np.tile(mask.reshape(-1), len(logits) // mask.size)
    placed = (one_hot * weight[:, None, None]).sum(0) / weight.sum()
    probability = (probabilities * weight[:, None]).sum(0) / weight.sum()
    return float((placed * probability[None]).sum() * logits.shape[-1])


@pytest.mark.parametrize("padded", [False, True])
def test_the_aux_loss_is_transformers_load_balancing_loss_and_the_z_loss_its_mean_square_lse(padded):
    layers, tokens = 3, 12
    logits = [np.asarray(z) for z in jax.random.normal(jax.random.key(5), (layers, tokens, EXPERTS)) * 2]
    real = np.ones(tokens, bool)
    if padded:
        real[:4] = False
    stacked = [moe.layer_routing(*moe.route(jnp.asarray(z), TOP_K, True)[::2], jnp.asarray(z), jnp.asarray(real),
                                 (1, tokens)) for z in logits]
    routing = moe.combine(jax.tree.map(lambda *a: jnp.stack(a), *stacked))
    np.testing.assert_allclose(float(routing.aux_loss), transformers_aux_loss(logits, TOP_K, real), rtol=1e-5)
    lse = np.concatenate([np.log(np.exp(z).sum(-1))[real] for z in logits])
    np.testing.assert_allclose(float(routing.z_loss), np.mean(lse ** 2), rtol=1e-5)
    assert routing.experts.shape == (1, tokens, layers, TOP_K)
    np.testing.assert_allclose(routing.load.sum(-1), 1.0, rtol=1e-6)


def test_padding_does_not_count_in_the_router_losses(variables):
    model = moe_model()
    ids = jnp.asarray(np.random.default_rng(1).integers(1, 32, size=(1, 10)))
    segments = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]])  # left padding, as a prompt batch has
    positions = jnp.maximum(jnp.cumsum(segments, axis=1) - 1, 0)
    _, padded = routed_hidden(model, variables, ids, segments, positions)
    _, alone = routed_hidden(model, variables, ids[:, 3:])
    np.testing.assert_allclose(padded.aux_loss, alone.aux_loss, rtol=1e-5)
    np.testing.assert_allclose(padded.z_loss, alone.z_loss, rtol=1e-5)
    np.testing.assert_array_equal(padded.experts[:, 3:], alone.experts)


def test_replayed_routes_are_used_and_the_router_still_gets_a_gradient(variables):
    model = moe_model()
    ids = jnp.asarray(np.random.default_rng(2).integers(1, 32, size=(2, 8)))
    _, free = routed_hidden(model, variables, ids)
    other = (free.experts + 1) % EXPERTS  # never what the router chose
    routed = jnp.zeros(ids.shape, bool).at[0].set(True)  # replay the first row only
    _, replayed = routed_hidden(model, variables, ids, routes=other, routed=routed)
    np.testing.assert_array_equal(replayed.experts[0], other[0])
    np.testing.assert_array_equal(replayed.experts[1], free.experts[1])

    def loss(params):
        h = model.apply(params, ids, method=model.hidden, routes=other, routed=routed)
        return (h ** 2).sum()

    grads = jax.jit(jax.grad(loss))(variables)
    assert float(jnp.abs(grads["params"]["layers"]["router"]["kernel"]).max()) > 0


def test_decode_with_a_cache_equals_the_forward_pass_logits_and_routes(variables):
    model = moe_model()
    # 8 ids, as the replay and adapter tests run (one program serves them all); the step decodes id 5
    ids = jnp.asarray(np.random.default_rng(3).integers(1, 32, size=(2, 8)))
    forward = logits_of(model, variables, ids)
    _, routing = routed_hidden(model, variables, ids)
    segments, positions = jnp.ones((2, 5), jnp.int32), jnp.broadcast_to(jnp.arange(5), (2, 5))
    prefill = jax.jit(functools.partial(model.apply, method=model.prefill, return_routes=True))
    _, kvs, prefill_routes = prefill(variables, ids[:, :5], segments, positions)
    np.testing.assert_array_equal(prefill_routes, routing.experts[:, :5])
    cache = model.empty_cache(2, 8)
    cache = KVCache(tuple(c.at[:, :, :5].set(jnp.moveaxis(k, 1, 2)) for c, (k, _) in zip(cache.keys, kvs)),
                    tuple(c.at[:, :, :5].set(jnp.moveaxis(v, 1, 2)) for c, (_, v) in zip(cache.values, kvs)),
                    jnp.full((2,), 5, jnp.int32))
    decode = jax.jit(functools.partial(model.apply, method=model.decode, return_routes=True))
    step, _, routes = decode(variables, ids[:, 5], cache, jnp.ones((2,), bool))
    np.testing.assert_allclose(step, forward[:, 5], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(routes, routing.experts[:, 5])


def test_a_python_loop_over_layers_and_remat_give_the_scan_s_values_and_gradients(variables):
    ids = jnp.asarray(np.random.default_rng(4).integers(1, 32, size=(2, 8)))
    scanned = square_grads(moe_model(), variables, ids)
    for other in (moe_model(scan_layers=False), moe_model(remat=True)):
        for a, b in zip(jax.tree.leaves(square_grads(other, variables, ids)), jax.tree.leaves(scanned), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_qwen2_moe_s_shared_expert_adds_its_gated_mlp():
    model = moe_model(shared_expert_features=20, norm_topk_prob=False)
    variables = init(model)
    layers = variables["params"]["layers"]
    assert layers["shared_expert"]["gate_proj"]["kernel"].shape == (2, 16, 20)
    assert layers["shared_expert_gate"]["kernel"].shape == (2, 16, 1)
    ids = jnp.arange(1, 9)[None]
    zeroed = {**layers, "shared_expert": jax.tree.map(jnp.zeros_like, layers["shared_expert"])}
    without = {"params": {**variables["params"], "layers": zeroed}}
    assert not np.allclose(logits_of(model, variables, ids), logits_of(model, without, ids))


def test_sampling_draws_from_a_mixture_of_experts_model(variables):
    model = moe_model()
    prompt = jnp.asarray([[3, 4, 5, 6]])
    drawn = generate(model, variables, prompt, jnp.asarray([4]), max_new_tokens=5,
                     sampling=Sampling(temperature=1.0), key=jax.random.key(0))
    assert drawn.tokens.shape[-1] >= 5


def test_refusals_name_what_is_wrong(variables):
    """Each refusal names what is wrong. Op by op, not compiled: the check that routes name this
    model's experts reads their values, which a compiled call sees only as tracers."""
    dense = tiny_model()
    ids = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="no experts"):
        dense.apply(init(dense), ids, method=dense.hidden, return_routing=True)
    model, sparse = moe_model(), variables
    with pytest.raises(ValueError, match=r"\[B, S, layers, experts_per_token\] = \(1, 4, 2, 2\)"):
        model.apply(sparse, ids, method=model.hidden, routes=jnp.zeros((1, 4, 2, 1), jnp.int32),
                    routed=jnp.ones((1, 4), bool))
    with pytest.raises(ValueError, match="this model's are 0..3"):
        model.apply(sparse, ids, method=model.hidden, routes=jnp.full((1, 4, 2, 2), 4, jnp.int32),
                    routed=jnp.ones((1, 4), bool))
    with pytest.raises(ValueError, match="1..experts"):
        init(moe_model(experts_per_token=5))


def test_adapters_on_a_mixture_of_experts_model_train_its_attention_and_quantizing_it_is_refused(variables):
    from dew_lib.models import lora, quantize

    model = moe_model()
    adapted, with_adapters = lora.attach(model, variables, lora.LoRA(rank=2, targets=("q_proj", "o_proj")),
                                         jax.random.key(1))
    ids = jnp.arange(1, 17).reshape(2, 8)  # the decode test's shape: its program serves
    np.testing.assert_allclose(logits_of(adapted, with_adapters, ids), logits_of(model, variables, ids), atol=1e-6)
    with pytest.raises(ValueError, match="attention projections only"):
        lora.attach(model, variables, lora.LoRA(rank=2, targets="all-linear"), jax.random.key(1))
    with pytest.raises(ValueError, match="mixtures of experts"):
        quantize.quantize_base(adapted, with_adapters)


# -- dense and sparse layers mixed (dense_layers) -----------------------------------------------


def test_a_dense_layer_is_a_sparse_layer_whose_experts_all_equal_its_mlp():
    """With every expert a copy of one MLP and the k weights renormalised, a sparse layer computes
    that MLP: so a model whose layer 1 of 4 is dense equals an all-sparse one built that way,
    which checks that each layer reads its own rows of the stacked leaves."""
    mixed = moe_model(num_layers=4, dense_layers=(1,), mlp_features=24)
    sparse = moe_model(num_layers=4)
    variables, reference = init(mixed), init(sparse)
    layers, other = variables["params"]["layers"], dict(reference["params"]["layers"])
    assert layers["gate_proj"]["kernel"].shape == (1, 16, 24) and layers["router"]["kernel"].shape == (3, 16, 4)
    assert mixed.moe_layers == (0, 2, 3)
    # the same seed draws the same attention weights, and the sparse layers' experts, per layer
    np.testing.assert_array_equal(layers["q_proj"]["kernel"], other["q_proj"]["kernel"])
    np.testing.assert_array_equal(layers["experts"]["up_proj"], other["experts"]["up_proj"][jnp.asarray([0, 2, 3])])
    experts = dict(other["experts"])
    for name in ("gate_proj", "up_proj", "down_proj"):
        dense = layers[name]["kernel"][0]
        experts[name] = experts[name].at[1].set(jnp.broadcast_to(dense, (EXPERTS, *dense.shape)))
    other["experts"] = experts
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "input_layernorm", "post_attention_layernorm",
                 "q_norm", "k_norm"):
        other[name] = layers[name]
    for name in ("router", "experts"):
        other[name] = jax.tree.map(lambda full, own: full.at[jnp.asarray([0, 2, 3])].set(own), other[name],
                                   layers[name])
    built = {"params": {**variables["params"], "layers": other}}
    ids = jnp.asarray(np.random.default_rng(5).integers(1, 32, size=(2, 8)))
    np.testing.assert_allclose(logits_of(mixed, variables, ids), logits_of(sparse, built, ids), rtol=1e-5, atol=1e-5)
    _, routing = routed_hidden(mixed, variables, ids)
    _, full = routed_hidden(sparse, built, ids)
    assert routing.experts.shape == (2, 8, 3, TOP_K)  # the sparse layers only, in order
    np.testing.assert_array_equal(routing.experts, full.experts[:, :, jnp.asarray([0, 2, 3])])


@pytest.mark.parametrize("dense_layers", [(0, 2), (1, 2)])
def test_mixed_layers_scan_loop_remat_decode_and_replay_agree(dense_layers):
    ids = jnp.asarray(np.random.default_rng(6).integers(1, 32, size=(2, 6)))
    model = moe_model(num_layers=4, dense_layers=dense_layers)
    variables = init(model)

    def hidden(**replay):
        return routed_hidden(model, variables, ids, **replay)

    scanned = square_grads(model, variables, ids)
    for other in (moe_model(num_layers=4, dense_layers=dense_layers, scan_layers=False),
                  moe_model(num_layers=4, dense_layers=dense_layers, remat=True)):
        for a, b in zip(jax.tree.leaves(square_grads(other, variables, ids)), jax.tree.leaves(scanned), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    forward = logits_of(model, variables, ids)
    _, routing = hidden()
    assert routing.experts.shape == (2, 6, 2, TOP_K) and routing.load.shape == (2, EXPERTS)
    decode = jax.jit(functools.partial(model.apply, method=model.decode, return_routes=True))
    step, _, routes = decode(variables, ids[:, 0], model.empty_cache(2, 8), jnp.ones((2,), bool))
    np.testing.assert_allclose(step, forward[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(routes, routing.experts[:, 0])
    other = (routing.experts + 1) % EXPERTS
    _, replayed = hidden(routes=other, routed=jnp.ones(ids.shape, bool))
    np.testing.assert_array_equal(replayed.experts, other)
    with pytest.raises(ValueError, match=r"\(2, 6, 2, 2\)"):  # routes over all 4 layers are refused
        hidden(routes=jnp.zeros((2, 6, 4, 2), jnp.int32), routed=jnp.ones(ids.shape, bool))


def test_adapters_attach_to_every_layer_of_a_mixed_model(mixed_variables):
    from dew_lib.models import lora

    model, variables = moe_model(num_layers=3, dense_layers=(1,)), mixed_variables
    adapted, with_adapters = lora.attach(model, variables, lora.LoRA(rank=2, targets=("q_proj", "v_proj")),
                                         jax.random.key(1))
    assert with_adapters["params"]["layers"]["q_proj"]["lora_a"].shape == (3, 16, 2)
    ids = jnp.arange(1, 9)[None]
    plain = logits_of(model, variables, ids)
    np.testing.assert_allclose(logits_of(adapted, with_adapters, ids), plain, atol=1e-6)
    merged_model, merged = lora.merged(adapted, with_adapters)
    np.testing.assert_allclose(logits_of(merged_model, merged, ids), plain, atol=1e-6)


@pytest.mark.parametrize("options, message", [
    (dict(experts=0, dense_layers=(0,)), "experts=0"),
    (dict(dense_layers=(1, 0)), "sorted distinct"),
    (dict(dense_layers=(2,)), "sorted distinct"),
    (dict(dense_layers=(0, 1)), "every layer dense"),
])
def test_dense_layers_refusals(options, message):
    with pytest.raises(ValueError, match=message):
        init(moe_model(**options))


def test_the_legacy_per_layer_conversion_leaves_a_mixed_stack_alone(variables, mixed_variables):
    """Checkpoint restore falls back to the per-layer layout written before stacking; no mixed
    model was ever written that way, so its stack is not cut into layers_i subtrees."""
    from dew_lib.models.decoder import stack_layers, unstack_layers

    mixed, homogeneous = mixed_variables, variables
    assert jax.tree.structure(unstack_layers(mixed)) == jax.tree.structure(mixed)
    per_layer = unstack_layers(homogeneous)
    assert set(per_layer["params"]) >= {"layers_0", "layers_1"}
    for a, b in zip(jax.tree.leaves(stack_layers(per_layer)), jax.tree.leaves(homogeneous), strict=True):
        np.testing.assert_array_equal(a, b)

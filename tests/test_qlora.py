"""QLoRA with an int8 or NF4 base: the projections' bytes, the logits' error against float32,
training that moves the adapters alone over bit-identical quantized leaves, DPO's and GRPO's
reference as the quantized base exactly, sampling, a merged save that loads as a plain model, and
the pipeline's `lora.quantize` through the builders."""

import dataclasses
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import fit_adapters, pairs_batch, tiny_model

from dew_lib import Dataset, Trainer
from dew_lib.models import lora, partitioning, quantize
from dew_lib.objectives import DPOObjective, GRPOObjective, loss
from dew_lib.sampling import Sampling, generate

MODEL = tiny_model()  # 2 layers, width 16, 4 heads of 4, 2 KV heads, MLP 32, vocabulary 32
WIDE = tiny_model(emb_features=64, mlp_features=128)
IDS = jnp.array([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]])
EVERY = lora.LoRA(rank=4, alpha=8, targets="all-linear")


@functools.cache
def weights(model):
    """`model`'s weights, made once, on first use, not at import: every xdist worker imports every
    module, and compiles at import would run with all of XLA's optimizations (conftest.py turns
    them off per module)."""
    return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


def base():
    """MODEL's weights, the float base the tests quantize."""
    return weights(MODEL)


@functools.partial(jax.jit, static_argnums=0)
def logits(model, variables):
    """`model`'s logits on IDS, compiled once per model: the tests compare many forwards of few
    models, and an eager forward traced the layers' scan anew and compiled it each time."""
    return model.apply(variables, IDS)


def quantized(config=EVERY, model=MODEL, bits=8):
    """An adapted model over an int8 (or NF4: bits=4) base, and the float adapted model it came
    from, on `weights(model)`."""
    return _quantized(config, model, bits)


@functools.cache
def _quantized(config, model, bits):
    """Made once for each choice (no test writes into them): quantize_base runs eagerly, op by op,
    and its scans over the layers compiled anew on every call."""
    adapted, fresh = lora.attach(model, weights(model), config, jax.random.key(1))
    return (*quantize.quantize_base(adapted, fresh, bits=bits), adapted, fresh)


def nudged(variables, by=0.1):
    return jax.tree_util.tree_map_with_path(lambda p, x: x + by if lora.is_adapter(p) else x, variables)


def projection_bytes(variables):
    layers = variables["params"]["layers"]
    return sum(leaf.nbytes for name in quantize.PROJECTIONS for key, leaf in layers[name].items()
               if key in ("kernel", quantize.SCALE, quantize.ABSMAX))


def test_the_projections_are_int8_with_a_float32_scale_per_output_channel_within_half_a_step():
    model, variables, _, fresh = quantized()
    assert model.quantized and model.lora == EVERY
    layers, before = variables["params"]["layers"], fresh["params"]["layers"]
    for name in quantize.PROJECTIONS:
        values, scale = layers[name]["kernel"], layers[name][quantize.SCALE]
        assert values.dtype == jnp.int8 and scale.dtype == jnp.float32
        assert scale.shape == (2, values.shape[2]) and int(jnp.abs(values).max()) == 127
        error = jnp.abs(values * scale[:, None, :] - before[name]["kernel"])
        assert bool(jnp.all(error <= scale[:, None, :] / 2 + 1e-9))
        assert layers[name]["lora_a"] is before[name]["lora_a"]
    for kept in ("embed_tokens", "norm", "lm_head"):
        assert variables["params"][kept] is base()["params"][kept]
    assert variables["params"]["layers"]["input_layernorm"] is base()["params"]["layers"]["input_layernorm"]
    # the model's own init makes the same leaves (their shapes and dtypes: traced, not run)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(model.init, jax.random.key(3), IDS)) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), variables)


def test_the_projections_take_a_quarter_of_their_float32_bytes_plus_a_scale_per_output():
    """1/4 + 1/in of float32 per kernel: 11/36 = 0.306 for the tiny model (width 16), 19/72 = 0.264
    at width 64; 0.27 or less from an input width of 50."""
    for model, ratio in ((MODEL, 11 / 36), (WIDE, 19 / 72)):
        _, variables, _, _ = quantized(model=model)
        assert projection_bytes(variables) / projection_bytes(weights(model)) == pytest.approx(ratio, rel=1e-12)
    assert 19 / 72 <= 0.27


@pytest.mark.parametrize("layout", [dict(), dict(scan_layers=False), dict(remat=True)],
                         ids=["scanned", "looped", "remat"])
def test_the_int8_base_s_logits_stay_within_2e_3_of_float32(layout):
    """The tiny model's logits reach 0.3; the int8 base moves them by 9.3e-4 at most and the
    next-token distributions by a mean KL of 1.5e-8 (docs/lora.md has a larger model)."""
    model, variables, _, _ = quantized()
    exact = logits(MODEL.clone(**layout), base())
    approximate = logits(model.clone(**layout), variables)
    error = float(jnp.abs(approximate - exact).max())
    assert 0 < error < 2e-3
    log_p, log_q = jax.nn.log_softmax(exact), jax.nn.log_softmax(approximate)
    assert float(jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1))) < 1e-7
    # the int8 model computes the float model of its dequantized kernels
    plain = quantize.dequantized(lora.split(variables)[1])
    np.testing.assert_array_equal(approximate, logits(MODEL.clone(**layout), plain))


def test_quantizing_refuses_unknown_bits_a_second_pass_and_a_base_without_adapters():
    model, variables, adapted, fresh = quantized()
    with pytest.raises(ValueError, match=r"bits=3\) is not supported; use bits=8 .* or bits=4 \(NF4"):
        quantize.quantize_base(adapted, fresh, bits=3)
    with pytest.raises(ValueError, match="already quantized"):
        quantize.quantize_base(model, variables)
    with pytest.raises(ValueError, match="no adapters: the Trainer would try to train its int8 weights"):
        quantize.quantize_base(MODEL, base())
    with pytest.raises(ValueError, match="attach adapters to the full-precision base, then quantize"):
        lora.attach(model.clone(lora=None), lora.split(variables)[1], EVERY, jax.random.key(0))


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "nf4"])
def test_training_moves_only_the_adapters_and_the_quantized_base_stays_bit_for_bit(bits):
    model, variables, _, _ = quantized(lora.LoRA(rank=2, targets=("q_proj", "v_proj", "down_proj")), bits=bits)
    state, sink = fit_adapters(model, variables)
    trained, frozen = lora.split(state.params)
    start_adapters, start_base = lora.split(variables)
    for after, before in zip(jax.tree.leaves(frozen), jax.tree.leaves(start_base), strict=True):
        assert after.dtype == before.dtype
        np.testing.assert_array_equal(after, before)
    assert all(jnp.any(a != b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(start_adapters)))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(state.opt_state[0].mu))
    losses = [value for _, value in sink.series("loss")]
    assert losses[-1] < losses[0]


def test_the_reference_of_dpo_and_grpo_is_the_int8_base_exactly():
    """Adapters off over the int8 base give the logits of the int8 base without adapters."""
    from dew_lib.records.sessions import Call, Session
    from dew_lib.rollouts.packing import pack

    model, variables, _, _ = quantized()
    base_model, int8_base = model.clone(lora=None), lora.split(variables)[1]
    objective = DPOObjective(model, seq_len=3, beta=0.1, pretrained=variables)
    batch = pairs_batch()
    value, _ = jax.jit(functools.partial(loss, objective))(variables, batch, reference=lora.without_adapters(variables))
    np.testing.assert_allclose(value, np.log(2.0), rtol=1e-6)
    state = Trainer(objective, optax.adam(3e-2), key=jax.random.key(1)).fit(
        Dataset(train=lambda p: itertools.repeat(batch), batch=8), steps=3, log_every=3, sinks=[])
    assert state.ema is None
    reference = lora.without_adapters(state.params)
    assert not np.array_equal(logits(model, state.params), logits(base_model, int8_base))
    np.testing.assert_array_equal(logits(model, reference), logits(base_model, int8_base))

    call = Call(prompt_ids=np.array([3, 4]), sampled_ids=np.array([5, 6, 7]),
                behavior_log_probs=np.full(3, -1.0), raw_log_probs=np.full(3, -1.0))
    packed = pack([Session(task="t", group=0, sample=i, calls=(call,), reward=float(i)) for i in range(2)], 8)
    np.testing.assert_array_equal(GRPOObjective(model, seq_len=7).packed_log_probs(reference, packed),
                                  GRPOObjective(base_model, seq_len=7).packed_log_probs(int8_base, packed))


def test_sampling_draws_from_the_int8_base_through_the_adapters():
    model, variables, _, _ = quantized()
    prompt, lengths = np.array([[0, 0, 5, 6], [7, 8, 9, 10]]), [2, 4]
    draw = dict(key=jax.random.key(2), max_new_tokens=6, sampling=Sampling(temperature=0.0))
    fresh = generate(model, variables, prompt, lengths, **draw)
    plain = generate(model.clone(lora=None), lora.split(variables)[1], prompt, lengths, **draw)
    np.testing.assert_array_equal(fresh.tokens, plain.tokens)
    moved = generate(model, nudged(variables, 0.3), prompt, lengths, **draw)
    assert not np.array_equal(moved.tokens, fresh.tokens)


@pytest.mark.parametrize("bits", [8, 4], ids=["int8", "nf4"])
def test_a_merged_save_is_a_plain_float_checkpoint_with_the_quantized_adapted_logits(tmp_path, bits):
    from dew_lib.models import Pretrained, load_pretrained

    model, variables, _, _ = quantized(bits=bits)
    moved = nudged(variables)
    pretrained = dataclasses.replace(Pretrained.from_model(MODEL), model=model)
    exported = dict(pretrained.export(moved, dtype=None))
    assert all(array.dtype == np.float32 for array in exported.values())
    assert not any("scale" in name or "absmax" in name or "lora" in name for name in exported)
    pretrained.save(moved, tmp_path / "merged", dtype=None)
    loaded = load_pretrained(tmp_path / "merged", tokenizer=False)
    assert loaded.model.lora is None and not loaded.model.quantized
    assert not lora.has_adapters(loaded.variables) and not quantize.is_quantized(loaded.variables)
    np.testing.assert_allclose(logits(loaded.model, loaded.variables), logits(model, moved), atol=2e-5)
    merged_model, merged = lora.merged(model, moved)
    assert not merged_model.quantized and merged_model.lora is None
    np.testing.assert_allclose(logits(merged_model, merged), logits(model, moved), atol=2e-5)


def test_the_scales_split_over_a_mesh_like_their_kernels_outputs():
    for name, out in (("q_proj", "heads"), ("k_proj", "kv_heads"), ("o_proj", "embed"), ("up_proj", "mlp"),
                      ("down_proj", "embed")):
        assert partitioning.logical_axes(("params", "layers", name, quantize.SCALE), 2) == ("layers", out)
        assert partitioning.logical_axes(("params", "layers", name, "kernel"), 3)[2] == out


NF4_GAP = 0.3038071990013123  # NF4's widest gap between neighbouring levels (-1.0 and -0.696...)


def test_nf4_packs_two_codes_a_byte_beside_an_absmax_per_block_within_half_the_widest_gap():
    """Each weight within half NF4's widest gap times its block's absmax; the packed codes are
    qwix's own, input row 2i in a byte's low half and 2i+1 in its high half."""
    import qwix

    model, variables, _, fresh = quantized(bits=4)
    assert model.quantized == "nf4" and model.lora == EVERY
    layers, before = variables["params"]["layers"], fresh["params"]["layers"]
    for name in quantize.PROJECTIONS:
        codes, absmax, kernel = layers[name]["kernel"], layers[name][quantize.ABSMAX], before[name]["kernel"]
        block = quantize.nf4_block(kernel.shape[1])
        assert codes.dtype == jnp.uint8 and codes.shape == (2, kernel.shape[1] // 2, kernel.shape[2])
        assert absmax.shape == (2, kernel.shape[1] // block, kernel.shape[2]) and absmax.dtype == jnp.float32
        per_weight = jnp.repeat(absmax, block, axis=1)
        np.testing.assert_allclose(per_weight.max(axis=1), jnp.abs(kernel).max(axis=1), rtol=1e-6)
        error = jnp.abs(quantize.dequantized_kernel(codes, absmax) - kernel)
        assert bool(jnp.all(error <= per_weight * NF4_GAP / 2 + 1e-7))
        own = qwix.quantize(kernel[0], "nf4", channelwise_axes=(1,), tiled_axes={0: block}).qvalue.astype(jnp.uint8)
        np.testing.assert_array_equal(codes[0] & 15, own[0::2])
        np.testing.assert_array_equal(codes[0] >> 4, own[1::2])
    assert jax.tree.map(lambda x: (x.shape, x.dtype), jax.eval_shape(model.init, jax.random.key(3), IDS)) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), variables)
    # an eighth of float32 for the codes and one float32 per block: 1/8 + 1/64 at width 64
    _, wide, _, _ = quantized(model=WIDE, bits=4)
    assert projection_bytes(wide) / projection_bytes(weights(WIDE)) == pytest.approx(1 / 8 + 1 / 64, rel=1e-12)


@pytest.mark.parametrize("layout", [dict(), dict(scan_layers=False), dict(remat=True)],
                         ids=["scanned", "looped", "remat"])
def test_the_nf4_base_s_logits_stay_within_4e_2_of_float32(layout):
    """The tiny model's logits reach 0.3; its NF4 base moves them by 1.6e-2 at most and the
    next-token distributions by a mean KL of 4.5e-6, about 20x and 300x what int8 moves them
    by here (docs/lora.md)."""
    model, variables, _, _ = quantized(bits=4)
    exact = logits(MODEL.clone(**layout), base())
    approximate = logits(model.clone(**layout), variables)
    error = float(jnp.abs(approximate - exact).max())
    assert 2e-3 < error < 4e-2
    log_p, log_q = jax.nn.log_softmax(exact), jax.nn.log_softmax(approximate)
    assert float(jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1))) < 1e-5
    plain = quantize.dequantized(lora.split(variables)[1])
    np.testing.assert_array_equal(approximate, logits(MODEL.clone(**layout), plain))


def test_the_lora_options_quantize_only_under_adapters_and_key_the_choice_only_when_made():
    from pydantic import ValidationError

    from dew_lib.recipes import DPOOptions, LoRAOptions

    with pytest.raises(ValidationError, match=r"lora.quantize='int8' .* lora.rank is 0 .* set lora.rank > 0, "
                                              r"or lora.quantize='none'"):
        LoRAOptions(quantize="int8")
    with pytest.raises(ValidationError, match="quantize"):
        LoRAOptions(rank=2, quantize="int4")
    # "none" stays out of the dump (so stages keyed before the option keep their keys); a choice is recorded
    assert "quantize" not in LoRAOptions(rank=2).model_dump(mode="json")
    chosen = DPOOptions(lora=dict(rank=2, quantize="int8")).model_dump(mode="json")["lora"]
    assert chosen["quantize"] == "int8" and DPOOptions.model_validate({"lora": chosen}).lora.quantize == "int8"


@pytest.mark.parametrize("kind, bound", [("int8", 2e-3), ("nf4", 4e-2)])
def test_a_stage_with_lora_quantize_trains_adapters_on_a_quantized_base_and_saves_a_float_policy_and_adapter(
        tmp_path, kind, bound):
    """What a text stage does with `lora.quantize`: its builder attaches the adapters, then
    quantizes the base under them; the adapters train over bit-identical quantized leaves; the stage's
    merged policy is a plain float checkpoint with the trained logits, its PEFT adapter loads on
    the float base."""
    from dew_lib.data import Loading, PreferencePairs
    from dew_lib.models import Pretrained, load_adapter, load_pretrained, save_adapter
    from dew_lib.recipes import DPOOptions, LoRAOptions
    from dew_lib.recipes.build import build_dpo

    rows = [{"chosen": [1, p, 3, 5], "rejected": [1, p, 4, 5],
             "chosen_mask": [0, 0, 1, 1], "rejected_mask": [0, 0, 1, 1]} for p in (2, 6, 7, 8)]
    pairs = PreferencePairs(records=tuple(json.dumps(r) for r in rows * 2), seq_len=4,
                            loading=Loading(workers=0, threads=1, read_buffer=2))
    options = DPOOptions(steps=3, batch=8, beta=0.1, learning_rate=3e-2,
                         lora=LoRAOptions(rank=2, targets=("q_proj", "down_proj"), quantize=kind))
    built = build_dpo(MODEL, base(), pairs, options, key=jax.random.key(1))
    assert built.model.quantized == {"int8": True, "nf4": "nf4"}[kind] and built.model.lora == options.lora.config()
    start = built.objective.pretrained
    stored = {"int8": jnp.int8, "nf4": jnp.uint8}[kind]
    assert quantize.is_quantized(start) and start["params"]["layers"]["q_proj"]["kernel"].dtype == stored
    assert options.lora.attach(built.model, start, jax.random.key(1)) == (built.model, start)  # once only
    state = Trainer(built.objective, optax.adam(3e-2), key=jax.random.key(0)).fit(
        built.dataset, steps=3, log_every=3, sinks=[])
    trained, frozen = lora.split(state.params)
    for after, before in zip(jax.tree.leaves(frozen), jax.tree.leaves(lora.split(start)[1]), strict=True):
        assert after.dtype == before.dtype
        np.testing.assert_array_equal(after, before)
    assert all(jnp.any(a != b) for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(lora.split(start)[0])))

    # the stage's two saves (tasks/train.py): the merged float policy and the PEFT adapter
    pretrained = dataclasses.replace(Pretrained.from_model(MODEL), model=built.model)
    pretrained.save(state.params, tmp_path / "policy", dtype=None)
    save_adapter(tmp_path / "adapter", built.model, {"params": trained["params"]})
    merged = load_pretrained(tmp_path / "policy", tokenizer=False)
    assert not merged.model.quantized and not quantize.is_quantized(merged.variables)
    trained_logits = logits(built.model, state.params)
    np.testing.assert_allclose(logits(merged.model, merged.variables), trained_logits, atol=2e-5)
    on_float, on_float_variables = load_adapter(tmp_path / "adapter", MODEL, base())
    assert not on_float.quantized
    error = jnp.abs(logits(on_float, on_float_variables) - trained_logits).max()
    assert 0 < float(error) < bound  # the quantized base's error, as for the base alone


def test_ppo_s_policy_and_critic_read_one_int8_base_and_train_their_adapters_and_head_alone():
    from dew_lib.data import Loading, Prompts
    from dew_lib.recipes import EpisodeOptions, GRPOOptions, LoRAOptions, OneTurn, PPOOptions
    from dew_lib.recipes.episodes import build_episode_grpo

    records = tuple(json.dumps({"prompt": [3, 4, 5], "ground_truth": "1"}) for _ in range(4))
    prompts = Prompts(records=records, max_prompt_len=4, loading=Loading(seed=None))
    side = GRPOOptions(steps=1, batch=2, groups=2, max_new_tokens=4,
                       lora=LoRAOptions(rank=2, targets="all-linear", quantize="int8"))
    ppo = build_episode_grpo(MODEL, base(), prompts, side, EpisodeOptions(max_turns=1, max_prompt_len=4),
                             environment=OneTurn, verifier=lambda task, episode: 1.0, eos_id=2, ppo=PPOOptions())
    assert ppo.model.quantized
    trainer = Trainer(ppo.objective, optax.adam(1e-3), key=jax.random.key(0))
    state = trainer.abstract_state()  # what the state holds: shapes and dtypes, nothing computed
    assert quantize.is_quantized(state.params["policy"])
    # the critic's adapters and head read the policy's int8 base: the state holds no second base
    assert ppo.objective.shares_base and not quantize.is_quantized(state.params["critic"])
    assert quantize.is_quantized(ppo.objective.critic_params(state.params))
    leaves = zip(jax.tree_util.tree_leaves_with_path(trainer.trainable_marks), jax.tree.leaves(state.params),
                 strict=True)
    trained = [(path, leaf.dtype) for (path, mark), leaf in leaves if mark]
    assert trained and all(dtype == jnp.float32 for _, dtype in trained)  # no quantized leaf trains
    # the policy and the critic: their adapters; beside them only the critic's value head
    assert all(lora.is_adapter(path) or "'value'" in jax.tree_util.keystr(path) for path, _ in trained)

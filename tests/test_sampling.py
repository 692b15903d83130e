"""Generation: cached log-probs equal rescoring, EOS stops rows, filters match their math."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from dew_lib.objectives.lm import token_log_probs
from dew_lib.sampling import Sampling, _generate, argmax, cache_stages, filter_logits, generate, sample

MODEL = tiny_model(max_seq_len=48)


@functools.cache
def variables():
    """MODEL's weights, made once, on first use, not at import: every xdist worker imports every
    module, and made eagerly at import they compiled op by op with all of XLA's optimizations."""
    return jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


# Compiled once per setting: called eagerly, each ran op by op (and a forward's layer scan
# compiled anew every call).
compiled_sample = jax.jit(sample, static_argnums=2)


def left_padded(lengths, width, seed=0):
    rng = np.random.default_rng(seed)
    prompt = np.zeros((len(lengths), width), np.int32)
    for row, length in enumerate(lengths):
        prompt[row, width - length:] = rng.integers(1, 32, length)
    return prompt, np.array(lengths, np.int32)


@functools.partial(jax.jit, static_argnums=0)
def full_log_probs(model, variables, ids):
    """Raw log-probs of `ids[:, 1:]` from a full forward pass over `ids[:, :-1]`."""
    return token_log_probs(model.apply(variables, ids[:, :-1]), ids[:, 1:])


def rescore(prompt, lengths, generation, model=MODEL, weights=None):
    """Raw log-probs of each row's sampled ids from a full forward pass over its prompt and
    sampled ids, unpadded at the start of a row of `model.max_seq_len`: attention is causal, so
    the padding after them changes none of their logits, and every call has one shape."""
    width = prompt.shape[1]
    ids = np.zeros((len(lengths), model.max_seq_len), np.int32)
    ends = []
    for row, length in enumerate(lengths):
        n = int(generation.lengths[row])
        ids[row, :length + n] = np.concatenate([prompt[row, width - length:], np.asarray(generation.tokens[row, :n])])
        ends.append(length + n)
    scores = np.asarray(full_log_probs(model, variables() if weights is None else weights, ids))
    return [scores[row, length - 1:end - 1] for row, (length, end) in enumerate(zip(lengths, ends, strict=True))]


@pytest.mark.parametrize("sampling", [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, eos_id=(3, 7)),
    Sampling(temperature=0.0, eos_id=4),
])
def test_cached_log_probs_equal_full_rescoring(sampling):
    prompt, lengths = left_padded([6, 3, 1, 4], width=6)
    out = generate(MODEL, variables(), prompt, lengths, key=jax.random.key(1), max_new_tokens=12,
                   sampling=sampling)
    for row, expected in enumerate(rescore(prompt, lengths, out)):
        n = int(out.lengths[row])
        np.testing.assert_allclose(np.asarray(out.log_probs[row, :n]), expected, atol=2e-5)
        assert np.all(np.asarray(out.log_probs[row, n:]) == 0)


def test_long_loops_grow_their_cache_in_stages():
    assert cache_stages(32, 128) == (64, 96, 128, 160)
    assert cache_stages(5, 70) == (23, 41, 59, 75)
    assert cache_stages(6, 12) == (18,)  # short loops keep one cache


def test_a_grown_cache_gives_the_log_probs_of_full_rescoring():
    model = tiny_model(max_seq_len=96)
    weights = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))  # compiled whole
    prompt, lengths = left_padded([6, 3, 1, 5], width=6, seed=2)
    out = generate(model, weights, prompt, lengths, key=jax.random.key(3), max_new_tokens=70,
                   sampling=Sampling(temperature=1.0, eos_id=5))
    n = np.asarray(out.lengths)
    assert n.max() > 18 + 18 and n.min() < n.max(), "seed chosen so rows stop in different stages"
    for row, expected in enumerate(rescore(prompt, lengths, out, model, weights)):
        np.testing.assert_allclose(np.asarray(out.log_probs[row, :n[row]]), expected, atol=2e-5)


def test_argmax_is_jnp_argmax_on_ties_nan_and_filtered_rows():
    x = np.random.default_rng(0).normal(size=(5, 40)).astype(np.float32)
    x[0, [5, 9]] = 10.0  # a tie: the first index
    x[1] = -np.inf  # every id filtered out
    x[2, [7, 3]] = np.nan  # the first NaN, as jnp.argmax
    x[3, 4] = np.inf
    np.testing.assert_array_equal(argmax(x), jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(argmax(x)[:4], [5, 0, 3, 4])


def test_sampled_ids_are_the_draws_of_jax_random_categorical():
    categorical = jax.jit(jax.random.categorical)
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(8, 64)) * 3, jnp.float32)
    for seed in range(20):
        ids, _, _ = compiled_sample(logits, jax.random.key(seed), Sampling(temperature=1.0))
        np.testing.assert_array_equal(ids, categorical(jax.random.key(seed), logits))


def test_greedy_picks_the_argmax_and_reports_zero_behavior_log_prob():
    prompt, lengths = left_padded([5, 2], width=5)
    out = generate(MODEL, variables(), prompt, lengths, key=jax.random.key(0), max_new_tokens=6,
                   sampling=Sampling(temperature=0.0))
    assert np.all(np.asarray(out.behavior_log_probs) == 0.0)
    ids = np.concatenate([prompt[1, 3:], np.asarray(out.tokens[1])])
    logits = jax.jit(MODEL.apply)(variables(), ids[None, :-1])[0, 1:]
    np.testing.assert_array_equal(np.argmax(logits, -1), np.asarray(out.tokens[1]))


def test_rows_stop_at_any_eos_and_pad_afterwards():
    prompt, lengths = left_padded([4, 4, 4, 4, 4, 4, 4, 4], width=4, seed=3)
    sampling = Sampling(temperature=1.0, eos_id=(2, 5, 9))
    out = generate(MODEL, variables(), prompt, lengths, key=jax.random.key(5), max_new_tokens=16,
                   sampling=sampling, pad_id=31)
    tokens, count = np.asarray(out.tokens), np.asarray(out.lengths)
    for row in range(len(tokens)):
        n = count[row]
        if out.stopped[row]:
            assert tokens[row, n - 1] in (2, 5, 9)
            assert not np.isin(tokens[row, : n - 1], (2, 5, 9)).any()
        else:
            assert n == 16
        assert np.all(tokens[row, n:] == 31)
    assert out.stopped.any(), "seed chosen so that some row stops"


def test_a_stopped_row_leaves_its_cache_untouched():
    cache = MODEL.empty_cache(2, 10)
    cache = cache._replace(lengths=jnp.array([3, 3]))
    decode = jax.jit(functools.partial(MODEL.apply, method=MODEL.decode))  # compiled whole
    _, after = decode(variables(), jnp.array([4, 4]), cache, jnp.array([True, False]))
    for before, now in zip(cache.keys + cache.values, after.keys + after.values):
        np.testing.assert_array_equal(before[1], now[1])
        assert not np.array_equal(before[0], now[0])
    np.testing.assert_array_equal(after.lengths, [4, 3])


def test_prompt_lengths_share_one_compilation():
    before = _generate._cache_size()
    for lengths in ([5, 1, 3], [2, 2, 2], [1, 5, 4]):
        prompt, lengths = left_padded(lengths, width=5)
        generate(MODEL, variables(), prompt, lengths, key=jax.random.key(0), max_new_tokens=4,
                 sampling=Sampling(top_k=3))
    assert _generate._cache_size() - before == 1


def test_top_k_top_p_min_p_keep_what_their_definitions_keep():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    def kept(sampling):
        return np.isfinite(np.asarray(filter_logits(logits, sampling)))[0].tolist()
    assert kept(Sampling(top_k=2)) == [True, True, False, False, False]
    # mass before each id: 0, .5, .7, .85, .95 -> top_p=.8 keeps the first three
    assert kept(Sampling(top_p=0.8)) == [True, True, True, False, False]
    assert kept(Sampling(min_p=0.3)) == [True, True, True, False, False]  # floor .15
    assert kept(Sampling(min_p=0.35)) == [True, True, False, False, False]


def test_behavior_log_prob_is_the_renormalized_filtered_probability():
    logits = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    ids, raw, behavior = compiled_sample(logits, jax.random.key(0), Sampling(top_k=2))
    expected = {0: 0.5 / 0.7, 1: 0.2 / 0.7}[int(ids[0])]
    np.testing.assert_allclose(np.exp(behavior), [expected], rtol=1e-6)
    np.testing.assert_allclose(np.exp(raw), [[0.5, 0.2][int(ids[0])]], rtol=1e-6)
    ids, _, behavior = compiled_sample(logits, jax.random.key(0), Sampling(temperature=2.0))
    tempered = np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05])
    np.testing.assert_allclose(np.exp(behavior), [tempered[int(ids[0])] / tempered.sum()], rtol=1e-5)


def test_bad_settings_and_inputs_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="eos_id"):
        Sampling(eos_id=-2)
    assert Sampling(eos_id=3).eos_id == (3,)
    prompt, lengths = left_padded([3], width=3)
    with pytest.raises(ValueError, match="max_seq_len=48"):
        generate(MODEL, variables(), prompt, lengths, key=jax.random.key(0), max_new_tokens=46)
    with pytest.raises(ValueError, match="prompt_length"):
        generate(MODEL, variables(), prompt, [4], key=jax.random.key(0), max_new_tokens=2)

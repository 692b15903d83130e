"""The diffusion building blocks: process, SDE sampler, inputs, SimpleDiT, flow matching, previews."""

import itertools
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dew_lib import DiffusionObjective, Field, InputSpec, Trainer, models, presets
from dew_lib.data import Dataset
from dew_lib.diffusion import (
    CFG,
    BagOfTokens,
    FlowSDE,
    Process,
    WordTokenizer,
    gaussian_log_density,
    grid_png,
    sample_trajectory,
)
from dew_lib.train.sinks import MemorySink


def tiny_dit(channels=1, **overrides):
    options = dict(output_channels=channels, patch_size=2, emb_features=16, num_layers=1, num_heads=2,
                   mlp_ratio=2)
    options.update(overrides)
    return models.SimpleDiT(**options)


def read_png(data: bytes) -> np.ndarray:
    """Decode the 8-bit, filter-0 PNGs grid_png writes (enough to check them)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    channels = {0: 1, 2: 3}[color]
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, 1 + width * channels)
    assert depth == 8 and np.all(raw[:, 0] == 0)
    return raw[:, 1:].reshape(height, width, channels)


# ----- process ---------------------------------------------------------------------------------
@pytest.mark.parametrize("prediction", ["velocity", "noise", "data"])
def test_every_prediction_converts_back_to_the_true_velocity(prediction):
    process = presets.Flow(prediction=prediction)()
    data, noise = jax.random.normal(jax.random.key(0), (2, 3, 4, 4, 1))
    t = jnp.array([0.3, 0.3, 0.7])
    x_t = process.interpolate(data, noise, t)
    column = t[:, None, None, None]
    np.testing.assert_allclose(x_t, (1 - column) * data + column * noise, rtol=1e-6)
    v = process.velocity(process.target(data, noise), x_t, t)
    np.testing.assert_allclose(v, noise - data, rtol=1e-4, atol=1e-5)


def test_time_grid_runs_from_one_to_zero_and_shift_spends_more_points_at_high_noise():
    plain = presets.Flow()().times(5)
    np.testing.assert_array_equal(plain, np.array([1.0, 0.75, 0.5, 0.25, 0.0], np.float32))
    shifted = presets.Flow(shift=3.0)().times(5)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and np.all(np.diff(shifted) < 0)
    assert np.all(shifted[1:-1] > plain[1:-1])
    with pytest.raises(ValueError, match="steps counts time points"):
        presets.Flow()().times(1)


def test_process_and_sde_options_are_validated():
    with pytest.raises(ValueError, match="prediction must be one of"):
        Process(prediction="epsilon")
    with pytest.raises(ValueError, match="noise_level"):
        FlowSDE(noise_level=-0.1)
    with pytest.raises(ValueError, match="window"):
        FlowSDE(window=(0.5, 0.5))


def test_ode_trajectory_with_constant_velocity_lands_exactly_one_velocity_away():
    noise = jax.random.normal(jax.random.key(1), (3, 2, 2, 1))
    path = sample_trajectory(lambda x, t: jnp.full_like(x, 0.5), noise, presets.Flow()().times(5),
                             jax.random.key(0))
    np.testing.assert_allclose(path.final, noise - 0.5, rtol=1e-6, atol=1e-6)
    assert path.states.shape == (3, 5, 2, 2, 1)
    assert not np.any(path.stochastic) and np.all(path.log_probs == 0)


def test_sde_trajectory_records_densities_only_inside_its_window():
    process = presets.Flow()()
    times = process.times(5)  # 1, .75, .5, .25, 0
    sde = FlowSDE(noise_level=0.7, window=(0.5, 1.0))

    def velocity(x, t):
        return -0.3 * x + t[:, None, None, None]

    noise = jax.random.normal(jax.random.key(2), (4, 2, 2, 1))
    path = sample_trajectory(velocity, noise, times, jax.random.key(3), sde=sde)
    np.testing.assert_array_equal(path.stochastic, np.tile([True, True, False, False], (4, 1)))
    assert np.all(path.log_probs[:, 2:] == 0) and np.all(path.log_probs[:, :2] != 0)
    for k in range(4):  # rescoring the recorded states gives the recorded densities
        x, t, t_next = path.states[:, k], jnp.full((4,), times[k]), jnp.full((4,), times[k + 1])
        if k < 2:
            mean, std = sde.transition(x, velocity(x, t), t, t_next)
            np.testing.assert_allclose(gaussian_log_density(path.states[:, k + 1], mean, std),
                                       path.log_probs[:, k], rtol=1e-5)
        else:  # deterministic intervals are plain Euler steps
            np.testing.assert_allclose(path.states[:, k + 1], x + velocity(x, t) * (times[k + 1] - times[k]),
                                       rtol=1e-6, atol=1e-6)


# ----- inputs ----------------------------------------------------------------------------------
def test_input_spec_checks_the_image_field_and_names_the_mismatch():
    inputs = InputSpec(Field("image", (4, 4, 1)))
    assert inputs.check({"image": np.zeros((2, 4, 4, 1), np.uint8)}) == 2
    with pytest.raises(ValueError, match=r"'image' has shape \(2, 4, 4, 3\).*expects \(2, 4, 4, 1\)"):
        inputs.check({"image": np.zeros((2, 4, 4, 3), np.uint8)})
    with pytest.raises(KeyError, match=r"none of this InputSpec's fields \['image'\]"):
        inputs.check({"picture": np.zeros((2, 4, 4, 1), np.uint8)})
    with pytest.raises(TypeError, match="must be numeric"):
        inputs.check({"image": np.zeros((2, 4, 4, 1), object)})
    with pytest.raises(ValueError, match=r"needs shape \(height, width, channels\)"):
        InputSpec(Field("image", (16,)))
    with pytest.raises(ValueError, match="needs an encoder"):
        InputSpec(Field("image", (4, 4, 1)), Field("label", ()))
    images = inputs.images({"image": np.array([0, 255], np.uint8).reshape(2, 1, 1, 1)})
    np.testing.assert_allclose(np.asarray(images).reshape(-1), [-1.0, 1.0])


def test_prompt_only_batches_come_from_tokenize_and_carry_captions():
    words = WordTokenizer(("red", "blue", "square"), length=3)
    inputs = InputSpec(Field("image", (4, 4, 3)),
                       Field("prompt", (3,), encoder=BagOfTokens(words.vocab_size), tokenizer=words))
    batch = inputs.tokenize(["red square", "blue"])
    np.testing.assert_array_equal(batch["prompt"], [[1, 3, 0], [2, 0, 0]])
    assert inputs.check(batch) == 2  # no image field: the size comes from the prompt
    assert inputs.captions(batch) == ["red square", "blue"]
    features = np.asarray(inputs.encode(batch))
    np.testing.assert_allclose(features, [[0, 0.5, 0, 0.5], [0, 0, 1, 0]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        inputs.tokenize(["green square"])


# ----- model -----------------------------------------------------------------------------------
def test_simple_dit_predicts_zero_at_init_and_learns_a_nonzero_map():
    model = tiny_dit(channels=3)
    x = jax.random.normal(jax.random.key(0), (2, 4, 6, 3))
    t, condition = jnp.array([0.1, 0.9]), jnp.ones((2, 5))
    variables = jax.jit(model.init)(jax.random.key(1), x, jnp.zeros(2), condition)

    def error(v):
        out = model.apply(v, x, t, condition)
        return ((out - x) ** 2).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(error, has_aux=True))(variables)
    assert out.shape == (2, 4, 6, 3) and np.all(np.asarray(out) == 0)
    # With the output at 0, the output layer's gradient is -2 x against its input: the final
    # norm's output (the zero final modulation leaves it as it is), per 2 x 2 patch.
    _, state = model.apply(variables, x, t, condition, capture_intermediates=True)
    hidden = np.asarray(state["intermediates"]["final_norm"]["__call__"][0])  # [B, patches, E]
    patches = np.asarray(x).reshape(2, 2, 2, 3, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(2, 6, 12)
    output = grads["params"]["output"]
    np.testing.assert_allclose(output["bias"], -2 * patches.sum(axis=(0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(output["kernel"], -2 * np.einsum("bne,bnk->ek", hidden, patches),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiples of patch_size=2"):
        jax.eval_shape(model.init, jax.random.key(1), jnp.zeros((1, 5, 4, 3)), jnp.zeros(1))


# ----- flow matching ---------------------------------------------------------------------------
def shapes(seed: int, count: int, size: int = 8) -> np.ndarray:
    """Toy images: a bright square or a bright cross at a random place on a dark ground, uint8."""
    rng = np.random.default_rng(seed)
    out = np.zeros((count, size, size, 1), np.uint8)
    for i in range(count):
        r, c = rng.integers(1, size - 4, size=2)
        if i % 2:
            out[i, r:r + 3, c:c + 3] = 255
        else:
            out[i, r + 1, c:c + 3] = 255
            out[i, r:r + 3, c + 1] = 255
    return out


@pytest.mark.slow
def test_flow_matching_loss_falls_on_toy_shapes():
    inputs = InputSpec(Field("image", (8, 8, 1)))
    objective = DiffusionObjective(tiny_dit(emb_features=32, num_layers=2, num_heads=4), presets.Flow()(),
                                   inputs, ema_decay=None, steps=6)
    images = shapes(0, 64)
    batches = [{"image": images[i:i + 16]} for i in range(0, 64, 16)]
    data = Dataset(train=lambda partition: itertools.cycle(batches),
                   val=lambda partition: [{"image": shapes(1, 16)}], batch=16)
    sink = MemorySink()
    trainer = Trainer(objective, optax.adam(3e-3), key=jax.random.key(0))
    state = trainer.initial_state()
    before = objective.evaluate(state.params, {"image": jnp.asarray(shapes(1, 16))})
    state = trainer.fit(data, steps=60, log_every=20, eval_every=60, sinks=[sink])
    train_losses = [m["loss"] for _, m in sink.history if "loss" in m]
    val = [m["val/loss"] for _, m in sink.history if "val/loss" in m]
    assert train_losses[-1] < 0.7 * train_losses[0]
    assert val[-1] < 0.7 * float(before["loss"][0] / before["loss"][1])
    preview = objective.preview(state.params, {"image": shapes(1, 4)})
    assert preview.images.shape == (4, 8, 8, 1) and np.abs(preview.images).max() <= 1


def test_flow_matching_refuses_batches_without_the_image_field():
    objective = DiffusionObjective(tiny_dit(), presets.Flow()(), InputSpec(Field("image", (4, 4, 1))))
    with pytest.raises(ValueError, match=r"expects \(2, 4, 4, 1\)"):
        objective.check_batch({"image": np.zeros((2, 8, 8, 1), np.uint8)})
    with pytest.raises(ValueError, match="guidance=None"):
        DiffusionObjective(tiny_dit(), presets.Flow()(), InputSpec(Field("image", (4, 4, 1))),
                           guidance=CFG(2.0))


# ----- previews --------------------------------------------------------------------------------
def test_grid_png_tiles_images_and_reads_back_exactly():
    images = np.stack([np.full((2, 3, 1), v, np.float32) for v in (-1.0, 0.0, 1.0)])
    pixels = read_png(grid_png(images, columns=2, scale=2))
    assert pixels.shape == (2 * (4 + 1) + 1, 2 * (6 + 1) + 1, 1)
    assert pixels[1, 1, 0] == 0 and pixels[1, 8, 0] == 128 and pixels[6, 1, 0] == 255
    assert pixels[0, 0, 0] == 128  # the border
    rgb = read_png(grid_png(np.zeros((1, 2, 2, 3), np.float32) + [[[[1.0, -1.0, 0.0]]]], scale=1))
    np.testing.assert_array_equal(rgb[1, 1], [255, 0, 128])
    with pytest.raises(ValueError, match=r"\[N, H, W, 1 or 3\]"):
        grid_png(np.zeros((2, 4, 4, 2)))

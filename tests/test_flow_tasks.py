"""The pieces the image flows are built from, without Prefect's harness: rewards by name, images
from a folder or an .npz, saved SimpleDiTs, and the pre-training preview hook."""

import typing

import jax
import numpy as np
import pytest

from dew_lib import models
from dew_lib.diffusion import encode_png, presets
from dew_lib.diffusion.toy import redness
from dew_lib.recipes import image_batches
from tasks.flow_train import PreviewHook
from tasks.images import REWARDS, dit_ref, load_dit, read_folder, read_npz, reward_named, save_dit
from tasks.params import FlowGRPOParams


def solid(rgb, count=2, size=4):
    """Images in [-1, 1] of one colour given in 0..1 units."""
    return np.broadcast_to(np.asarray(rgb, np.float32) * 2 - 1, (count, size, size, 3)).copy()


def test_every_reward_a_form_offers_is_registered_and_scores_what_its_name_says():
    assert set(typing.get_args(FlowGRPOParams.model_fields["reward"].annotation)) == set(REWARDS)
    red, green, blue = solid([1, 0, 0]), solid([0, 1, 0]), solid([0, 0, 1])
    assert reward_named("redness")(red, {}).tolist() == [1.0, 1.0]
    assert reward_named("greenness")(green, {}).tolist() == [1.0, 1.0]
    assert reward_named("blueness")(blue, {}).tolist() == [1.0, 1.0]
    assert reward_named("greenness")(red, {}).tolist() == [-0.5, -0.5]
    np.testing.assert_array_equal(reward_named("redness")(green, {}), redness(green, {}))
    assert reward_named("brightness")(solid([0.5, 0.5, 0.5]), {}).tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="needs RGB images.*brightness"):
        reward_named("redness")(np.zeros((2, 4, 4, 1), np.float32), {})
    with pytest.raises(ValueError, match="unknown reward 'purple'"):
        reward_named("purple")


def test_images_come_from_a_folder_resized_or_from_an_npz(tmp_path):
    folder = tmp_path / "pictures"
    (folder / "nested").mkdir(parents=True)
    (folder / "a.png").write_bytes(encode_png(np.full((6, 6, 3), [255, 0, 0], np.uint8)))
    (folder / "nested" / "b.png").write_bytes(encode_png(np.full((3, 3), 100, np.uint8)))
    (folder / "notes.txt").write_text("not an image")
    images = read_folder(str(folder), 4, 3)
    assert images.shape == (2, 4, 4, 3) and images.dtype == np.uint8
    assert images[0].reshape(-1, 3).tolist() == [[255, 0, 0]] * 16
    assert images[1].reshape(-1, 3).tolist() == [[100, 100, 100]] * 16
    assert read_folder(str(folder), 2, 1).shape == (2, 2, 2, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no .png"):
        read_folder(str(tmp_path / "empty"), 4, 3)

    np.savez(tmp_path / "set.npz", images=images)
    np.testing.assert_array_equal(read_npz(str(tmp_path / "set.npz")), images)
    np.savez(tmp_path / "float.npz", pixels=images.astype(np.float32))
    with pytest.raises(ValueError, match="uint8 array .* got float32"):
        read_npz(str(tmp_path / "float.npz"))
    np.savez(tmp_path / "two.npz", a=images, b=images)
    with pytest.raises(ValueError, match="name the image array 'images'"):
        read_npz(str(tmp_path / "two.npz"))


def test_a_saved_dit_loads_back_with_identical_variables(tmp_path):
    model = models.SimpleDiT(output_channels=3, patch_size=2, emb_features=8, num_layers=1,
                             num_heads=2, mlp_ratio=2)
    variables = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 4, 4, 3), np.float32), np.zeros((1,), np.float32))
    process = presets.Flow(shift=2.0)()
    ref = save_dit(model, variables, (4, 4, 3), process, str(tmp_path / "dit"), "abc")
    assert ref.fingerprint == "abc" and dit_ref(ref.path) == ref
    loaded, back, shape, loaded_process = load_dit(ref.path)
    assert loaded == model and shape == (4, 4, 3) and loaded_process == process
    assert jax.tree.structure(back) == jax.tree.structure(variables)
    for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="no SimpleDiT config.json"):
        load_dit(str(tmp_path))


def test_the_preview_hook_previews_every_few_steps_with_the_state_each_starts_from():
    seen = []
    hook = PreviewHook(lambda params, step: seen.append((params, step)), every=2)
    for step in range(3, 7):  # a retry resumed at step 3 (fit calls before_step from there)
        hook.before_step(step, type("State", (), {"params": f"p{step}"})())
    assert seen == [("p4", 4), ("p6", 6)]


def test_image_batches_shuffle_every_epoch_and_refuse_a_set_smaller_than_a_batch():
    images = np.arange(6, dtype=np.uint8).reshape(6, 1, 1, 1)
    stream = image_batches(images, 3, seed=0)
    epoch = [next(stream)["image"].reshape(-1) for _ in range(2)]
    assert sorted(np.concatenate(epoch).tolist()) == list(range(6))
    with pytest.raises(ValueError, match="fewer than batch=8"):
        next(image_batches(images, 8, seed=0))

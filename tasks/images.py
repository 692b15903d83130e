"""Images, rewards and saved models of the rectified-flow stages.

* `prepare_images`: the toy task's coloured shapes, or a user's folder of PNG/JPEG files or
  .npz array, written once as `images.npz` (uint8 [N, H, W, C]) with a fingerprint.
* `REWARDS`: the rewards a flow can name (a UI form cannot pass a callable).
* `save_dit`/`load_dit`: a SimpleDiT as a directory: `config.json` (the model's options, the
  image shape and the process), `model.safetensors` (every variable, float32, named by its path
  in the variables tree joined with '/', e.g. `params/DiTBlock_0/qkv/kernel`) and `dew_dit.json`
  (the fingerprint of what made it), written last so its presence means the rest is whole.
  Dew has no Hugging Face or diffusers format for these small models; this one loads with
  `safetensors` and `flax.traverse_util.unflatten_dict(..., sep="/")` anywhere.

Not here: training (tasks/flow_train.py), data with conditions (prompts or labels).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Mapping

import jax
import numpy as np
from flax import traverse_util
from prefect import get_run_logger, task
from safetensors.numpy import load_file, save_file

from dew_lib import models
from dew_lib.diffusion import presets
from dew_lib.diffusion.toy import coloured_shapes, redness
from tasks.manifests import DiTRef, ImageManifest, fingerprint
from tasks.params import DiTParams, ImageDataParams
from tasks.refusals import RunRefused, retry_unless_refused
from tasks.storage import read_json, write_json

GENERATOR_VERSION = 1  # bump when the shapes would come out differently
DIT_FORMAT = 1
PICTURES = (".png", ".jpg", ".jpeg")


# ----- rewards ---------------------------------------------------------------------------------

def _needs_colour(name: str, images: np.ndarray) -> None:
    if images.shape[-1] != 3:
        raise RunRefused(f"the reward {name!r} scores colour and needs RGB images; these have "
                         f"{images.shape[-1]} channel(s). Use reward='brightness'")


def _colour(name: str, order: tuple[int, int, int]) -> Callable:
    def reward(images: np.ndarray, batch: Mapping) -> np.ndarray:
        _needs_colour(name, images)
        return redness(np.asarray(images)[..., list(order)], batch)

    reward.__name__ = name
    reward.__doc__ = f"{name}: toy.redness with the channels reordered so {name[:-4]} comes first."
    return reward


def brightness(images: np.ndarray, batch: Mapping) -> np.ndarray:
    """Mean pixel value per sample, in [0, 1]."""
    return (np.asarray(images, np.float64).reshape(len(images), -1).mean(axis=1) + 1.0) / 2.0


def _redness(images: np.ndarray, batch: Mapping) -> np.ndarray:
    _needs_colour("redness", images)
    return redness(images, batch)


REWARDS: dict[str, Callable] = {
    "redness": _redness,
    "greenness": _colour("greenness", (1, 0, 2)),
    "blueness": _colour("blueness", (2, 0, 1)),
    "brightness": brightness,
}


def reward_named(name: str) -> Callable:
    if name not in REWARDS:
        raise RunRefused(f"unknown reward {name!r}; the rewards are {sorted(REWARDS)}")
    return REWARDS[name]


# ----- images ----------------------------------------------------------------------------------

def read_folder(path: str, size: int, channels: int) -> np.ndarray:
    """Every PNG/JPEG under `path` (sorted by name), resized to `size` x `size`, uint8."""
    from PIL import Image

    files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                   if f.lower().endswith(PICTURES))
    if not files:
        raise RunRefused(f"{path} holds no {'/'.join(PICTURES)} files; give a folder of images")
    out = np.zeros((len(files), size, size, channels), np.uint8)
    for i, name in enumerate(files):
        with Image.open(name) as image:
            image = image.convert("RGB" if channels == 3 else "L").resize((size, size), Image.BILINEAR)
            out[i] = np.asarray(image).reshape(size, size, channels)
    return out


def read_npz(path: str) -> np.ndarray:
    """The `images` array of an .npz (or its only array), checked to be uint8 [N, H, W, 1 or 3]."""
    with np.load(path) as archive:
        names = list(archive.keys())
        if "images" not in names and len(names) != 1:
            raise RunRefused(f"{path} holds {names}; name the image array 'images'")
        images = archive["images" if "images" in names else names[0]]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3) or not len(images):
        raise RunRefused(f"{path}: the images must be a non-empty uint8 array [N, H, W, 1 or 3], got "
                         f"{images.dtype} {images.shape} (scale floats to 0..255 and cast to uint8)")
    return images


def _source_stats(path: str) -> list:
    files = [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "**", "*"), recursive=True))
    return [(os.path.relpath(f, path) if f != path else os.path.basename(f), os.path.getsize(f),
             os.path.getmtime(f)) for f in files if os.path.isfile(f)]


@task(retries=1, retry_delay_seconds=1, retry_condition_fn=retry_unless_refused, task_run_name="images-{params.source}")
def prepare_images(params: ImageDataParams, directory: str, seed: int) -> ImageManifest:
    """Write the training images as `directory`/images.npz (or reuse an identical earlier set)."""
    logger = get_run_logger()
    if params.source == "shapes":
        key = fingerprint("shapes", GENERATOR_VERSION, params.count, seed)
    else:
        if params.path is None:
            raise RunRefused(f"ImageDataParams(source={params.source!r}) needs path")
        key = fingerprint(params.source, params.size, params.channels, _source_stats(params.path))
    manifest_path = os.path.join(directory, "manifest.json")
    existing = read_json(manifest_path)
    if existing is not None and existing.get("fingerprint") == key:
        return ImageManifest(**existing)
    if params.source == "shapes":
        images = coloured_shapes(seed, params.count)
    elif params.source == "folder":
        images = read_folder(params.path, params.size, params.channels)
    else:
        images = read_npz(params.path)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "images.npz")
    np.savez(path + ".tmp.npz", images=images)
    os.replace(path + ".tmp.npz", path)
    manifest = ImageManifest(path=path, shape=tuple(int(d) for d in images.shape[1:]),
                             count=len(images), fingerprint=key)
    write_json(manifest_path, manifest.model_dump())  # last: its presence means the set is whole
    logger.info("%d training images %s in %s", manifest.count, manifest.shape, path)
    return manifest


def load_images(manifest: ImageManifest) -> np.ndarray:
    with np.load(manifest.path) as archive:
        return archive["images"]


# ----- saved models ----------------------------------------------------------------------------

def build_dit(params: DiTParams, channels: int):
    return models.SimpleDiT(output_channels=channels, patch_size=params.patch_size,
                            emb_features=params.emb_features, num_layers=params.num_layers,
                            num_heads=params.num_heads, mlp_ratio=params.mlp_ratio)


def _options(model) -> dict:
    return {"output_channels": model.output_channels, "patch_size": model.patch_size,
            "emb_features": model.emb_features, "num_layers": model.num_layers,
            "num_heads": model.num_heads, "mlp_ratio": float(model.mlp_ratio)}


def save_dit(model, variables, image_shape, process, directory: str, key: str) -> DiTRef:
    """Save a SimpleDiT (see the module docstring); `key` names what made it."""
    os.makedirs(directory, exist_ok=True)
    marker = os.path.join(directory, "dew_dit.json")
    if os.path.exists(marker):
        os.remove(marker)  # until the new files are whole, the directory is not a saved model
    flat = traverse_util.flatten_dict(jax.device_get(variables), sep="/")
    save_file({name: np.asarray(value, np.float32) for name, value in flat.items()},
              os.path.join(directory, "model.safetensors"))
    write_json(os.path.join(directory, "config.json"), {
        "format": DIT_FORMAT, "model": "SimpleDiT", **_options(model),
        "image_shape": [int(d) for d in image_shape],
        "process": {"prediction": process.prediction, "shift": process.shift}})
    write_json(marker, {"fingerprint": key})
    return DiTRef(path=directory, fingerprint=key)


def dit_ref(directory: str) -> DiTRef:
    """A reference to a saved SimpleDiT: its own fingerprint, or one of its files' sizes and times."""
    saved = read_json(os.path.join(directory, "dew_dit.json"))
    if saved is not None:
        return DiTRef(path=directory, fingerprint=saved["fingerprint"])
    files = [os.path.join(directory, n) for n in ("config.json", "model.safetensors")]
    return DiTRef(path=directory, fingerprint=fingerprint(
        [(os.path.basename(f), os.path.getsize(f), os.path.getmtime(f)) for f in files]))


def load_dit(directory: str):
    """`(model, variables, image_shape, process)` of a SimpleDiT saved by `save_dit`."""
    config = read_json(os.path.join(directory, "config.json"))
    if config is None or config.get("model") != "SimpleDiT":
        raise RunRefused(f"{directory} has no SimpleDiT config.json; give a directory flow_pretrain wrote")
    if config.get("format") != DIT_FORMAT:
        raise RunRefused(f"{directory}/config.json has format {config.get('format')}; this Dew reads "
                         f"format {DIT_FORMAT}")
    model = models.SimpleDiT(**{k: config[k] for k in ("output_channels", "patch_size", "emb_features",
                                                        "num_layers", "num_heads", "mlp_ratio")})
    flat = load_file(os.path.join(directory, "model.safetensors"))
    variables = traverse_util.unflatten_dict({k: jax.numpy.asarray(v) for k, v in flat.items()}, sep="/")
    process = presets.Flow(**config["process"])()
    return model, variables, tuple(config["image_shape"]), process

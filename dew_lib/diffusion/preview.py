"""Preview grids: generated images as one PNG, for docs, logs and flow artifacts.

`grid_png(images)` tiles images in [-1, 1] (`[N, H, W, C]`, C = 1 or 3) into one 8-bit PNG,
scaled up by pixel repetition so that tiny samples stay visible, with a one-pixel-wide gray
border between tiles. The PNG is written with zlib and the standard library only.
`Preview` is what the objectives' `preview` returns: host arrays plus captions and scores;
`sample_preview` draws it for either diffusion objective.

Not here: captions drawn into the image (they travel beside it as text), other formats.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib
from collections.abc import Sequence

import jax
import numpy as np


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(pixels: np.ndarray) -> bytes:
    """An 8-bit PNG of `pixels` `[H, W]` (gray) or `[H, W, 3]` (RGB), dtype uint8."""
    pixels = np.ascontiguousarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3) or (pixels.ndim == 3 and pixels.shape[2] != 3):
        raise ValueError(f"encode_png takes uint8 [H, W] or [H, W, 3]; got {pixels.dtype} {pixels.shape}")
    height, width = pixels.shape[:2]
    color = 0 if pixels.ndim == 2 else 2
    rows = pixels.reshape(height, -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter type 0 on every scanline
    header = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9))
            + _chunk(b"IEND", b""))


def to_uint8(images: np.ndarray) -> np.ndarray:
    """Images in [-1, 1] to uint8 in [0, 255] (values outside are clipped)."""
    images = np.asarray(images, np.float64)
    return np.round((np.clip(images, -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8)


def grid_png(images: np.ndarray, *, columns: int | None = None, scale: int | None = None) -> bytes:
    """Tile `[N, H, W, C]` images in [-1, 1] into one PNG (see the module docstring).

    columns: tiles per row (default: about the square root of N). scale: pixel repetition
    (default: the smallest that makes a tile at least 48 pixels wide).
    """
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] not in (1, 3) or images.shape[0] == 0:
        raise ValueError(f"grid_png takes a non-empty [N, H, W, 1 or 3] array, got shape {images.shape}")
    count, height, width, channels = images.shape
    columns = columns or math.ceil(math.sqrt(count))
    if columns < 1:
        raise ValueError(f"grid_png(columns=...) must be >= 1, got {columns}")
    scale = scale or max(1, math.ceil(48 / max(height, width)))
    tiles = to_uint8(images).repeat(scale, axis=1).repeat(scale, axis=2)
    rows = math.ceil(count / columns)
    tile_h, tile_w = height * scale, width * scale
    canvas = np.full((rows * (tile_h + 1) + 1, columns * (tile_w + 1) + 1, channels), 128, np.uint8)
    for i, tile in enumerate(tiles):
        r, c = divmod(i, columns)
        canvas[1 + r * (tile_h + 1): 1 + r * (tile_h + 1) + tile_h,
               1 + c * (tile_w + 1): 1 + c * (tile_w + 1) + tile_w] = tile
    return encode_png(canvas[..., 0] if channels == 1 else canvas)


@dataclasses.dataclass(frozen=True)
class Preview:
    """Generated samples on the host: `images` `[N, H, W, C]` float32 in [-1, 1], one caption per
    sample (the decoded condition, or empty), and `scores` float64 `[N]` when a scorer was given."""

    images: np.ndarray
    captions: tuple[str, ...]
    scores: np.ndarray | None = None
    step: int = 0

    def png(self, *, columns: int | None = None, scale: int | None = None) -> bytes:
        return grid_png(self.images, columns=columns, scale=scale)

    def labels(self) -> list[str]:
        """Caption and score per sample, e.g. 'a red square | reward 0.412'."""
        out = []
        for i, caption in enumerate(self.captions):
            parts = [caption] if caption else []
            if self.scores is not None:
                parts.append(f"reward {float(self.scores[i]):.4g}")
            out.append(" | ".join(parts))
        return out


def score(scorer, images: np.ndarray, batch, rows: int) -> np.ndarray:
    """Call a reward on host images and check it returns `rows` finite float64 scalars."""
    values = scorer(images, batch)
    try:
        values = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise TypeError(f"the reward returned {type(values).__name__}, not an array of numbers: {error}") from None
    if values.shape != (rows,):
        raise ValueError(
            f"the reward returned shape {values.shape}; it must return one scalar per sample, shape "
            f"({rows},) (reduce over pixels, e.g. images.mean(axis=(1, 2, 3)))"
        )
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(
            f"the reward returned non-finite values {values[bad[:4]].tolist()} at samples "
            f"{bad[:4].tolist()}; every reward must be a finite number"
        )
    return values


def ensure_sequence(captions: Sequence[str], rows: int) -> tuple[str, ...]:
    captions = tuple(captions)
    return captions if len(captions) == rows else tuple("" for _ in range(rows))


EVAL_KEY = 1729  # previews and evaluation draw the same times and noise every time, so numbers compare


def sample_preview(objective, params, batch, step, scored) -> Preview:
    """What a diffusion objective's `preview` returns: its samples for `batch`'s rows, generated
    with the fixed evaluation key (one compilation per batch shape, cached on the objective),
    with captions and, when `scored` is given, each sample's reward."""
    rows = objective.inputs.check(batch)
    conditions = {k: np.asarray(v) for k, v in objective.inputs.condition_batch(batch).items()}
    signature = (rows, tuple((k, v.shape, v.dtype.name) for k, v in conditions.items()))
    if signature not in objective._generate:
        steps = objective.steps

        def draw(params, conditions, key):
            path = objective.denoiser.trajectory(params, conditions, key, rows=rows, steps=steps,
                                                 guidance=objective.guidance, solver=objective.sampler)
            return objective.denoiser.decode(path.final)

        objective._generate[signature] = jax.jit(draw)
    key = jax.random.key(EVAL_KEY)  # the same noise at every step: previews show the same samples evolve
    images = np.asarray(jax.device_get(objective._generate[signature](params, conditions, key)), np.float32)
    scores = None if scored is None else score(scored, images, batch, rows)
    return Preview(images, ensure_sequence(objective.inputs.captions(batch), rows), scores, int(step))

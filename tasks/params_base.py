"""What every flow's parameters are made of: the frozen base model, a path check, and the
fields every training stage adds to the library's options (tasks/params.py, tasks/params_image.py)."""

from __future__ import annotations

import os

from pydantic import Field

from dew_lib.recipes.options import Options, TrainOptions

Params = Options  # frozen, and unknown fields are refused: a typo in the UI is an error, not a no-op


def _existing(value: str | None) -> str | None:
    """A path field's check: empty, or a path that exists where the flow runs."""
    if value is not None and not os.path.exists(value):
        raise ValueError(f"{value!r} does not exist; give a path readable from where the flow runs")
    return value


class StageParams(TrainOptions):
    """A pipeline stage: the library's training options and a deadline."""

    max_minutes: float | None = Field(None, gt=0, description="stop the stage with an error after this long")


__all__ = ["Params", "StageParams"]

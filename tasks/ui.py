"""What a training stage shows in the Prefect UI: logs, a moving progress bar, a table of final
metrics, a PNG of its curves and, for image stages, preview grids. All of it comes from Trainer
sinks and hooks, so the library stays unaware of Prefect."""

from __future__ import annotations

import base64
import math
import os
import time
from collections.abc import Mapping

from prefect import get_run_logger
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    text = "-".join(parts).lower()
    return "".join(c if c.isalnum() or c == "-" else "-" for c in text).strip("-")


class LogSink:
    """Each metric window as one line through the run logger."""

    def __init__(self, stage: str, keys: tuple[str, ...] = ()):
        self.stage, self.keys = stage, keys
        self.logger = get_run_logger()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        names = self.keys or tuple(sorted(metrics))
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in names if k in metrics)
        self.logger.info("%s step %d: %s", self.stage, step, shown)

    def close(self) -> None:
        pass


class ProgressSink:
    """A progress artifact that moves with every logged window."""

    def __init__(self, stage: str, steps: int):
        self.steps = steps
        self.artifact = create_progress_artifact(0.0, key=artifact_key(stage, "progress"),
                                                 description=f"{stage}: training steps done")

    def begin(self, position: int, steps: int) -> None:
        update_progress_artifact(self.artifact, 100.0 * position / max(steps, 1))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not any(k.startswith("val/") for k in metrics):
            update_progress_artifact(self.artifact, min(100.0, 100.0 * step / max(self.steps, 1)))

    def close(self) -> None:
        pass


class Deadline:
    """Stops a stage that runs past `minutes`: Prefect cannot interrupt a running task itself."""

    def __init__(self, stage: str, minutes: float | None):
        self.stage, self.minutes = stage, minutes
        self.started = time.monotonic()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.minutes is not None and time.monotonic() - self.started > 60 * self.minutes:
            raise TimeoutError(f"stage {self.stage!r} ran past max_minutes={self.minutes} at step "
                               f"{step}; its last checkpoint is kept and a rerun continues there")

    def close(self) -> None:
        pass


def plot_curves(history, path: str, title: str) -> str:
    """Save the stage's loss and reward (or accuracy) curves as a PNG and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name in ("loss", "reward", "rewards/accuracy", "accuracy", "val/loss")
              if any(name in m for _, m in history)][:3]
    figure, axes = plt.subplots(1, max(len(panels), 1), figsize=(4 * max(len(panels), 1), 3))
    axes = axes if len(panels) > 1 else [axes]
    for axis, name in zip(axes, panels, strict=False):
        points = [(s, m[name]) for s, m in history if name in m and math.isfinite(m[name])]
        axis.plot([s for s, _ in points], [v for _, v in points], marker=".")
        axis.set_title(name)
        axis.set_xlabel("step")
    figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return path


def publish_stage(stage: str, metrics: Mapping[str, float], plot: str | None) -> None:
    """The stage's final metrics as a table artifact and its curves as a markdown artifact."""
    rows = [{"metric": k, "value": round(v, 6)} for k, v in sorted(metrics.items())]
    create_table_artifact(rows, key=artifact_key(stage, "metrics"),
                          description=f"{stage}: metrics of the last logged window")
    if plot is not None:
        create_markdown_artifact(
            f"### {stage} curves\n\nSaved at `{plot}`.\n\n![{stage} curves](file://{plot})\n",
            key=artifact_key(stage, "curves"), description=f"{stage}: loss and reward curves")


def publish_images(stage: str, step: int, images: list[tuple[str, str]], lines: list[str]) -> None:
    """A markdown artifact `<stage>-preview` (a new version at every call) showing PNG files.

    Each PNG is embedded as a `data:image/png` URL, which the Prefect 3.9 UI's markdown renderer
    displays (it refuses `file://` sources), and its path is listed beside it.
    """
    parts = [f"### {stage} at step {step}", "", *lines, ""]
    for title, path in images:
        with open(path, "rb") as handle:
            encoded = base64.b64encode(handle.read()).decode("ascii")
        parts += [f"**{title}** (`{path}`)", "", f"![{title}](data:image/png;base64,{encoded})", ""]
    create_markdown_artifact("\n".join(parts), key=artifact_key(stage, "preview"),
                             description=f"{stage}: samples at step {step}")

"""What a training stage shows in the Prefect UI: logs, a moving progress bar, a table of final
metrics, a PNG of its curves and, for image stages, preview grids. All of it comes from Trainer
sinks and hooks, so the library stays unaware of Prefect.

The keys of a stage's progress, metrics and curves artifacts begin with the store's run id
(`demo-1a2b3c4d-sft-curves`), so runs do not share them. Images are embedded as
`data:image/png` URLs, which both Prefect UIs display (a page served over http shows no
`file://` image).

Prefect is imported where an artifact is made or the run logger taken, not at the top: the
processes of a stage's job (tasks/stage_job.py) use the sinks here without Prefect."""

from __future__ import annotations

import base64
import math
import os
import time
from collections.abc import Mapping

from dew_lib.train.sinks import Sink

EMBEDDED_BYTES = 256 * 1024  # a larger PNG is linked by its path, not embedded


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    text = "-".join(parts).lower()
    return "".join(c if c.isascii() and c.isalnum() or c == "-" else "-" for c in text).strip("-")


def current_run() -> str | None:
    """The store's run id of the task or flow this is called in (its `run` parameter), if any."""
    from prefect.context import FlowRunContext, TaskRunContext

    for context in (TaskRunContext.get(), FlowRunContext.get()):
        run = (getattr(context, "parameters", None) or {}).get("run") if context is not None else None
        if isinstance(run, str) and run:
            return run
    return None


def run_key(*parts: str) -> str:
    """An artifact key that begins with the current run's id, so each run has its own."""
    run = current_run()
    return artifact_key(*([run] if run else []), *parts)


def png_markdown(title: str, path: str) -> str:
    """`path` as a markdown image the Prefect UI shows: a `data:image/png` URL (its markdown
    renderer refuses `file://`), or only the path when the file is over EMBEDDED_BYTES."""
    if os.path.getsize(path) > EMBEDDED_BYTES:
        return f"(`{path}` is over {EMBEDDED_BYTES // 1024} KB; open it from the run directory)"
    with open(path, "rb") as handle:
        encoded = base64.b64encode(handle.read()).decode("ascii")
    return f"![{title}](data:image/png;base64,{encoded})"


def keep_last_checkpoint(directory: str) -> str:
    """Once a stage's training has finished, remove all but its last checkpoint (training keeps
    two; a resume reads only the last) and say what is kept and where, for the log."""
    from dew_lib.train.checkpoint import Checkpoints

    removed = []
    if os.path.isdir(directory):
        existing = Checkpoints(directory)
        try:
            removed = sorted(existing.manager.all_steps())[:-1]
            for step in removed:
                existing.manager.delete(step)
        finally:
            existing.close()
    steps = sorted(int(p) for p in os.listdir(directory) if p.isdigit()) if os.path.isdir(directory) else []
    size = sum(os.path.getsize(os.path.join(folder, name)) for step in steps
               for folder, _, names in os.walk(os.path.join(directory, str(step))) for name in names)
    kept = ", ".join(map(str, steps)) or "none"
    gone = f"; removed the older step {', '.join(map(str, removed))}" if removed else ""
    return f"kept the last checkpoint, step {kept} ({size / 2**20:.1f} MiB), in {directory}{gone}"


class LogSink(Sink):
    """Each metric window as one line through the run logger (or `logger`, outside a task: the
    processes of a stage's job print theirs)."""

    def __init__(self, stage: str, keys: tuple[str, ...] = (), logger=None):
        self.stage, self.keys = stage, keys
        if logger is None:
            from prefect import get_run_logger

            logger = get_run_logger()
        self.logger = logger

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        names = self.keys or tuple(sorted(metrics))
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in names if k in metrics)
        self.logger.info("%s step %d: %s", self.stage, step, shown)


class ProgressSink(Sink):
    """A progress artifact that moves with every logged window."""

    def __init__(self, stage: str, steps: int):
        from prefect.artifacts import create_progress_artifact

        self.steps = steps
        self.artifact = create_progress_artifact(0.0, key=run_key(stage, "progress"),
                                                 description=f"{stage}: training steps done")

    def begin(self, position: int, steps: int) -> None:
        from prefect.artifacts import update_progress_artifact

        update_progress_artifact(self.artifact, 100.0 * position / max(steps, 1))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        from prefect.artifacts import update_progress_artifact

        if not any(k.startswith("val/") for k in metrics):
            update_progress_artifact(self.artifact, min(100.0, 100.0 * step / max(self.steps, 1)))


class Deadline(Sink):
    """Stops a stage that runs past `minutes`: Prefect cannot interrupt a running task itself."""

    def __init__(self, stage: str, minutes: float | None):
        self.stage, self.minutes = stage, minutes
        self.started = time.monotonic()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.minutes is not None and time.monotonic() - self.started > 60 * self.minutes:
            raise TimeoutError(f"stage {self.stage!r} ran past max_minutes={self.minutes} at step "
                               f"{step}; its last checkpoint is kept and a rerun continues there")


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
        axis.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) <= 200 else None)
        axis.set_title(name)
        axis.set_xlabel("step")
    figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    figure.savefig(path, dpi=80)  # at most 960 x 240 pixels, tens of KB: embedded in the artifact
    plt.close(figure)
    return path


def publish_stage(stage: str, metrics: Mapping[str, float], plot: str | None) -> None:
    """The stage's final metrics as a table artifact and its curves as a markdown artifact that
    shows the PNG (embedded) above its metrics."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows = [{"metric": k, "value": round(v, 6)} for k, v in sorted(metrics.items())]
    create_table_artifact(rows, key=run_key(stage, "metrics"),
                          description=f"{stage}: metrics of the last logged window")
    if plot is not None:
        table = ["| metric | value |", "| --- | --- |",
                 *(f"| {r['metric']} | {r['value']:.6g} |" for r in rows)]
        create_markdown_artifact(
            "\n".join([f"### {stage} curves", "", png_markdown(f"{stage} curves", plot), "",
                       f"Saved at `{plot}`.", "", *table, ""]),
            key=run_key(stage, "curves"), description=f"{stage}: loss and reward curves")


def publish_images(stage: str, step: int, images: list[tuple[str, str]], lines: list[str]) -> None:
    """A markdown artifact `<run>-<stage>-preview` (a new version at every call) showing PNG files.

    Each PNG is embedded as a `data:image/png` URL, which the Prefect 3.9 UI's markdown renderer
    displays (it refuses `file://` sources), and its path is listed beside it.
    """
    from prefect.artifacts import create_markdown_artifact

    parts = [f"### {stage} at step {step}", "", *lines, ""]
    for title, path in images:
        parts += [f"**{title}** (`{path}`)", "", png_markdown(title, path), ""]
    create_markdown_artifact("\n".join(parts), key=run_key(stage, "preview"),
                             description=f"{stage}: samples at step {step}")

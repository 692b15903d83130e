"""Where training metrics go once the Trainer reads them back from the device.

A sink subclasses `Sink`: it implements `write(step, metrics)` and may override the hooks.
Metrics arrive late, a window at a time, so writing never stalls the device. `ProgressBar` redraws one terminal line;
`LineLog` prints one line per window (for logs and CI); `MemorySink` keeps everything (tests,
notebooks); `JsonlSink` appends to a file; `dew_lib.store.StoreSink` writes to the run store.
"""

from __future__ import annotations

import abc
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO


class Sink(abc.ABC):
    """Receives what `fit` reports. `write` is the one method a sink must implement; the others
    are hooks with nothing to do by default, called by `fit` at fixed points:

    - `begin(first_step, total_steps)`, once before training (the progress displays use it);
    - `before_step(step, state)`, on the host before each update, with the state it updates
      (nothing is read back: a sink that reads the state's arrays here waits for the device;
      the image stages' previews sample the live model this way);
    - `checkpoint(step, path)`, after each checkpoint `fit` saves (the run store records it);
    - `note(step, text)`, what `fit` decided without training: resuming from a checkpoint, or
      finding nothing to train because `steps` is already reached;
    - `close()`, once at the end, whatever happened.

    `dew_lib.store.StoreSink` (the store may not import this package) declares the same methods.
    """

    @abc.abstractmethod
    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """A window's metric means, labelled with its last step."""

    def begin(self, first_step: int, total_steps: int) -> None:
        """Training starts at `first_step` of `total_steps`."""
        return None

    def before_step(self, step: int, state: Any) -> None:
        """The update of `step` (0-based) is about to run on `state`."""
        return None

    def checkpoint(self, step: int, path: str) -> None:
        """A checkpoint of `step` was saved at `path`."""
        return None

    def note(self, step: int, text: str) -> None:
        """What `fit` decided at `step` without training."""
        return None

    def close(self) -> None:
        """Flush and release what the sink holds."""
        return None


HOOKS = ("write", "begin", "before_step", "checkpoint", "note", "close")


def check_sinks(sinks) -> list:
    """`sinks` as a list, each checked to have every method of `Sink`, so a sink missing one
    fails before training rather than at the first checkpoint."""
    sinks = list(sinks)
    for sink in sinks:
        missing = [name for name in HOOKS if not callable(getattr(sink, name, None))]
        if missing:
            raise TypeError(f"{type(sink).__name__} is not a sink: it lacks {missing}; subclass "
                            "dew_lib.train.sinks.Sink, which gives every hook but write a default")
    return sinks


def _format(metrics: Mapping[str, float], keys=None) -> str:
    items = [(k, metrics[k]) for k in (keys or metrics) if k in metrics]
    return " ".join(f"{k}={v:.4g}" for k, v in items)


_HEADLINE = ("loss", "val/loss", "accuracy", "tokens_per_second")


class ProgressBar(Sink):
    """One redrawn line: a bar, step/total, rate and the headline metrics."""

    def __init__(self, stream: TextIO | None = None, width: int = 24):
        self.stream = stream or sys.stderr
        self.width = width
        self.total: int | None = None
        self.first = 0
        self.start = time.perf_counter()
        self.latest: dict[str, float] = {}
        self.drawn = False  # whether the bar's line is open (close ends it)

    def begin(self, first: int, total: int) -> None:
        self.total, self.first, self.start = total, first, time.perf_counter()

    def note(self, step: int, text: str) -> None:
        self.stream.write(("\n" if self.drawn else "") + text + "\n")  # below the bar, if drawn
        self.stream.flush()
        self.drawn = False

    def write(self, step, metrics):
        self.latest.update(metrics)
        total = self.total or step
        done = min(1.0, step / max(total, 1))
        bar = "#" * int(done * self.width)
        elapsed = time.perf_counter() - self.start
        rate = (step - self.first) / elapsed if elapsed > 0 else 0.0
        line = f"\r[{bar:<{self.width}}] {step}/{total} {rate:.2f} step/s {_format(self.latest, _HEADLINE)}"
        if self.stream.isatty():  # keep to one terminal line so the carriage return redraws it
            line = line[: max(40, os.get_terminal_size(self.stream.fileno()).columns - 1)]
        self.stream.write(line)
        self.stream.flush()
        self.drawn = True

    def close(self):
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


class LineLog(Sink):
    """One plain line per delivered window."""

    def __init__(self, stream: TextIO | None = None, prefix: str = ""):
        self.stream = stream or sys.stderr
        self.prefix = prefix
        self.total: int | None = None

    def begin(self, first: int, total: int) -> None:
        self.total = total

    def write(self, step, metrics):
        self.stream.write(f"{self.prefix}step {step}/{self.total or '?'} {_format(metrics)}\n")
        self.stream.flush()

    def note(self, step: int, text: str) -> None:
        self.stream.write(f"{self.prefix}{text}\n")
        self.stream.flush()

    def close(self):
        pass


class MemorySink(Sink):
    """Keeps `(step, metrics)` pairs in `.history` and `(step, text)` notes in `.notes`."""

    def __init__(self):
        self.history: list[tuple[int, dict[str, float]]] = []
        self.notes: list[tuple[int, str]] = []

    def write(self, step, metrics):
        self.history.append((step, dict(metrics)))

    def note(self, step, text):
        self.notes.append((step, text))

    def series(self, name: str) -> list[tuple[int, float]]:
        return [(s, m[name]) for s, m in self.history if name in m]

    def close(self):
        pass


class JsonlSink(Sink):
    """Appends `{"step": ..., **metrics}` lines to a file; non-finite values become null."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self.file = open(self.path, "a", encoding="utf-8")

    def write(self, step, metrics):
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}) + "\n")
        self.file.flush()

    def close(self):
        self.file.close()


def default_sinks() -> list[Sink]:
    """A progress bar on a terminal, plain lines otherwise."""
    return [ProgressBar() if sys.stderr.isatty() else LineLog()]

"""The rollout-server contract: what a draw is and what any backend that draws them offers.

A `RolloutServer` takes token-id prompts one at a time and answers each with a future `Draw`, so
the scheduler and the sources can keep many requests in flight and consume them as they finish;
`load` pushes new weights under a version number; a `Publisher` is anything with that `load`. The
native server (`NativeRolloutServer`) and the remote engines implement it; so does anything else
with these two methods.

Not here: the backends themselves (`dew_lib.inference.native`, `dew_lib.inference.server`),
text (prompts and draws are token ids), chat templates.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dew_lib.records.draw import Draw


class ServerClosed(RuntimeError):
    """The server was closed (or its loop died) before a request could be served."""


@runtime_checkable
class RolloutServer(Protocol):
    """Draws completions of token-id prompts and serves the weights it was last given.

    submit returns at once; the future resolves to the `Draw`, or raises the backend's failure.
    Cancelling the future withdraws the request: a backend frees its place in the batch at its
    next step. load(variables, version) pushes new weights; requests already generating keep
    going on them, and their draw reports the oldest version that touched them.
    """

    def submit(self, prompt_ids: Sequence[int] | np.ndarray, max_new_tokens: int, *,
               seed: int | None = None) -> Future[Draw]: ...

    def load(self, variables: Any, version: int) -> None: ...


class Publisher(Protocol):
    """Where the trainer's weights go: load serves them under version.

    A RolloutServer is one. A publisher with a `version` attribute is checked after each load.
    """

    def load(self, variables: Any, version: int) -> None: ...


def push_weights(publisher: Publisher, variables: Any, version: int) -> None:
    """`publisher.load(variables, version)`, checked: a publisher that reports a `version` must
    serve `version` afterwards. A load that did not move it is tried once more, then raises."""
    for _ in range(2):
        publisher.load(variables, version)
        reported = getattr(publisher, "version", version)
        if reported == version:
            return
    raise RuntimeError(
        f"pushing version {version} did not move the publisher's version (it reports "
        f"{reported} after two loads); check the engine's weight-update endpoint")

"""Checkpoints: the TrainState plus the data position, through orbax-checkpoint.

Each save is a numbered step directory that orbax writes under a temporary name and renames
when complete, so a process killed mid-save leaves the previous checkpoint as the latest one.
The JSON side-record carries what is needed to continue the same run: the data position (batches
consumed) and the accumulation setting the state was shaped for.
"""

from __future__ import annotations

import os
from typing import Any

import orbax.checkpoint as ocp


class CheckpointMismatch(ValueError):
    """A checkpoint exists but does not fit this trainer's state."""


class Checkpoints:
    """Save and restore `(state, info)` pairs in `directory`, keeping the newest `keep`."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory = os.path.abspath(os.fspath(directory))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, info: dict) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), info=ocp.args.JsonSave(info)),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        where = os.path.join(self.directory, str(step))
        try:
            info = self.manager.restore(step, args=ocp.args.Composite(info=ocp.args.JsonRestore()))["info"]
        except Exception as error:  # noqa: BLE001 - orbax raises many kinds; name the file instead
            raise CheckpointMismatch(f"cannot read the checkpoint record in {where}: {error}") from error
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        except Exception as error:  # noqa: BLE001
            raise CheckpointMismatch(
                f"the checkpoint in {where} does not match this trainer's state (model, optimizer "
                f"or accumulation differ from the run that wrote it): {error}. Resume with the same "
                "model, optimizer and accumulate setting, or point fit at a new directory"
            ) from error
        return restored["state"], info

    def close(self) -> None:
        self.manager.close()

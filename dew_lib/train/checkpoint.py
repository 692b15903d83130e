"""Checkpoints: the TrainState plus the data position, through orbax-checkpoint.

Each save is a numbered step directory that orbax writes under a temporary name and renames
when complete, so a process killed mid-save leaves the previous checkpoint as the latest one.
The JSON side-record carries what is needed to continue the same run: the data position (batches
consumed) and the accumulation setting the state was shaped for.

Checkpoints written before the decoder stacked its layers (one `layers_i` subtree per layer in
the params, the EMA and the optimizer moments) are converted on restore: read in that layout,
stacked on the layer axis, and logged. The next save writes the stacked layout.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from dew_lib.models.decoder import stack_layers, unstack_layers

_LOG = logging.getLogger(__name__)


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
            state = self._restore_state(step, abstract_state)
        except Exception as error:  # noqa: BLE001
            state = self._restore_per_layer(step, abstract_state)
            if state is None:
                raise CheckpointMismatch(
                    f"the checkpoint in {where} does not match this trainer's state (model, "
                    f"optimizer or accumulation differ from the run that wrote it): {error}. Resume "
                    "with the same model, optimizer and accumulate setting, or point fit at a new "
                    "directory"
                ) from error
            _LOG.warning("%s holds the decoder's layers one layers_i subtree per layer (written "
                         "before they were stacked); restored and stacked on the layer axis", where)
        return state, info

    def _restore_state(self, step: int, abstract_state: Any) -> Any:
        return self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )["state"]

    def _restore_per_layer(self, step: int, abstract_state: Any) -> Any | None:
        """The state from a checkpoint in the per-layer layout, stacked; None when the state has
        no stacked layers or the checkpoint does not fit the per-layer layout either."""
        per_layer = unstack_layers(abstract_state)
        if jax.tree.structure(per_layer) == jax.tree.structure(abstract_state):
            return None
        try:
            restored = self._restore_state(step, per_layer)
        except Exception:  # noqa: BLE001 - the caller reports the first error
            return None
        return jax.tree.map(lambda leaf, like: jax.device_put(leaf, like.sharding),
                            stack_layers(restored), abstract_state)

    def close(self) -> None:
        self.manager.close()

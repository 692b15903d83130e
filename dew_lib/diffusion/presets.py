"""Named process configurations: `presets.Flow()()` builds a rectified-flow `Process`.

A preset is a small frozen options object; calling it builds the process, so a recipe can carry
the preset (and its options) and build the process where it is needed.

Not here: variance-preserving (DDPM-style) processes.
"""

from __future__ import annotations

import dataclasses

from dew_lib.diffusion.process import Process


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flow:
    """Rectified flow with velocity prediction (what Flow-GRPO needs).

    shift: time shift of the sampling grid (1: evenly spaced; SD3 uses 3).
    prediction: "velocity" (default), "noise" or "data" for flow-matching pre-training of other
    parameterizations; FlowGRPOObjective accepts only "velocity".
    """

    shift: float = 1.0
    prediction: str = "velocity"

    def __call__(self) -> Process:
        return Process(prediction=self.prediction, shift=self.shift)


__all__ = ["Flow"]

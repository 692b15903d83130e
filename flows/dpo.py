"""dpo: direct preference optimization against the starting policy, from a saved policy.

With `pairs="policy"` (the default) the pairs come from the starting policy's own wrong answers
(tasks/pairs.py); with `pairs="data"` from the prepared pairs file. `max_epochs` caps the steps
at that many passes over the pairs.
"""

from __future__ import annotations

import os

from prefect import flow

from dew_lib.train.trackers import TrackerOptions
from tasks.manifests import DataManifest, PolicyRef, StageResult
from tasks.pairs import epochs_capped, policy_pairs
from tasks.params import DPOParams
from tasks.train import train_stage


@flow(name="dpo")
def dpo(params: DPOParams, data: DataManifest, start: PolicyRef, directory: str,
        store_root: str = "runs", run: str = "dpo", seed: int = 0,
        tracking: TrackerOptions | None = None) -> StageResult:
    if params.pairs == "policy":
        data = data.model_copy(update={"pairs_path": policy_pairs(params, data, start,
                                                                  os.path.join(directory, "pairs"), seed)})
    elif data.pairs_path is None:
        raise ValueError("DPOParams(pairs='data') needs DataParams.pairs_path")
    return train_stage("dpo", "dpo", epochs_capped(params, data.pairs_path), data, start, directory,
                       store_root, run, seed, tracking=tracking)

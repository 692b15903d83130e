"""data_prep: generate the embedded task or check the user's files, and train nothing."""

from __future__ import annotations

from prefect import flow

from tasks.data import prepare_data
from tasks.manifests import DataManifest
from tasks.params import DataParams


@flow(name="data_prep")
def data_prep(params: DataParams = DataParams(), directory: str = "runs/demo/data",
              seed: int = 0) -> DataManifest:
    return prepare_data(params, directory, seed)

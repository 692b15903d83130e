"""The one check every record applies to the token ids it is given."""

from __future__ import annotations

from typing import Any

import numpy as np


def token_ids(value: Any, name: str) -> np.ndarray:
    """`value` as a flat int32 array of token ids; refuses booleans, non-integers and negatives.

    name: how the caller names the field in the error (e.g. "Call.prompt_ids"). The upper bound
    is the model's business (`dew_lib.objectives.base.check_token_ids`), not the record's.
    """
    array = np.asarray(value)
    if array.dtype == bool or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"{name} must hold integer token ids, got dtype {array.dtype}")
    array = array.astype(np.int64).reshape(-1)
    if array.size and array.min() < 0:
        raise ValueError(f"{name} holds a negative token id ({int(array.min())})")
    return array.astype(np.int32)

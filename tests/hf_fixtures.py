"""The Hugging Face fixtures (tests/fixtures/hf, written by tools/parity_hf.py) and what the
checkpoint tests do with them: copy one, edit its config, flatten variables to compare."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
DELETE = object()  # edit_config(directory, field=DELETE) removes the field


def copy_fixture(name, tmp_path) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURES / name, target)
    return target


def edit_config(directory: Path, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def flat(variables):
    """Every leaf by its path string, as a NumPy array."""
    return {jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(variables)}

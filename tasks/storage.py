"""Small file helpers tasks share: atomic JSON writes and JSON-lines files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from dew_lib.store import parts


def write_json(path: str, value: Any) -> None:
    """Write JSON so a reader sees the old file or the whole new one, never a part (indented,
    keys sorted, other values as str); `dew_lib.store.parts.write_json` does the durable write."""
    parts.write_json(path, value, indent=2, sort_keys=True, default=str)


def read_json(path: str) -> Any:
    """The JSON in `path`, or None when there is no such file."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None


def write_lines(path: str, records: Iterable[dict]) -> None:
    """One JSON object per line, written to a temporary file and renamed into place."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    os.replace(temporary, path)

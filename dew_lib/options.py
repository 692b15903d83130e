"""The checks options classes apply to their fields, so every refusal names the field, what it
accepts and what it got, in the same words everywhere."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")


def choice(name: str, value: T, choices: Collection[Any]) -> T:
    """`value` when it is one of `choices`; else a ValueError naming `name`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def integer(name: str, value: Any, *, at_least: int = 1, optional: bool = False,
            accepts: str | None = None) -> int | None:
    """`value` as an int >= `at_least` (None passes when `optional`); booleans are refused.

    `accepts` words what the field takes in the message, in place of "a positive integer" (for
    `at_least=1`) or "an integer >= N": for a reason in parentheses, or a unit.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < at_least:
        bound = accepts or ("a positive integer" if at_least == 1 else f"an integer >= {at_least}")
        raise ValueError(f"{name} must be {'None or ' if optional else ''}{bound}, got {value!r}")
    return int(value)


def number(name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
           optional: bool = False, accepts: str | None = None) -> float | None:
    """`value` as a finite float, > `above` or >= `at_least` when given (None passes when
    `optional`); booleans are refused. `accepts` words what the field takes, as for `integer`."""
    if value is None and optional:
        return None
    ok = not isinstance(value, bool) and isinstance(value, int | float | np.integer | np.floating)
    ok = ok and math.isfinite(value)
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    if not ok:
        bound = ("positive" if above == 0 else f"> {above}") if above is not None else (
            f">= {at_least}" if at_least is not None else "finite")
        bound = accepts or f"a {bound} number"
        raise ValueError(f"{name} must be {'None or ' if optional else ''}{bound}, got {value!r}")
    return float(value)

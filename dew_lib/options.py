"""The checks options classes apply to their fields, so every refusal names the field, what it
accepts and what it got, in the same words everywhere."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, Literal, TypeVar, overload

import numpy as np

T = TypeVar("T")


def choice(name: str, value: T, choices: Collection[Any]) -> T:
    """`value` when it is one of `choices`; else a ValueError naming `name`."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


# Typed so that a required option reads as `int` and only `optional=True` adds None.
@overload
def integer(name: str, value: Any, *, at_least: int = ..., optional: Literal[False] = ...,
            accepts: str | None = ...) -> int: ...
@overload
def integer(name: str, value: Any, *, at_least: int = ..., optional: bool,
            accepts: str | None = ...) -> int | None: ...
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


@overload
def number(name: str, value: Any, *, above: float | None = ..., at_least: float | None = ...,
           optional: Literal[False] = ..., accepts: str | None = ...) -> float: ...
@overload
def number(name: str, value: Any, *, above: float | None = ..., at_least: float | None = ...,
           optional: bool, accepts: str | None = ...) -> float | None: ...
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


def group_size(name: str, value: Any) -> int:
    """A group's size: an int >= 2, since group-relative advantages compare each sample with the
    others drawn for the same prompt (or noise)."""
    return integer(name, value, at_least=2, accepts="an integer >= 2 (group-relative advantages compare "
                   "each sample with the others of its group)")


def lag_bound(owner: str, max_lag: int, ahead: int, sync_every: int) -> None:
    """The asynchronous schedule's one rule: a rollout submitted `ahead` batches early under
    weights up to `sync_every - 1` updates old is `ahead + sync_every - 1` behind when trained,
    so `max_lag` below that would discard every one of them."""
    if max_lag < ahead + sync_every - 1:
        raise ValueError(
            f"{owner}.max_lag={max_lag} is below ahead + sync_every - 1 = {ahead + sync_every - 1}: a "
            f"rollout submitted {ahead} batches ahead under weights up to {sync_every - 1} updates old "
            f"would always be discarded. Raise max_lag to {ahead + sync_every - 1}, or lower ahead or "
            "sync_every")

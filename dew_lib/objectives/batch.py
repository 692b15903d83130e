"""PackedBatch: the packed-rows batch as a typed pytree, with its proximal policy as a static field.

`dew_lib.rollouts.pack` returns the rows as a dict of numpy arrays (see `dew_lib.rollouts.packing`
for the columns). A rollout that hands rows to the Trainer wraps them in a `PackedBatch`, which
says which policy the clipped ratio compares with:

    "recorded"   old_log_probs hold it (the raw policy at sampling time, or a rescoring pass)
    "in_update"  it is the weights this batch is trained with, scored in the update's own forward
                 pass: exact when the batch trains once, under the weights its rollout saw (the
                 Trainer's case, with or without accumulation), and it saves a scoring pass
    "bypass"     there is none: the ratio is current over behavior (verl's bypass mode)

The mode is part of the pytree's structure, so each mode compiles its own update and no array
carries it. A plain dict is read as "recorded" when it has old_log_probs and "bypass" otherwise.

Not here: building the rows (packing), the loss (grpo.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax

from dew_lib.options import choice

PROXIMAL_MODES = ("recorded", "in_update", "bypass")
REQUIRED = ("input_ids", "text_segment_ids", "text_positions", "response_mask",
            "behavior_log_probs", "advantages", "session_index")
OPTIONAL = ("old_log_probs", "versions", "call_index", "session_weights", "rewards",
            "routed_experts", "routed", "support_ids", "support_columns", "old_values", "returns")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class PackedBatch:
    """Packed rollout rows; reads like a mapping of its present columns (`batch["input_ids"]`,
    `"old_log_probs" in batch`, `dict(batch)`), and `proximal` names the proximal policy."""

    input_ids: Any
    text_segment_ids: Any
    text_positions: Any
    response_mask: Any
    behavior_log_probs: Any
    advantages: Any
    session_index: Any
    old_log_probs: Any = None
    versions: Any = None
    call_index: Any = None
    session_weights: Any = None
    rewards: Any = None
    routed_experts: Any = None
    routed: Any = None
    support_ids: Any = None
    support_columns: Any = None
    old_values: Any = None  # PPO: the critic's values when the rows were prepared
    returns: Any = None     # PPO: the critic's targets
    proximal: str = "recorded"

    def __post_init__(self):
        choice("PackedBatch.proximal", self.proximal, PROXIMAL_MODES)
        has_old = self.old_log_probs is not None
        if self.proximal == "in_update" and has_old:
            raise ValueError(
                "PackedBatch(proximal='in_update') also has old_log_probs; they name two different "
                "proximal policies: keep old_log_probs (proximal='recorded') if the batch was "
                "rescored, or drop them to score the proximal policy in the update")
        if self.proximal == "recorded" and not has_old:
            raise ValueError("PackedBatch(proximal='recorded') needs old_log_probs; without them "
                             "choose 'in_update' or 'bypass'")
        if self.proximal == "bypass" and has_old:
            raise ValueError("PackedBatch(proximal='bypass') has old_log_probs; bypass compares "
                             "the current policy with behavior, so drop them or use 'recorded'")

    @classmethod
    def of(cls, rows: Mapping[str, Any], proximal: str | None = None) -> PackedBatch:
        """`rows` (pack's dict, or a PackedBatch) typed; `proximal` None reads it from the rows:
        "recorded" with old_log_probs, else "bypass". "in_update" drops no column for you."""
        if isinstance(rows, PackedBatch) and proximal in (None, rows.proximal):
            return rows
        unknown = sorted(set(rows) - set(REQUIRED) - set(OPTIONAL))
        if unknown:
            raise KeyError(f"PackedBatch has no field {unknown[0]!r}; packed rows have "
                           f"{list(REQUIRED + OPTIONAL)}")
        missing = [name for name in REQUIRED if name not in rows]
        if missing:
            raise KeyError(
                f"a packed batch needs the fields {missing} (see dew_lib.rollouts.pack; a Prompts "
                f"batch must go through a rollout first); the batch has {sorted(rows)}")
        if proximal is None:
            proximal = "recorded" if "old_log_probs" in rows else "bypass"
        return cls(**{name: rows[name] for name in rows}, proximal=proximal)

    def replace(self, **changes) -> PackedBatch:
        return dataclasses.replace(self, **changes)

    # ----- the mapping view ----------------------------------------------------------------------
    def keys(self) -> list[str]:
        return [name for name in REQUIRED + OPTIONAL if getattr(self, name) is not None]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in REQUIRED + OPTIONAL and getattr(self, name) is not None

    def __getitem__(self, name: str) -> Any:
        if name not in self:
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def items(self) -> list[tuple[str, Any]]:
        return [(name, getattr(self, name)) for name in self.keys()]

    def values(self) -> list[Any]:
        return [getattr(self, name) for name in self.keys()]


jax.tree_util.register_dataclass(PackedBatch, data_fields=list(REQUIRED + OPTIONAL),
                                 meta_fields=["proximal"])


def proximal_mode(batch: Mapping[str, Any]) -> str:
    """The proximal policy a batch names: its own field, or for a plain mapping "recorded" with
    old_log_probs and "bypass" without."""
    if isinstance(batch, PackedBatch):
        return batch.proximal
    return "recorded" if "old_log_probs" in batch else "bypass"

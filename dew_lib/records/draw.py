"""A `Draw`: one sampled completion of one prompt, as any rollout server reports it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from dew_lib.records.ids import token_ids


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Draw:
    """One sampled completion of one prompt.

    ids: the sampled ids `[n]`, EOS included when EOS ended the draw. behavior_log_probs: the
    likelihood of each id under the distribution it was drawn from (after temperature and
    filters; 0 for greedy). raw_log_probs: the model's own log-softmax at each id, or None when
    the backend does not report it. eos: whether EOS ended the draw (else it used its budget).
    version: the oldest weights version that may have produced any of its tokens.
    routed_experts: the expert ids each token was routed to, `[prompt + sampled ids, layers,
    top_k]` in the engine's integer dtype, when the engine reports routing (routing replay).
    support: for each sampled id, the ids the sampler kept (its top-k/top-p support), when the
    engine reports them. A `Call` built from the draw checks the routing against its prompt.
    """

    ids: np.ndarray
    behavior_log_probs: np.ndarray
    raw_log_probs: np.ndarray | None
    eos: bool
    version: int
    routed_experts: Any = None
    support: Sequence[Any] | None = None

    def __post_init__(self):
        ids = np.asarray(self.ids)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise ValueError(f"Draw.ids must be a 1-D array of token ids, got {ids.dtype} {ids.shape}")
        if ids.size and ids.min() < 0:
            raise ValueError(f"Draw.ids must be nonnegative token ids, got {ids.tolist()}")
        fields = {"ids": ids.astype(np.int32)}
        for name in ("behavior_log_probs", "raw_log_probs"):
            value = getattr(self, name)
            if value is None and name == "raw_log_probs":
                continue
            value = np.asarray(value, np.float32)
            if value.shape != ids.shape:
                raise ValueError(
                    f"Draw.{name} must hold one entry per sampled id ({ids.shape}), got {value.shape}")
            if not np.isfinite(value).all():
                raise ValueError(f"Draw.{name} must be finite, got {value.tolist()}")
            fields[name] = value
        if isinstance(self.version, bool) or not isinstance(self.version, int | np.integer):
            raise ValueError(f"Draw.version must be an int, got {self.version!r}")
        if self.routed_experts is not None:
            routed = np.array(self.routed_experts)  # a copy, so freezing it leaves the caller's
            if routed.ndim != 3 or routed.shape[0] <= ids.size or not np.issubdtype(routed.dtype, np.integer):
                raise ValueError(
                    f"Draw.routed_experts must be integer expert ids [prompt + sampled ids, layers, "
                    f"top_k] covering more than the {ids.size} sampled ids, got {routed.dtype} "
                    f"{routed.shape}")
            fields["routed_experts"] = routed
        if self.support is not None:
            support = tuple(token_ids(kept, "Draw.support") for kept in self.support)
            if len(support) != ids.size:
                raise ValueError(f"Draw.support has {len(support)} entries for {ids.size} sampled ids; "
                                 "it needs the kept ids of every sampled id")
            for j, (token, kept) in enumerate(zip(ids, support, strict=True)):
                if token not in kept:
                    raise ValueError(f"Draw.support[{j}] does not contain the id sampled there "
                                     f"({int(token)}); a support lists every id the sampler could draw")
                kept.flags.writeable = False
            object.__setattr__(self, "support", support)
        for name, value in fields.items():
            value.flags.writeable = False
            object.__setattr__(self, name, value)
        object.__setattr__(self, "eos", bool(self.eos))
        object.__setattr__(self, "version", int(self.version))

    @property
    def finish_reason(self) -> str:
        """"stop" when EOS ended the draw, "length" when it used its whole budget."""
        return "stop" if self.eos else "length"

    def __len__(self) -> int:
        return int(self.ids.shape[0])

"""TextGeneration: a model and its variables as the policy a lock-step episode rollout samples.

`bind(snapshot)` returns the policy bound to one snapshot of the variables (the Trainer's
params at collection time) under a fresh binding identity; a collection binds once and samples
every turn from that binding. Calling a bound policy samples one turn for a cohort of contexts:
each context's exact ids, left-padded into a fixed width so every turn of every collection
reuses one compiled shape, with the response budget, key and `Sampling` of the turn. It returns
a `dew_lib.sampling.Generation` of host arrays, a row per context: the sampled ids (EOS included
when EOS ended the turn; `lengths` of them are real), the raw and behavior log-probability of
each, and whether EOS ended it (`stopped`). With `routing` (a mixture of experts) it also holds
the experts every prompt and sampled id went through (`routes`), for routing replay.

Rows are drawn from the row's own logits with the turn's key (`dew_lib.sampling.generate`), so
what one slot draws does not depend on what the other slots hold: a cohort can keep finished
slots in place with inert contexts and the draws of the others stay the same.

Not here: the episode loop (`dew_lib.rollouts.episodes`), rollout servers (`dew_lib.inference.base`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dew_lib.records.ids import token_ids
from dew_lib.sampling import Generation, Sampling, generate

_BINDINGS = itertools.count(1)


class TextGeneration:
    """An autoregressive policy over token ids: `model` (a Dew decoder) and `variables`.

    pad_id: the id that fills the left of short contexts (masked out; any valid id works).
    routing: record each draw's routes (`Generation.routes`; a mixture of experts only).
    """

    def __init__(self, model, variables: Any = None, *, pad_id: int = 0, routing: bool = False):
        self.model, self.variables, self.pad_id, self.routing = model, variables, int(pad_id), bool(routing)
        self.binding = 0  # 0: unbound; each bind() gets a new number

    def bind(self, snapshot: Any) -> TextGeneration:
        """This policy bound to `snapshot` (the variables every turn of one collection reads)."""
        bound = TextGeneration(self.model, snapshot, pad_id=self.pad_id, routing=self.routing)
        bound.binding = next(_BINDINGS)
        return bound

    def __call__(self, contexts: Sequence[Any], *, max_new_tokens: int, key: jax.Array,
                 sampling: Sampling, width: int | None = None) -> Generation:
        """Sample one turn after each context; `width` (default: the longest context) fixes the
        padded prompt width so every call of a collection compiles once."""
        if self.variables is None:
            raise ValueError("this TextGeneration has no variables; pass them or call bind(snapshot)")
        ids = [token_ids(c, f"context {n}") for n, c in enumerate(contexts)]
        if not ids:
            raise ValueError("a turn needs at least one context")
        width = max(len(c) for c in ids) if width is None else int(width)
        prompt = np.full((len(ids), width), self.pad_id, np.int32)
        lengths = np.zeros(len(ids), np.int32)
        for row, context in enumerate(ids):
            if not 1 <= context.size <= width:
                raise ValueError(f"context {row} has {context.size} ids; a turn reads 1 to {width}")
            prompt[row, width - context.size:] = context
            lengths[row] = context.size
        drawn = generate(self.model, self.variables, prompt, lengths, key=key,
                         max_new_tokens=max_new_tokens, sampling=sampling, pad_id=self.pad_id,
                         return_routes=self.routing)
        return jax.tree.map(np.asarray, jax.device_get(drawn))


__all__ = ["TextGeneration"]

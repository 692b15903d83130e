"""vLLM's `prompt_logprobs`: the served model's log-probability of every prompt id after the first.

A request with `prompt_logprobs=k` (0 <= k <= MAX_PROMPT_LOGPROBS) gets, beside its draw, one list
per prompt in vLLM's shape: `null` for the first id (nothing predicts it), then for each later id a
dict keyed by token-id strings of `{"logprob", "rank", "decoded_token"}` holding that id, then
the k most likely ids in order (an id that is both appears once, at the prompt id's place, with its
top-k rank, as vLLM's dict comprehension leaves it). A prompt id's `rank` is counted as vLLM counts
it: the number of ids whose log-probability is at least its own (1 for the most likely id; ties
share the worse rank); the alternatives are ranked 1 to k. `decoded_token` is the id decoded alone,
as vLLM's detokenizer names it, or null on a checkpoint without a tokenizer. -inf is written as
-9999.0, as vLLM's `clamp_prompt_logprobs` writes it.

The values are the model's raw log-softmax, whatever the served temperature, filters or
`--logprobs-mode` (vLLM computes prompt log-probs from the raw logits too). They come from one
forward pass of the served model over all the request's prompts at once, padded to a power-of-two
width (at most the capacity) and row count so a server compiles a handful of shapes, with the weights served when the
request's draws finish.

Refused as vLLM refuses them: with `stream=true` (vLLM lets 0 through a stream and sends no prompt
log-probs in it; Dew refuses every value there rather than drop what was asked for), a value below
-1, and more than MAX_PROMPT_LOGPROBS alternatives (vLLM's default `--max-logprobs`; -1, the whole
vocabulary, is more than that).

Not here: `echo` (the prompt's own log-probs inside `logprobs`), a chunked forward for long prompts
over a large vocabulary (the pass holds `[rows, width, vocab]` float32 logits).
"""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dew_lib.serve import render
from dew_lib.serve.protocol import PromptLogprob, PromptLogprobs, ServeError

MAX_PROMPT_LOGPROBS = 20  # vLLM's default --max-logprobs
CLAMP = -9999.0  # what vLLM writes for -inf


def requested(request: Any) -> int | None:
    """How many alternatives the request asks for per prompt position (None: no prompt log-probs);
    a ServeError for what vLLM refuses and for more than this server reports."""
    value = getattr(request, "prompt_logprobs", None)
    if value is None:
        return None
    if request.stream:
        raise ServeError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if value < 0 and value != -1:
        raise ServeError("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
    if value == -1 or value > MAX_PROMPT_LOGPROBS:
        raise ServeError(f"prompt_logprobs={value} asks for more alternatives than dew serve reports "
                         f"({MAX_PROMPT_LOGPROBS}, vLLM's default --max-logprobs; -1 means the whole "
                         f"vocabulary); send 0 to {MAX_PROMPT_LOGPROBS}", param="prompt_logprobs")
    return int(value)


def _bucket(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _scores(model, variables, ids, top):
    """For rows of ids `[N, L]`: the log-prob of each next id `[N, L - 1]`, its vLLM rank, and the
    `top` most likely ids and their log-probs `[N, L - 1, top]`. One forward pass."""
    logits = model.apply(variables, ids[:, :-1]).astype(jnp.float32)  # [N, L - 1, V]
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(log_probs, ids[:, 1:, None], axis=-1)  # [N, L - 1, 1]
    rank = jnp.sum(log_probs >= picked, axis=-1)  # vLLM's batched_count_greater_than
    values, indices = jax.lax.top_k(log_probs, top)
    return picked[..., 0], rank, values, indices


def compute(policy: Any, prompts: list[list[int]], k: int) -> list[tuple[np.ndarray, ...]]:
    """Per prompt of n ids: (log-probs [n - 1], ranks [n - 1], top values [n - 1, k], top ids
    [n - 1, k]), from one forward pass of `policy`'s served model and current weights."""
    width = min(_bucket(max(map(len, prompts))), policy.capacity)  # never past the served context
    rows = _bucket(len(prompts))
    ids = np.zeros((rows, width), np.int32)  # padding after a prompt cannot change its causal scores
    for n, prompt in enumerate(prompts):
        ids[n, :len(prompt)] = prompt
    out = jax.device_get(_scores(policy.model, policy.native.server.variables, jnp.asarray(ids), max(k, 1)))
    picked, rank, values, indices = (np.asarray(a) for a in out)
    return [(picked[n, :len(p) - 1], rank[n, :len(p) - 1], values[n, :len(p) - 1, :k], indices[n, :len(p) - 1, :k])
            for n, p in enumerate(prompts)]


def _value(x: float) -> float:
    return CLAMP if x == -math.inf else float(x)


def render_one(policy: Any, prompt: list[int], scored: tuple[np.ndarray, ...]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs` list for one prompt (run on the policy's text thread: it decodes)."""
    picked, rank, values, indices = scored
    names: dict[int, str] | None = None
    if policy.tokenizer is not None:
        every = list(dict.fromkeys([*prompt[1:], *indices.reshape(-1).tolist()]))
        names = dict(zip(every, render.decoded_tokens(policy.tokenizer, every, policy.token_text), strict=True))
    out: PromptLogprobs = [None]
    for j, token in enumerate(prompt[1:]):
        ids = [token, *indices[j].tolist()]
        ranks = [int(rank[j]), *range(1, len(ids))]
        logprobs = [picked[j], *values[j]]
        out.append({str(i): PromptLogprob(logprob=_value(v), rank=r, decoded_token=None if names is None else names[i])
                    for i, v, r in zip(ids, logprobs, ranks, strict=True)})
    return out


async def prompt_logprobs(policy: Any, prompts: list[list[int]], k: int) -> list[PromptLogprobs]:
    """Every prompt's `prompt_logprobs`: the forward pass off the event loop, the names on the
    policy's text thread."""
    scored = await asyncio.to_thread(compute, policy, prompts, k)
    return [await policy.text(render_one, policy, p, s) for p, s in zip(prompts, scored, strict=True)]


__all__ = ["MAX_PROMPT_LOGPROBS", "compute", "prompt_logprobs", "requested"]

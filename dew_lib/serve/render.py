"""A `Draw` as vLLM reports a completion: finish reason, visible text, token strings, log-probs.

vLLM's conventions, followed here:

- finish_reason is "stop" when an EOS id ended the draw (checked before the budget, so an EOS that
  is also the last budgeted id still reads "stop") and "length" when the budget ran out.
  stop_reason is None for the tokenizer's own EOS id and the id itself for the checkpoint's other
  EOS ids (generation_config.json), which vLLM serves as stop_token_ids.
- The EOS id stays in the ids: in `token_ids`, in the usage count, and as the last entry of the
  log-probs with its own log-probability. The text leaves it out (unless
  include_stop_str_in_output) and skips special tokens (unless skip_special_tokens is false).
- A token's string is `tokenizer.decode([id])`, or "token_id:{id}" under
  return_tokens_as_token_ids; text_offset advances by the length of each token string.
- Log-probabilities are clamped at -9999.0, as vLLM writes them for JSON.
- A mixture of experts served with --enable-return-routed-experts sends each choice's routes as
  base64 of a .npy over every id but the last sampled one, which the engine never feeds.

Not here: request checking (`app`), the response models (`protocol`).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable, Sequence
from typing import Any, SupportsInt

import numpy as np

from dew_lib.records.draw import Draw
from dew_lib.serve.protocol import ChatLogProbs, ChatLogProbsContent, CompletionLogProbs

FLOOR = -9999.0  # vLLM's stand-in for -inf in JSON
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


def finish(draw: Draw, primary_eos: int | None) -> tuple[str, int | None]:
    """(finish_reason, stop_reason) of `draw` as vLLM reports them."""
    if not draw.eos:
        return "length", None
    last = int(draw.ids[-1])
    return "stop", None if last == primary_eos else last


def log_probs(draw: Draw, mode: str) -> list[float]:
    """The draw's reported log-probabilities: the model's own log-softmax ("raw_logprobs") or
    the sampling distribution's after temperature and filters ("processed_logprobs")."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    values = draw.raw_log_probs if mode == "raw_logprobs" else draw.behavior_log_probs
    if values is None:
        raise ValueError("this draw carries no raw log-probabilities; serve processed_logprobs")
    return [max(float(v), FLOOR) for v in values]


def routed_experts(draw: Draw, model: Any) -> str | None:
    """The draw's routes as vLLM sends them: base64 of a .npy `[prompt + sampled - 1, layers,
    top_k]` (the last sampled id is never fed) in the smallest unsigned type that holds an expert
    id; None for a draw without routes."""
    if draw.routed_experts is None:
        return None
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(draw.routed_experts[:-1]).astype(np.min_scalar_type(model.experts - 1)))
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def visible_text(tokenizer: Any, draw: Draw, *, include_stop: bool, skip_special: bool) -> str:
    """The completion's text: its ids decoded, the stopping EOS left out unless asked for."""
    if tokenizer is None:
        return ""
    ids = draw.ids.tolist()
    if draw.eos and not include_stop:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=skip_special)


def decoded_tokens(tokenizer: Any, ids: Iterable[SupportsInt], known: dict[int, str] | None = None) -> list[str]:
    """Each id decoded on its own, as vLLM names a token in its log-probs.

    known: decodings kept from earlier calls (filled here), since decoding ids one at a time
    costs microseconds each and a policy names the same few thousand ids over and over.
    """
    known = {} if known is None else known
    numbers = [int(i) for i in ids]
    missing = list(dict.fromkeys(i for i in numbers if i not in known))
    if missing:
        known.update(zip(missing, (text or "" for text in tokenizer.batch_decode([[i] for i in missing]))))
    return [known[i] for i in numbers]


def token_names(tokenizer: Any, ids: Iterable[SupportsInt], *, as_ids: bool,
                known: dict[int, str] | None = None) -> list[str]:
    if as_ids:
        return [f"token_id:{int(i)}" for i in ids]
    return decoded_tokens(tokenizer, ids, known)


def completion_logprobs(names: Sequence[str], values: Sequence[float], start: int = 0) -> CompletionLogProbs:
    """/v1/completions log-probs for logprobs=0: each sampled token and nothing else in its top.

    start: the first text_offset (a stream's chunk starts at the length of the text sent before it).
    """
    offsets, at = [], start
    for name in names:
        offsets.append(at)
        at += len(name)
    return CompletionLogProbs(text_offset=offsets, token_logprobs=list(values), tokens=list(names),
                              top_logprobs=[{name: value} for name, value in zip(names, values, strict=True)])


def chat_logprobs(names: Sequence[str], decoded: Sequence[str], values: Sequence[float]) -> ChatLogProbs:
    """/v1/chat/completions log-probs for top_logprobs=0: bytes are those of the decoded token
    even when the token is named by its id."""
    return ChatLogProbs(content=[
        ChatLogProbsContent(token=name, logprob=value, bytes=list(text.encode("utf-8", errors="replace")),
                            top_logprobs=[])
        for name, text, value in zip(names, decoded, values, strict=True)])


__all__ = ["FLOOR", "LOGPROBS_MODES", "chat_logprobs", "completion_logprobs", "decoded_tokens", "finish",
           "log_probs", "routed_experts", "token_names", "visible_text"]

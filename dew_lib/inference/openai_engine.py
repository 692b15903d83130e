"""Draws from a vLLM or SGLang completions endpoint (POST /v1/completions) by token ids.

`OpenAICompletion(name, client, provider)` is one served model behind an `openai.OpenAI` client
pointed at the engine's /v1. `create` posts token-id prompts (one row of ids, or several rows,
one choice each) with the Sampling controls, a seed, logprobs=0 and the field that makes the
engine report the ids it sampled, and reads each choice into a `CompletionChoice`: the sampled
ids, one log-probability per id, the finish reason and, from vLLM, the routing. The ids come
from the engine, so nothing is detokenized or retokenized.

    provider  ids requested by                  where the ids come back
    vllm      return_tokens_as_token_ids: true  logprobs.tokens, rendered "token_id:<id>"
    sglang    return_token_ids: true            the choice's token_ids

Both engines keep the EOS id they stopped on in those ids and report its log-probability (vLLM
appends each sampled id before its stop check and leaves it out of the text only; SGLang trims
it from the text only), so a natural stop's draw ends with EOS, as Dew's own draws do.

`OpenAIRolloutServer(completion, sampling, weights)` is the `RolloutServer` over it. The two
engines report different likelihoods, so a Sampling each cannot report truthfully is refused
when the server is built:

- vLLM reports the raw model's log-probabilities unless it runs with --logprobs-mode
  processed_logprobs: a temperature other than 1 needs that flag and processed_logprobs=True.
  Its filters (top-k, top-p, min-p) change the distribution to one over the kept ids, which
  this route never returns: a filtering Sampling goes to `VLLMGenerateServer`.
- SGLang reports log_softmax(logits / temperature), before its filters, with no field for the
  filtered likelihood: any temperature is fine and every filter is refused.

Not here: the engines' token route (`vllm_generate`), chat completions, weight pushes.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dew_lib.inference.base import Publisher
from dew_lib.inference.remote import (
    EngineError,
    RemoteOptions,
    RemoteRolloutServer,
    decode_npy,
    field,
    remote_draw,
)
from dew_lib.options import choice
from dew_lib.records.draw import Draw
from dew_lib.sampling import Sampling

PROVIDERS = ("vllm", "sglang")
_TOKEN_ID = re.compile(r"token_id:(\d+)")


@dataclasses.dataclass(frozen=True)
class CompletionChoice:
    """One choice as Dew reads it. tokens: the sampled ids (EOS included on a natural stop).
    log_probs: one engine-reported log-probability per id. finish_reason: the engine's own
    ("stop", "length", "abort", ...). routed_experts: vLLM's `[prompt + sampled - 1, layers,
    top_k]` routing, when it sent one."""

    tokens: np.ndarray
    log_probs: np.ndarray
    finish_reason: str | None
    routed_experts: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """An engine's answer: its choices and the JSON body they were read from."""

    choices: tuple[CompletionChoice, ...]
    body: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class OpenAICompletion:
    """A model served by vLLM or SGLang, reached through `client` (an `openai.OpenAI` whose
    base_url is the engine's /v1). name: the served model name (vLLM checks it; SGLang reads a
    "base:adapter" name as a LoRA adapter)."""

    name: str
    client: Any
    provider: str = "vllm"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"OpenAICompletion.name must be the served model's name, got {self.name!r}")
        if not callable(getattr(getattr(self.client, "completions", None), "create", None)):
            raise TypeError("OpenAICompletion.client must be an openai.OpenAI client pointed at the "
                            f"engine's /v1, got {type(self.client).__name__}")
        choice("OpenAICompletion.provider", self.provider, PROVIDERS)

    @property
    def engine(self) -> str:
        """How messages name the engine: its provider and address."""
        label = {"vllm": "vLLM", "sglang": "SGLang"}[self.provider]
        return f"{label} at {getattr(self.client, 'base_url', '?')}"

    def request(self, prompt_ids, *, max_tokens: int, sampling: Sampling,
                seed: int | None) -> dict[str, Any]:
        """The JSON fields of one request (the body `create` posts, model and prompt included)."""
        body: dict[str, Any] = {
            "model": self.name, "prompt": _prompt(prompt_ids), "max_tokens": int(max_tokens),
            "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
            "top_k": -1 if sampling.top_k is None else int(sampling.top_k),  # -1: no top-k, both engines
            "min_p": float(sampling.min_p), "logprobs": 0}
        if seed is not None:
            body["seed"] = int(seed)
        if sampling.eos_ids:
            body["stop_token_ids"] = list(sampling.eos_ids)
        body["return_tokens_as_token_ids" if self.provider == "vllm" else "return_token_ids"] = True
        return body

    def create(self, prompt_ids, *, max_tokens: int, sampling: Sampling,
               seed: int | None = None) -> Completion:
        """Post a token-id prompt (one row of ids, or a list of rows: one choice each) and read the
        answer; `EngineError` on any failure."""
        body = self.request(prompt_ids, max_tokens=max_tokens, sampling=sampling, seed=seed)
        named = {key: body.pop(key) for key in ("model", "prompt", "max_tokens", "temperature",
                                                 "top_p", "logprobs", "seed") if key in body}
        answer = _post(self, named, body)
        choices = field(self.engine, answer, "choices", list)
        if not choices:
            raise EngineError(f"{self.engine} answered with no choices")
        read = _read_vllm if self.provider == "vllm" else _read_sglang
        return Completion(tuple(read(self.engine, item, f"choices.{n}")
                                for n, item in enumerate(choices)), answer)


def _prompt(prompt_ids) -> list:
    """One row of ids as a list of ints, or several rows as a list of such lists."""
    rows = list(prompt_ids)
    if rows and isinstance(rows[0], Sequence | np.ndarray):
        return [[int(i) for i in row] for row in rows]
    return [int(i) for i in rows]


def _post(completion: OpenAICompletion, named: dict[str, Any], extra: dict[str, Any]) -> dict:
    """POST /v1/completions through the openai client; the parsed JSON body or `EngineError`."""
    import openai  # the client's own exceptions

    engine = completion.engine
    try:
        raw = completion.client.completions.with_raw_response.create(**named, extra_body=extra)
        text = raw.http_response.text
    except openai.APITimeoutError as error:
        raise EngineError(f"{engine} did not answer within the client's timeout "
                          f"({completion.client.timeout})") from error
    except openai.APIConnectionError as error:
        raise EngineError(f"the connection to {engine} failed or was closed: {error.__cause__ or error}") from error
    except openai.APIStatusError as error:
        raise EngineError(f"{engine} answered HTTP {error.status_code}: {str(error.message)[:1000]}") from error
    try:
        answer = json.loads(text)
    except ValueError as error:
        raise EngineError(f"{engine} answered with a body that is not JSON: {text[:200]!r}") from error
    if not isinstance(answer, dict):
        raise EngineError(f"{engine} answered with JSON that is not an object: {text[:200]!r}")
    return answer


def _log_probs(engine: str, logprobs: dict, path: str, count: int) -> np.ndarray:
    values = field(engine, logprobs, "token_logprobs", list, at=f"{path}.logprobs")
    if len(values) != count or any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        raise EngineError(f"{engine} answered {path}.logprobs.token_logprobs with {values[:20]} for "
                          f"{count} sampled ids; it must hold one number per id")
    return np.asarray(values, np.float64)


def _read_vllm(engine: str, item: Any, path: str) -> CompletionChoice:
    """vLLM's choice: ids from the "token_id:<id>" renderings of logprobs.tokens."""
    logprobs = field(engine, item, "logprobs", dict, at=path)
    tokens = field(engine, logprobs, "tokens", list, at=f"{path}.logprobs")
    ids = []
    for token in tokens:
        match = _TOKEN_ID.fullmatch(token) if isinstance(token, str) else None
        if match is None:
            raise EngineError(f"{engine} rendered the sampled token {token!r} without its id; it "
                              "ignored return_tokens_as_token_ids (a vLLM too old for it?)")
        ids.append(int(match.group(1)))
    listed = item.get("token_ids")
    if listed is not None and list(listed) != ids:
        raise EngineError(f"{engine} listed token_ids {list(listed)[:20]} that disagree with its "
                          f"logprobs tokens {ids[:20]}")
    routed = item.get("routed_experts")
    return CompletionChoice(tokens=np.asarray(ids, np.int64),
                            log_probs=_log_probs(engine, logprobs, path, len(ids)),
                            finish_reason=item.get("finish_reason"),
                            routed_experts=None if routed is None else decode_npy(
                                engine, f"{path}.routed_experts", routed))


def _read_sglang(engine: str, item: Any, path: str) -> CompletionChoice:
    """SGLang's choice: ids from its token_ids (return_token_ids), log-probs from logprobs."""
    if not isinstance(item, dict) or item.get("token_ids") is None:
        raise EngineError(f"{engine} answered without {path}.token_ids; it ignored return_token_ids "
                          "(an SGLang too old for it?)")
    ids = field(engine, item, "token_ids", list, at=path)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise EngineError(f"{engine} answered {path}.token_ids with values that are not token ids")
    logprobs = field(engine, item, "logprobs", dict, at=path)
    return CompletionChoice(tokens=np.asarray(ids, np.int64),
                            log_probs=_log_probs(engine, logprobs, path, len(ids)),
                            finish_reason=item.get("finish_reason"))


class OpenAIRolloutServer(RemoteRolloutServer):
    """A `RolloutServer` drawing from `completion`'s engine (see the module docstring).

    sampling: the policy's Sampling; the refusals above are raised here. weights: the publisher
    `load` hands weights to, or None for fixed weights. routing: read vLLM's per-choice
    routed_experts into each draw (start vLLM with --enable-return-routed-experts).
    processed_logprobs: vLLM runs with --logprobs-mode processed_logprobs, so a temperature
    other than 1 is reported truthfully. options: threads and timeouts (RemoteOptions() when
    None); the client is copied with them and with retries off (the scheduler retries failed
    sessions).
    """

    def __init__(self, completion: OpenAICompletion, sampling: Sampling, weights: Publisher | None,
                 routing: bool = False, processed_logprobs: bool = False, *,
                 options: RemoteOptions | None = None, seed: int = 0):
        import openai

        if not isinstance(completion, OpenAICompletion):
            raise TypeError("OpenAIRolloutServer.completion must be an OpenAICompletion(name, client, "
                            f"provider), got {type(completion).__name__}")
        if isinstance(sampling, Sampling):
            _refuse(completion.provider, sampling, bool(routing), bool(processed_logprobs))
        options = RemoteOptions() if options is None else options
        if not isinstance(options, RemoteOptions):
            raise TypeError(f"OpenAIRolloutServer.options must be a RemoteOptions, got {type(options).__name__}")
        client = completion.client.with_options(
            timeout=openai.Timeout(options.timeout, connect=options.connect_timeout), max_retries=0)
        super().__init__(sampling, weights, options=options, seed=seed)
        self.routing, self.processed_logprobs = bool(routing), bool(processed_logprobs)
        self.completion = dataclasses.replace(completion, client=client)
        self.engine = completion.engine

    def _draw(self, prompt: np.ndarray, max_new_tokens: int, seed: int, version: int) -> Draw:
        answer = self.completion.create(prompt, max_tokens=max_new_tokens, sampling=self.sampling,
                                        seed=seed)
        if len(answer.choices) != 1:
            raise EngineError(f"{self.engine} answered {len(answer.choices)} choices to a request for one")
        (drawn,) = answer.choices
        if self.routing and drawn.routed_experts is None:
            raise EngineError(f"{self.engine} sent no routed_experts; start vLLM with "
                              "--enable-return-routed-experts, or build the server with routing=False")
        return remote_draw(self.engine, self.sampling, ids=drawn.tokens, log_probs=drawn.log_probs,
                           finish_reason=drawn.finish_reason, version=version,
                           max_new_tokens=max_new_tokens, prompt_size=prompt.size,
                           routed_experts=drawn.routed_experts if self.routing else None)


def _refuse(provider: str, sampling: Sampling, routing: bool, processed_logprobs: bool) -> None:
    """Raise ValueError for a Sampling or option the provider's completions route cannot serve."""
    filters = [text for text, on in (
        (f"top_k={sampling.top_k}", sampling.top_k is not None),
        (f"top_p={sampling.top_p}", sampling.top_p < 1.0),
        (f"min_p={sampling.min_p}", sampling.min_p > 0.0)) if on]
    if provider == "vllm":
        if filters:
            raise ValueError(
                f"Sampling({', '.join(filters)}) filters the distribution, and vLLM's /v1/completions "
                "never returns the ids each draw kept, so the filtered likelihood cannot be trained "
                "on; use VLLMGenerateServer (vLLM's token route with --return-sampling-mask) or "
                "drop the filters")
        if sampling.temperature != 1.0 and not processed_logprobs:
            raise ValueError(
                f"Sampling.temperature={sampling.temperature} transforms the distribution, and vLLM "
                "reports the raw model's log-probabilities unless it runs with --logprobs-mode "
                "processed_logprobs; start it so and pass processed_logprobs=True, or sample at "
                "temperature 1")
        return
    if filters:
        raise ValueError(
            f"Sampling({', '.join(filters)}) filters the distribution, and SGLang's /v1/completions "
            "reports log_softmax(logits / temperature) before its filters, with no field for the "
            "filtered likelihood; drop the filters (any temperature is fine)")
    if processed_logprobs:
        raise ValueError("processed_logprobs=True describes vLLM's --logprobs-mode; SGLang always "
                         "reports tempered log-probabilities, so leave it False for provider='sglang'")
    if routing:
        raise ValueError("routing=True reads vLLM's per-choice routed_experts; SGLang's completions "
                         "route does not send them per choice, so build this server with routing=False")


__all__ = ["PROVIDERS", "Completion", "CompletionChoice", "OpenAICompletion", "OpenAIRolloutServer"]

"""Draws from a vLLM or SGLang completions endpoint (POST /v1/completions) by token ids.

`OpenAICompletion(name, client, provider)` is one served model behind an `openai.OpenAI` client
pointed at the engine's /v1. `create` posts token-id prompts (one row of ids, or several rows,
one choice each) with the Sampling controls, a seed, logprobs=0 and the field that makes the
engine report the ids it sampled, and reads each choice into a `CompletionChoice`: the sampled
ids, one log-probability per id, the finish reason and the routing. The ids come from the
engine, so nothing is detokenized or retokenized.

    provider  ids requested by                  where the ids come back
    vllm      return_tokens_as_token_ids: true  logprobs.tokens, rendered "token_id:<id>"
    sglang    return_token_ids: true            the choice's token_ids

Routing (the experts an MoE model sent each token to) comes back in two shapes, both covering the
prompt and every sampled id but the last, which the engines never run through the model:

    provider  launched with, requested by           where it comes back
    vllm      --enable-return-routed-experts         each choice's routed_experts: base64 .npy
              (nothing in the request)               of [prompt + sampled - 1, layers, top_k]
    sglang    --enable-return-routed-experts,        the response's sglext.routed_experts, once
              return_routed_experts: true            per response (its first choice): base64 of
                                                     raw int32 bytes, flat, so the caller gives
                                                     (layers, top_k) to read it

SGLang leaves sglext out, without an error, when it was launched without the flag.

A draw from a LoRA adapter the engine serves over its base (`adapter_push.AdapterReload` loads one
per version) names it the engine's way: vLLM (and `dew serve`) take the adapter's name as the
request's `model`; SGLang keeps the base's `model` and takes the name in `lora_path`.

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

import base64
import binascii
import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
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
    ("stop", "length", "abort", ...). routed_experts: the engine's `[prompt + sampled - 1, layers,
    top_k]` routing, when it sent one (vLLM per choice; SGLang for its first choice only)."""

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

    def request(self, prompt_ids, *, max_tokens: int, sampling: Sampling, seed: int | None,
                routing: tuple[int, int] | None = None, adapter: str | None = None) -> dict[str, Any]:
        """The JSON fields of one request (the body `create` posts, model and prompt included).
        routing: (layers, top_k) when the routing is wanted; SGLang is asked for it
        (return_routed_experts), vLLM sends it whenever it runs with the flag. adapter: the name
        of a LoRA adapter the engine serves over the base, to draw from it (None: the base)."""
        model = adapter if adapter is not None and self.provider == "vllm" else self.name
        body: dict[str, Any] = {
            "model": model, "prompt": _prompt(prompt_ids), "max_tokens": int(max_tokens),
            "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
            "top_k": -1 if sampling.top_k is None else int(sampling.top_k),  # -1: no top-k, both engines
            "min_p": float(sampling.min_p), "logprobs": 0}
        if seed is not None:
            body["seed"] = int(seed)
        if sampling.eos_ids:
            body["stop_token_ids"] = list(sampling.eos_ids)
        body["return_tokens_as_token_ids" if self.provider == "vllm" else "return_token_ids"] = True
        if routing is not None and self.provider == "sglang":
            body["return_routed_experts"] = True
        if adapter is not None and self.provider == "sglang":
            body["lora_path"] = adapter  # SGLang's field for the adapter's name
        return body

    def create(self, prompt_ids, *, max_tokens: int, sampling: Sampling,
               seed: int | None = None, routing: tuple[int, int] | None = None,
               adapter: str | None = None) -> Completion:
        """Post a token-id prompt (one row of ids, or a list of rows: one choice each) and read the
        answer; `EngineError` on any failure. routing: (layers, top_k) to ask for the routing
        and read it in that shape (SGLang needs it; a vLLM routing of another shape is refused).
        Without it vLLM's routing is still read when sent, SGLang's is not asked for. adapter:
        the LoRA adapter to draw from (`request`)."""
        if routing is not None:
            routing = _routing_shape(routing)
        body = self.request(prompt_ids, max_tokens=max_tokens, sampling=sampling, seed=seed,
                            routing=routing, adapter=adapter)
        named: dict[str, Any] = {key: body.pop(key) for key in ("model", "prompt", "max_tokens", "temperature",
                                                 "top_p", "logprobs", "seed") if key in body}
        answer = _post(self, named, body)
        choices = field(self.engine, answer, "choices", list)
        if not choices:
            raise EngineError(f"{self.engine} answered with no choices")
        read = _read_vllm if self.provider == "vllm" else _read_sglang
        read_choices = [read(self.engine, item, f"choices.{n}") for n, item in enumerate(choices)]
        if routing is not None:
            if self.provider == "sglang":
                routed = _sglang_routing(self.engine, answer, routing)
                read_choices[0] = dataclasses.replace(read_choices[0], routed_experts=routed)
            for n, item in enumerate(read_choices):
                routed = item.routed_experts
                if routed is not None and (routed.ndim != 3 or routed.shape[1:] != routing):
                    raise EngineError(f"{self.engine} sent choices.{n}.routed_experts of shape "
                                      f"{routed.shape}; expected [tokens, {routing[0]}, {routing[1]}]")
        return Completion(tuple(read_choices), answer)


def _routing_shape(value: Any) -> tuple[int, int]:
    """(layers, top_k) as two positive ints, or ValueError."""
    if (not isinstance(value, tuple | list) or len(value) != 2
            or any(isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1 for n in value)):
        raise ValueError(f"routing_shape must be (layers, top_k), two positive ints, got {value!r}")
    return int(value[0]), int(value[1])


def _sglang_routing(engine: str, answer: dict, shape: tuple[int, int]) -> np.ndarray | None:
    """SGLang's sglext.routed_experts (base64 of flat int32 bytes) as [tokens, layers, top_k];
    None when SGLang sent none (it was launched without --enable-return-routed-experts)."""
    ext = answer.get("sglext")
    if ext is None:
        return None
    if not isinstance(ext, dict):
        raise EngineError(f"{engine} answered sglext as {type(ext).__name__}, not an object")
    value = ext.get("routed_experts")
    if value is None:
        return None
    if not isinstance(value, str):
        raise EngineError(f"{engine} sent sglext.routed_experts as {type(value).__name__}, not base64 text")
    try:
        raw = base64.b64decode(value, validate=True)
    except binascii.Error as error:
        raise EngineError(f"{engine} sent a sglext.routed_experts that is not base64: {error}") from error
    row = 4 * shape[0] * shape[1]  # int32 bytes of one token's [layers, top_k]
    if not raw or len(raw) % row:
        raise EngineError(f"{engine} sent sglext.routed_experts of {len(raw)} bytes, not whole tokens of "
                          f"[{shape[0]} layers, top_k {shape[1]}] int32; is routing_shape the served "
                          "model's (num_hidden_layers, num_experts_per_tok)?")
    return np.frombuffer(raw, "<i4").reshape(-1, *shape)


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
    `load` hands weights to, or None for fixed weights. routing: read the engine's routing into
    each draw (start the engine with --enable-return-routed-experts); a draw without one fails
    with `EngineError`. routing_shape: (layers, top_k) of that routing, the served model's
    (num_hidden_layers, num_experts_per_tok): required for SGLang, whose routing is flat int32;
    for vLLM, optional, and a routing of another shape fails the draw. processed_logprobs: vLLM
    runs with --logprobs-mode processed_logprobs, so a temperature other than 1 is reported
    truthfully. options: threads and timeouts (RemoteOptions() when None); the client is copied
    with them and with retries off (the scheduler retries failed sessions). adapter: None, or a
    callable `adapter(version)` giving the LoRA adapter a draw labelled `version` is drawn from
    (`AdapterReload.name`), None for the base.
    """

    def __init__(self, completion: OpenAICompletion, sampling: Sampling, weights: Publisher | None,
                 routing: bool = False, processed_logprobs: bool = False, *,
                 options: RemoteOptions | None = None, seed: int = 0,
                 routing_shape: tuple[int, int] | None = None,
                 adapter: Callable[[int], str | None] | None = None):
        import openai

        if not isinstance(completion, OpenAICompletion):
            raise TypeError("OpenAIRolloutServer.completion must be an OpenAICompletion(name, client, "
                            f"provider), got {type(completion).__name__}")
        if routing_shape is not None:
            routing_shape = _routing_shape(routing_shape)
        if adapter is not None and not callable(adapter):
            raise TypeError(f"OpenAIRolloutServer.adapter must be None or callable as adapter(version), got "
                            f"{type(adapter).__name__}")
        if isinstance(sampling, Sampling):
            _refuse(completion.provider, sampling, bool(processed_logprobs))
        _refuse_routing(completion.provider, bool(routing), routing_shape)
        options = RemoteOptions() if options is None else options
        if not isinstance(options, RemoteOptions):
            raise TypeError(f"OpenAIRolloutServer.options must be a RemoteOptions, got {type(options).__name__}")
        client = completion.client.with_options(
            timeout=openai.Timeout(options.timeout, connect=options.connect_timeout), max_retries=0)
        super().__init__(sampling, weights, options=options, seed=seed)
        self.routing, self.processed_logprobs = bool(routing), bool(processed_logprobs)
        self.routing_shape, self.adapter = routing_shape, adapter
        self.completion = dataclasses.replace(completion, client=client)
        self.engine = completion.engine

    def _draw(self, prompt: np.ndarray, max_new_tokens: int, seed: int, version: int) -> Draw:
        answer = self.completion.create(prompt, max_tokens=max_new_tokens, sampling=self.sampling,
                                        seed=seed, routing=self.routing_shape if self.routing else None,
                                        adapter=None if self.adapter is None else self.adapter(version))
        if len(answer.choices) != 1:
            raise EngineError(f"{self.engine} answered {len(answer.choices)} choices to a request for one")
        (drawn,) = answer.choices
        if self.routing and drawn.routed_experts is None:
            where = "routed_experts" if self.completion.provider == "vllm" else "sglext.routed_experts"
            raise EngineError(f"{self.engine} sent no {where}; start it with "
                              "--enable-return-routed-experts, or build the server with routing=False")
        return remote_draw(self.engine, self.sampling, ids=drawn.tokens, log_probs=drawn.log_probs,
                           finish_reason=drawn.finish_reason, version=version,
                           max_new_tokens=max_new_tokens, prompt_size=prompt.size,
                           routed_experts=drawn.routed_experts if self.routing else None)


def _refuse(provider: str, sampling: Sampling, processed_logprobs: bool) -> None:
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


def _refuse_routing(provider: str, routing: bool, shape: tuple[int, int] | None) -> None:
    if shape is not None and not routing:
        raise ValueError(f"routing_shape={shape} describes a routing this server does not read; "
                         "pass routing=True with it, or drop it")
    if routing and shape is None and provider == "sglang":
        raise ValueError("routing=True for SGLang needs routing_shape=(layers, top_k), the served "
                         "model's (num_hidden_layers, num_experts_per_tok): SGLang sends "
                         "sglext.routed_experts as flat int32 without its shape")


__all__ = ["PROVIDERS", "Completion", "CompletionChoice", "OpenAICompletion", "OpenAIRolloutServer"]

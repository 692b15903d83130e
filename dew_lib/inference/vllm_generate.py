"""Draws from vLLM's token route, POST /inference/v1/generate, with the supports of filtered sampling.

A top-k, top-p or min-p policy draws each id from the distribution renormalized over the ids
its filters kept. Training on those draws needs that set for every sampled id: vLLM started with
--return-sampling-mask sends it as the choice's sampling_mask, one list of kept ids per sampled
id, and with --logprobs-mode processed_logprobs its log-probabilities are the renormalized ones.
`VLLMGenerateServer` reads the ids, those log-probabilities and the masks (into `Draw.support`),
and with routing=True the choice's routed_experts.

The request is vLLM's GenerateRequest: {"token_ids": [...], "sampling_params": {...}}, the
sampling parameters by vLLM's own names, logprobs=0 (the sampled id's log-probability only)
and detokenize=false (Dew reads ids). The answer's choice carries token_ids, logprobs.content
(one entry per sampled id: {"token_id": id, "logprob": x, ...} in current vLLM, {"token":
"token_id:<id>", "logprob": x, ...} in older releases; both are read), finish_reason,
sampling_mask and routed_experts (base64 .npy of [prompt + sampled - 1, layers, top_k]).

Refused when the server is built: a Sampling without a finite top-k (vLLM builds the mask only
under one; pure top-p could keep the whole vocabulary) and a greedy one (it has no filtered
distribution to record).

Not here: vLLM's /v1/completions (`openai_engine`), streaming, weight pushes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
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
from dew_lib.records.draw import Draw
from dew_lib.sampling import Sampling

GENERATE = "/inference/v1/generate"


class VLLMGenerateServer(RemoteRolloutServer):
    """A `RolloutServer` drawing from vLLM's token route at `base_url` (the engine's root URL,
    e.g. http://127.0.0.1:8000). weights: the publisher `load` hands weights to, or None for
    fixed weights. routing: read each choice's routed_experts (start vLLM with
    --enable-return-routed-experts). options: threads and timeouts (RemoteOptions() when None).

    Start vLLM with --enable-scale-out (or --tokens-only), --return-sampling-mask and
    --logprobs-mode processed_logprobs.
    """

    def __init__(self, base_url: str, sampling: Sampling, weights: Publisher | None,
                 routing: bool = False, *, options: RemoteOptions | None = None, seed: int = 0):
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"VLLMGenerateServer.base_url must be the engine's root URL such as "
                             f"http://127.0.0.1:8000, got {base_url!r}")
        if isinstance(sampling, Sampling):
            if sampling.top_k is None:
                raise ValueError(
                    "VLLMGenerateServer needs Sampling.top_k: vLLM builds the sampling_mask (each "
                    "draw's kept ids) only under a finite top-k, and without it a top-p support can "
                    "span the vocabulary; set top_k (e.g. Sampling(top_k=50, top_p=0.95))")
            if sampling.greedy:
                raise ValueError("VLLMGenerateServer needs Sampling.temperature > 0: a greedy draw "
                                 "has no filtered distribution to record; use OpenAIRolloutServer "
                                 "with processed_logprobs=True for greedy draws")
        options = RemoteOptions() if options is None else options
        super().__init__(sampling, weights, options=options, seed=seed)
        self.base_url = base_url.rstrip("/")
        self.routing = bool(routing)
        self.engine = f"vLLM at {self.base_url}"
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(options.timeout, connect=options.connect_timeout),
            limits=httpx.Limits(max_connections=options.workers,
                                max_keepalive_connections=options.workers))

    def request(self, prompt_ids, max_new_tokens: int, seed: int | None) -> dict[str, Any]:
        """The JSON body of one request."""
        sampling = self.sampling
        if sampling.top_k is None:  # refused at construction: vLLM builds no sampling_mask without it
            raise ValueError("VLLMGenerateServer needs Sampling.top_k; set top_k (e.g. Sampling(top_k=50, top_p=0.95))")
        params: dict[str, Any] = {
            "max_tokens": int(max_new_tokens), "temperature": float(sampling.temperature),
            "top_p": float(sampling.top_p), "top_k": int(sampling.top_k),
            "min_p": float(sampling.min_p), "logprobs": 0, "detokenize": False}
        if seed is not None:
            params["seed"] = int(seed)
        if sampling.eos_ids:
            params["stop_token_ids"] = list(sampling.eos_ids)
        return {"token_ids": [int(i) for i in prompt_ids], "sampling_params": params}

    def _close_transport(self) -> None:
        self._http.close()

    def _draw(self, prompt: np.ndarray, max_new_tokens: int, seed: int, version: int) -> Draw:
        answer = self._post(self.request(prompt, max_new_tokens, seed))
        choices = field(self.engine, answer, "choices", list)
        if len(choices) != 1:
            raise EngineError(f"{self.engine} answered {len(choices)} choices to a request for one")
        item = choices[0]
        if not isinstance(item, dict):
            raise EngineError(f"{self.engine} answered choices.0 as {type(item).__name__}, not an object")
        ids = field(self.engine, item, "token_ids", list, at="choices.0")
        content = field(self.engine, item, "logprobs.content", list, at="choices.0")
        if len(content) != len(ids):
            raise EngineError(f"{self.engine} answered {len(content)} logprobs entries for "
                              f"{len(ids)} sampled ids; it must report one per id (logprobs=0)")
        values = []
        for n, (token, entry) in enumerate(zip(ids, content, strict=True)):
            if _entry_id(entry) != token:
                raise EngineError(f"{self.engine} answered choices.0.logprobs.content.{n} for id "
                                  f"{_entry_id(entry)}, but sampled id {token} there")
            values.append(field(self.engine, entry, "logprob", (int, float),
                                at=f"choices.0.logprobs.content.{n}"))
        mask = item.get("sampling_mask")
        if mask is None:
            raise EngineError(f"{self.engine} sent no sampling_mask; start vLLM with "
                              "--return-sampling-mask (and --logprobs-mode processed_logprobs)")
        if not isinstance(mask, list) or len(mask) != len(ids) or not all(isinstance(m, list) for m in mask):
            raise EngineError(f"{self.engine} sent a sampling_mask that is not one list of ids per "
                              f"sampled id ({len(ids)})")
        routed = item.get("routed_experts")
        if self.routing and routed is None:
            raise EngineError(f"{self.engine} sent no routed_experts; start vLLM with "
                              "--enable-return-routed-experts, or build the server with routing=False")
        return remote_draw(
            self.engine, self.sampling, ids=ids, log_probs=values,
            finish_reason=item.get("finish_reason"), version=version, max_new_tokens=max_new_tokens,
            prompt_size=prompt.size, support=mask,
            routed_experts=decode_npy(self.engine, "choices.0.routed_experts", routed) if self.routing else None)

    def _post(self, body: dict[str, Any]) -> dict:
        """POST the generate route; the parsed JSON answer or `EngineError`."""
        try:
            response = self._http.post(GENERATE, json=body)
        except httpx.TimeoutException as error:
            raise EngineError(f"{self.engine} did not answer {GENERATE} within "
                              f"{self.options.timeout} s (RemoteOptions.timeout)") from error
        except httpx.HTTPError as error:
            raise EngineError(f"the connection to {self.engine} failed or was closed: "
                              f"{type(error).__name__}: {error}") from error
        if response.status_code >= 400:
            raise EngineError(f"{self.engine} answered HTTP {response.status_code} to {GENERATE}: "
                              f"{response.text[:1000]}")
        try:
            answer = json.loads(response.text)
        except ValueError as error:
            raise EngineError(f"{self.engine} answered with a body that is not JSON: "
                              f"{response.text[:200]!r}") from error
        if not isinstance(answer, dict):
            raise EngineError(f"{self.engine} answered with JSON that is not an object: "
                              f"{response.text[:200]!r}")
        return answer


def _entry_id(entry: Any) -> int | None:
    """The sampled id a logprobs.content entry names: its token_id, or its "token_id:<id>" token."""
    if not isinstance(entry, dict):
        return None
    if isinstance(entry.get("token_id"), int) and not isinstance(entry["token_id"], bool):
        return entry["token_id"]
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    return None


__all__ = ["GENERATE", "VLLMGenerateServer"]

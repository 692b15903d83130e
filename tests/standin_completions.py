"""Stand-ins for the completion routes of vLLM and SGLang, answered the way those engines answer.

Each factory returns a FastAPI `APIRouter`, so a test app can hold a stand-in engine's completion
routes beside other routers (the weight-update routes of tests/standin_weights.py):

    vllm_router(engine)           GET /health, GET /v1/models, POST /v1/completions
    vllm_generate_router(engine)  POST /inference/v1/generate (vLLM's token route)
    sglang_router(engine)         GET /health, GET /v1/models, POST /v1/completions

`Engine` is one stand-in engine: its "model" (a fixed random logit table over a small vocabulary,
sampled with numpy from a generator seeded by the request's seed, so a request answers the same
every time), the launch flags that change its answers (vLLM's --logprobs-mode,
--enable-return-routed-experts, --return-sampling-mask), what it received and answered, and the
faults queued for its next requests:

    "error"      HTTP 500 with the engine's error body
    "slow"       answers after `Engine.delay` seconds (past a client's timeout)
    "malformed"  HTTP 200 whose JSON body is cut short
    "missing"    HTTP 200 whose choice lacks its logprobs
    "drop"       sends the headers and a few bytes, then closes the connection
    "abort"      a complete answer whose finish_reason is "abort"
    "cut"        SGLang's sglext.routed_experts loses its last int32 (valid base64, not whole tokens)
    "garbled"    SGLang's sglext.routed_experts is not base64

The answers follow the engines' own code (field names, where EOS goes, how ids are rendered,
error bodies; vLLM's routed_experts per choice as base64 .npy of [prompt + sampled - 1, layers,
top_k], SGLang's once per response, asked for with return_routed_experts, as
sglext.routed_experts: base64 of the same rows' raw int32 bytes); the files and commits are
cited in tests/test_rollout_servers.py and tests/test_sglang_routing.py. `serve(app)` runs an
app with uvicorn on 127.0.0.1 and an ephemeral port in a background thread.

A completions prompt may be one row of ids or a list of rows (one choice each).

Not here: streaming, chat completions, n > 1, tokenizers (texts are "t<id>" stand-ins).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import threading
import time
import uuid
from collections import deque
from typing import Any

import numpy as np
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

FAULTS = ("error", "slow", "malformed", "missing", "drop", "abort", "cut", "garbled")


@dataclasses.dataclass
class Engine:
    """One stand-in engine. name: the served model name. vocab: ids are [0, vocab). eos_id: the
    model's EOS. eos_at: the step at which the model all but certainly draws EOS (elsewhere it
    all but never does); None: never. max_model_len: prompt + max_tokens allowed.
    logprobs_mode: vLLM's --logprobs-mode ("raw_logprobs" or "processed_logprobs").
    routing: (layers, top_k) when the engine runs with --enable-return-routed-experts.
    sampling_mask: vLLM runs with --return-sampling-mask. generate_logprobs: "ids" answers the
    token route's logprobs as current vLLM does ({"token_id": n}), "tokens" as older releases
    ({"token": "token_id:n"}). renders_ids: False plays an engine that ignores the request's
    ids field (return_tokens_as_token_ids / return_token_ids)."""

    name: str = "standin"
    vocab: int = 16
    eos_id: int = 2
    eos_at: int | None = None
    max_model_len: int = 64
    logprobs_mode: str = "raw_logprobs"
    routing: tuple[int, int] | None = None
    sampling_mask: bool = False
    generate_logprobs: str = "ids"
    renders_ids: bool = True
    delay: float = 1.0
    faults: deque = dataclasses.field(default_factory=deque)
    received: list = dataclasses.field(default_factory=list)  # (path, JSON body)
    answered: list = dataclasses.field(default_factory=list)  # (path, JSON answer)

    def fault(self, *names: str) -> None:
        """Queue faults for the next requests, one per request."""
        for name in names:
            assert name in FAULTS, name
            self.faults.append(name)


# ---- the fake model ---------------------------------------------------------------------------

def _log_softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    top = x[finite].max()
    shifted = np.where(finite, x - top, -np.inf)
    return shifted - np.log(np.exp(shifted[finite]).sum())


def _filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float):
    """Tempered logits with filtered ids at -inf (temperature, top-k, top-p, min-p, in vLLM's order
    of effect on the kept set)."""
    x = logits / (temperature if temperature > 0 else 1.0)
    if 0 < top_k < x.size:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = np.exp(_log_softmax(x))[order]
        keep = np.cumsum(probs) - probs < top_p
        x = np.where(np.isin(np.arange(x.size), order[keep]), x, -np.inf)
    if min_p > 0.0:
        probs = np.exp(_log_softmax(x))
        x = np.where(probs < min_p * probs.max(), -np.inf, x)
    return x


@dataclasses.dataclass
class _Step:
    token: int
    raw: float        # log_softmax(logits)[token]
    tempered: float   # log_softmax(logits / T)[token], before filters (SGLang)
    processed: float  # log_softmax(filtered)[token] (vLLM processed_logprobs)
    kept: list[int]   # ids the filters kept, ascending


def _generate(engine: Engine, prompt: list[int], params: dict[str, Any]) -> tuple[list[_Step], str, Any]:
    """Sample up to max_tokens ids; (steps, finish_reason, matched stop id or None)."""
    rng = np.random.default_rng([int(params.get("seed") or 0), *prompt])
    temperature = float(params.get("temperature", 1.0))
    top_k, top_p = int(params.get("top_k") or -1), float(params.get("top_p", 1.0))
    min_p = float(params.get("min_p") or 0.0)
    stops = {engine.eos_id, *(params.get("stop_token_ids") or [])}
    steps: list[_Step] = []
    for t in range(int(params["max_tokens"])):
        logits = rng.normal(0.0, 2.0, engine.vocab)
        logits[engine.eos_id] = 30.0 if t == engine.eos_at else -30.0
        x = _filtered(logits, temperature, top_k, top_p, min_p)
        if temperature == 0:
            token = int(np.argmax(x))
        else:
            token = int(rng.choice(engine.vocab, p=np.exp(_log_softmax(x))))
        steps.append(_Step(token, float(_log_softmax(logits)[token]),
                           float(_log_softmax(logits / (temperature or 1.0))[token]),
                           float(_log_softmax(x)[token]), np.flatnonzero(np.isfinite(x)).tolist()))
        if token in stops:  # the engines append the id, then check it: EOS stays in the ids
            return steps, "stop", token
    return steps, "length", None


def _routed(engine: Engine, prompt: list[int], steps: list[_Step]) -> np.ndarray:
    """The routing of every id but the last sampled one (never forwarded): [rows, layers, top_k]."""
    layers, top_k = engine.routing
    rng = np.random.default_rng([len(prompt), len(steps), *prompt])
    return rng.integers(0, 8, (len(prompt) + len(steps) - 1, layers, top_k))


def _routing(engine: Engine, prompt: list[int], steps: list[_Step]) -> str:
    """base64 .npy routing, as vLLM sends it (its dtype here: uint8)."""
    buffer = io.BytesIO()
    np.save(buffer, _routed(engine, prompt, steps).astype(np.uint8))
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _sglang_routing(engine: Engine, prompt: list[int], steps: list[_Step], fault: str | None) -> str:
    """base64 of the routing's raw int32 bytes, flat, as SGLang's detokenizer encodes it."""
    raw = _routed(engine, prompt, steps).astype(np.int32).tobytes()
    if fault == "cut":
        raw = raw[:-4]
    text = base64.b64encode(raw).decode("ascii")
    return "not base64!" + text if fault == "garbled" else text


def _text(steps: list[_Step], stop: Any) -> str:
    tokens = [s.token for s in steps]
    if stop is not None:  # both engines leave a stop id out of the text only
        tokens = tokens[:-1]
    return "".join(f"t{t}" for t in tokens)


# ---- faults and errors --------------------------------------------------------------------------

class _Dropped(Response):
    """Headers and a few body bytes, then the connection closes under the client."""

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")]})
        await send({"type": "http.response.body", "body": b'{"id": "cmpl-', "more_body": True})
        raise ConnectionAbortedError("the stand-in dropped the connection")


def _vllm_error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)


def _sglang_error(status: int, message: str, kind: str) -> JSONResponse:
    """SGLang's ErrorResponse: {"object": "error", "message", "type", "param", "code"}."""
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None,
                         "code": status}, status_code=status)


async def _take_fault(engine: Engine, path: str, body: Any) -> str | None:
    received = engine.received
    received.append((path, body))
    fault = engine.faults.popleft() if engine.faults else None
    if fault == "slow":
        await asyncio.sleep(engine.delay)
        if engine.received is not received:  # the engine was reset for a later test meanwhile:
            fault = "stale"                  # answer nothing that test would record as its own
    return fault


def _answer(engine: Engine, path: str, answer: dict, fault: str | None) -> Response:
    if fault == "stale":
        return Response(status_code=503)
    for choice in answer["choices"]:
        if fault == "missing":
            choice.pop("logprobs", None)
        if fault == "abort":
            choice["finish_reason"] = "abort"
    engine.answered.append((path, answer))
    if fault == "malformed":
        return Response(JSONResponse(answer).body[:-7], media_type="application/json")
    if fault == "drop":
        return _Dropped()
    return JSONResponse(answer)


def _rows(prompt: Any) -> list:
    """A completions prompt as rows: one list of ids, or a list of such lists (a batch)."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]


def _bad_request(engine: Engine, body: Any, prompt_field: str) -> str | None:
    """What the engines refuse with 400 before generating (validation, context length)."""
    if not isinstance(body, dict):
        return "the request body must be a JSON object"
    params = body.get("sampling_params", body)
    budget = params.get("max_tokens")
    if not isinstance(budget, int) or budget <= 0:
        return "max_tokens must be a positive integer"
    for prompt in _rows(body.get(prompt_field)):
        if (not isinstance(prompt, list) or not prompt
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt)):
            return f"{prompt_field} must be a nonempty list of nonnegative token ids"
        if max(prompt) >= engine.vocab:
            return f"Token id {max(prompt)} is out of vocabulary"
        if len(prompt) + budget > engine.max_model_len:
            return (f"This model's maximum context length is {engine.max_model_len} tokens. However, "
                    f"you requested {len(prompt) + budget} tokens ({len(prompt)} in the messages, "
                    f"{budget} in the completion).")
    return None


def _usage(rows: list[tuple[list[int], list[_Step]]], **extra) -> dict:
    prompt = sum(len(p) for p, _ in rows)
    completion = sum(len(steps) for _, steps in rows)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": None, **extra}


def _models(engine: Engine, owner: str) -> dict:
    return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": int(time.time()),
                                        "owned_by": owner, "root": engine.name, "parent": None,
                                        "max_model_len": engine.max_model_len}]}


# ---- vLLM ---------------------------------------------------------------------------------------

def vllm_router(engine: Engine) -> APIRouter:
    """vLLM's OpenAI-compatible completions route with /v1/models and /health."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        return Response(status_code=200)

    @router.get("/v1/models")
    async def models():
        return _models(engine, "vllm")

    @router.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _vllm_error(400, "the request body is not JSON", "BadRequestError")
        fault = await _take_fault(engine, "/v1/completions", body)
        if fault == "error":
            return _vllm_error(500, "EngineCore encountered an issue.", "InternalServerError")
        if (problem := _bad_request(engine, body, "prompt")) is not None:
            return _vllm_error(400, problem, "BadRequestError", "prompt")
        if body.get("model") not in (None, engine.name):
            return _vllm_error(404, f"The model `{body['model']}` does not exist.", "NotFoundError", "model")
        rows = [(prompt, _generate(engine, prompt, body)) for prompt in _rows(body["prompt"])]
        as_ids = bool(body.get("return_tokens_as_token_ids")) and engine.renders_ids
        wants_ids = bool(body.get("return_token_ids"))
        mode = "processed" if engine.logprobs_mode == "processed_logprobs" else "raw"
        choices = []
        for index, (prompt, (steps, finish, stop)) in enumerate(rows):
            logprobs = None
            if body.get("logprobs") is not None:
                tokens = [f"token_id:{s.token}" if as_ids else f"t{s.token}" for s in steps]
                values = [max(getattr(s, mode), -9999.0) for s in steps]
                offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])[:-1]]).astype(int).tolist()
                logprobs = {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                            "top_logprobs": [{t: v} for t, v in zip(tokens, values)]}
            choices.append({
                "index": index, "text": _text(steps, stop), "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop if stop != engine.eos_id else None,
                "token_ids": [s.token for s in steps] if wants_ids else None,
                "prompt_logprobs": None, "prompt_token_ids": prompt if wants_ids else None,
                "routed_experts": _routing(engine, prompt, steps) if engine.routing else None})
        answer = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                  "model": engine.name, "choices": choices, "service_tier": None,
                  "system_fingerprint": None, "usage": _usage([(p, r[0]) for p, r in rows]),
                  "kv_transfer_params": None}
        return _answer(engine, "/v1/completions", answer, fault)

    return router


def vllm_generate_router(engine: Engine) -> APIRouter:
    """vLLM's token route (--enable-scale-out / --tokens-only): token ids in, token ids out."""
    router = APIRouter()

    @router.post("/inference/v1/generate")
    async def generate(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _vllm_error(400, "the request body is not JSON", "BadRequestError")
        fault = await _take_fault(engine, "/inference/v1/generate", body)
        if fault == "error":
            return _vllm_error(500, "EngineCore encountered an issue.", "InternalServerError")
        if not isinstance(body, dict) or not isinstance(body.get("sampling_params"), dict):
            return _vllm_error(400, "sampling_params is required", "BadRequestError", "sampling_params")
        if (problem := _bad_request(engine, body, "token_ids")) is not None:
            return _vllm_error(400, problem, "BadRequestError", "token_ids")
        params, prompt = body["sampling_params"], body["token_ids"]
        steps, finish, _ = _generate(engine, prompt, params)
        logprobs = None
        if params.get("logprobs") is not None:
            mode = "processed" if engine.logprobs_mode == "processed_logprobs" else "raw"
            content = []
            for s in steps:
                value = max(getattr(s, mode), -9999.0)
                if engine.generate_logprobs == "ids":
                    top = [{"token_id": s.token, "logprob": value, "rank": None}]
                    content.append({"token_id": s.token, "logprob": value, "rank": None, "top_logprobs": top})
                else:
                    top = [{"token": f"token_id:{s.token}", "logprob": value, "bytes": None}]
                    content.append({"token": f"token_id:{s.token}", "logprob": value, "bytes": None,
                                    "top_logprobs": top})
            logprobs = {"content": content}
        choice = {"index": 0, "finish_reason": finish, "token_ids": [s.token for s in steps],
                  "routed_experts": _routing(engine, prompt, steps) if engine.routing else None,
                  "sampling_mask": [s.kept for s in steps] if engine.sampling_mask else None,
                  "weight_versions": None, "logprobs": logprobs}
        answer = {"request_id": f"generate-tokens-{uuid.uuid4().hex}", "model": engine.name,
                  "created": int(time.time()), "usage": _usage([(prompt, steps)]), "prompt_logprobs": None,
                  "prompt_token_id_logprobs": None, "prompt_token_ids": None, "mm_placeholders": None,
                  "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
                  "output_mode": "tokens", "choices": [choice]}
        return _answer(engine, "/inference/v1/generate", answer, fault)

    return router


# ---- SGLang -------------------------------------------------------------------------------------

def sglang_router(engine: Engine) -> APIRouter:
    """SGLang's OpenAI-compatible completions route with /v1/models and /health."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        return Response(status_code=200)

    @router.get("/v1/models")
    async def models():
        return _models(engine, "sglang")

    @router.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return _sglang_error(400, "the request body is not JSON", "BadRequest")
        fault = await _take_fault(engine, "/v1/completions", body)
        if fault == "error":
            return _sglang_error(500, "Internal server error", "InternalServerError")
        if (problem := _bad_request(engine, body, "prompt")) is not None:
            return _sglang_error(400, problem, "BadRequest")
        rows = [(prompt, _generate(engine, prompt, body)) for prompt in _rows(body["prompt"])]
        choices = []
        for index, (prompt, (steps, finish, stop)) in enumerate(rows):
            logprobs = None
            if body.get("logprobs") is not None:  # output_token_logprobs; no top entries for logprobs=0
                logprobs = {"text_offset": [-1] * len(steps), "token_logprobs": [s.tempered for s in steps],
                            "tokens": [f"t{s.token}" for s in steps], "top_logprobs": []}
            choice = {"index": index, "text": _text(steps, stop), "logprobs": logprobs,
                      "finish_reason": finish, "matched_stop": stop}
            if body.get("return_token_ids") and engine.renders_ids:
                choice["token_ids"] = [s.token for s in steps]
                choice["prompt_token_ids"] = prompt
            choices.append(choice)
        answer = {"id": uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                  "model": body.get("model", "default"), "choices": choices,
                  "usage": _usage([(p, r[0]) for p, r in rows], reasoning_tokens=0),
                  "metadata": {"weight_version": "default"}}
        if body.get("return_routed_experts") and engine.routing:  # the first choice's, per response
            prompt, (steps, _, _) = rows[0]
            answer["sglext"] = {"routed_experts": _sglang_routing(engine, prompt, steps, fault)}
        return _answer(engine, "/v1/completions", answer, fault)

    return router


# ---- serving ------------------------------------------------------------------------------------

def app(*routers: APIRouter) -> FastAPI:
    """A FastAPI app holding `routers` (completion and weight routes alike)."""
    application = FastAPI()
    for router in routers:
        application.include_router(router)
    return application


@contextlib.contextmanager
def serve(application: FastAPI, *, timeout: float = 10.0):
    """Serve `application` on 127.0.0.1 at an ephemeral port in a background thread; yields its
    root URL and stops the server on exit."""
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=0, log_level="critical",
                                           lifespan="off", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name="standin-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError("the stand-in server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)

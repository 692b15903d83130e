"""The HTTP routes of `dew serve`: vLLM's OpenAI-compatible subset over a `ServedPolicy`.

`create_app(policy, dev_endpoints=...)` returns a FastAPI app with

- GET /health, GET /v1/models, POST /v1/completions (prompts as ids or text), POST
  /v1/chat/completions (messages through the tokenizer's chat template), both whole or, with
  stream=true, as server-sent events while the engine samples (`stream`);
- with dev_endpoints, the calls a weight push makes on a vLLM launched with
  VLLM_SERVER_DEV_MODE=1: POST /pause?mode=wait, POST /collective_rpc {"method":
  "reload_weights"}, POST /reset_prefix_cache, POST /update_weight_version, POST /resume, and GET
  /is_paused, GET /weight_info, and vLLM's runtime LoRA routes POST /v1/load_lora_adapter and
  /v1/unload_lora_adapter (`lora_routes`). Whoever reaches them can stop the server and swap its
  weights for whatever the launch directory holds: they are behind the API key when there is one.

A request's `model` picks the base or one of the adapters served over it (`adapters.ServedModels`).

`options` (`guard.ServeOptions`) are the limits on clients: the API key, the request size, read
and write timeouts, the per-request max_tokens ceiling, and whether chat templates sent with
requests are rendered (in a sandboxed process, `template`) or refused. Every error, 4xx or 5xx, is
`{"error": {"message", "type", "param", "code"}}` (`guard`).

Every request is checked before it is drawn: sampling controls must equal the served ones (the
engine has one `Sampling`), fields vLLM knows but Dew cannot honour are refused by name, and
prompt plus max_tokens must fit the server's capacity. A refused request gets a plain JSON 400,
streamed or not: a stream starts only once every check passed. The draw is awaited against the
client's connection: a client that goes away cancels its request, and its slot frees at the next
call.

Not here: request and response models (`protocol`), rendering a draw (`render`), streaming it
(`stream`), the engine (`policy`), limits and error handlers (`guard`), request chat templates
(`template`), launching (`launch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from dew_lib.records.draw import Draw
from dew_lib.sampling import Sampling
from dew_lib.serve import prompt_logprobs, render, stream
from dew_lib.serve.adapters import ServedModels
from dew_lib.serve.dev import dev_routes
from dew_lib.serve.guard import ServeOptions, install
from dew_lib.serve.lora_routes import lora_routes
from dew_lib.serve.policy import ServedPolicy
from dew_lib.serve.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelList,
    ServeError,
    UsageInfo,
    error_response,
    failure,
    unsupported,
)
from dew_lib.serve.template import TemplateRenderer, request_template
from dew_lib.serve.tokenize_route import tokenize_routes

GREEDY_BELOW = 1e-5  # vLLM samples greedily under this temperature
SEEDS = 2**32  # the native server's seeds are uint32


def create_app(policy: ServedPolicy | ServedModels, *, dev_endpoints: bool = False,
               options: ServeOptions = ServeOptions()) -> FastAPI:
    """The app serving `policy` (one checkpoint, or a `ServedModels` with adapters over it);
    dev_endpoints adds the pause/reload and LoRA load/unload routes (trusted callers only);
    options: the limits on clients (`guard.ServeOptions`: API key, sizes, timeouts, templates).

    The caller owns `policy` and closes it after the app stops.
    """
    models = policy if isinstance(policy, ServedModels) else ServedModels(policy)
    app = FastAPI(title="dew serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.policy, app.state.models = models.base, models
    install(app, options)
    app.add_exception_handler(ServeError, lambda request, error: error.response())
    app.include_router(_openai_routes(models, options))
    app.include_router(tokenize_routes(models))
    if dev_endpoints:
        app.include_router(dev_routes(models))
        app.include_router(lora_routes(models))
    return app


# ---- checks ------------------------------------------------------------------------------------

# What each sampling control may be, as `Sampling` (and so `dew serve`'s launch flags) accepts it.
SAMPLING_RANGES = {
    "temperature": ("a number >= 0 (under 1e-5 is greedy)", lambda v: v >= 0 and math.isfinite(v)),
    "top_p": ("a number in (0, 1]", lambda v: 0 < v <= 1),
    "min_p": ("a number in [0, 1)", lambda v: 0 <= v < 1),
    "top_k": ("-1 or 0 (none) or a positive integer", lambda v: v >= -1),
}


def check_sampling(request: Any, served: Sampling) -> None:
    """Refuse a sampling control that is out of range or differs from the served one, saying what
    the server accepts."""
    def close(a, b):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)

    top_k = None if request.top_k in (0, -1) else request.top_k  # vLLM's spellings of "no top-k"
    checks = (  # (field, value sent, value compared, served value, launch flag, equality)
        ("temperature", request.temperature, request.temperature, served.temperature, "--temperature",
         lambda a, b: (a < GREEDY_BELOW and b == 0.0) or close(a, b)),
        ("top_p", request.top_p, request.top_p, served.top_p, "--top-p", close),
        ("min_p", request.min_p, request.min_p, served.min_p, "--min-p", close),
        ("top_k", request.top_k, top_k, served.top_k, "--top-k", lambda a, b: a == b),
    )
    for name, sent, given, value, flag, same in checks:
        if sent is None:
            continue
        shown = "none (null, 0 or -1)" if value is None else repr(value)
        rule, valid = SAMPLING_RANGES[name]
        if not valid(sent):
            raise ServeError(f"{name}={sent!r} is out of range: {name} is {rule}. This server draws every request "
                             f"with {name}={shown}; leave {name} out or send that value", param=name)
        if not same(given, value):
            raise ServeError(
                f"{name}={sent!r} differs from the served {name}={shown}: dew serve draws every request "
                f"with the sampling fixed at launch; leave {name} out or send the served value, or "
                f"relaunch dew serve with {flag} {sent}", param=name)


def _check_request(request: CompletionRequest | ChatCompletionRequest, policy: ServedPolicy) -> None:
    _check_stream_options(request)
    if request.n not in (None, 1):
        raise ServeError(f"n={request.n}: dew serve draws one completion per prompt; send n=1, or n "
                         "requests with different seeds", param="n")
    unsupported(request)
    check_sampling(request, policy.sampling)
    extra = sorted(set(request.stop_token_ids or ()) - set(policy.sampling.eos_ids))
    if extra:  # vLLM stops on the model's EOS ids and these; the native server on its EOS ids only
        raise ServeError(f"stop_token_ids {extra} are not among the ids dew serve stops on "
                         f"({list(policy.sampling.eos_ids)}, the checkpoint's EOS ids); send a subset of those "
                         "or leave stop_token_ids out", param="stop_token_ids")
    if request.seed is not None and not 0 <= request.seed < SEEDS:
        raise ServeError(f"seed={request.seed} is outside [0, 2**32), the seeds Dew's sampler takes; "
                         "send a seed in that range", param="seed")


def _check_stream_options(request: CompletionRequest | ChatCompletionRequest) -> None:
    options = request.stream_options
    if options and not request.stream:  # vLLM's validate_stream_options
        raise ServeError("Stream options can only be defined when `stream=True`.", param="stream_options")
    for name, value in (options or {}).items():
        if name not in stream.STREAM_OPTIONS:
            raise ServeError(f"dew serve does not support stream_options.{name}={value!r}; leave it out (it "
                             f"understands {' and '.join(stream.STREAM_OPTIONS)})", param=f"stream_options.{name}")
        if value is not None and not isinstance(value, bool):
            raise ServeError(f"stream_options.{name} must be a boolean, got {value!r}", param=f"stream_options.{name}")


def _max_tokens(sent: tuple[tuple[str, int | None], ...], default: int, options: ServeOptions) -> int:
    """The budget of a request: the first field it sends, else `default`, both within the server's
    --max-tokens-limit (a sent value above it is refused, the default is lowered to it)."""
    limit = options.max_tokens_limit
    for name, value in sent:
        if value is not None:
            if limit is not None and value > limit:
                raise ServeError(f"{name}={value} is more than this server draws for one request ({limit}, its "
                                 f"--max-tokens-limit); send {name} <= {limit}", param=name)
            return value
    return default if limit is None else min(default, limit)


def _check_prompt(policy: ServedPolicy, prompt: Sequence[int], max_tokens: int, seed: int | None) -> None:
    if max_tokens < 1:
        raise ServeError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if len(prompt) + max_tokens > policy.capacity:
        raise ServeError(
            f"This server's maximum context length is {policy.capacity} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} in the "
            f"completion). Lower max_tokens or shorten the prompt, or relaunch dew serve with a larger "
            f"--capacity.", param="max_tokens")
    try:
        policy.native.server.check(prompt, max_tokens, seed)
    except ValueError as error:
        raise ServeError(str(error), param="prompt") from None


# ---- drawing -----------------------------------------------------------------------------------

async def _draw_all(policy: ServedPolicy, prompts: list[list[int]], max_tokens: int, seed: int | None) -> list[Draw]:
    try:
        if len(prompts) == 1:
            return [await policy.draw(prompts[0], max_tokens, seed)]
        async with asyncio.TaskGroup() as group:  # one failure cancels the siblings
            tasks = [group.create_task(policy.draw(p, max_tokens, seed)) for p in prompts]
        return [task.result() for task in tasks]
    except BaseExceptionGroup as errors:
        raise failure(errors.exceptions[0]) from None
    except Exception as error:  # noqa: BLE001 - every failure becomes an error response
        raise failure(error) from None


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(raw: Request, work: Awaitable):
    """`work`'s result, or None when the client went away first (then `work` is cancelled)."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def _gone() -> Response:
    return error_response("Client disconnected", param=None, status=400, kind="BadRequestError")


# ---- /v1/completions ---------------------------------------------------------------------------

async def _completion_prompts(policy: ServedPolicy, request: CompletionRequest) -> list[list[int]]:
    """The request's prompts as id lists; text is encoded on the policy's text thread."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ServeError("prompt must be nonempty: token ids, a string, or a list of either", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], list):
        if not all(prompt):
            raise ServeError("every prompt must hold at least one token id", param="prompt")
        return [list(p) for p in prompt]
    if policy.tokenizer is None:
        raise ServeError(f"{policy.directory} has no tokenizer, so text prompts cannot be encoded; "
                         "send token ids", param="prompt")
    encoded = await policy.text(policy.tokenizer, list(prompt), add_special_tokens=request.add_special_tokens)
    if not all(encoded["input_ids"]):
        raise ServeError("a text prompt encoded to no token ids; send nonempty text", param="prompt")
    return [list(ids) for ids in encoded["input_ids"]]


def _completion_choices(policy: ServedPolicy, request: CompletionRequest, prompts, draws) -> list[CompletionChoice]:
    tokenizer, choices = policy.tokenizer, []
    for index, (prompt, draw) in enumerate(zip(prompts, draws, strict=True)):
        finish_reason, stop_reason = render.finish(draw, policy.primary_eos)
        logprobs = None
        if request.logprobs is not None:
            names = render.token_names(tokenizer, draw.ids, as_ids=bool(request.return_tokens_as_token_ids),
                                       known=policy.token_text)
            logprobs = render.completion_logprobs(names, render.log_probs(draw, policy.logprobs_mode))
        ids = draw.ids.tolist() if request.return_token_ids else None
        choices.append(CompletionChoice(
            index=index, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
            text=render.visible_text(tokenizer, draw, include_stop=request.include_stop_str_in_output,
                                     skip_special=request.skip_special_tokens),
            token_ids=ids, prompt_token_ids=list(prompt) if request.return_token_ids else None,
            routed_experts=render.routed_experts(draw, policy.model)))
    return choices


# ---- /v1/chat/completions ----------------------------------------------------------------------

def _text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with list contents joined into text, as vLLM's "string" content format does."""
    out = []
    for k, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise ServeError(f"messages[{k}] needs a string role, got {message.get('role')!r}", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ServeError(f"messages[{k}] has a {kind!r} content part; dew serve takes text "
                                     "parts only", param="messages")
                texts.append(str(part.get("text", "")))
            message = {**message, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise ServeError(f"messages[{k}].content must be a string, a list of text parts or null",
                             param="messages")
        out.append(message)
    return out


def _chat_prompt(policy: ServedPolicy, request: ChatCompletionRequest) -> list[int]:
    """The prompt the checkpoint's own chat template makes of the request (on the text thread)."""
    try:
        text = policy.tokenizer.apply_chat_template(
            _text_messages(request.messages), tools=request.tools, tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, **(request.chat_template_kwargs or {}))
    except ServeError:
        raise
    except Exception as error:  # noqa: BLE001 - a template's own refusal (jinja2 raise_exception) included
        raise ServeError(f"the chat template could not render these messages: {error}", param="messages") from None
    return _encoded_chat(policy, text, request.add_special_tokens)


async def _templated_prompt(policy: ServedPolicy, request: ChatCompletionRequest, template: str, param: str,
                            renderer: TemplateRenderer) -> list[int]:
    """The prompt the request's own template makes of it, rendered in a sandboxed process."""
    kwargs = {k: v for k, v in (request.chat_template_kwargs or {}).items() if k != "chat_template"}
    text = await renderer.render(
        template, _text_messages(request.messages), tools=request.tools, param=param,
        add_generation_prompt=request.add_generation_prompt, continue_final_message=request.continue_final_message,
        variables={**policy.tokenizer.special_tokens_map, **kwargs})  # as apply_chat_template: kwargs win
    return await policy.text(_encoded_chat, policy, text, request.add_special_tokens)


def _encoded_chat(policy: ServedPolicy, text: str, add_special_tokens: bool) -> list[int]:
    ids = policy.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    if not ids:
        raise ServeError("the chat template rendered these messages to no token ids", param="messages")
    return list(ids)


def _chat_choice(policy: ServedPolicy, request: ChatCompletionRequest, draw: Draw) -> ChatChoice:
    tokenizer = policy.tokenizer
    finish_reason, stop_reason = render.finish(draw, policy.primary_eos)
    logprobs = None
    if request.logprobs:
        decoded = render.decoded_tokens(tokenizer, draw.ids, policy.token_text)
        names = render.token_names(tokenizer, draw.ids, as_ids=True) if request.return_tokens_as_token_ids else decoded
        logprobs = render.chat_logprobs(names, decoded, render.log_probs(draw, policy.logprobs_mode))
    content = render.visible_text(tokenizer, draw, include_stop=request.include_stop_str_in_output,
                                  skip_special=request.skip_special_tokens)
    return ChatChoice(index=0, message=ChatMessage(role=_chat_role(request), content=content), logprobs=logprobs,
                      finish_reason=finish_reason, stop_reason=stop_reason,
                      token_ids=draw.ids.tolist() if request.return_token_ids else None)


def _chat_role(request: ChatCompletionRequest) -> str:
    """vLLM's get_chat_request_role: the assistant's, unless the last message is being continued."""
    if request.add_generation_prompt or not request.messages:
        return "assistant"
    return str(request.messages[-1].get("role"))


def _check_chat(request: ChatCompletionRequest, policy: ServedPolicy, templated: bool) -> None:
    if policy.tokenizer is None or not (templated or getattr(policy.tokenizer, "chat_template", None)):
        raise ServeError(f"{policy.directory} has no tokenizer with a chat template, so messages cannot "
                         "be rendered; use /v1/completions with token ids", param="messages")
    if request.top_logprobs not in (None, 0):
        if not request.logprobs:
            raise ServeError("when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs")
        raise ServeError(f"top_logprobs={request.top_logprobs}: dew serve reports the sampled token's "
                         "log-probability only; send top_logprobs=0", param="top_logprobs")
    if request.tool_choice not in (None, "none"):
        raise ServeError(f"tool_choice={request.tool_choice!r} needs a tool-call parser, which dew serve "
                         "does not have; leave it out or send \"none\" (tools still reach the chat template)",
                         param="tool_choice")
    if request.add_generation_prompt and request.continue_final_message:
        raise ServeError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                         param="continue_final_message")


# ---- routes ------------------------------------------------------------------------------------

def _openai_routes(models: ServedModels, options: ServeOptions) -> APIRouter:
    router = APIRouter()
    base = models.base
    renderer = TemplateRenderer(timeout=options.template_timeout, max_chars=options.template_max_chars)

    @router.get("/health")
    async def health() -> Response:
        if base.failure is not None:
            return error_response(f"the engine stopped: {base.failure}", param=None, status=503,
                                  kind="ServiceUnavailableError")
        return Response(status_code=200)

    @router.get("/v1/models")
    async def model_list() -> JSONResponse:
        return JSONResponse(ModelList(data=models.cards()).model_dump())

    @router.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        policy = models.pick(request.model)
        _check_request(request, policy)
        prompt_k = prompt_logprobs.requested(request)
        if request.logprobs not in (None, 0):
            raise ServeError(f"logprobs={request.logprobs}: dew serve reports the sampled token's "
                             "log-probability only; send logprobs=0", param="logprobs")
        tokenizer_needed = (request.logprobs is not None and not request.return_tokens_as_token_ids)
        if tokenizer_needed and policy.tokenizer is None:
            raise ServeError(f"{policy.directory} has no tokenizer to name tokens with; send "
                             "return_tokens_as_token_ids=true", param="return_tokens_as_token_ids")
        sent = request.max_tokens if "max_tokens" in request.model_fields_set else None
        max_tokens = _max_tokens((("max_tokens", sent),), 16, options)
        prompts = await _completion_prompts(policy, request)
        for prompt in prompts:
            _check_prompt(policy, prompt, max_tokens, request.seed)
        if request.stream:
            return _events(stream.CompletionStream(policy, request, prompts).events(max_tokens))
        draws = await _unless_disconnected(raw, _draw_all(policy, prompts, max_tokens, request.seed))
        if draws is None:
            return _gone()
        choices = await policy.text(_completion_choices, policy, request, prompts, draws)
        if prompt_k is not None:  # one forward pass over every prompt, with the weights that drew
            for choice, scored in zip(choices, await prompt_logprobs.prompt_logprobs(policy, prompts, prompt_k),
                                      strict=True):
                choice.prompt_logprobs = scored
        usage = _usage(sum(map(len, prompts)), sum(map(len, draws)))
        return _json(CompletionResponse(model=policy.name, choices=choices, usage=usage))

    @router.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        policy = models.pick(request.model)
        _check_request(request, policy)
        prompt_k = prompt_logprobs.requested(request)
        template = request_template(request, options.trust_request_chat_template)
        _check_chat(request, policy, templated=template is not None)
        sent = (("max_completion_tokens", request.max_completion_tokens), ("max_tokens", request.max_tokens))
        _max_tokens(sent, 1, options)  # a budget over the ceiling is refused before rendering
        if template is None:
            prompt = await policy.text(_chat_prompt, policy, request)
        else:  # a client that leaves stops its template's rendering too
            prompt = await _unless_disconnected(raw, _templated_prompt(policy, request, *template, renderer))
            if prompt is None:
                return _gone()
        # vLLM's default: whatever the context has left
        max_tokens = _max_tokens(sent, max(policy.capacity - len(prompt), 1), options)
        _check_prompt(policy, prompt, max_tokens, request.seed)
        if request.stream:
            return _events(stream.ChatStream(policy, request, prompt, _chat_role(request)).events(max_tokens))
        draws = await _unless_disconnected(raw, _draw_all(policy, [prompt], max_tokens, request.seed))
        if draws is None:
            return _gone()
        choice = await policy.text(_chat_choice, policy, request, draws[0])
        response = ChatCompletionResponse(model=policy.name, choices=[choice], usage=_usage(len(prompt), len(draws[0])),
                                          prompt_token_ids=prompt if request.return_token_ids else None)
        if prompt_k is not None:
            (response.prompt_logprobs,) = await prompt_logprobs.prompt_logprobs(policy, [prompt], prompt_k)
        return _json(response)

    return router


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the sending ends: a write that fails
    (a stalled reader cut off by the write timeout) leaves it suspended at a `yield`, and only
    closing it runs its `finally`, which cancels the draws and frees their slots now."""

    def __init__(self, events: AsyncGenerator[str, None]):
        super().__init__(events, media_type="text/event-stream")
        self._events = events  # the body_iterator too (StreamingResponse keeps an async one as is)

    async def stream_response(self, send) -> None:
        async with contextlib.aclosing(self._events):
            await super().stream_response(send)


def _events(events: AsyncGenerator[str, None]) -> StreamingResponse:
    return _EventStream(events)


def _json(model: BaseModel) -> Response:
    # pydantic's own encoder: a fifth of json.dumps(model.model_dump()) for a 128-token logprobs body
    return Response(model.model_dump_json(), media_type="application/json")


def _usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


__all__ = ["check_sampling", "create_app"]

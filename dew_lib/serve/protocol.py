"""The subset of vLLM's OpenAI-compatible request and response shapes that `dew serve` speaks.

Names, defaults and layouts follow vLLM's protocol modules (the revisions are listed in
tests/test_serve.py): requests accept unknown fields, as OpenAI clients send extras and vLLM
ignores them; responses carry every field they declare, None where vLLM writes null; an error is
`{"error": {"message", "type", "param", "code"}}` with the HTTP status as `code`.

Fields vLLM understands but Dew's engine cannot honour (stop strings, penalties, beam search,
echo, structured output, ...) are declared with their neutral values in `NEUTRAL`, so a request
that sets one is refused by name instead of being silently served without it.

The streamed chunks (`CompletionStreamResponse`, `ChatStreamResponse`) are written the way vLLM
writes them, `model_dump_json(exclude_unset=True)`: a chunk holds the fields its builder set,
null ones included, and no others. `failure` maps an engine error to the error a client gets.

Not here: turning requests into draws (`app`), turning draws into choices (`render`), the
streams themselves (`stream`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from dew_lib.inference.base import ServerClosed

TokenId = Annotated[int, Field(ge=0)]


class ServeError(Exception):
    """A refusal with vLLM's error shape: HTTP `status`, `kind` (vLLM's `type`) and the `param`
    at fault."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 kind: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def response(self) -> JSONResponse:
        return error_response(self.message, param=self.param, status=self.status, kind=self.kind)


def error_response(message: str, *, param: str | None, status: int, kind: str,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param=param, status=status, kind=kind), status_code=status,
                        headers=headers)


def error_body(message: str, *, param: str | None, status: int, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def failure(error: BaseException) -> BaseException:
    """The ServeError a failed draw answers with (a cancellation passes through)."""
    if isinstance(error, ServerClosed):
        return ServeError(f"the engine stopped: {error}", status=503, kind="ServiceUnavailableError")
    if isinstance(error, ValueError):  # the engine refused the request itself
        return ServeError(str(error), param="prompt")
    if isinstance(error, ServeError | asyncio.CancelledError):
        return error
    return ServeError(f"drawing failed: {error!r}", status=500, kind="InternalServerError")


# ---- requests --------------------------------------------------------------------------------

class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # as vLLM: unknown fields are ignored

    model: str | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] | None = None  # served only when the served EOS ids already cover them
    # Understood by vLLM, refused here unless neutral (see NEUTRAL).
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    use_beam_search: bool | None = False
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    truncate_prompt_tokens: int | None = None
    stream_options: dict[str, Any] | None = None
    spaces_between_special_tokens: bool | None = True
    priority: int | None = 0


class CompletionRequest(_Request):
    """POST /v1/completions: one prompt (ids or text) or a list of them."""

    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    add_special_tokens: bool = True
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages rendered by the served tokenizer's chat template."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool | None = False
    chat_template: str | None = None  # refused unless trusted (`template`)
    documents: list[dict[str, str]] | None = None
    reasoning_effort: str | None = None


# What each refused field may hold without asking for anything: its default and its no-op values.
NEUTRAL: dict[str, tuple] = {
    "stop": (None, [], ""), "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0), "repetition_penalty": (None, 1.0), "length_penalty": (None, 1.0),
    "logit_bias": (None, {}), "ignore_eos": (None, False), "min_tokens": (None, 0),
    "use_beam_search": (None, False), "bad_words": (None, []), "allowed_token_ids": (None,),
    "logprob_token_ids": (None,),
    "response_format": (None, {"type": "text"}), "structured_outputs": (None,),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True), "priority": (None, 0), "echo": (None, False),
    "suffix": (None, ""), "best_of": (None, 1), "documents": (None, []),
    "reasoning_effort": (None,),
}


def unsupported(request: _Request) -> None:
    """Refuse the first field in NEUTRAL that the request sets to something Dew cannot do."""
    for name in request.model_fields_set & NEUTRAL.keys():
        value = getattr(request, name)
        if value not in NEUTRAL[name]:
            raise ServeError(
                f"dew serve does not support {name}={value!r}; leave it out (its neutral values: "
                f"{', '.join(repr(v) for v in NEUTRAL[name])})", param=name)


# ---- responses -------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, Any] | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One entry of a prompt position's dict in `prompt_logprobs`: vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # null for the first id, then one dict per id


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    routed_experts: str | None = None  # base64 .npy [prompt + sampled - 1, layers, top_k], when served


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    service_tier: None = None
    system_fingerprint: None = None
    usage: UsageInfo


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    reasoning: None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    service_tier: None = None
    system_fingerprint: None = None
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "dew"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


__all__ = ["NEUTRAL", "ChatChoice", "ChatCompletionRequest", "ChatCompletionResponse", "ChatDelta",
           "ChatLogProb", "ChatLogProbs", "ChatLogProbsContent", "ChatMessage", "ChatStreamChoice",
           "ChatStreamResponse", "CompletionChoice", "CompletionLogProbs", "CompletionRequest",
           "CompletionResponse", "CompletionStreamChoice", "CompletionStreamResponse", "ModelCard", "ModelList",
           "ServeError", "UsageInfo", "error_body", "error_response", "failure", "new_id", "now", "unsupported"]

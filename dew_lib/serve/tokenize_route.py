"""`POST /tokenize`: vLLM's route that encodes a text prompt with the served model's tokenizer.

A client asks it whether the ids it sends mean to the engine what they mean to the client. A
distillation stage does, before it trains against a served teacher
(`RemoteTeacher.check_tokenizer`): a teacher served with another tokenizer would otherwise score
ids that mean nothing to it, without an error. The body is vLLM's `TokenizeCompletionRequest`
(`model`, `prompt`, `add_special_tokens`, `return_token_strs`) and the answer its
`TokenizeResponse` (`count`, `max_model_len`, `tokens`, `token_strs`).

Not here: vLLM's chat form of the request (`messages`, refused naming the field), `/detokenize`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from dew_lib.serve.adapters import ServedModels
from dew_lib.serve.protocol import ServeError


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest; unknown fields are ignored, as vLLM ignores them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


def tokenize_routes(models: ServedModels) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        policy = models.pick(request.model)
        if request.messages is not None:
            raise ServeError("dew serve tokenizes text prompts only; send `prompt` (render the chat "
                             "yourself) instead of `messages`", param="messages")
        if request.prompt is None:
            raise ServeError("`prompt` is missing: send the text to tokenize", param="prompt")
        tokenizer = policy.tokenizer
        if tokenizer is None:
            raise ServeError(f"{policy.directory} has no tokenizer, so text cannot be tokenized", param="prompt")
        ids = await policy.text(tokenizer.encode, request.prompt, add_special_tokens=request.add_special_tokens)
        strings = await policy.text(tokenizer.convert_ids_to_tokens, ids) if request.return_token_strs else None
        answer = TokenizeResponse(count=len(ids), max_model_len=policy.capacity, tokens=list(ids),
                                  token_strs=strings)
        return JSONResponse(answer.model_dump())

    return router


__all__ = ["TokenizeRequest", "TokenizeResponse", "tokenize_routes"]

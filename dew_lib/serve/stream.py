"""`stream=true`: a draw sent as vLLM's server-sent events while the engine samples it.

`CompletionStream(...).events(max_tokens)` and `ChatStream(...).events(max_tokens)` are what a
route hands to a StreamingResponse (text/event-stream): `data: {json}\\n\\n` chunks, then
`data: [DONE]\\n\\n`. The ids arrive as the engine samples them: each request is submitted with
`on_ids`, which the native server calls after every engine call that sampled ids for it, so a
chunk carries the ids of one engine call (the first one the prompt's first id and up to `steps`
more, then up to `steps`, fewer when a call ends early), as vLLM's chunks carry the tokens of one
engine step (or of `stream_interval` steps). The call that finishes a draw sends its last ids
with the finish reason. Nothing is chunked after the fact: a chunk leaves as soon as its engine
call is read back.

The chunks follow vLLM's stream generators field by field (tests/test_serve_stream.py names the
revisions): completions chunks `text_completion` with the choice's text delta, log-probs of the
new ids only (`text_offset` counting on from the text already sent), `token_ids` of the new ids
and `prompt_token_ids` on a choice's first chunk under return_token_ids, and `finish_reason` null
until the choice's last chunk; chat chunks `chat.completion.chunk`, first
`{"role": "assistant", "content": ""}` (with `prompt_token_ids` on that chunk), then content
deltas, log-probs in the chat shape, and a last chunk with the finish reason. stream_options
`include_usage` adds a last chunk with no choices and the usage; `continuous_usage_stats` (with
it) puts the running usage on every chunk. A list of prompts streams one choice per prompt, each
chunk naming its choice's index, interleaved as the engine samples them.

Text is detokenized incrementally (`IncrementalText`): a UTF-8 character split across ids is held
back until its last byte arrives, as vLLM's detokenizer does, and a draw's last chunk completes
the text decoded at once, so the deltas concatenate to the non-streamed text. Tokenizer work runs
on the policy's text thread. A client that goes away ends the iteration (Starlette cancels it
when the connection closes), and so does one that stops reading for longer than the write timeout
(`guard`; the route's response then closes the generator): either cancels the draws, whose slots
free at the engine's next call. The draws never wait for the reader.
A draw that fails mid-stream ends the stream with a `data: {"error": ...}` chunk and `[DONE]`, as
vLLM's generators do (the other prompts' draws are cancelled).

Not here: checking requests (they are refused with a plain 400 before a stream starts, `app`),
`n` > 1, `echo`, top-k alternatives in the log-probs, stream_options fields other than the two.
"""

from __future__ import annotations

import abc
import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from dew_lib.records.draw import Draw
from dew_lib.serve import render
from dew_lib.serve.policy import ServedPolicy
from dew_lib.serve.protocol import (
    ChatCompletionRequest,
    ChatDelta,
    ChatStreamChoice,
    ChatStreamResponse,
    CompletionRequest,
    CompletionStreamChoice,
    CompletionStreamResponse,
    ServeError,
    UsageInfo,
    error_body,
    failure,
    new_id,
    now,
)

DONE = "data: [DONE]\n\n"
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


class IncrementalText:
    """The text of ids that arrive a few at a time, as vLLM's incremental detokenizer yields it.

    `add(ids)` returns the text the new ids complete. It decodes a window that starts at the ids
    sent in the delta before last, so ids are decoded in context (a tokenizer that strips a leading
    space strips it the same way in both decodes), and returns nothing while the window's text
    ends in U+FFFD: a character whose UTF-8 bytes are split across ids waits for the ids that
    complete it. `finish(ids)` takes the last ids and returns the rest of the text decoded at
    once, so the deltas add up to `tokenizer.decode(every id)`, the non-streamed text.
    Without a tokenizer every delta is "" (as the non-streamed text is).
    """

    def __init__(self, tokenizer: Any, *, skip_special: bool):
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = []
        self.sent: list[str] = []
        self.prefix = self.read = 0  # vLLM's prefix_offset and read_offset

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _window(self) -> tuple[str, str]:
        return self._decode(self.ids[self.prefix:self.read]), self._decode(self.ids[self.prefix:])

    def add(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        before, after = self._window()
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        self.sent.append(after[len(before):])
        return self.sent[-1]

    def finish(self, ids: Sequence[int]) -> str:
        self.ids.extend(ids)
        if self.tokenizer is None:
            return ""
        whole, sent = self._decode(self.ids), "".join(self.sent)
        if whole.startswith(sent):
            return whole[len(sent):]
        before, after = self._window()  # a tokenizer whose text changes behind the window
        return after[len(before):]


class _Choice:
    """One streamed choice: its prompt, text, and how much of it has been sent."""

    def __init__(self, index: int, prompt: list[int], tokenizer: Any, skip_special: bool):
        self.index, self.prompt = index, prompt
        self.text = IncrementalText(tokenizer, skip_special=skip_special)
        self.ids = 0  # ids sent
        self.chars = 0  # characters of text sent
        self.started = False


def stream_options(request: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as vLLM's should_include_usage reads them."""
    options = request.stream_options or {}
    usage = bool(options.get("include_usage"))
    return usage, usage and bool(options.get("continuous_usage_stats"))


class _Stream(abc.ABC):
    """What the two routes' streams share: the draws, their events, the deltas and the usage."""

    prefix = ""

    def __init__(self, policy: ServedPolicy, request, prompts: list[list[int]]):
        self.policy, self.request = policy, request
        self.id, self.created = new_id(self.prefix), now()
        self.usage, self.continuous = stream_options(request)
        skip = request.skip_special_tokens
        self.choices = [_Choice(k, p, policy.tokenizer, skip) for k, p in enumerate(prompts)]

    async def events(self, max_tokens: int) -> AsyncGenerator[str, None]:
        """Draw every prompt and yield its SSE chunks as the engine samples the ids."""
        loop = asyncio.get_running_loop()
        # (index, ids, raw, behavior) of a call that did not finish a draw; (index, Draw or error) at its end
        queue: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()

        def listener(index):
            return lambda ids, raw, behavior: loop.call_soon_threadsafe(queue.put_nowait, (index, ids, raw, behavior))

        async def draw(choice):
            try:
                done = await self.policy.draw(choice.prompt, max_tokens, self.request.seed, listener(choice.index))
            except Exception as error:  # noqa: BLE001 - it ends the stream as an error chunk
                done = error
            queue.put_nowait((choice.index, done))

        tasks = [asyncio.ensure_future(draw(choice)) for choice in self.choices]
        try:
            left = len(tasks)
            while left:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                left -= sum(len(event) == 2 for event in batch)
                failed = [e[1] for e in batch if len(e) == 2 and isinstance(e[1], BaseException)]
                batch = [e for e in batch if not (len(e) == 2 and isinstance(e[1], BaseException))]
                if batch:
                    yield await self.policy.text(self.render, batch)
                if failed:
                    error = failure(failed[0])
                    if not isinstance(error, ServeError):  # a cancellation passes through
                        raise error
                    body = error_body(error.message, param=error.param, status=error.status, kind=error.kind)
                    yield f"data: {json.dumps(body)}\n\n"
                    break
            else:
                if self.usage:
                    yield self.usage_chunk()
            yield DONE
        finally:  # a client that went away lands here too: its draws stop
            for task in tasks:
                task.cancel()

    def render(self, batch) -> str:
        return "".join(self.chunks(self.choices[event[0]], *self.delta(event)) for event in batch)

    def delta(self, event) -> tuple[list[int], list[float], str, str | None, int | None]:
        """(new ids, their log-probs, new text, finish_reason, stop_reason) of an engine event."""
        choice, mode = self.choices[event[0]], self.policy.logprobs_mode
        reasons: tuple[str | None, int | None]
        if len(event) == 4:  # ids of a call that did not finish the draw
            _, ids, raw, behavior = event
            values = [max(float(v), render.FLOOR) for v in (raw if mode == "raw_logprobs" else behavior)]
            text, reasons = choice.text.add(ids), (None, None)
        else:
            draw: Draw = event[1]
            ids, values = draw.ids[choice.ids:].tolist(), render.log_probs(draw, mode)[choice.ids:]
            shown = ids[:-1] if draw.eos and not self.request.include_stop_str_in_output else ids
            text, reasons = choice.text.finish(shown), render.finish(draw, self.policy.primary_eos)
        return ids, values, text, *reasons

    def running_usage(self, choice: _Choice) -> UsageInfo | None:
        if not self.continuous:
            return None
        return UsageInfo(prompt_tokens=len(choice.prompt), completion_tokens=choice.ids,
                         total_tokens=len(choice.prompt) + choice.ids)

    def usage_chunk(self) -> str:
        prompt = sum(len(c.prompt) for c in self.choices)
        completion = sum(c.ids for c in self.choices)
        usage = UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        return _sse(self.chunk(choices=[], usage=usage), exclude_none=True)

    @abc.abstractmethod
    def chunks(self, choice, ids, values, text, finish_reason, stop_reason) -> str:
        """The events carrying one choice's new ids (its text delta, log-probs and finish)."""

    @abc.abstractmethod
    def chunk(self, **fields):
        """One chunk of this route's stream model, with the stream's id, created and model."""


class CompletionStream(_Stream):
    """/v1/completions with stream=true: one choice per prompt."""

    prefix = "cmpl"

    def chunk(self, **fields) -> CompletionStreamResponse:
        return CompletionStreamResponse(id=self.id, object="text_completion", created=self.created,
                                        model=self.policy.name, **fields)

    def chunks(self, choice, ids, values, text, finish_reason, stop_reason) -> str:
        request, tokenizer = self.request, self.policy.tokenizer
        logprobs = None
        if request.logprobs is not None:
            names = render.token_names(tokenizer, ids, as_ids=bool(request.return_tokens_as_token_ids),
                                       known=self.policy.token_text)
            logprobs = render.completion_logprobs(names, values, start=choice.chars)
        first, choice.started = not choice.started, True
        choice.ids += len(ids)
        choice.chars += len(text)
        out = CompletionStreamChoice(
            index=choice.index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason,
            prompt_token_ids=choice.prompt if request.return_token_ids and first else None,
            token_ids=ids if request.return_token_ids else None)
        usage = self.running_usage(choice)
        return _sse(self.chunk(choices=[out], **({} if usage is None else {"usage": usage})))


class ChatStream(_Stream):
    """/v1/chat/completions with stream=true: one assistant message."""

    prefix = "chatcmpl"

    def __init__(self, policy: ServedPolicy, request: ChatCompletionRequest, prompt: list[int], role: str):
        super().__init__(policy, request, [prompt])
        self.role = role

    def chunk(self, **fields) -> ChatStreamResponse:
        return ChatStreamResponse(id=self.id, object="chat.completion.chunk", created=self.created,
                                  model=self.policy.name, **fields)

    def chunks(self, choice, ids, values, text, finish_reason, stop_reason) -> str:
        request, tokenizer, out = self.request, self.policy.tokenizer, []
        if not choice.started:  # vLLM's first chunk: the role, and the prompt's ids when asked for
            choice.started = True
            usage = self.running_usage(choice)
            out.append(_sse(self.chunk(
                choices=[ChatStreamChoice(index=choice.index, delta=ChatDelta(role=self.role, content=""),
                                          logprobs=None, finish_reason=None)],
                prompt_token_ids=choice.prompt if request.return_token_ids else None,
                **({} if usage is None else {"usage": usage}))))
        logprobs = None
        if request.logprobs:
            decoded = render.decoded_tokens(tokenizer, ids, self.policy.token_text)
            names = render.token_names(tokenizer, ids, as_ids=True) if request.return_tokens_as_token_ids else decoded
            logprobs = render.chat_logprobs(names, decoded, values)
        choice.ids += len(ids)
        choice.chars += len(text)
        fields = dict(index=choice.index, delta=ChatDelta(content=text), logprobs=logprobs, finish_reason=finish_reason,
                      token_ids=ids if request.return_token_ids else None)
        if finish_reason is not None:
            fields["stop_reason"] = stop_reason  # vLLM sets it on the last chunk only
        usage = self.running_usage(choice)
        out.append(_sse(self.chunk(choices=[ChatStreamChoice(**fields)],
                                   **({} if usage is None else {"usage": usage}))))
        return "".join(out)


def _sse(chunk, *, exclude_none: bool = False) -> str:
    return f"data: {chunk.model_dump_json(exclude_unset=True, exclude_none=exclude_none)}\n\n"


__all__ = ["DONE", "STREAM_OPTIONS", "ChatStream", "CompletionStream", "IncrementalText", "stream_options"]

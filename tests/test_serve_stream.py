"""`dew serve` with stream=true: vLLM's server-sent events, checked against the non-streamed answers.

The tiny checkpoint and the server of tests/test_serve.py (its `checkpoint` and `served` fixtures),
through real HTTP: every stream is compared with the non-streamed response for the same prompt and
seed (text, ids, log-probs, finish reasons, usage: exactly), its chunks with vLLM's shapes, and the
official `openai` client's streaming iterators read both routes.

The shapes follow vLLM's own source, read at these revisions (nothing copied):

- vllm/entrypoints/openai/completion/serving.py @ 030ea52effcb05071543c8c42b8f0145e94cee43:
  completion_stream_generator (one chunk per engine output and choice, index prompt * n + sample,
  prompt_token_ids on a choice's first chunk and token_ids of the delta under return_token_ids,
  logprobs of the delta with text_offset from the text already sent, the last usage chunk with no
  choices, continuous usage per chunk, an error chunk then `data: [DONE]`), chunks written with
  model_dump_json(exclude_unset=True), the usage chunk with exclude_none=True.
- vllm/entrypoints/openai/completion/protocol.py @ 002032ee2b18e1f7bd924ec47b62504ba3866063:
  CompletionResponseStreamChoice, CompletionStreamResponse, validate_stream_options ("Stream
  options can only be defined when `stream=True`.").
- vllm/entrypoints/openai/chat_completion/serving.py @ 006c49d485f9ca479bf4989cbb694d0ac02f44b5:
  chat_completion_stream_generator (first chunk `{"role", "content": ""}` with prompt_token_ids,
  content deltas without stop_reason, the finishing chunk with finish_reason and stop_reason),
  get_chat_request_role, _create_chat_logprobs.
- vllm/entrypoints/openai/chat_completion/protocol.py @ 002032ee2b18e1f7bd924ec47b62504ba3866063:
  ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse ("chat.completion.chunk").
- vllm/entrypoints/generate/base/protocol.py @ 022e555dbb75a9a96363a04933bfdd1f0b5b123d:
  StreamOptions (include_usage, continuous_usage_stats), DeltaMessage.
- vllm/entrypoints/serve/utils/api_utils.py @ 00a5fdd20935ba7679750db22997dcf539ca4591:
  should_include_usage (continuous usage only with include_usage).
- vllm/tokenizers/detokenizer_utils.py @ 092baf62944c9a120190bf72f6f63aefc8d853f1:
  detokenize_incrementally (prefix and read offsets, text ending in U+FFFD held back).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import test_serve
from test_serve import NAME, PROMPT, SEED, SLOTS, STEPS, long_seed, reference, slowed

from dew_lib.inference import ServerClosed
from dew_lib.records.draw import Draw
from dew_lib.serve.stream import IncrementalText

checkpoint, served = test_serve.checkpoint, test_serve.served  # the same tiny checkpoint and server

COMPLETION_CHOICE = {"index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"}
CHUNK = {"id", "object", "created", "model", "choices"}
USAGE = {"prompt_tokens", "total_tokens", "completion_tokens"}
SPLIT = "héllo wörld 你好 🙂 ∑"  # ö and 🙂 are split across byte-level ids by the MiniMind tokenizer


def sse(url: str, route: str, body: dict) -> list[dict | str]:
    """The events of one streamed request: `data:` payloads parsed, `[DONE]` kept as a string."""
    with httpx.stream("POST", f"{url}/v1/{route}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = raw.split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), raw
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events[:-1]]


def plain(url: str, route: str, body: dict) -> dict:
    response = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def same_stream(chunks: list[dict], prefix: str, kind: str) -> None:
    assert chunks[0]["id"].startswith(prefix) and all(c["object"] == kind for c in chunks)
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1 and chunks[0]["model"] == NAME


def joined_logprobs(chunks: list[dict]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in out:
            out[key] += chunk["choices"][0]["logprobs"][key]
    return out


# ---- /v1/completions ---------------------------------------------------------------------------

@pytest.mark.parametrize(("prompt", "seed", "extra"), [
    ([9, 10, 11], 3, {"return_tokens_as_token_ids": True}),  # the whole budget: finish_reason length
    (PROMPT, SEED, {}),  # stops on the checkpoint's second EOS id: stop_reason is that id
    (PROMPT, SEED, {"include_stop_str_in_output": True, "skip_special_tokens": False}),
])
def test_a_streamed_completion_is_the_non_streamed_one_in_vllm_chunks(served, prompt, seed, extra):
    policy, url, _ = served
    body = {"prompt": prompt, "max_tokens": 12, "seed": seed, "logprobs": 0, "return_token_ids": True, **extra}
    whole = plain(url, "completions", body)["choices"][0]
    *chunks, done = sse(url, "completions", body)
    assert done == "[DONE]"
    assert len(chunks) > 1 or len(whole["token_ids"]) <= STEPS + 1, "a chunk per engine call: several here"
    same_stream(chunks, "cmpl-", "text_completion")
    assert all(set(c) == CHUNK and set(c["choices"][0]) == COMPLETION_CHOICE for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert all(c["index"] == 0 for c in choices)
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert sum((c["token_ids"] for c in choices), []) == whole["token_ids"]
    assert choices[0]["prompt_token_ids"] == prompt and all(c["prompt_token_ids"] is None for c in choices[1:])
    assert all(c["finish_reason"] is None and c["stop_reason"] is None for c in choices[:-1])
    assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == (whole["finish_reason"], whole["stop_reason"])
    streamed = joined_logprobs(chunks)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert streamed[key] == whole["logprobs"][key]
    sent = 0  # vLLM: a chunk's offsets start at the text sent before it and add the token lengths
    for choice in choices:
        names = choice["logprobs"]["tokens"]
        assert choice["logprobs"]["text_offset"] == [sent + sum(map(len, names[:k])) for k in range(len(names))]
        sent += len(choice["text"])
    draw = reference(policy, prompt, 12, seed)
    assert whole["token_ids"] == draw.ids.tolist()


def test_several_prompts_stream_their_choices_by_index_with_usage(served):
    _, url, _ = served
    prompts = [[20, 21, 22], [23, 24], [25]]
    body = {"prompt": prompts, "max_tokens": 9, "seed": 4, "return_token_ids": True}
    whole = plain(url, "completions", body)
    *chunks, usage, done = sse(url, "completions", {**body, "stream_options": {"include_usage": True}})
    assert done == "[DONE]"
    assert set(usage) == CHUNK | {"usage"} and usage["choices"] == [] and usage["object"] == "text_completion"
    assert usage["usage"] == {k: whole["usage"][k] for k in USAGE}
    same_stream([*chunks, usage], "cmpl-", "text_completion")
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
    for index, expected in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == expected["text"]
        assert sum((c["token_ids"] for c in mine), []) == expected["token_ids"]
        assert mine[0]["prompt_token_ids"] == prompts[index]
        assert [c["finish_reason"] for c in mine][-1] == expected["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_continuous_usage_counts_on_every_chunk(served):
    _, url, _ = served
    body = {"prompt": [30, 31, 32], "max_tokens": 10, "seed": 6,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    *chunks, usage, _ = sse(url, "completions", body)
    running = [c["usage"] for c in chunks]
    assert all(set(u) == USAGE and u["prompt_tokens"] == 3 for u in running)
    assert [u["completion_tokens"] for u in running] == sorted(u["completion_tokens"] for u in running)
    assert running[-1]["completion_tokens"] == usage["usage"]["completion_tokens"]
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in running)
    only_usage = sse(url, "completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in only_usage[:-1]), "continuous usage needs include_usage, as vLLM"


# ---- /v1/chat/completions ----------------------------------------------------------------------

def test_a_streamed_chat_is_the_non_streamed_message_in_vllm_chunks(served):
    _, url, _ = served
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 10, "seed": 5,
            "logprobs": True, "return_token_ids": True}
    whole = plain(url, "chat/completions", body)
    role, *chunks, usage, done = sse(url, "chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert done == "[DONE]" and len(chunks) > 1
    same_stream([role, *chunks, usage], "chatcmpl-", "chat.completion.chunk")
    assert set(role) == CHUNK | {"prompt_token_ids"} and role["prompt_token_ids"] == whole["prompt_token_ids"]
    assert role["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None}]
    choices = [c["choices"][0] for c in chunks]
    assert all(set(c) == CHUNK for c in chunks)
    assert all(set(c) == {"index", "delta", "logprobs", "finish_reason", "token_ids"} for c in choices[:-1])
    assert set(choices[-1]) == {"index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"}
    assert all(set(c["delta"]) == {"content"} and c["finish_reason"] is None for c in choices[:-1])
    (expected,) = whole["choices"]
    assert "".join(c["delta"]["content"] for c in choices) == expected["message"]["content"]
    assert sum((c["token_ids"] for c in choices), []) == expected["token_ids"]
    assert sum((c["logprobs"]["content"] for c in choices), []) == expected["logprobs"]["content"]
    assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == (expected["finish_reason"],
                                                                          expected["stop_reason"])
    assert set(usage) == CHUNK | {"usage"} and usage["choices"] == []
    assert usage["usage"] == {k: whole["usage"][k] for k in USAGE}


def test_the_openai_client_reads_both_streams(served):
    _, url, client = served
    whole = client.completions.create(model=NAME, prompt=[40, 41, 42], max_tokens=10, seed=8)
    parts = list(client.completions.create(model=NAME, prompt=[40, 41, 42], max_tokens=10, seed=8, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    messages = [{"role": "user", "content": "What is 17 * 3?"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, seed=2)
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, seed=2, stream=True,
                                            stream_options={"include_usage": True})
    parts = list(stream)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == chat.choices[0].message.content
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == chat.choices[0].finish_reason


# ---- cancellation, errors, refusals ------------------------------------------------------------

def test_a_client_that_closes_the_stream_frees_the_slot(served):
    policy, _, client = served
    engine = policy.native.server
    seed = long_seed(policy, [1, 2, 3, 4], 120)
    with slowed(policy, 0.05):  # 120 ids at 4 per call: 1.5 s if nothing cancelled it
        stream = client.completions.create(model=NAME, prompt=[1, 2, 3, 4], max_tokens=120, seed=seed, stream=True)
        first = next(iter(stream))
        assert first.choices[0].finish_reason is None
        stream.close()
        gone = time.monotonic()
        while (policy.in_flight or engine.free < SLOTS) and time.monotonic() - gone < 1.0:
            time.sleep(0.02)
        assert policy.in_flight == 0 and engine.free == SLOTS and not engine.busy
    after = client.completions.create(model=NAME, prompt=[5, 6], max_tokens=5, seed=1,
                                      extra_body={"return_token_ids": True})
    assert after.choices[0].token_ids == reference(policy, [5, 6], 5, 1).ids.tolist()


def scripted(pieces: list[list[int]], *, fail: BaseException | None = None):
    """A stand-in for `policy.draw` that reports `pieces` one engine call at a time, then finishes
    (or raises `fail`)."""
    async def draw(prompt_ids, max_tokens, seed, on_ids=None):
        for piece in pieces[:-1]:
            on_ids(piece, [-1.0] * len(piece), [-0.5] * len(piece))
            await asyncio.sleep(0.005)
        if fail is not None:
            raise fail
        ids = sum(pieces, [])
        return Draw(ids=np.array(ids, np.int32), behavior_log_probs=[-0.5] * len(ids),
                    raw_log_probs=[-1.0] * len(ids), eos=False, version=0)
    return draw


def test_a_character_split_across_ids_streams_whole(served, monkeypatch):
    policy, url, _ = served
    ids = policy.tokenizer(SPLIT, add_special_tokens=False)["input_ids"]
    pieces = [[i] for i in ids]  # one id per engine call: every split character arrives in parts
    assert any("\ufffd" in policy.tokenizer.decode(p) for p in pieces), "the text has no split character"
    monkeypatch.setattr(policy, "draw", scripted(pieces))
    chunks = sse(url, "completions", {"prompt": [1, 2], "max_tokens": len(ids), "return_token_ids": True})[:-1]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert "".join(texts) == SPLIT and not any("\ufffd" in t for t in texts)
    assert [c["choices"][0]["token_ids"] for c in chunks] == pieces and "" in texts  # held back, ids still sent
    chat = sse(url, "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": len(ids)})
    assert "".join(c["choices"][0]["delta"]["content"] for c in chat[1:-1]) == SPLIT


def test_incremental_text_matches_one_decode_for_every_split(served):
    tokenizer = served[0].tokenizer
    ids = tokenizer(SPLIT + " and 世界 again", add_special_tokens=False)["input_ids"]
    for cut in range(1, len(ids)):
        for size in (1, 2, 3):
            text = IncrementalText(tokenizer, skip_special=True)
            parts = [text.add(ids[k:min(k + size, cut)]) for k in range(0, cut, size)]
            parts.append(text.finish(ids[cut:]))
            assert "".join(parts) == tokenizer.decode(ids) and not any("\ufffd" in p for p in parts), (cut, size)


def test_a_draw_that_fails_mid_stream_ends_it_with_an_error_chunk(served, monkeypatch):
    policy, url, _ = served
    monkeypatch.setattr(policy, "draw", scripted([[107], [3006], []], fail=ServerClosed("stopped")))
    first, second, error, done = sse(url, "completions", {"prompt": [1, 2], "max_tokens": 4})
    assert [first["choices"][0]["text"], second["choices"][0]["text"]] == ["h", "é"] and done == "[DONE]"
    assert error["error"]["code"] == 503 and error["error"]["type"] == "ServiceUnavailableError"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"stream_options": {"include_usage": True}}, "stream_options", "only be defined when `stream=True`"),
    ({"stream": True, "stream_options": {"include_obfuscation": False}}, "stream_options.include_obfuscation",
     "does not support stream_options.include_obfuscation"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "boolean"),
    ({"stream": True, "temperature": 0.5}, "temperature", "served temperature"),
    ({"stream": True, "prompt": list(range(100)), "max_tokens": 50}, "max_tokens", "maximum context length"),
])
def test_a_refused_stream_is_a_plain_json_400(served, body, param, words):
    _, url, _ = served
    response = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 400 and response.headers["content-type"] == "application/json", response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"] and error["code"] == 400, error


def test_on_ids_reports_each_call_and_the_future_the_rest(served):
    policy = served[0]
    seen = []
    draw = policy.native.submit([7, 8, 9], 14, seed=12, on_ids=lambda *d: seen.append(d)).result(timeout=60)
    assert len(seen) > 1 and sum(len(ids) for ids, *_ in seen) < len(draw)
    assert sum((ids for ids, *_ in seen), []) == draw.ids.tolist()[: sum(len(ids) for ids, *_ in seen)]
    raw = sum((r for _, r, _ in seen), [])
    assert raw == draw.raw_log_probs.tolist()[: len(raw)]

    def broken(*_):
        raise RuntimeError("listener failed")

    with pytest.raises(RuntimeError, match="listener failed"):
        policy.native.submit([7, 8, 9], 14, seed=12, on_ids=broken).result(timeout=60)
    assert policy.native.submit([7, 8, 9], 14, seed=12).result(timeout=60).ids.tolist() == draw.ids.tolist()

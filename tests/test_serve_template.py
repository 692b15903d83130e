"""`dew serve` and chat templates sent with a request: refused unless trusted, sandboxed when trusted.

The tiny checkpoint of tests/test_serve.py (MiniMind's Qwen3-style chat template), served by
uvicorn on 127.0.0.1 and asked over real HTTP with httpx and the `openai` client. A request
template used to be handed to `apply_chat_template` on the server's only text thread: it replaced
the served rendering, and a template looping 10^8 times held that thread (and every response
waiting on it) for seconds. vLLM closed the same hole (GHSA-6fvq-23cw-5628, GHSA-4hw3-g54f-xfrj)
with `--trust-request-chat-template`, read at
vllm/entrypoints/openai/engine/serving.py (`_validate_chat_template`: the top-level
`chat_template` and `chat_template_kwargs["chat_template"]` both refused unless trusted).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import httpx
import openai
import pytest
import test_serve
from test_serve import NAME, reference

from dew_lib.serve import ServeOptions, create_app, running
from dew_lib.serve.template import WORKER, TemplateRenderer

checkpoint = test_serve.checkpoint  # the same tiny checkpoint
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"  # 10^10 steps


@pytest.fixture(scope="module")
def policy(checkpoint):
    served = test_serve.warm_policy(checkpoint)
    yield served
    served.close()


@pytest.fixture(scope="module")
def untrusted(policy):
    with running(create_app(policy)) as url:
        yield url


@pytest.fixture(scope="module")
def trusted(policy):
    options = ServeOptions(trust_request_chat_template=True, template_timeout=3.0, template_max_chars=20_000)
    with running(create_app(policy, options=options)) as url:
        yield url


def chat(url: str, **body) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 2, "seed": 1, "return_token_ids": True, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def refusal(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and (error["param"], error["code"]) == (param, 400)
    return error["message"]


def workers() -> list[int]:
    """This process's template workers still alive."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if str(WORKER).encode() in cmdline.read() and test_serve._children(os.getpid()).count(int(pid)):
                found.append(int(pid))
    return found


# ---- not trusted: refused, as vLLM refuses it ----------------------------------------------------

@pytest.mark.parametrize(("body", "param"), [
    ({"chat_template_kwargs": {"chat_template": "{{ 'pwned' }}"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template": "{{ 'pwned' }}"}, "chat_template"),
    ({"chat_template": LOOP, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template"),
])
def test_a_request_template_is_refused_unless_the_server_trusts_them(untrusted, body, param):
    message = refusal(chat(untrusted, **body), param)
    assert "--trust-request-chat-template is not set" in message and f"Leave {param} out" in message


def test_the_openai_client_gets_the_refusal_and_the_served_template_still_answers(untrusted, policy):
    client = openai.OpenAI(base_url=f"{untrusted}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})
    served = chat(untrusted, chat_template_kwargs={"enable_thinking": False}).json()
    text = policy.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                                enable_thinking=False)
    assert served["prompt_token_ids"] == policy.tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- trusted: rendered in a sandboxed process ------------------------------------------------------

@pytest.mark.parametrize("body", [
    {},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [*MESSAGES, {"role": "assistant", "content": "Blue, or "}], "add_generation_prompt": False,
     "continue_final_message": True},
])
def test_the_checkpoint_template_sent_back_renders_exactly_as_the_server_renders_it(trusted, policy, body):
    """The sandbox's environment is transformers': the served template, sent as a request's own,
    gives the same prompt ids as the server's in-process rendering (namespaces, tojson, tools,
    kwargs, continue_final_message)."""
    served = chat(trusted, **body)
    assert served.status_code == 200, served.text
    template = policy.tokenizer.chat_template
    kwargs = {**body.get("chat_template_kwargs", {}), "chat_template": template}
    sent = chat(trusted, **{**body, "chat_template_kwargs": kwargs})
    assert sent.status_code == 200, sent.text
    assert sent.json()["prompt_token_ids"] == served.json()["prompt_token_ids"]
    top = chat(trusted, **{**body, "chat_template": template})
    assert top.json()["prompt_token_ids"] == served.json()["prompt_token_ids"]
    assert workers() == []


def test_the_sandbox_renders_tools_as_transformers_does(policy):
    """The served template with tools (namespaces, tojson of nested dicts, non-ASCII text), rendered
    by the worker and by transformers: the same text. (Too long to draw at this capacity.)"""
    schema = {"type": "object", "properties": {"a": {"type": "number"}}}
    tools = [{"type": "function",
              "function": {"name": "add", "description": "adds — two numbers", "parameters": schema}}]
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "1"}, {"role": "user", "content": "Thanks, ünd now?", "name": None}]
    renderer = TemplateRenderer(timeout=10, max_chars=100_000)
    for thinking in (True, False):
        text = asyncio.run(renderer.render(
            policy.tokenizer.chat_template, messages, tools=tools, add_generation_prompt=True,
            continue_final_message=False, param="chat_template",
            variables={**policy.tokenizer.special_tokens_map, "enable_thinking": thinking}))
        assert text == policy.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                            tokenize=False, enable_thinking=thinking)


def test_a_trusted_template_replaces_the_rendering_and_the_draw_follows_it(trusted, policy):
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ eos_token }}"
    out = chat(trusted, chat_template=template, max_tokens=6).json()
    text = "system: You are terse.\nuser: Name a color.\n<|im_end|>"
    prompt = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out["prompt_token_ids"] == prompt
    assert out["choices"][0]["token_ids"] == reference(policy, prompt, 6, 1).ids.tolist()


@pytest.mark.parametrize(("template", "kwargs", "param", "words"), [
    ("{{ ''.__class__.__mro__ }}", {}, "chat_template", "unsafe"),
    ("{% set ns = namespace() %}{% set ns._hidden = 1 %}", {}, "chat_template", "underscore-prefixed"),
    ("{{ raise_exception('no system messages here') }}", {}, "chat_template", "no system messages here"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}", {},
     "chat_template", "too large: the rendered prompt passed 20000 characters"),
    ("{{ 'x' * 1000000000 }}", {}, "chat_template", "ran out of memory"),
    ("{% if %}", {}, "chat_template", "TemplateSyntaxError"),
    ("x" * 20_001, {}, "chat_template", "more than this server renders (20000)"),
    ("{{ messages }}", {"messages": []}, "chat_template_kwargs.messages", "would replace"),
])
def test_a_trusted_template_that_misbehaves_costs_only_its_own_request(trusted, template, kwargs, param, words):
    message = refusal(chat(trusted, chat_template=template, chat_template_kwargs=kwargs), param)
    assert words in message, message
    assert workers() == []


def test_a_runaway_template_never_holds_the_draws_of_others(trusted, policy):
    """The issue's attack: a template that loops for ever, while token-id requests and a chat on the
    served template are answered as if it were not there; the loop is killed at the time limit."""
    answer, started = {}, time.monotonic()
    looping = threading.Thread(target=lambda: answer.setdefault("r", chat(trusted, chat_template=LOOP)))
    looping.start()
    deadline = time.monotonic() + 30
    while not workers():  # the loop is rendering now
        assert time.monotonic() < deadline and looping.is_alive(), "the template never started rendering"
        time.sleep(0.01)
    took = []
    for k in range(3):
        begun = time.monotonic()
        done = httpx.post(f"{trusted}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "seed": k,
                                                             "logprobs": 0}, timeout=60)
        assert done.status_code == 200, done.text
        took.append(time.monotonic() - begun)
    begun = time.monotonic()
    assert chat(trusted, max_tokens=4).status_code == 200  # the served template, on the text thread
    took.append(time.monotonic() - begun)
    assert looping.is_alive(), f"the loop ended before the other requests were answered: {took}"
    looping.join(timeout=60)
    message = refusal(answer["r"], "chat_template")
    assert "did not finish rendering within 3 s" in message
    assert 3.0 <= time.monotonic() - started < 20
    assert max(took) < 2.0, took  # each answered while the loop ran, none waiting for it
    assert workers() == [], "the looping worker outlived its time limit"


def test_a_client_that_leaves_while_its_template_renders_stops_it(trusted):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{trusted}/v1/chat/completions", json={"messages": MESSAGES, "chat_template": LOOP},
                   timeout=1.0)
    left, gone = time.monotonic(), None
    while gone is None and time.monotonic() - left < 10:
        gone = None if workers() else time.monotonic() - left
        time.sleep(0.02)
    assert gone is not None and gone < 1.5, f"the worker outlived its client by {gone} s (the limit is 3 s)"

"""`dew serve`: vLLM's OpenAI-compatible routes over the native server, through real HTTP.

A tiny Qwen3-architecture decoder with the MiniMind tokenizer (its Qwen3-style chat template) is
written with Pretrained.save and served by uvicorn on 127.0.0.1; the real `openai` SDK and httpx
talk to it. Every answer is checked against the draw the in-process NativeRolloutServer makes for
the same prompt and seed, field by field.

The shapes follow vLLM's own source, read at these revisions (nothing copied):

- vllm/entrypoints/openai/completion/protocol.py @ 002032ee2b18e1f7bd924ec47b62504ba3866063:
  CompletionRequest (max_tokens 16, logprobs, return_tokens_as_token_ids, return_token_ids),
  CompletionLogProbs, CompletionResponseChoice (stop_reason, token_ids, prompt_token_ids).
- vllm/entrypoints/openai/completion/serving.py @ 030ea52effcb05071543c8c42b8f0145e94cee43:
  _create_completion_logprobs (text_offset, -9999.0 floor, top_logprobs with the sampled token).
- vllm/entrypoints/openai/chat_completion/protocol.py @ 002032ee2b18e1f7bd924ec47b62504ba3866063
  and chat_completion/serving.py @ 006c49d485f9ca479bf4989cbb694d0ac02f44b5: ChatMessage,
  _create_chat_logprobs (bytes of the decoded token, top_logprobs=0 gives []), prompt_token_ids
  on the response.
- vllm/tokenizers/detokenizer_utils.py @ 092baf62944c9a120190bf72f6f63aefc8d853f1: a token's
  string is tokenizer.decode([id]); generate/base/serving.py: "token_id:{id}".
- vllm/v1/core/sched/utils.py @ 018d5dc78efa9af8a03457451b6f27d56bf3b9c2: check_stop tests EOS
  before the length budget; stop_token_ids (generation_config's other EOS ids) set stop_reason.
- vllm/entrypoints/serve/engine/protocol.py @ f1bf7bd07a112d72d905d355a8206b8d1e82cb5d,
  exception_handling/error_response.py @ ba638200e9731168ac964ebcee2f704f9f01098d and
  exception_handling/handlers/validation.py @ 4da14a5cf11a5a5ed50bd267b7460d9957f84c35: the error
  JSON, BadRequestError / NotFoundError, validation errors as "Bad Request" with a dotted param.
- vllm/entrypoints/serve/dev/rlhf/api_router.py @ 0100a2129224e729af1b3b8ed42a900cdfe9a452
  (/pause modes, /resume, /is_paused, /update_weight_version, /weight_info),
  dev/rpc/api_router.py @ cd20a5785d36d73795dc3e87088ca370f9efe807 ({"results": [...]}),
  vllm/frontend/entrypoints/serve/dev/cache/api_router.py @ 055e47c28003156421365af985d676fc921cb075
  ({"success": bool}); tests/entrypoints/serve/dev/rlhf/state_transitions/test_pause_resume.py @
  01a095ae826a2fc2b829fa6c57298e6a3fbb553a and info_retrieval/test_weight_info.py @
  a2e072733083aab347a444056e343d0f03ee0dd5 (mode=wait, "default", body.new_version).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import ROOT, SHARED_DATA, launched_serve, tiny_model, xla_flags
from fastapi.testclient import TestClient

from dew_lib.inference import Server, ServeTask
from dew_lib.models.pretrained import load_pretrained
from dew_lib.records.draw import Draw
from dew_lib.sampling import Sampling
from dew_lib.serve import ServedPolicy, create_app, dev_endpoints_for, render, running

TOKENIZER = os.path.join(SHARED_DATA, "tokenizers", "minimind")
SAMPLING = Sampling(temperature=0.8, top_k=20)  # transforming: raw and processed log-probs differ
NAME = "tiny-policy"
PROMPT, SEED = [5, 6, 7, 8], 11  # the draw the checkpoint's second EOS id is chosen from
SLOTS, CAPACITY, STEPS = 4, 128, 4


def drain(engine: Server) -> dict:
    draws = {}
    while engine.busy:
        draws.update(engine.step())
    return draws


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint whose generation_config adds a second EOS id: the fifth-or-later id of the
    (PROMPT, SEED) draw, so that request stops on it. Returns (directory, stop id, probe server)."""
    if not os.path.isdir(TOKENIZER):
        pytest.skip(f"no MiniMind tokenizer at {TOKENIZER}; set DEW_SHARED_DATA")
    from transformers import AutoTokenizer

    from dew_lib.models.pretrained import Pretrained

    model = tiny_model(vocab_size=6400, emb_features=32, max_seq_len=CAPACITY, tie_embeddings=True)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    directory = tmp_path_factory.mktemp("serve") / NAME
    Pretrained.from_model(model, tokenizer=AutoTokenizer.from_pretrained(TOKENIZER)).save(
        variables, directory, dtype=None)
    pretrained, loaded = load_pretrained(directory)
    # The probe draws with the served filters and no EOS: served draws are its prefixes.
    probe = Server.from_task(ServeTask(model=pretrained.model, variables=loaded, sampling=SAMPLING),
                             slots=1, capacity=64, steps=STEPS)
    probe.add(0, PROMPT, 12, seed=SEED)
    ids = drain(probe)[0].ids.tolist()
    stop = next(i for k, i in enumerate(ids) if k >= 4 and i not in ids[:k] and i != 2)
    pretrained = dataclasses.replace(pretrained, generation_config={"eos_token_id": [2, stop]})
    pretrained.save(loaded, directory, dtype=None)
    assert json.loads((directory / "generation_config.json").read_text()) == {"eos_token_id": [2, stop]}
    return directory, stop, probe, pretrained, loaded


def warm_policy(checkpoint) -> ServedPolicy:
    """The tiny checkpoint served as every serve test serves it, compiled before the first request."""
    policy = ServedPolicy.load(checkpoint[0], slots=SLOTS, capacity=CAPACITY, sampling=SAMPLING, steps=STEPS,
                               served_model_name=NAME)
    policy.warm_up()
    return policy


@pytest.fixture(scope="module")
def served(checkpoint):
    policy = warm_policy(checkpoint)
    try:
        with running(create_app(policy, dev_endpoints=True)) as url:
            yield policy, url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    finally:
        policy.close()


@contextlib.contextmanager
def slowed(policy: ServedPolicy, seconds: float):
    """Every engine call takes `seconds` longer, so a request stays in flight long enough to act on."""
    engine = policy.native.server
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    engine.step = slow
    try:
        yield
    finally:
        del engine.step


def reference(policy: ServedPolicy, prompt, budget: int, seed: int) -> Draw:
    return policy.native.submit(prompt, budget, seed=seed).result(timeout=60)


def long_seed(policy: ServedPolicy, prompt, budget: int) -> int:
    """The first seed whose draw of `prompt` uses its whole budget (no EOS), so it stays in flight."""
    seed = next((s for s in range(200) if len(reference(policy, prompt, budget, s)) == budget), None)
    assert seed is not None, f"no seed in 200 draws {budget} ids after {prompt} without an EOS"
    return seed


def offsets(names):
    return [sum(len(n) for n in names[:k]) for k in range(len(names))]


# ---- /v1/completions ---------------------------------------------------------------------------

def test_token_id_completion_reports_the_native_draw_field_by_field(served):
    policy, _, client = served
    out = client.completions.create(model=NAME, prompt=[9, 10, 11], max_tokens=8, seed=3, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    draw = reference(policy, [9, 10, 11], 8, 3)
    assert not draw.eos, "seed chosen so the draw uses its whole budget: finish_reason length"
    (choice,) = out.choices
    names = [f"token_id:{i}" for i in draw.ids.tolist()]
    assert choice.token_ids == draw.ids.tolist() and choice.prompt_token_ids == [9, 10, 11]
    assert choice.logprobs.tokens == names
    assert choice.logprobs.token_logprobs == draw.raw_log_probs.tolist()  # the default raw_logprobs
    assert choice.logprobs.top_logprobs == [{n: v} for n, v in zip(names, draw.raw_log_probs.tolist())]
    assert choice.logprobs.text_offset == offsets(names)
    assert choice.text == policy.tokenizer.decode(draw.ids.tolist(), skip_special_tokens=True)
    assert (choice.finish_reason, choice.stop_reason, choice.index) == ("length", None, 0)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 8, 11)
    assert out.model == NAME and out.object == "text_completion" and out.id.startswith("cmpl-")


def test_the_checkpoint_stop_id_ends_the_draw_and_stays_in_ids_and_logprobs(served, checkpoint):
    policy, url, client = served
    _, stop, *_ = checkpoint
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=12, seed=SEED, logprobs=0,
                                    extra_body={"return_token_ids": True})
    draw = reference(policy, PROMPT, 12, SEED)
    (choice,) = out.choices
    assert draw.eos and draw.ids[-1] == stop and len(draw) < 12
    assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)  # a stop_token_id, as vLLM
    assert choice.token_ids == draw.ids.tolist() and out.usage.completion_tokens == len(draw)
    decoded = [policy.tokenizer.decode([i]) for i in draw.ids.tolist()]
    assert choice.logprobs.tokens == decoded and len(choice.logprobs.token_logprobs) == len(draw)
    assert choice.text == policy.tokenizer.decode(draw.ids[:-1].tolist(), skip_special_tokens=True)
    kept = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "seed": SEED,
                                                     "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == policy.tokenizer.decode(draw.ids.tolist(), skip_special_tokens=True)


def test_finish_reasons_follow_vllm():
    def draw(ids, eos):
        return Draw(ids=ids, behavior_log_probs=[0.0] * len(ids), raw_log_probs=None, eos=eos, version=0)

    assert render.finish(draw([5, 2], True), primary_eos=2) == ("stop", None)  # the tokenizer's EOS
    assert render.finish(draw([5, 9], True), primary_eos=2) == ("stop", 9)  # generation_config's other
    assert render.finish(draw([5, 9], False), primary_eos=2) == ("length", None)


def test_logprobs_mode_picks_raw_or_processed_likelihoods(served):
    policy, _, client = served
    body = dict(model=NAME, prompt=[12, 13], max_tokens=6, seed=4, logprobs=0)
    raw = client.completions.create(**body).choices[0].logprobs.token_logprobs
    policy.logprobs_mode = "processed_logprobs"
    try:
        processed = client.completions.create(**body).choices[0].logprobs.token_logprobs
    finally:
        policy.logprobs_mode = "raw_logprobs"
    draw = reference(policy, [12, 13], 6, 4)
    assert raw == draw.raw_log_probs.tolist() and processed == draw.behavior_log_probs.tolist()
    assert all(p > r for p, r in zip(processed, raw))  # top-20 at temperature 0.8 sharpens every token


def test_seeded_requests_reproduce_and_seeds_differ(served):
    _, _, client = served

    def ids(seed):
        out = client.completions.create(model=NAME, prompt=[20, 21, 22], max_tokens=10, seed=seed, logprobs=0,
                                        extra_body={"return_token_ids": True})
        return out.choices[0].token_ids, out.choices[0].logprobs.token_logprobs

    assert ids(7) == ids(7)
    assert ids(7)[0] != ids(8)[0]


def test_text_prompts_are_encoded_with_the_tokenizer(served):
    policy, _, client = served
    out = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=4, seed=2,
                                    extra_body={"return_token_ids": True})
    expected = policy.tokenizer("Once upon a time")["input_ids"]
    assert out.choices[0].prompt_token_ids == expected
    assert out.choices[0].token_ids == reference(policy, expected, 4, 2).ids.tolist()


# ---- /v1/chat/completions ----------------------------------------------------------------------

def test_chat_goes_through_the_chat_template_and_back(served):
    policy, url, client = served
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, seed=5, logprobs=True,
                                         extra_body={"return_token_ids": True})
    text = policy.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    draw = reference(policy, prompt, 10, 5)
    (choice,) = out.choices
    assert out.prompt_token_ids == prompt and choice.token_ids == draw.ids.tolist()
    visible = draw.ids[:-1] if draw.eos else draw.ids
    assert choice.message.role == "assistant"
    assert choice.message.content == policy.tokenizer.decode(visible.tolist(), skip_special_tokens=True)
    decoded = [policy.tokenizer.decode([i]) for i in draw.ids.tolist()]
    assert [c.token for c in choice.logprobs.content] == decoded
    assert [c.bytes for c in choice.logprobs.content] == [list(d.encode()) for d in decoded]
    assert [c.logprob for c in choice.logprobs.content] == draw.raw_log_probs.tolist()
    assert all(c.top_logprobs == [] for c in choice.logprobs.content)
    assert choice.finish_reason == render.finish(draw, policy.primary_eos)[0]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(draw))
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are"}, {"type": "text", "text": "terse."}]},
             messages[1]]
    joined = httpx.post(f"{url}/v1/chat/completions",
                        json={"messages": parts, "max_tokens": 1, "return_token_ids": True})
    spelled = [{"role": "system", "content": "You are\nterse."}, messages[1]]
    text = policy.tokenizer.apply_chat_template(spelled, add_generation_prompt=True, tokenize=False)
    assert joined.json()["prompt_token_ids"] == policy.tokenizer(text, add_special_tokens=False)["input_ids"]


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("route", "body", "param", "words"), [
    ("completions", {"temperature": 0.5}, "temperature", "served temperature=0.8"),
    ("completions", {"top_k": 0}, "top_k", "served top_k=20"),
    ("completions", {"top_p": 0.9}, "top_p", "served top_p=1.0"),
    ("completions", {"min_p": 0.1}, "min_p", "served min_p=0.0"),
    ("completions", {"n": 2}, "n", "one completion per prompt"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "only be defined when"),
    ("completions", {"logprobs": 2}, "logprobs", "logprobs=0"),
    ("completions", {"stop": ["x"]}, "stop", "does not support stop"),
    ("completions", {"presence_penalty": 0.5}, "presence_penalty", "does not support"),
    ("completions", {"stop_token_ids": [2, 9]}, "stop_token_ids", "[9] are not among the ids"),
    ("completions", {"seed": -1}, "seed", "2**32"),
    ("completions", {"prompt": list(range(100)), "max_tokens": 50}, "max_tokens", "maximum context length is 128"),
    ("completions", {"prompt": [7000]}, "prompt", "vocabulary"),
    ("completions", {"max_tokens": "many"}, "body.max_tokens", "valid integer"),
    ("chat/completions", {"top_logprobs": 2, "logprobs": True}, "top_logprobs", "top_logprobs=0"),
    ("chat/completions", {"tool_choice": "auto"}, "tool_choice", "tool-call parser"),
])
def test_requests_the_engine_cannot_honour_get_a_400_naming_the_field(served, route, body, param, words):
    _, url, _ = served
    base = {"prompt": [1, 2, 3]} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    response = httpx.post(f"{url}/v1/{route}", json={**base, "max_tokens": 2, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400 and words in error["message"], error
    assert error["type"] == ("Bad Request" if param.startswith("body.") else "BadRequestError")


def test_served_values_unknown_fields_and_model_names(served):
    policy, url, client = served
    accepted = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 0.8,
                                                         "top_k": 20, "top_p": 1.0, "stop_token_ids": [2],
                                                         "user": "me", "extra": 1})
    assert accepted.status_code == 200, accepted.text
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt=[1, 2], max_tokens=2, temperature=1.0)
    missing = httpx.post(f"{url}/v1/completions", json={"model": "other", "prompt": [1], "max_tokens": 1})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert httpx.get(f"{url}/health").status_code == 200
    (card,) = httpx.get(f"{url}/v1/models").json()["data"]
    assert (card["id"], card["max_model_len"], card["root"]) == (NAME, CAPACITY, str(policy.directory))


# ---- concurrency -------------------------------------------------------------------------------

def test_concurrent_requests_share_the_batch_and_match_their_own_draws(served):
    policy, _, client = served
    prompts = [[30 + k, 31 + k, 32 + k][: 1 + k % 3] for k in range(8)]

    def ask(k):
        out = client.completions.create(model=NAME, prompt=prompts[k], max_tokens=12, seed=100 + k,
                                        extra_body={"return_token_ids": True})
        return out.choices[0].token_ids

    policy.most_in_flight = 0
    with slowed(policy, 0.02), ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert policy.most_in_flight > 1, "the requests were served one after another"
    assert answers == [reference(policy, prompts[k], 12, 100 + k).ids.tolist() for k in range(8)]


def test_a_burst_reaching_an_idle_engine_joins_one_prefill(served):
    policy = served[0]
    engine = policy.native.server
    calls, added = [0], []
    add, step = engine.add, engine.step

    def counted_step():
        calls[0] += 1
        return step()

    def recorded_add(*args, **kwargs):
        added.append(calls[0])  # how many engine calls ran before this request joined
        return add(*args, **kwargs)

    async def burst():
        tasks = []
        for k in range(SLOTS):  # arrivals 2 ms apart: without the wait the first decodes alone
            tasks.append(asyncio.ensure_future(policy.draw([60 + k, 61], 6, k)))
            await asyncio.sleep(0.002)
        return await asyncio.gather(*tasks)

    engine.step, engine.add, quiet = counted_step, recorded_add, policy.quiet
    policy.quiet = 0.05  # generous, so a loaded machine's late wake-ups still count as one burst
    try:
        draws = asyncio.run(burst())
    finally:
        del engine.step, engine.add
        policy.quiet = quiet
    assert len(added) == SLOTS and len(set(added)) == 1, added
    assert [d.ids.tolist() for d in draws] == [reference(policy, [60 + k, 61], 6, k).ids.tolist() for k in range(SLOTS)]


def test_a_client_that_disconnects_cancels_its_request(served):
    policy, url, _ = served
    engine = policy.native.server
    seed = long_seed(policy, [1, 2, 3, 4], 120)
    with slowed(policy, 0.1):  # 120 ids at 4 per call: 3 s if nothing cancelled it
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 120, "seed": seed},
                       timeout=0.5)
        gone = time.monotonic()
        while (policy.in_flight or engine.free < SLOTS) and time.monotonic() - gone < 1.0:
            time.sleep(0.02)
        assert policy.in_flight == 0 and engine.free == SLOTS and not engine.busy


# ---- the weight push: pause, reload, version, resume --------------------------------------------

def test_pause_reload_and_resume_serve_the_new_checkpoint(served, checkpoint):
    policy, url, client = served
    directory, _, probe, pretrained, launch = checkpoint

    def ask(prompt, budget, seed):
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=budget, seed=seed,
                                        extra_body={"return_token_ids": True})
        return out.choices[0].token_ids

    before = ask([40, 41], 6, 9)
    seed = long_seed(policy, [50, 51], 40)
    finished, waited = {}, {}
    with slowed(policy, 0.05):  # 40 ids at 4 per call: half a second in flight
        running_one = threading.Thread(target=lambda: finished.setdefault("ids", ask([50, 51], 40, seed)))
        running_one.start()
        deadline = time.monotonic() + 10
        while policy.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert policy.in_flight == 1
        assert httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=60).json() == {"status": "paused"}
        assert policy.in_flight == 0 and not policy.native.server.busy, "paused while a draw was generating"
    running_one.join(timeout=60)
    assert len(finished["ids"]) == 40  # the in-flight request finished normally, on its budget
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
    waiting = threading.Thread(target=lambda: waited.setdefault("ids", ask([40, 41], 6, 9)))
    waiting.start()
    time.sleep(0.5)
    assert "ids" not in waited and policy.in_flight == 0, "a request was admitted while paused"

    changed = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), launch)
    pretrained.save(changed, directory, dtype=None)
    assert httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}).json() == {"results": [None]}
    assert policy.version == 1
    assert httpx.post(f"{url}/reset_prefix_cache").json() == {"success": True}
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": "step-1"}).json() == {
        "success": True, "new_version": "step-1"}
    assert httpx.get(f"{url}/weight_info").json() == {"weight_version": "step-1"}
    assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}
    waiting.join(timeout=60)
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}

    after = waited["ids"]
    assert after != before
    probe.reload(load_pretrained(directory, tokenizer=False).variables, 1)
    probe.add(0, [40, 41], 6, seed=9)
    assert after == drain(probe)[0].ids.tolist()[: len(after)]  # the new checkpoint's own draw

    pretrained.save(launch, directory, dtype=None)  # back to the launch weights for the other tests
    assert httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}).status_code == 200
    assert ask([40, 41], 6, 9) == before and policy.version == 2


def test_dev_route_refusals_have_vllm_shapes(served):
    _, url, _ = served
    bad_mode = httpx.post(f"{url}/pause", params={"mode": "sideways"})
    assert bad_mode.status_code == 400 and bad_mode.json()["error"]["param"] == "query.mode"
    abort = httpx.post(f"{url}/pause", params={"mode": "abort"})
    assert abort.status_code == 400 and "mode=wait" in abort.json()["error"]["message"]
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": False}
    for body in ({}, {"new_version": ["not", "a", "string"]}):
        wrong = httpx.post(f"{url}/update_weight_version", json=body)
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "body.new_version"
    other = httpx.post(f"{url}/collective_rpc", json={"method": "sleep"})
    assert other.status_code == 400 and other.json()["error"]["param"] == "method"


def test_dev_routes_are_off_unless_asked_for_even_on_loopback(served):
    # Any local user could pause a loopback server, and paused requests wait indefinitely.
    assert not dev_endpoints_for("127.0.0.1", None) and not dev_endpoints_for("::1", None)
    assert not dev_endpoints_for("localhost", None) and not dev_endpoints_for("0.0.0.0", None)
    assert dev_endpoints_for("127.0.0.1", True) and dev_endpoints_for("0.0.0.0", True)
    policy = served[0]
    with TestClient(create_app(policy)) as local:
        for method, path in (("post", "/pause"), ("post", "/collective_rpc"), ("post", "/resume"),
                             ("post", "/update_weight_version"), ("get", "/is_paused")):
            refused = local.request(method.upper(), path, params={"mode": "wait"}, json={"method": "reload_weights"})
            assert refused.status_code == 404, path
            assert refused.json()["error"]["code"] == 404 and "--dev-endpoints" in refused.json()["error"]["message"]
        assert local.get("/health").status_code == 200
    assert not policy.paused


def test_openai_rollout_server_and_safetensors_reload_run_against_dew_serve(checkpoint, tmp_path):
    """The remote-engine path end to end: Dew's vLLM client draws, and a SafetensorsReload push
    (bfloat16 files, pause, reload, cache reset, version, resume) swaps the served weights."""
    from dew_lib.inference import OpenAICompletion, OpenAIRolloutServer, Publication, SafetensorsReload

    source, stop, _, pretrained, launch = checkpoint
    directory = tmp_path / NAME  # a launch directory of its own: the push rewrites it
    shutil.copytree(source, directory)
    sampling = Sampling(temperature=0.8, eos_id=(2, stop))  # vLLM's completions route takes no filters
    policy = ServedPolicy.load(directory, slots=SLOTS, capacity=CAPACITY, sampling=Sampling(temperature=0.8),
                               steps=STEPS, logprobs_mode="processed_logprobs")
    try:
        with running(create_app(policy, dev_endpoints=True)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
            weights = Publication(SafetensorsReload(pretrained, directory, engines=(url,)), version=0)
            with OpenAIRolloutServer(OpenAICompletion(NAME, client, provider="vllm"), sampling, weights,
                                     processed_logprobs=True) as remote:
                first = remote.submit([40, 41], 8, seed=9).result(timeout=60)
                expected = reference(policy, [40, 41], 8, 9)
                assert first.ids.tolist() == expected.ids.tolist() and first.eos == expected.eos
                np.testing.assert_array_equal(first.behavior_log_probs, expected.behavior_log_probs)
                changed = jax.tree.map(lambda x: x * 1.5, launch)
                remote.load(changed, 1)
                assert (policy.version, policy.weight_version, policy.paused) == (1, "1", False)
                second = remote.submit([40, 41], 8, seed=9).result(timeout=60)
                expected = reference(policy, [40, 41], 8, 9)
                assert second.version == 1 and second.ids.tolist() == expected.ids.tolist()
                np.testing.assert_array_equal(second.behavior_log_probs, expected.behavior_log_probs)
                assert not np.allclose(second.behavior_log_probs[:2], first.behavior_log_probs[:2], atol=1e-3)
    finally:
        policy.close()


# ---- the command -------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def test_dew_serve_split_over_two_devices_draws_like_one_and_exits_on_sigterm(checkpoint):
    """The command, tensor-parallel over two host devices, with its API key from the environment
    and the development routes asked for: it draws what the one-device probe draws."""
    directory, stop, _, pretrained, launch = checkpoint
    probe = Server.from_task(ServeTask(model=pretrained.model, variables=launch, sampling=SAMPLING),
                             slots=1, capacity=64, steps=STEPS)  # the launch weights on one device
    probe.add(0, PROMPT, 12, seed=SEED)
    ids = drain(probe)[0].ids.tolist()
    expected = ids[:ids.index(stop) + 1]  # the served draw ends on the checkpoint's second EOS id
    arguments = [str(directory), "--port", "0", "--slots", "2", "--capacity", "64", "--temperature", "0.8",
                 "--top-k", "20", "--dev-endpoints", "--tensor-parallel-size", "2"]
    env = {"DEW_SERVE_API_KEY": "sesame", "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
    with launched_serve(arguments, env) as (process, started, seen):
        assert "development routes on, API key required" in started and "warning" not in "".join(seen), seen
        assert "tensor parallel over 2 devices" in started, started
        url = started.split(" on ")[1].split()[0]
        for _ in range(200):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.1)
        body, key = {"model": NAME, "prompt": PROMPT, "max_tokens": 3, "seed": 1}, {"Authorization": "Bearer sesame"}
        refused = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == 401
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=key, timeout=60)
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] in ("stop", "length")
        same = {"model": NAME, "prompt": PROMPT, "max_tokens": 12, "seed": SEED, "return_token_ids": True}
        (choice,) = httpx.post(f"{url}/v1/completions", json=same, headers=key, timeout=60).json()["choices"]
        assert (choice["token_ids"], choice["finish_reason"]) == (expected, "stop")
        # the launch directory read again, straight into the split layout
        reloaded = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, headers=key, timeout=60)
        assert reloaded.json() == {"results": [None]}, reloaded.text
        (choice,) = httpx.post(f"{url}/v1/completions", json=same, headers=key, timeout=60).json()["choices"]
        assert choice["token_ids"] == expected
        assert httpx.get(f"{url}/is_paused").status_code == 401  # the development routes are behind the key
        assert httpx.get(f"{url}/is_paused", headers=key).json() == {"is_paused": False}
        children = _children(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, "".join(seen)
        assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], "orphaned children"


def test_dew_serve_reports_a_missing_checkpoint_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dew_lib.cli", "serve", str(tmp_path / "none"), "--port", "0"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                         timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("dew serve: ") and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr

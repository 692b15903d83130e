"""Remote rollout servers against stand-ins that answer as vLLM and SGLang do.

OpenAIRolloutServer (vLLM and SGLang /v1/completions) and VLLMGenerateServer (vLLM's
/inference/v1/generate) are checked field by field: the JSON each request carries (the
stand-ins record it) and the Draw each answer becomes (the stand-ins record what they sent),
every Sampling the servers refuse, routing, sampling supports, a draw's version across a push,
and every way an engine can fail a request, down to the INFRA_ERROR session PromptSource makes
of it.

The wire formats were read from the engines' own source (tests/standin_completions.py answers
accordingly):

- vLLM vllm/entrypoints/openai/completion/protocol.py @ 002032ee2b18e1f7bd924ec47b62504ba3866063:
  CompletionRequest (return_tokens_as_token_ids, return_token_ids, top_k, min_p, seed,
  stop_token_ids); CompletionResponseChoice.routed_experts, base64 .npy of
  [num_tokens - 1, layers, top_k].
- vLLM vllm/entrypoints/openai/completion/serving.py @ 030ea52effcb05071543c8c42b8f0145e94cee43:
  _create_completion_logprobs renders ids as "token_id:<id>" (format_token_id_placeholder in
  vllm/entrypoints/generate/base/serving.py), clamps log-probs at -9999, lists top_logprobs.
- vLLM vllm/v1/core/sched/utils.py @ 018d5dc78efa9af8a03457451b6f27d56bf3b9c2: check_stop runs
  after the sampled id is appended, EOS before the length cap, so EOS stays in the ids.
- vLLM vllm/entrypoints/scale_out/token_in_token_out/protocol.py @
  006ebac240f34ddcd36383832b28c25840d2ea80: GenerateRequest {token_ids, sampling_params},
  GenerateChoiceBase {token_ids, finish_reason, routed_experts, sampling_mask},
  GenerateLogProbsContent {token_id, logprob, rank, top_logprobs}; .../logprobs_render.py @
  227e42a2f786f978e8be8c374eb870b5d88c8e95 (that shape on the wire); .../serving.py @
  00a80787a504467c1bcd76d5405a50b2aaa00d5a (the older {"token": "token_id:<id>"} entries);
  vllm/entrypoints/serve/disagg/protocol.py @ 06408932946d17ad6453126aca82ea96c4509605 (the
  route's earlier home).
- vLLM docs/features/routed_experts.md @ e2059013e37372019b40e70ecb823902968f37c2, and the
  "Sampling Mask (Distribution Replay)" feature page (two revisions in the search index, its
  path not resolved there): mask rows per generated id, top_k > 0, temperature > 0.
- SGLang python/sglang/srt/entrypoints/openai/protocol.py and serving_completions.py @
  004c82e07d876f6e4a0ad6e15325706b0f478f1a: CompletionRequest.return_token_ids (top_k default
  -1, seed -> sampling_seed), choice token_ids = output_ids, matched_stop, ErrorResponse,
  metadata.weight_version; python/sglang/srt/entrypoints/openai/utils.py @
  0101654f9cc8d059f1c0914628f00a8cee65f9e0 (to_openai_style_logprobs, text_offset -1).
- SGLang python/sglang/srt/managers/detokenizer_manager.py @
  000935bdda57675933def88a37dcd6786a2de0d1 (a matched stop id is trimmed from the text only;
  output_ids are sent untrimmed) and scheduler_output_processor_mixin.py @
  004ec010d0292427acff6a0003fd5fd4c91fb356 (output_ids.append before check_finished).
"""

from __future__ import annotations

import dataclasses
import re
import socket
import time
from concurrent.futures import CancelledError

import numpy as np
import openai
import pytest
from standin_completions import (
    Engine,
    app,
    serve,
    sglang_router,
    vllm_generate_router,
    vllm_router,
)

from dew_lib.inference.base import RolloutServer, ServerClosed
from dew_lib.inference.openai_engine import OpenAICompletion, OpenAIRolloutServer
from dew_lib.inference.remote import EngineError, RemoteOptions
from dew_lib.inference.vllm_generate import VLLMGenerateServer
from dew_lib.records.draw import Draw
from dew_lib.records.sessions import Status, Task
from dew_lib.rollouts.sources import PromptSource
from dew_lib.sampling import Sampling

VLLM, SGLANG = Engine(), Engine()
WAIT = 20  # seconds any future may take on a loaded machine
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def urls():
    with serve(app(vllm_router(VLLM), vllm_generate_router(VLLM))) as vllm_url, \
            serve(app(sglang_router(SGLANG))) as sglang_url:
        yield {"vllm": vllm_url, "sglang": sglang_url}


@pytest.fixture(autouse=True)
def fresh_engines():
    for engine in (VLLM, SGLANG):
        for spec in dataclasses.fields(Engine):
            default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
            setattr(engine, spec.name, default)


class Weights:
    """A publisher with a version, like Publication: load records the push and moves it."""

    def __init__(self, version: int = 0):
        self.version, self.loads = version, []

    def load(self, variables, version: int) -> None:
        self.loads.append((variables, version))
        self.version = version


def completion(urls, provider: str, name: str = "standin") -> OpenAICompletion:
    return OpenAICompletion(name, openai.OpenAI(base_url=f"{urls[provider]}/v1", api_key="EMPTY"), provider)


def openai_server(urls, provider, sampling, weights=None, **kwargs) -> OpenAIRolloutServer:
    return OpenAIRolloutServer(completion(urls, provider), sampling, weights, **kwargs)


def answered(engine: Engine) -> dict:
    (_, answer), = engine.answered
    return answer["choices"][0]


# ---- requests and draws, field by field ---------------------------------------------------------

def test_vllm_completion_request_and_draw(urls):
    VLLM.eos_at = 2
    with openai_server(urls, "vllm", Sampling(eos_id=2), Weights(version=4)) as server:
        assert isinstance(server, RolloutServer)
        draw = server.submit(PROMPT, 6, seed=11).result(WAIT)
    (path, body), = VLLM.received
    assert path == "/v1/completions"
    assert body == {"model": "standin", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
                    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 0, "seed": 11,
                    "stop_token_ids": [2], "return_tokens_as_token_ids": True}
    choice = answered(VLLM)
    assert choice["finish_reason"] == "stop" and choice["text"] == "".join(f"t{t}" for t in draw.ids[:-1])
    ids = [int(token.split(":")[1]) for token in choice["logprobs"]["tokens"]]
    assert draw.ids.tolist() == ids and ids[-1] == 2 and len(ids) == 3  # EOS kept, as vLLM sends it
    np.testing.assert_array_equal(draw.behavior_log_probs,
                                  np.float32(choice["logprobs"]["token_logprobs"]))
    assert draw.eos and draw.finish_reason == "stop" and draw.version == 4
    assert draw.raw_log_probs is None and draw.routed_experts is None and draw.support is None


def test_vllm_budget_and_seeds(urls):
    with openai_server(urls, "vllm", Sampling(eos_id=2), None) as server:
        first, again, other = (server.submit(PROMPT, 5, seed=s).result(WAIT) for s in (3, 3, 4))
    assert not first.eos and first.finish_reason == "length" and len(first) == 5 and 2 not in first.ids
    assert first.ids.tolist() == again.ids.tolist() and first.ids.tolist() != other.ids.tolist()
    assert [body["seed"] for _, body in VLLM.received] == [3, 3, 4]


def test_vllm_tempered_draws_need_processed_logprobs(urls):
    VLLM.logprobs_mode = "processed_logprobs"
    with openai_server(urls, "vllm", Sampling(temperature=0.7), None, processed_logprobs=True) as server:
        tempered = server.submit(PROMPT, 4, seed=1).result(WAIT)
    assert VLLM.received[0][1]["temperature"] == 0.7
    np.testing.assert_array_equal(tempered.behavior_log_probs,
                                  np.float32(answered(VLLM)["logprobs"]["token_logprobs"]))
    VLLM.answered.clear()
    with openai_server(urls, "vllm", Sampling(temperature=0.0), None, processed_logprobs=True) as server:
        greedy = server.submit(PROMPT, 4, seed=1).result(WAIT)
    assert any(v != 0 for v in answered(VLLM)["logprobs"]["token_logprobs"])
    np.testing.assert_array_equal(greedy.behavior_log_probs, 0.0)  # a greedy policy is certain


def test_sglang_completion_request_and_draw(urls):
    SGLANG.eos_at = 3
    with openai_server(urls, "sglang", Sampling(temperature=0.7, eos_id=2), None) as server:
        draw = server.submit(PROMPT, 8, seed=9).result(WAIT)
    (path, body), = SGLANG.received
    assert path == "/v1/completions"
    assert body == {"model": "standin", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.7,
                    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 0, "seed": 9,
                    "stop_token_ids": [2], "return_token_ids": True}
    choice = answered(SGLANG)
    assert choice["matched_stop"] == 2 and choice["finish_reason"] == "stop"
    assert draw.ids.tolist() == choice["token_ids"] and draw.ids[-1] == 2 and len(draw) == 4
    np.testing.assert_array_equal(draw.behavior_log_probs,
                                  np.float32(choice["logprobs"]["token_logprobs"]))
    assert draw.eos and draw.version == 0 and draw.raw_log_probs is None


@pytest.mark.parametrize("provider,field_name", [("vllm", "return_tokens_as_token_ids"),
                                                 ("sglang", "return_token_ids")])
def test_engine_that_ignores_the_ids_field(urls, provider, field_name):
    engine = VLLM if provider == "vllm" else SGLANG
    engine.renders_ids = False
    with openai_server(urls, provider, Sampling(), None) as server:
        error = server.submit(PROMPT, 3, seed=0).exception(WAIT)
    assert isinstance(error, EngineError) and field_name in str(error)


def test_stop_on_an_id_sampling_does_not_list(urls):
    VLLM.eos_at = 1  # the model's EOS is 2; the policy says 3
    with openai_server(urls, "vllm", Sampling(eos_id=3), None) as server:
        error = server.submit(PROMPT, 4, seed=0).exception(WAIT)
    assert isinstance(error, EngineError) and "Sampling.eos_id" in str(error) and "stopped on id 2" in str(error)
    assert VLLM.received[0][1]["stop_token_ids"] == [3]


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("provider,sampling,options,words", [
    ("vllm", Sampling(top_k=5), {}, "VLLMGenerateServer"),
    ("vllm", Sampling(top_p=0.9), {"processed_logprobs": True}, "VLLMGenerateServer"),
    ("vllm", Sampling(min_p=0.1), {}, "min_p=0.1"),
    ("vllm", Sampling(temperature=0.7), {}, "--logprobs-mode processed_logprobs"),
    ("vllm", Sampling(temperature=0.0), {}, "processed_logprobs=True"),
    ("sglang", Sampling(top_k=5), {}, "before its filters"),
    ("sglang", Sampling(temperature=0.5, top_p=0.9), {}, "top_p=0.9"),
    ("sglang", Sampling(min_p=0.05), {}, "drop the filters"),
    ("sglang", Sampling(), {"processed_logprobs": True}, "leave it False"),
    ("sglang", Sampling(), {"routing": True}, "routing_shape=(layers, top_k)"),
    ("vllm", Sampling(), {"routing_shape": (3, 2)}, "pass routing=True"),
])
def test_openai_refusals(urls, provider, sampling, options, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        openai_server(urls, provider, sampling, None, **options)


@pytest.mark.parametrize("provider,sampling,options", [
    ("vllm", Sampling(), {}),
    ("vllm", Sampling(temperature=0.6), {"processed_logprobs": True}),
    ("sglang", Sampling(temperature=0.3), {}),
])
def test_accepted_samplings_draw_as_asked(urls, provider, sampling, options):
    """A sampling the server accepts reaches the engine as it is and comes back as a Draw of the
    engine's ids and log-probabilities."""
    engine = VLLM if provider == "vllm" else SGLANG
    if options.get("processed_logprobs"):
        engine.logprobs_mode = "processed_logprobs"
    with openai_server(urls, provider, sampling, None, **options) as server:
        draw = server.submit(PROMPT, 4, seed=3).result(WAIT)
    (_, body), = engine.received
    asked = {k: body[k] for k in ("prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")}
    assert asked == {"prompt": PROMPT, "max_tokens": 4, "temperature": sampling.temperature, "top_p": 1.0,
                     "top_k": -1, "min_p": 0.0, "seed": 3}
    choice = answered(engine)
    assert not draw.eos and draw.finish_reason == "length" and len(draw) == 4
    ids = choice["token_ids"] if provider == "sglang" else [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    assert draw.ids.tolist() == ids
    np.testing.assert_array_equal(draw.behavior_log_probs, np.float32(choice["logprobs"]["token_logprobs"]))


def test_other_refusals(urls):
    with pytest.raises(ValueError, match="finite top-k|Sampling.top_k"):
        VLLMGenerateServer(urls["vllm"], Sampling(top_p=0.9), None)
    with pytest.raises(ValueError, match="temperature > 0"):
        VLLMGenerateServer(urls["vllm"], Sampling(temperature=0.0, top_k=4), None)
    with pytest.raises(ValueError, match="root URL"):
        VLLMGenerateServer("127.0.0.1:8000", Sampling(top_k=4), None)
    with pytest.raises(ValueError, match="provider must be one of"):
        OpenAICompletion("standin", openai.OpenAI(base_url=f"{urls['vllm']}/v1", api_key="EMPTY"), "tgi")
    with pytest.raises(ValueError, match="served model's name"):
        OpenAICompletion("", openai.OpenAI(base_url=f"{urls['vllm']}/v1", api_key="EMPTY"))
    with pytest.raises(TypeError, match="openai.OpenAI client"):
        OpenAICompletion("standin", urls["vllm"])
    with pytest.raises(TypeError, match="Publisher"):
        openai_server(urls, "vllm", Sampling(), weights=object())
    with pytest.raises(ValueError, match="RemoteOptions.timeout"):
        RemoteOptions(timeout=0)
    with openai_server(urls, "vllm", Sampling(), None) as server:
        for prompt, budget, seed, words in [([], 4, 0, "nonempty"), ([1, -2], 4, 0, "nonnegative"),
                                            ([1.5], 4, 0, "integer"), (PROMPT, 0, 0, "max_new_tokens"),
                                            (PROMPT, 4, 2**32, "seed"), (PROMPT, 4, True, "seed")]:
            with pytest.raises(ValueError, match=words):
                server.submit(prompt, budget, seed=seed)
        with pytest.raises(ValueError, match="weights=None"):
            server.load({}, 1)
    assert not VLLM.received


# ---- routing and supports ------------------------------------------------------------------------

def test_vllm_routing(urls):
    VLLM.routing, VLLM.eos_at = (3, 2), 2
    with openai_server(urls, "vllm", Sampling(eos_id=2), None, routing=True) as server:
        draw = server.submit(PROMPT, 5, seed=2).result(WAIT)
    from dew_lib.inference.remote import decode_npy
    sent = decode_npy("stand-in", "routed_experts", answered(VLLM)["routed_experts"])
    assert sent.shape == (len(PROMPT) + len(draw) - 1, 3, 2)  # the last sampled id is never forwarded
    assert draw.routed_experts.shape == (len(PROMPT) + len(draw), 3, 2)
    assert draw.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(draw.routed_experts[:-1], sent)
    np.testing.assert_array_equal(draw.routed_experts[-1], 0)
    VLLM.routing = None
    with openai_server(urls, "vllm", Sampling(), None, routing=True) as server:
        error = server.submit(PROMPT, 3, seed=2).exception(WAIT)
    assert isinstance(error, EngineError) and "--enable-return-routed-experts" in str(error)


@pytest.mark.parametrize("shape", ["ids", "tokens"])
def test_generate_supports_and_routing(urls, shape):
    VLLM.sampling_mask, VLLM.routing, VLLM.generate_logprobs = True, (2, 2), shape
    VLLM.logprobs_mode, VLLM.eos_at = "processed_logprobs", 4
    sampling = Sampling(temperature=0.8, top_k=4, top_p=0.9, eos_id=2)
    with VLLMGenerateServer(urls["vllm"], sampling, Weights(version=2), routing=True) as server:
        draw = server.submit(PROMPT, 6, seed=5).result(WAIT)
    (path, body), = VLLM.received
    assert path == "/inference/v1/generate"
    assert body == {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "top_k": 4, "min_p": 0.0, "logprobs": 0,
        "detokenize": False, "seed": 5, "stop_token_ids": [2]}}
    choice = answered(VLLM)
    assert draw.ids.tolist() == choice["token_ids"] and draw.eos and draw.ids[-1] == 2 and draw.version == 2
    assert [kept.tolist() for kept in draw.support] == choice["sampling_mask"]
    assert all(1 <= len(kept) <= 4 and token in kept for token, kept in zip(draw.ids, draw.support))
    np.testing.assert_array_equal(draw.behavior_log_probs,
                                  np.float32([e["logprob"] for e in choice["logprobs"]["content"]]))
    assert draw.routed_experts.shape == (len(PROMPT) + len(draw), 2, 2)


def test_generate_without_a_mask(urls):
    with VLLMGenerateServer(urls["vllm"], Sampling(top_k=4), None) as server:
        error = server.submit(PROMPT, 3, seed=0).exception(WAIT)
    assert isinstance(error, EngineError) and "--return-sampling-mask" in str(error)


def test_draw_checks_routing_and_supports():
    base = {"ids": [4, 2], "behavior_log_probs": [-0.5, -0.1], "raw_log_probs": None, "eos": True,
            "version": 0}
    with pytest.raises(ValueError, match="routed_experts"):
        Draw(**base, routed_experts=np.zeros((2, 3, 2), np.int32))  # no room for a prompt
    with pytest.raises(ValueError, match="routed_experts"):
        Draw(**base, routed_experts=np.zeros((4, 3), np.int32))
    with pytest.raises(ValueError, match="support\\[1\\]"):
        Draw(**base, support=[[4, 5], [3]])
    with pytest.raises(ValueError, match="2 sampled ids"):
        Draw(**base, support=[[4]])
    draw = Draw(**base, routed_experts=np.ones((3, 1, 2), np.uint16), support=[[4, 5], [2]])
    assert draw.routed_experts.dtype == np.uint16 and not draw.support[0].flags.writeable


# ---- versions, cancellation, close ---------------------------------------------------------------

def test_version_of_a_draw_in_flight_across_a_push(urls):
    VLLM.delay = 0.6
    VLLM.fault("slow")
    weights = Weights(version=0)
    with openai_server(urls, "vllm", Sampling(), weights) as server:
        in_flight = server.submit(PROMPT, 3, seed=0)
        while not VLLM.received:
            time.sleep(0.01)
        server.load({"w": 1}, 1)
        assert not in_flight.done()  # the engine holds it for 0.6 s
        after = server.submit(PROMPT, 3, seed=0).result(WAIT)
        assert in_flight.result(WAIT).version == 0 and after.version == 1
        assert weights.loads == [({"w": 1}, 1)] and server.version == 1

    class Unversioned:
        def load(self, variables, version):
            pass

    with openai_server(urls, "vllm", Sampling(), Unversioned()) as server:
        assert server.version == 0
        server.load({}, 7)
        assert server.version == 7 and server.submit(PROMPT, 2, seed=0).result(WAIT).version == 7


def test_cancel_before_and_during_a_request(urls):
    VLLM.delay = 0.5
    VLLM.fault("slow")
    with openai_server(urls, "vllm", Sampling(), None, options=RemoteOptions(workers=1)) as server:
        running = server.submit(PROMPT, 3, seed=0)
        queued = server.submit(PROMPT, 3, seed=1)
        assert queued.cancel()
        while not VLLM.received:
            time.sleep(0.01)
        assert running.cancel()  # pending until answered, so cancellable in flight; answer dropped
        later = server.submit(PROMPT, 3, seed=2).result(WAIT)
    assert [body["seed"] for _, body in VLLM.received] == [0, 2]  # the queued one was never sent
    assert isinstance(later, Draw)
    with pytest.raises(CancelledError):
        running.result(0)


def test_close_fails_pending_draws(urls):
    VLLM.delay = 2.0
    VLLM.fault("slow")
    server = VLLMGenerateServer(urls["vllm"], Sampling(top_k=4), Weights())
    pending = server.submit(PROMPT, 3, seed=0)
    while not VLLM.received:
        time.sleep(0.01)
    started = time.monotonic()
    server.close()
    assert isinstance(pending.exception(WAIT), ServerClosed) and time.monotonic() - started < 1.5
    with pytest.raises(ServerClosed):
        server.submit(PROMPT, 3)
    with pytest.raises(ServerClosed):
        server.load({}, 1)


# ---- failures ------------------------------------------------------------------------------------

FAILURES = {"error": "HTTP 500", "slow": "did not answer", "malformed": "not JSON",
            "missing": "without choices.0.logprobs", "drop": "connection", "abort": "'abort'"}


def failing_server(urls, route):
    options = RemoteOptions(timeout=0.3)
    if route == "generate":
        VLLM.sampling_mask = True
        return VLLM, VLLMGenerateServer(urls["vllm"], Sampling(top_k=4), None, options=options)
    engine = VLLM if route == "vllm" else SGLANG
    return engine, openai_server(urls, route, Sampling(), None, options=options)


@pytest.mark.parametrize("route", ["vllm", "sglang", "generate"])
def test_failures_fail_the_future(urls, route):
    engine, server = failing_server(urls, route)
    engine.delay = 1.0
    with server:
        for fault, words in FAILURES.items():
            engine.fault(fault)
            error = server.submit(PROMPT, 3, seed=0).exception(WAIT)
            assert isinstance(error, EngineError), (fault, error)
            assert words in str(error), (fault, str(error))
        assert isinstance(server.submit(PROMPT, 3, seed=0).result(WAIT), Draw)  # the server lives on
        too_long = server.submit(PROMPT, engine.max_model_len, seed=0).exception(WAIT)
    assert isinstance(too_long, EngineError) and "HTTP 400" in str(too_long) and "context length" in str(too_long)


def test_wrong_model_name_and_no_engine(urls):
    server = OpenAIRolloutServer(completion(urls, "vllm", name="other"), Sampling(), None)
    with server:
        error = server.submit(PROMPT, 3, seed=0).exception(WAIT)
    assert isinstance(error, EngineError) and "HTTP 404" in str(error) and "other" in str(error)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with VLLMGenerateServer(f"http://127.0.0.1:{port}", Sampling(top_k=4), None) as server:
        error = server.submit(PROMPT, 3, seed=0).exception(WAIT)
    assert isinstance(error, EngineError) and "connection" in str(error)


def test_failed_draws_become_infra_error_sessions(urls):
    VLLM.sampling_mask, VLLM.routing, VLLM.eos_at = True, (2, 2), 1
    server = VLLMGenerateServer(urls["vllm"], Sampling(top_k=4, eos_id=2), Weights(version=3), routing=True)
    task = Task("t0", {"prompt_ids": PROMPT, "ground_truth": "1"})
    with server, PromptSource(server, lambda *args: 1.0, decode=lambda ids: "", max_new_tokens=4,
                              workers=1) as source:
        VLLM.fault("error")
        failed = source.submit(task, group=0, sample=0, attempt=0, seed=1).result(WAIT)
        done = source.submit(task, group=0, sample=0, attempt=1, seed=1).result(WAIT)
    assert failed.status is Status.INFRA_ERROR and not failed.calls and failed.reward is None
    assert "EngineError" in failed.detail and "HTTP 500" in failed.detail
    assert done.status is Status.COMPLETED and done.reward == 1.0
    (call,), choice = done.calls, answered(VLLM)
    assert call.sampled_ids.tolist() == choice["token_ids"] and call.version == 3
    assert call.routed_experts.shape == (len(PROMPT) + call.sampled_ids.size, 2, 2)
    assert [kept.tolist() for kept in call.support] == choice["sampling_mask"]


def test_standin_models_and_health(urls):
    import httpx

    for provider in ("vllm", "sglang"):
        assert httpx.get(f"{urls[provider]}/health").status_code == 200
        (model,) = httpx.get(f"{urls[provider]}/v1/models").json()["data"]
        assert model["id"] == "standin" and model["owned_by"] == provider


@pytest.mark.parametrize("provider", ["vllm", "sglang"])
def test_completion_of_token_id_rows(urls, provider):
    engine = VLLM if provider == "vllm" else SGLANG
    engine.eos_at = 1
    rows = [[5, 6, 7], [8, 9]]
    answer = completion(urls, provider).create(rows, max_tokens=3, sampling=Sampling(eos_id=2), seed=4)
    assert engine.received[0][1]["prompt"] == rows
    sent = engine.answered[0][1]["choices"]
    assert len(answer.choices) == 2 and answer.body["choices"] == sent
    for choice, row in zip(answer.choices, sent, strict=True):
        assert choice.finish_reason == "stop" and choice.tokens[-1] == 2 and len(choice.tokens) == 2
        np.testing.assert_array_equal(choice.log_probs, row["logprobs"]["token_logprobs"])
    single = completion(urls, provider).create(np.array(PROMPT), max_tokens=3, sampling=Sampling(), seed=4)
    assert engine.received[1][1]["prompt"] == PROMPT and len(single.choices) == 1

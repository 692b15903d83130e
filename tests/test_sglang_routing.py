"""SGLang's routed experts through OpenAIRolloutServer, against the stand-in SGLang.

SGLang's OpenAI-compatible /v1/completions returns the routing once per response, not per
choice, and flat, so the server needs the model's (layers, top_k) to read it. Read from
SGLang's own source: the two route files at sgl-project/sglang commit
004c82e07d876f6e4a0ad6e15325706b0f478f1a (the commit tests/test_rollout_servers.py cites for the
rest of this route) and again in the sglang 0.5.23 wheel from PyPI, where the other files were
read:

- python/sglang/srt/entrypoints/openai/protocol.py: CompletionRequest.return_routed_experts
  (bool, default False) and routed_experts_start_len (default 0: the whole sequence);
  SglExt.routed_experts: Optional[str]; CompletionResponse.sglext (left out when None), at the
  response level. CompletionResponseChoice has no routing field.
- python/sglang/srt/entrypoints/openai/serving_completions.py, _build_completion_response:
  "Build sglext at response level (from first ret_item, as these are per-request)":
  process_routed_experts_from_ret(ret[0], request), which is meta_info["routed_experts"] when
  the request asked for it (python/sglang/srt/entrypoints/openai/utils.py).
- python/sglang/srt/managers/detokenizer_manager.py (_b64_encode_per_request) and
  tokenizer_manager.py: meta_info["routed_experts"] is base64 of the tensor's raw bytes
  (`pybase64.b64encode(t.numpy().tobytes())`), no shape header;
  python/sglang/srt/state_capturer/routed_experts.py (extract_routed_experts_from_meta_info
  decodes it with np.frombuffer(..., dtype=np.int32)) and state_capturer/base.py (the host cache
  is int32 [tokens, num_hidden_layers, num_experts_per_tok]).
- python/sglang/srt/managers/scheduler_components/batch_result_processor.py
  (_maybe_collect_routed_experts, wheel 0.5.23): rows [routed_experts_start_len, seqlen - 1),
  seqlen = prompt + output ids through the stop (EOS included), so with start 0 the rows cover
  the prompt and every sampled id but the last, as vLLM's do. Without
  --enable-return-routed-experts there is no capturer and sglext is left out, without an error.

Checked here: the request field only under routing=True, exact ids into the draw (a zero row
appended for the last sampled id) and into a packed batch, a missing, cut, garbled or misshapen
routing failing the draw with EngineError (an INFRA_ERROR session), and the refusals.
"""

from __future__ import annotations

import base64
import dataclasses
import re

import numpy as np
import openai
import pytest
from standin_completions import Engine, app, serve, sglang_router, vllm_router

from dew_lib.inference.openai_engine import OpenAICompletion, OpenAIRolloutServer
from dew_lib.inference.remote import EngineError
from dew_lib.records.sessions import Status, Task
from dew_lib.rollouts.packing import pack
from dew_lib.rollouts.sources import PromptSource
from dew_lib.sampling import Sampling

SGLANG, VLLM = Engine(), Engine()
WAIT = 20
PROMPT = [5, 6, 7]
SHAPE = (3, 2)  # the stand-in model's (layers, top_k)


@pytest.fixture(scope="module")
def urls():
    with serve(app(sglang_router(SGLANG))) as sglang_url, serve(app(vllm_router(VLLM))) as vllm_url:
        yield {"sglang": sglang_url, "vllm": vllm_url}


@pytest.fixture(autouse=True)
def fresh_engines():
    for engine in (SGLANG, VLLM):
        for spec in dataclasses.fields(Engine):
            default = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
            setattr(engine, spec.name, default)
    SGLANG.routing, SGLANG.eos_at = SHAPE, 2  # draws of 3 ids: 3 + 3 - 1 = 5 routed rows


def completion(urls, provider="sglang") -> OpenAICompletion:
    return OpenAICompletion("standin", openai.OpenAI(base_url=f"{urls[provider]}/v1", api_key="EMPTY"),
                            provider)


def server(urls, provider="sglang", **kwargs) -> OpenAIRolloutServer:
    return OpenAIRolloutServer(completion(urls, provider), Sampling(eos_id=2), None, **kwargs)


def sent_routing(engine: Engine) -> np.ndarray:
    """What the stand-in sent, decoded as SGLang's own extract_routed_experts_from_meta_info does."""
    (_, answer), = engine.answered
    flat = np.frombuffer(base64.b64decode(answer["sglext"]["routed_experts"]), dtype=np.int32)
    return flat.reshape(-1, *SHAPE)


def test_routing_round_trips_into_the_draw(urls):
    with server(urls, routing=True, routing_shape=SHAPE) as rollouts:
        draw = rollouts.submit(PROMPT, 6, seed=3).result(WAIT)
    (_, body), = SGLANG.received
    assert body == {"model": "standin", "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0,
                    "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 0, "seed": 3,
                    "stop_token_ids": [2], "return_token_ids": True, "return_routed_experts": True}
    (_, answer), = SGLANG.answered
    assert "routed_experts" not in answer["choices"][0]  # response level only
    sent = sent_routing(SGLANG)
    assert draw.eos and len(draw) == 3 and sent.shape == (len(PROMPT) + len(draw) - 1, *SHAPE)
    assert draw.routed_experts.dtype == np.int32
    assert draw.routed_experts.shape == (len(PROMPT) + len(draw), *SHAPE)
    np.testing.assert_array_equal(draw.routed_experts[:-1], sent)
    np.testing.assert_array_equal(draw.routed_experts[-1], 0)  # never forwarded, never scored


def test_routing_round_trips_into_a_packed_batch(urls):
    task = Task("t0", {"prompt_ids": PROMPT, "ground_truth": "1"})
    with server(urls, routing=True, routing_shape=SHAPE) as rollouts, \
            PromptSource(rollouts, lambda *args: 1.0, decode=lambda ids: "", max_new_tokens=4,
                         workers=1) as source:
        sessions = [source.submit(task, group=0, sample=s, attempt=0, seed=s).result(WAIT) for s in (1, 2)]
    batch = pack(sessions, width=16)
    sent = [answer["sglext"]["routed_experts"] for _, answer in SGLANG.answered]
    for index, (session, encoded) in enumerate(zip(sessions, sent, strict=True)):
        assert session.status is Status.COMPLETED
        (call,) = session.calls
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32).reshape(-1, *SHAPE)
        np.testing.assert_array_equal(call.routed_experts[:-1], flat)
        rows, sampled = np.nonzero(batch["session_index"] == index)
        row, chain = rows[0], slice(sampled[0] - len(PROMPT), sampled[-1] + 1)  # prompt, then samples
        assert (rows == row).all() and batch["routed"][row, chain].all()
        np.testing.assert_array_equal(batch["input_ids"][row, chain],
                                      np.concatenate([PROMPT, call.sampled_ids]))
        np.testing.assert_array_equal(batch["routed_experts"][row, chain], call.routed_experts)
    assert batch["routed"].sum() == sum(len(PROMPT) + s.calls[0].sampled_ids.size for s in sessions)
    assert batch["routed_experts"].dtype == np.int32 and batch["routed_experts"].shape[2:] == SHAPE


def test_routing_false_does_not_ask(urls):
    with server(urls) as rollouts:
        draw = rollouts.submit(PROMPT, 6, seed=3).result(WAIT)
    (_, body), = SGLANG.received
    (_, answer), = SGLANG.answered
    assert "return_routed_experts" not in body and "sglext" not in answer
    assert draw.routed_experts is None


def test_vllm_is_never_sent_the_field(urls):
    VLLM.routing = SHAPE
    with server(urls, "vllm", routing=True, routing_shape=SHAPE) as rollouts:
        draw = rollouts.submit(PROMPT, 4, seed=3).result(WAIT)
    (_, body), = VLLM.received
    assert "return_routed_experts" not in body and draw.routed_experts.shape[1:] == SHAPE
    with server(urls, "vllm", routing=True, routing_shape=(2, 2)) as rollouts:
        error = rollouts.submit(PROMPT, 4, seed=3).exception(WAIT)
    assert isinstance(error, EngineError) and "choices.0.routed_experts" in str(error)


@pytest.mark.parametrize("fault,shape,words", [
    ("cut", SHAPE, "not whole tokens"),
    ("garbled", SHAPE, "not base64"),
    (None, (4, 2), "not whole tokens"),         # 5 rows x 6 ids: not a multiple of 4 x 2
    (None, (5, 2), "expected [5, layers, top_k]"),  # 30 ids read as 3 rows of 5 x 2
])
def test_malformed_routing_fails_the_draw(urls, fault, shape, words):
    if fault:
        SGLANG.fault(fault)
    with server(urls, routing=True, routing_shape=shape) as rollouts:
        error = rollouts.submit(PROMPT, 6, seed=3).exception(WAIT)
    assert isinstance(error, EngineError) and "routed_experts" in str(error)
    assert words in str(error), str(error)


def test_missing_routing_is_an_infra_error(urls):
    SGLANG.routing = None  # launched without --enable-return-routed-experts: sglext left out
    task = Task("t0", {"prompt_ids": PROMPT, "ground_truth": "1"})
    with server(urls, routing=True, routing_shape=SHAPE) as rollouts:
        error = rollouts.submit(PROMPT, 6, seed=3).exception(WAIT)
        with PromptSource(rollouts, lambda *args: 1.0, decode=lambda ids: "", max_new_tokens=4,
                          workers=1) as source:
            failed = source.submit(task, group=0, sample=0, attempt=0, seed=1).result(WAIT)
    assert isinstance(error, EngineError)
    assert "sglext.routed_experts" in str(error) and "--enable-return-routed-experts" in str(error)
    assert all(body["return_routed_experts"] for _, body in SGLANG.received)
    assert failed.status is Status.INFRA_ERROR and "EngineError" in failed.detail and not failed.calls


def test_refusals(urls):
    for kwargs, words in [({"routing": True}, "routing_shape=(layers, top_k)"),
                          ({"routing_shape": SHAPE}, "pass routing=True"),
                          ({"routing": True, "routing_shape": (0, 2)}, "two positive ints"),
                          ({"routing": True, "routing_shape": (3,)}, "two positive ints")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            server(urls, **kwargs)
    assert not SGLANG.received


def test_create_reads_the_first_choices_routing(urls):
    rows = [[5, 6, 7], [8, 9]]
    answer = completion(urls).create(rows, max_tokens=3, sampling=Sampling(eos_id=2), seed=4,
                                     routing=SHAPE)
    first, second = answer.choices
    np.testing.assert_array_equal(first.routed_experts, sent_routing(SGLANG))
    assert first.routed_experts.shape == (len(rows[0]) + len(first.tokens) - 1, *SHAPE)
    assert second.routed_experts is None  # SGLang sends one routing per response
    plain = completion(urls).request(PROMPT, max_tokens=3, sampling=Sampling(), seed=None)
    assert "return_routed_experts" not in plain

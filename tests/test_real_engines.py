"""The remote-engine clients against a real vLLM, opt-in: set DEW_VLLM_URL to its root URL.

tests/test_rollout_servers.py checks the clients against stand-ins written from vLLM's source;
this module sends the same requests to a running vLLM, so what the stand-ins assume is checked
against the engine itself. Without DEW_VLLM_URL every engine test skips, saying so; the checks
of tools/gpu_engines.py's parsing run anyway (no engine needed). tools/gpu_engines.sh launches
vLLM on a checkpoint Dew wrote and runs this module against it.

One vLLM cannot serve both clients: launched with --return-sampling-mask (which the token
route's supports need) it refuses every request without a top-k and a temperature above 0,
/v1/completions included (vllm/v1/engine/input_processor.py, v0.30.0). So the tests come in two
sets, for two launches (tools/gpu_engines.sh runs both, one after the other):

    completions   vllm serve DIR --logprobs-mode processed_logprobs
    token route   vllm serve DIR --logprobs-mode processed_logprobs --enable-scale-out
                  --return-sampling-mask; DEW_VLLM_SAMPLING_MASK=1; test names hold "mask"

Settings:

    DEW_VLLM_URL            vLLM's root URL, e.g. http://127.0.0.1:8000 (not its /v1)
    DEW_VLLM_MODEL          the served model name (default: the one /v1/models lists)
    DEW_VLLM_EOS            the EOS ids, comma-separated (default: Qwen3's 151645,151643)
    DEW_VLLM_SAMPLING_MASK  1 when the engine runs with --return-sampling-mask
    DEW_VLLM_ENGINE         "vllm" (default), or "dew" for `dew serve` standing in for vLLM in a
                            CPU dry run: it serves one temperature and no prompt log-probs, so
                            the tests that need those skip

Checked: draws on both routes (ids, one finite log-prob per id, budgets, EOS, seeds giving the
same draw), the behavior log-probs against vLLM's own prompt log-probs of the same ids, top-k
supports, a session through PromptSource, and errors (context length, model name, a request
without top-k on a masking engine) as EngineError. Not checked: routing (Dew writes dense
checkpoints only), SGLang.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from dew_lib.inference.openai_engine import OpenAICompletion, OpenAIRolloutServer
from dew_lib.inference.remote import EngineError, RemoteOptions
from dew_lib.inference.vllm_generate import VLLMGenerateServer
from dew_lib.records.sessions import Status, Task
from dew_lib.rollouts.sources import PromptSource
from dew_lib.sampling import Sampling

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import gpu_engines  # noqa: E402  tools/gpu_engines.py, whose parsing is checked offline below

URL = os.environ.get("DEW_VLLM_URL", "").rstrip("/")
KIND = os.environ.get("DEW_VLLM_ENGINE", "vllm")
EOS = tuple(int(i) for i in os.environ.get("DEW_VLLM_EOS", "151645,151643").split(","))
PROMPT = gpu_engines.PROMPT[:12]
WAIT = 300

MASK = os.environ.get("DEW_VLLM_SAMPLING_MASK") == "1"
NO_ENGINE = "no real engine: set DEW_VLLM_URL to a running vLLM's root URL (tools/gpu_engines.sh does)"

engine = pytest.mark.skipif(not URL or MASK, reason=NO_ENGINE if not URL else (
    "the engine runs with --return-sampling-mask, which refuses requests without top-k; these tests "
    "need a launch without it"))
mask_engine = pytest.mark.skipif(not URL or not MASK or KIND != "vllm", reason=NO_ENGINE if not URL else (
    "needs vLLM launched with --enable-scale-out --return-sampling-mask and DEW_VLLM_SAMPLING_MASK=1"))
vllm_only = pytest.mark.skipif(KIND != "vllm", reason=f"DEW_VLLM_ENGINE={KIND}: needs vLLM itself")


@pytest.fixture(scope="module")
def model():
    return os.environ.get("DEW_VLLM_MODEL") or gpu_engines.served_model(URL)


@pytest.fixture(scope="module")
def client():
    import openai

    return openai.OpenAI(base_url=f"{URL}/v1", api_key="EMPTY")


def completions(client, model, sampling, **kwargs) -> OpenAIRolloutServer:
    return OpenAIRolloutServer(OpenAICompletion(model, client, "vllm"), sampling, None,
                               processed_logprobs=True, options=RemoteOptions(timeout=WAIT), **kwargs)


def check_draw(draw, budget: int):
    assert 1 <= len(draw) <= budget and draw.behavior_log_probs.shape == draw.ids.shape
    assert np.isfinite(draw.behavior_log_probs).all() and (draw.behavior_log_probs <= 0).all()
    assert draw.eos == (int(draw.ids[-1]) in EOS) and (draw.eos or len(draw) == budget)
    assert draw.raw_log_probs is None and draw.version == 0


@engine
def test_completion_draws_and_seeds(client, model):
    with completions(client, model, Sampling(eos_id=EOS)) as server:
        first, again, other = (server.submit(PROMPT, 16, seed=s).result(WAIT) for s in (7, 7, 8))
    for draw in (first, again, other):
        check_draw(draw, 16)
    assert first.ids.tolist() == again.ids.tolist()
    np.testing.assert_allclose(first.behavior_log_probs, again.behavior_log_probs, atol=1e-5)
    assert first.ids.tolist() != other.ids.tolist()


@engine
@vllm_only
def test_behavior_log_probs_are_the_models(client, model):
    """The draw's log-probs (decode) against vLLM's prompt log-probs of the same ids (prefill)."""
    import httpx

    with completions(client, model, Sampling(eos_id=EOS)) as server:
        draw = server.submit(PROMPT, 8, seed=3).result(WAIT)
    ids = PROMPT + draw.ids.tolist()
    answer = httpx.post(f"{URL}/v1/completions", timeout=WAIT, json={
        "model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
    assert answer.status_code == 200, answer.text
    rows = answer.json()["choices"][0]["prompt_logprobs"]
    rescored = [rows[len(PROMPT) + i][str(token)]["logprob"] for i, token in enumerate(draw.ids.tolist())]
    np.testing.assert_allclose(draw.behavior_log_probs, rescored, atol=0.05)  # bfloat16, two kernels


@engine
@vllm_only
def test_tempered_completion(client, model):
    with completions(client, model, Sampling(temperature=0.7, eos_id=EOS)) as server:
        check_draw(server.submit(PROMPT, 8, seed=1).result(WAIT), 8)


@mask_engine
def test_mask_token_route_supports():
    sampling = Sampling(temperature=0.8, top_k=4, eos_id=EOS)
    with VLLMGenerateServer(URL, sampling, None, options=RemoteOptions(timeout=WAIT)) as server:
        first, again = (server.submit(PROMPT, 8, seed=5).result(WAIT) for _ in range(2))
    check_draw(first, 8)
    assert first.ids.tolist() == again.ids.tolist() and len(first.support) == len(first)
    for token, kept in zip(first.ids.tolist(), first.support, strict=True):
        assert 1 <= kept.size <= 4 and token in kept.tolist()


@mask_engine
def test_mask_engine_refuses_completions_without_top_k(client, model):
    with completions(client, model, Sampling(eos_id=EOS)) as server:
        error = server.submit(PROMPT, 4, seed=0).exception(WAIT)
    assert isinstance(error, EngineError) and "HTTP 400" in str(error) and "top_k" in str(error)


@engine
def test_session_through_prompt_source(client, model):
    task = Task("t0", {"prompt_ids": PROMPT, "ground_truth": "x"})
    with completions(client, model, Sampling(eos_id=EOS)) as server, \
            PromptSource(server, lambda *args: 0.5, decode=lambda ids: "", max_new_tokens=8, workers=1) as source:
        session = source.submit(task, group=0, sample=0, attempt=0, seed=2).result(WAIT)
    assert session.status in (Status.COMPLETED, Status.TRUNCATED) and session.reward == 0.5
    (call,) = session.calls
    assert call.prompt_ids.tolist() == PROMPT and 1 <= call.sampled_ids.size <= 8


@engine
def test_batch_of_rows(client, model):
    answer = OpenAICompletion(model, client, "vllm").create([PROMPT, PROMPT[:5]], max_tokens=4,
                                                            sampling=Sampling(eos_id=EOS), seed=4)
    assert len(answer.choices) == 2
    for choice in answer.choices:
        assert 1 <= choice.tokens.size <= 4 and choice.log_probs.shape == choice.tokens.shape


@engine
def test_engine_errors(client, model):
    import httpx

    (listed,) = httpx.get(f"{URL}/v1/models", timeout=30).json()["data"]
    with completions(client, model, Sampling(eos_id=EOS)) as server:
        too_long = server.submit(PROMPT, int(listed["max_model_len"]), seed=0).exception(WAIT)
    assert isinstance(too_long, EngineError) and "HTTP 400" in str(too_long)
    with completions(client, model + "-not-served", Sampling(eos_id=EOS)) as server:
        unknown = server.submit(PROMPT, 4, seed=0).exception(WAIT)
    assert isinstance(unknown, EngineError) and "HTTP 404" in str(unknown)


# ---- tools/gpu_engines.py, offline ---------------------------------------------------------------

def test_probe_reads_vllm_prompt_logprobs():
    """A completion as vLLM 0.30.0 serializes it (CompletionResponseChoice.prompt_logprobs:
    list[dict[int, Logprob] | None], int keys as JSON strings; the first row None)."""
    prompt = gpu_engines.PROMPT
    rows = [None] + [{str(t): {"logprob": -0.5 - i, "rank": 3, "decoded_token": "x"}}
                     for i, t in enumerate(prompt[1:])]
    body = {"choices": [{"logprobs": {"tokens": ["token_id:11", "token_id:12"], "token_logprobs": [-1.0, -2.0]},
                         "prompt_logprobs": rows}]}
    read = gpu_engines.read_probe(body)
    assert read["ids"] == [11, 12] and read["sampled"] == [-1.0, -2.0]
    assert read["prompt"] == [-0.5 - i for i in range(len(prompt) - 1)]
    other = {**read, "prompt": [v - 0.25 for v in read["prompt"]]}
    assert gpu_engines.difference(read, read) == 0 and gpu_engines.difference(read, other) == 0.25
    assert gpu_engines.difference(read, {**read, "ids": [11, 13]}) == float("inf")
    rows[3] = {"99999999": {"logprob": -1.0}}
    with pytest.raises(RuntimeError, match="own ids"):
        gpu_engines.read_probe(body)
    body["choices"][0]["prompt_logprobs"] = None
    assert gpu_engines.read_probe(body)["prompt"] is None


def test_helper_arguments():
    parse = gpu_engines.parser().parse_args
    args = parse(["nccl", "--url", "http://h:1", "--dir", "d", "--library", "l.so", "--pushes", "3"])
    assert (args.pushes, args.tolerance, args.prompt_logprobs, args.nccl_version) == (3, 0.0, True, None)
    assert parse(["reload", "--url", "u", "--dir", "d", "--no-prompt-logprobs"]).prompt_logprobs is False
    assert parse(["checkpoint", "--out", "o"]).preset == "small"
    with pytest.raises(SystemExit):
        parse(["nccl", "--url", "u", "--dir", "d"])  # --library is required
    params = {"layers": {"down_proj": {"kernel": np.ones((2, 3, 4))}, "up_proj": {"kernel": np.ones(2)}}}
    changed = gpu_engines.halved({"params": params})
    assert (changed["params"]["layers"]["down_proj"]["kernel"] == 0.5).all()
    assert (params["layers"]["down_proj"]["kernel"] == 1).all()  # the launch weights stay as they were
    assert changed["params"]["layers"]["up_proj"] is params["layers"]["up_proj"]

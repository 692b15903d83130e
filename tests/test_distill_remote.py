"""A distillation teacher on a remote engine: `dew serve` answering vLLM's `prompt_logprobs`, and
`RemoteTeacher` feeding DistillObjective's reverse_kl the same loss a local teacher gives.

One tiny teacher checkpoint (Pretrained.save, the MiniMind tokenizer when the shared data has it)
is served in-thread by `running(create_app(...))` on 127.0.0.1 and loaded in process by
`load_pretrained` from the same directory: the served prompt log-probs must equal an in-process
forward within 1e-5, and the remote teacher's distillation loss, gradient and rewards the local
teacher's. vLLM's answer shape (choices[i].prompt_logprobs: null, then per position a dict keyed
by token-id strings of {"logprob", "rank", "decoded_token"} holding the prompt's id and the top k)
is vLLM's `CompletionResponseChoice.prompt_logprobs` with `Logprob` and `_make_logprob_dict`
(vllm/v1/engine/logprobs.py), and its refusals `CompletionRequest.check_logprobs`.
"""

import os

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import optax
import pytest
from conftest import SHARED_DATA, tiny_model

from dew_lib.data.dataset import Dataset
from dew_lib.inference import remote_teacher
from dew_lib.inference.openai_engine import OpenAICompletion
from dew_lib.inference.remote import EngineError, RemoteOptions
from dew_lib.inference.remote_teacher import RemoteTeacher
from dew_lib.models.pretrained import Pretrained, load_pretrained
from dew_lib.objectives import DistillObjective, loss
from dew_lib.objectives.lm import score_targets
from dew_lib.rollouts.distill import DistillRollout
from dew_lib.serve import ServedPolicy, create_app, running
from dew_lib.train.sinks import MemorySink
from dew_lib.train.trainer import Trainer

TOKENIZER = os.path.join(SHARED_DATA, "tokenizers", "minimind")
VOCAB, CAPACITY, P, R = 6400, 32, 4, 6
NAME = "teacher"
STUDENT = tiny_model(vocab_size=VOCAB, num_layers=1, max_seq_len=CAPACITY)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, the teacher's model and variables as loaded in process, whether it has a tokenizer)."""
    tokenizer = None
    if os.path.isdir(TOKENIZER):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    model = tiny_model(vocab_size=VOCAB, emb_features=32, max_seq_len=CAPACITY)
    variables = jax.jit(model.init)(jax.random.key(3), jnp.zeros((1, 8), jnp.int32))
    directory = tmp_path_factory.mktemp("teacher") / NAME
    Pretrained.from_model(model, tokenizer=tokenizer).save(variables, directory, dtype=None)
    pretrained, loaded = load_pretrained(directory)
    policy = ServedPolicy.load(directory, slots=4, capacity=CAPACITY, steps=4, served_model_name=NAME)
    try:
        with running(create_app(policy)) as url:
            yield url, pretrained.model, loaded, pretrained.tokenizer
    finally:
        policy.close()


def post(url, body, route="/v1/completions"):
    return httpx.post(url + route, json=body, timeout=120)


def local_log_probs(model, variables, ids):
    """log_softmax of an in-process forward, `[len(ids) - 1, V]`."""
    logits = model.apply(variables, jnp.asarray([ids[:-1]], jnp.int32)).astype(jnp.float32)
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))[0]


def check_vllm_shape(listed, ids, k, expected, tokenizer):
    """`listed` is vLLM's prompt_logprobs for `ids` at k alternatives, with `expected`'s values."""
    assert len(listed) == len(ids) and listed[0] is None
    for t in range(1, len(ids)):
        entry, row = listed[t], expected[t - 1]
        keys = list(entry)
        assert keys[0] == str(ids[t]) and all(isinstance(key, str) for key in keys)
        top = np.argsort(-row, kind="stable")[:k]
        assert keys[1:] == [str(i) for i in top if i != ids[t]]  # the prompt id once, at its own place
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert abs(value["logprob"] - row[int(key)]) <= 1e-5
            decoded = None if tokenizer is None else tokenizer.decode([int(key)])
            assert value["decoded_token"] == decoded
        ranks = [entry[str(i)]["rank"] for i in top]
        assert ranks == list(range(1, k + 1))
        if ids[t] not in top:  # vLLM's rank: the ids at least as likely
            assert entry[str(ids[t])]["rank"] == int((row >= row[ids[t]]).sum())


# ----- dew serve's prompt_logprobs -------------------------------------------------------------------

def test_prompt_logprobs_are_vllms_json_and_an_in_process_forward(served):
    url, model, variables, tokenizer = served
    ids = [5, 17, 300, 17, 4000, 9]
    for k in (0, 3):
        answer = post(url, {"model": NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": k})
        assert answer.status_code == 200, answer.text
        (choice,) = answer.json()["choices"]
        check_vllm_shape(choice["prompt_logprobs"], ids, k, local_log_probs(model, variables, ids), tokenizer)
        if k == 0:
            assert all(len(entry) == 1 for entry in choice["prompt_logprobs"][1:])
    plain = post(url, {"model": NAME, "prompt": ids, "max_tokens": 1}).json()
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_a_list_of_prompts_gets_one_list_each(served):
    url, model, variables, tokenizer = served
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13, 14], [42, 43]]
    answer = post(url, {"model": NAME, "prompt": prompts, "max_tokens": 2, "prompt_logprobs": 1}).json()
    by_index = {c["index"]: c for c in answer["choices"]}
    for n, ids in enumerate(prompts):
        check_vllm_shape(by_index[n]["prompt_logprobs"], ids, 1, local_log_probs(model, variables, ids), tokenizer)


@pytest.mark.parametrize(("fields", "message"), [
    ({"prompt_logprobs": 1, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": 0, "stream": True}, "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -2}, "`prompt_logprobs` must be a positive value or -1."),
    ({"prompt_logprobs": -1}, "prompt_logprobs=-1 asks for more alternatives"),
    ({"prompt_logprobs": 21}, "prompt_logprobs=21 asks for more alternatives"),
])
def test_what_vllm_refuses_is_refused_naming_the_field(served, fields, message):
    answer = post(served[0], {"model": NAME, "prompt": [1, 2, 3], "max_tokens": 1, **fields})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "prompt_logprobs" and message in error["message"]


def test_chat_answers_prompt_logprobs_of_its_rendered_prompt(served):
    url, model, variables, tokenizer = served
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        pytest.skip(f"no MiniMind tokenizer with a chat template at {TOKENIZER}")
    answer = post(url, {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                        "prompt_logprobs": 2, "return_token_ids": True}, route="/v1/chat/completions").json()
    assert "error" not in answer, answer
    ids = answer["prompt_token_ids"]
    check_vllm_shape(answer["prompt_logprobs"], ids, 2, local_log_probs(model, variables, ids), tokenizer)


# ----- the remote teacher ------------------------------------------------------------------------

def teacher(url, **options):
    return RemoteTeacher(OpenAICompletion(NAME, openai.OpenAI(base_url=url + "/v1", api_key="none")), **options)


def objectives(served, **remote_options):
    url, model, variables, _ = served
    local = DistillObjective(STUDENT, P + R - 1, teacher_model=model, teacher=variables, loss="reverse_kl")
    remote = DistillObjective(STUDENT, P + R - 1, teacher=teacher(url, **remote_options), loss="reverse_kl")
    return local, remote


class State:
    def __init__(self, params, ema):
        self.params, self.ema, self.updates = params, ema, jnp.int32(0)


def prompts(seed, rows=4):
    rng = np.random.default_rng(seed)
    return {"prompt": rng.integers(1, VOCAB, (rows, P)).astype(np.int32),
            "prompt_length": rng.integers(2, P + 1, rows).astype(np.int32)}


def test_the_remote_teachers_loss_is_the_local_teachers(served):
    local, remote = objectives(served, rows_per_request=3)  # 4 rows: two requests, one of 3 and one of 1
    params = jax.jit(local.init)(jax.random.key(0))
    key = jax.random.key(11)
    local_rollout = DistillRollout(local, max_new_tokens=R)
    remote_rollout = DistillRollout(remote, max_new_tokens=R)
    local_batch = local_rollout(State(params, local.teacher), prompts(0), key)
    remote_batch = remote_rollout(State(params, None), prompts(0), key)
    for name in local_batch:
        np.testing.assert_array_equal(local_batch[name], remote_batch[name])  # the same samples, packed alike
    ids = jnp.asarray(local_batch["input_ids"])
    scores, _ = score_targets(local.teacher_model, local.teacher, ids[:, :-1], ids[:, 1:],
                              jnp.asarray(local_batch["text_segment_ids"][:, :-1]),
                              jnp.asarray(local_batch["text_positions"][:, :-1]))
    mask = local_batch["response_mask"][:, 1:] > 0
    assert mask.sum() > 4
    np.testing.assert_allclose(remote_batch["teacher_log_probs"][:, 1:][mask], np.asarray(scores)[mask], atol=1e-5)
    assert not remote_batch["teacher_log_probs"][:, 1:][~mask].any()

    def value(objective, batch, reference):
        return loss(objective, params, batch, reference=reference)

    local_loss, local_metrics = value(local, local_batch, local.teacher)
    remote_loss, remote_metrics = value(remote, remote_batch, None)
    np.testing.assert_allclose(remote_loss, local_loss, rtol=1e-5, atol=1e-6)
    for name in ("kl", "tokens", "completions/mean_length", "on_policy"):
        np.testing.assert_allclose(remote_metrics[name], local_metrics[name], rtol=1e-5, atol=1e-6)
    grads = [jax.grad(lambda p, o=o, b=b, r=r: loss(o, p, b, reference=r)[0])(params)
             for o, b, r in ((local, local_batch, local.teacher), (remote, remote_batch, None))]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    rewards = [[s.reward for s in r.last_sessions] for r in (local_rollout, remote_rollout)]
    np.testing.assert_allclose(rewards[1], rewards[0], rtol=1e-5, atol=1e-6)
    held_out = remote.teacher.annotate({k: v for k, v in local_batch.items()})
    np.testing.assert_allclose(remote.evaluate(params, held_out)["kl"], local.evaluate(params, local_batch)["kl"],
                               rtol=1e-5, atol=1e-6)
    remote.teacher.close()


def test_a_trainer_distils_from_the_remote_teacher(served):
    _, remote = objectives(served)
    rollout = DistillRollout(remote, max_new_tokens=R)

    def batches(partition):
        seed = 0
        while True:
            seed += 1
            yield prompts(seed)

    sink = MemorySink()
    trainer = Trainer(remote, optax.adam(1e-2), key=jax.random.key(0), rollout=rollout)
    trainer.fit(Dataset(train=batches, batch=4), steps=2, log_every=1, sinks=[sink])
    assert [step for step, _ in sink.history] == [1, 2]
    assert all(np.isfinite(m["loss"]) and m["on_policy"] == 1.0 and m["kl"] != 0 for _, m in sink.history)
    remote.teacher.close()


# ----- refusals -----------------------------------------------------------------------------------

def test_a_remote_teacher_refuses_jsd_and_temperature_naming_the_option_and_the_fix(served):
    remote = teacher(served[0])
    for beta in (0.0, 0.5, 1.0):
        with pytest.raises(ValueError, match=r"loss='jsd', beta=.*RemoteTeacher reports only.*use loss='reverse_kl'"):
            DistillObjective(STUDENT, P + R - 1, teacher=remote, loss="jsd", beta=beta)
    with pytest.raises(ValueError, match=r"temperature=2.0.*raw model's log-probs.*temperature=1.0"):
        DistillObjective(STUDENT, P + R - 1, teacher=remote, loss="reverse_kl", temperature=2.0)
    with pytest.raises(ValueError, match="provider='sglang'"):
        RemoteTeacher(OpenAICompletion(NAME, openai.OpenAI(base_url=served[0] + "/v1", api_key="x"), "sglang"))
    remote.close()


def test_a_teacher_context_shorter_than_the_rows_is_refused_when_the_rollout_is_built(served):
    url, model, variables, _ = served
    wide = CAPACITY - 1  # rows of 32 ids: the engine (max_model_len 32, from /v1/models) needs 33
    remote = DistillObjective(STUDENT, wide, teacher=teacher(url), loss="reverse_kl")
    assert remote.teacher.context() == CAPACITY
    with pytest.raises(ValueError, match=(r"max_model_len=32.*prompt width 26 plus DistillRollout.max_new_tokens=6 "
                                          r"= 32 ids.*max_model_len >= 33")):
        DistillRollout(remote, max_new_tokens=6)
    DistillRollout(DistillObjective(STUDENT, wide - 1, teacher=teacher(url), loss="reverse_kl"), max_new_tokens=6)
    given = DistillObjective(STUDENT, P + R - 1, teacher=teacher(url, max_model_len=8), loss="reverse_kl")
    with pytest.raises(ValueError, match="max_model_len=8"):
        DistillRollout(given, max_new_tokens=R)
    short = tiny_model(vocab_size=VOCAB, emb_features=32, max_seq_len=8)  # a local teacher: refused at once
    with pytest.raises(ValueError, match=r"the teacher\).seq_len=9 exceeds the model's max_seq_len=8"):
        DistillObjective(STUDENT, P + R - 1, teacher_model=short, teacher=variables, loss="reverse_kl")


def test_passing_failures_are_retried_and_others_are_not(served, monkeypatch):
    url = served[0]
    real, calls, failed = remote_teacher._post, [], []

    def flaky(completion, named, extra):
        calls.append(named["model"])
        if not failed:  # the first request ever sent is dropped
            failed.append(True)
            try:
                raise openai.APIConnectionError(request=httpx.Request("POST", url))
            except openai.APIConnectionError as error:
                raise EngineError("dropped") from error
        return real(completion, named, extra)

    monkeypatch.setattr(remote_teacher, "_post", flaky)
    scored = teacher(url, retries=1, backoff=0.0).score([[1, 2, 3]])
    assert len(calls) == 2 and scored[0].shape == (2,)
    calls.clear()
    wrong = RemoteTeacher(OpenAICompletion("no-such-model", openai.OpenAI(base_url=url + "/v1", api_key="x")),
                          retries=3, backoff=0.0, options=RemoteOptions(timeout=30.0))
    with pytest.raises(EngineError, match="answered HTTP 404"):
        wrong.score([[1, 2, 3]])
    assert calls == ["no-such-model"]  # a refusal is not sent again

"""`dew serve`'s `POST /tokenize` (vLLM's route and shapes) and what a distillation stage does with
it: refuse a served teacher whose tokenizer is not the student's.

vLLM's shapes are `TokenizeCompletionRequest` and `TokenizeResponse` of
vllm/entrypoints/openai/protocol.py (`count`, `max_model_len`, `tokens`, `token_strs`). The
checkpoints here carry byte-level BPEs trained on two different corpora, so they share their
256 byte ids and their special tokens yet merge differently.
"""

import httpx
import jax
import jax.numpy as jnp
import openai
import pytest
from conftest import tiny_model

from dew_lib.data.byte_bpe import train_byte_bpe
from dew_lib.inference.openai_engine import OpenAICompletion
from dew_lib.inference.remote_teacher import PROBE, RemoteTeacher
from dew_lib.models.pretrained import Pretrained
from dew_lib.recipes import DistillOptions
from dew_lib.recipes.build import remote_teacher
from dew_lib.serve import ServedPolicy, create_app, running

VOCAB = 320
ARITHMETIC = [f"Distil {a} + {b} = {a + b}, then check: naïve café" for a in range(40) for b in range(0, 40, 7)]
PROSE = [f"The {w} of the river runs {n} miles to the sea" for w in ("mouth", "bend", "source") for n in range(60)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(url of a teacher served with the ARITHMETIC tokenizer, url of one served without a
    tokenizer, that tokenizer, the PROSE tokenizer)."""
    ours = train_byte_bpe(ARITHMETIC, vocab_size=VOCAB)
    theirs = train_byte_bpe(PROSE, vocab_size=VOCAB)
    model = tiny_model(vocab_size=VOCAB, max_seq_len=32)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    policies = []
    for name, tokenizer in (("with", ours), ("without", None)):
        directory = tmp_path_factory.mktemp(name) / "teacher"
        Pretrained.from_model(model, tokenizer=tokenizer).save(variables, directory, dtype=None)
        policies.append(ServedPolicy.load(directory, slots=2, capacity=32, steps=2, served_model_name="teacher"))
    try:
        with running(create_app(policies[0])) as first, running(create_app(policies[1])) as second:
            yield first, second, ours, theirs
    finally:
        for policy in policies:
            policy.close()


def test_tokenize_answers_vllms_shape_with_the_served_tokenizer(engines):
    url, _, ours, _ = engines
    text = "Distil 12 + 30 = 42"
    answer = httpx.post(f"{url}/tokenize", json={"model": "teacher", "prompt": text}, timeout=30)
    assert answer.status_code == 200
    expected = ours.encode(text)
    assert answer.json() == {"count": len(expected), "max_model_len": 32, "tokens": expected, "token_strs": None}
    named = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                "return_token_strs": True, "extra": 1}, timeout=30).json()
    assert named["tokens"] == ours.encode(text, add_special_tokens=False)
    assert named["token_strs"] == ours.convert_ids_to_tokens(named["tokens"])


@pytest.mark.parametrize("body, param, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages", "tokenizes text prompts only"),
    ({}, "prompt", "`prompt` is missing"),
])
def test_what_tokenize_cannot_do_is_refused_naming_the_field(engines, body, param, message):
    answer = httpx.post(f"{engines[0]}/tokenize", json=body, timeout=30)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and message in error["message"] and error["code"] == 400
    unknown = httpx.post(f"{engines[0]}/tokenize", json={"model": "other", "prompt": "x"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    untokenized = httpx.post(f"{engines[1]}/tokenize", json={"prompt": "x"}, timeout=30)
    assert untokenized.status_code == 400 and "has no tokenizer" in untokenized.json()["error"]["message"]


def teacher(url: str) -> RemoteTeacher:
    return RemoteTeacher(OpenAICompletion("teacher", openai.OpenAI(base_url=f"{url}/v1", api_key="none")))


def test_a_served_teacher_with_another_tokenizer_is_refused(engines):
    url, untokenized, ours, theirs = engines
    assert ours.encode(PROBE, add_special_tokens=False) != theirs.encode(PROBE, add_special_tokens=False)
    with teacher(url) as served:
        assert served.check_tokenizer(ours) is True
        with pytest.raises(ValueError, match="tokenizes text otherwise than the student: .* first differing at id "
                                             r"\d+ .* Serve a teacher that shares the student's tokenizer"):
            served.check_tokenizer(theirs)
    with teacher(untokenized) as served:
        assert served.check_tokenizer(ours) is False  # the engine cannot say: nothing was checked
    # The recipe's builder checks the same way, and warns when it could not.
    options = dict(teacher_model="teacher", loss="reverse_kl")
    with pytest.raises(ValueError, match="tokenizes text otherwise than the student"):
        remote_teacher(DistillOptions(teacher_url=f"{url}/v1", **options), theirs)
    remote_teacher(DistillOptions(teacher_url=f"{url}/v1", **options), ours).close()
    with pytest.warns(UserWarning, match="could not be checked against the student's"):
        remote_teacher(DistillOptions(teacher_url=f"{untokenized}/v1", **options), ours).close()

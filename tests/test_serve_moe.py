"""`dew serve` serves a mixture-of-experts checkpoint, and with --enable-return-routed-experts
sends each completion's routes as vLLM does, so Dew's own vLLM client reads them into the draw
that routing replay trains on."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from conftest import SHARED_DATA, tiny_model

from dew_lib.inference.openai_engine import OpenAICompletion, OpenAIRolloutServer
from dew_lib.sampling import Sampling
from dew_lib.serve import ServedPolicy, create_app, running

TOKENIZER = os.path.join(SHARED_DATA, "tokenizers", "minimind")
LAYERS, TOP_K = 2, 2
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen3-MoE checkpoint of a tiny random model, with the MiniMind tokenizer."""
    if not os.path.isdir(TOKENIZER):
        pytest.skip(f"no MiniMind tokenizer at {TOKENIZER}; set DEW_SHARED_DATA")
    from transformers import AutoTokenizer

    from dew_lib.models.pretrained import Pretrained

    model = tiny_model(vocab_size=6400, emb_features=32, max_seq_len=64, num_layers=LAYERS, experts=4,
                       experts_per_token=TOP_K, expert_features=16)
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    directory = tmp_path_factory.mktemp("serve_moe") / "tiny-moe"
    pretrained = Pretrained.from_model(model, tokenizer=AutoTokenizer.from_pretrained(TOKENIZER))
    pretrained.save(variables, directory, dtype=None)
    return directory


def test_dew_serve_sends_the_routes_vllm_s_client_reads(checkpoint):
    from dew_lib.models.pretrained import load_pretrained

    policy = ServedPolicy.load(checkpoint, slots=2, capacity=64, sampling=Sampling(), steps=4,
                               routing=True)
    try:
        with running(create_app(policy)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            assert policy.model.experts == 4  # read back as a mixture of experts
            with OpenAIRolloutServer(OpenAICompletion(policy.name, client), Sampling(), None,
                                     routing=True, routing_shape=(LAYERS, TOP_K)) as engine:
                draw = engine.submit(PROMPT, 8, seed=3).result(60)
    finally:
        policy.close()
    assert draw.routed_experts.shape == (len(PROMPT) + draw.ids.size, LAYERS, TOP_K)
    pretrained, variables = load_pretrained(checkpoint)
    fed = jnp.asarray(PROMPT + draw.ids.tolist()[:-1])[None]
    _, routing = pretrained.model.apply(variables, fed, method=pretrained.model.hidden, return_routing=True)
    np.testing.assert_array_equal(draw.routed_experts[:-1], np.asarray(routing.experts[0]))

"""Serving split over a `tensor` axis: the native server and `generate` draw what one device
draws, each device holds its share of the weights and the KV cache, and weights pushed from a
trainer's FSDP layout land in the served layout without a recompile.

One process with 4 host devices runs every check (`run_on_host_devices`); `dew serve
--tensor-parallel-size 2` is checked over HTTP in tests/test_serve.py. A split contraction sums
its partial products in another order, so log-probs agree to float32 rounding and ids exactly.
"""

import json

import pytest
from conftest import run_on_host_devices

from dew_lib.inference import serving_mesh

SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from conftest import tiny_model
from dew_lib.inference import Server, ServeTask, serving_mesh
from dew_lib.models import partitioning
from dew_lib.sampling import Sampling, generate
from dew_lib.train.mesh import MeshSpec

model = tiny_model(max_seq_len=48)
variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
sampling = Sampling(temperature=0.7, top_k=5, top_p=0.9, eos_id=(3, 7))
prompts = [np.array(p, np.int32) for p in ([5, 6, 7, 8, 9, 10], [11], [12, 13, 14], list(range(1, 21)))]
report = {}

def serve(mesh, weights=variables, cancel=False):
    server = Server.from_task(ServeTask(model=model, variables=variables, sampling=sampling),
                              slots=3, capacity=40, steps=4, mesh=mesh)
    if weights is not variables:
        server.reload(weights, 1)
    draws = {}
    for name, prompt in enumerate(prompts[:3]):
        server.add(name, prompt, 12, seed=110 + name)
    if cancel:  # a slot freed mid-flight, then refilled
        draws.update(server.step())
        server.cancel(1)
        server.add(9, prompts[3], 12, seed=4)
    while server.busy:
        draws.update(server.step())
    return server, {name: draw for name, draw in draws.items()}

def compare(a, b):
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for name in a:
        assert a[name].ids.tolist() == b[name].ids.tolist(), name
        assert a[name].eos == b[name].eos and a[name].version == b[name].version
    return max(float(np.abs(a[n].raw_log_probs - b[n].raw_log_probs).max()) for n in a)

mesh = serving_mesh(2)
one, one_draws = serve(None, cancel=True)
split, split_draws = serve(mesh, cancel=True)
report["server_error"] = compare(one_draws, split_draws)
report["compilations"] = split.compilations
q = split.variables["params"]["layers"]["q_proj"]["kernel"]
keys = split._state.cache.keys[0]
report["shares"] = {"q_proj": [s.data.nbytes / q.nbytes for s in q.addressable_shards],
                    "kv_cache": [s.data.nbytes / keys.nbytes for s in keys.addressable_shards]}
report["devices"] = sorted(d.id for d in keys.sharding.device_set)
report["any_eos"] = any(d.eos for d in split_draws.values())

# weights trained under FSDP over all four devices, pushed to the server on two of them
trained = jax.tree.map(lambda x: x * 1.01, variables)
fsdp = partitioning.place(trained, MeshSpec(fsdp=4).build())
_, pushed_one = serve(None, trained)
pushed, pushed_split = serve(mesh, fsdp)
report["push_error"] = compare(pushed_one, pushed_split)
report["push_layout"] = str(pushed.variables["params"]["layers"]["q_proj"]["kernel"].sharding.spec)
report["push_compilations"] = pushed.compilations

prompt = np.zeros((2, 20), np.int32)
prompt[0, -6:], prompt[1, -3:] = prompts[0], prompts[2]
whole = generate(model, variables, prompt, [6, 3], key=jax.random.key(3), max_new_tokens=12, sampling=sampling)
parts = generate(model, partitioning.place(variables, mesh), prompt, [6, 3], key=jax.random.key(3),
                 max_new_tokens=12, sampling=sampling)
report["generate_same_ids"] = bool((whole.tokens == parts.tokens).all())
report["generate_error"] = float(np.abs(np.asarray(whole.log_probs - parts.log_probs)).max())
try:  # the tiny model has 2 KV heads: four devices cannot split its cache
    Server.from_task(ServeTask(model=model, variables=variables, sampling=sampling), slots=3, capacity=40,
                     mesh=serving_mesh(4))
except ValueError as error:
    report["refusal"] = str(error)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    return json.loads(run_on_host_devices(SCRIPT, devices=4, timeout=300).strip().splitlines()[-1])


def test_the_split_server_draws_what_one_device_draws(report):
    assert report["server_error"] < 1e-5
    assert report["any_eos"], "seeds chosen so that a draw stops on EOS"
    assert report["compilations"] == {"decode": 1, "prefill": 2}  # the cancel and refill recompile nothing


def test_each_device_holds_half_the_weights_and_half_the_kv_cache(report):
    assert report["shares"] == {"q_proj": [0.5, 0.5], "kv_cache": [0.5, 0.5]}
    assert report["devices"] == [0, 1]


def test_weights_from_an_fsdp_trainer_are_served_in_the_served_layout(report):
    assert report["push_error"] < 1e-5
    assert report["push_layout"] == "P(None, None, 'tensor')"
    assert report["push_compilations"] == {"decode": 1, "prefill": 2}


def test_generate_on_split_weights_draws_the_same_ids(report):
    assert report["generate_same_ids"] and report["generate_error"] < 1e-5


def test_a_split_the_kv_heads_do_not_divide_is_refused_by_name(report):
    assert report["refusal"] == ("the KV cache: its kv_heads dimension of 2 does "
                                 "not divide across the mesh's tensor=4; choose a mesh whose tensor size divides 2")


def test_a_tensor_parallel_size_beyond_the_devices_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=64 needs 64 devices; this process has 1"):
        serving_mesh(64)

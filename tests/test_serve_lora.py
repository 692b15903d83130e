"""Several PEFT adapters over one `dew serve` base, and adapter-only pushes, through real HTTP.

A tiny decoder is written with Pretrained.save as the base; two LoRA adapters (rank 2 on q_proj
and v_proj, B drawn so they change the logits) are written with `save_adapter`. `dew serve`
serves the base and both adapters on 127.0.0.1: each `model` name must draw exactly what an
in-process Server with that adapter's variables draws under the same seed. The runtime routes
follow vLLM's vllm/entrypoints/serve/lora/api_router.py and openai/serving_models.py (plain-text
"Success: ..." answers, InvalidUserInput 400s, NotFoundError 404s). `AdapterReload` pushes a
sequence of trained adapters the way a GRPO stage's Publication does.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time

import httpx
import jax
import jax.numpy as jnp
import openai
import pytest
from conftest import launched_serve, tiny_model

from dew_lib.inference import (
    AdapterReload,
    OpenAICompletion,
    OpenAIRolloutServer,
    Publication,
    PushFailed,
    Server,
    ServeTask,
)
from dew_lib.inference import slot_steps as engine
from dew_lib.inference.adapter_push import directory_bytes
from dew_lib.models import lora
from dew_lib.models.pretrained import Pretrained, load_adapter, load_pretrained, save_adapter
from dew_lib.sampling import Sampling
from dew_lib.serve import ServedModels, ServedPolicy, create_app, running

NAME = "tiny-base"
SAMPLING = Sampling(temperature=1.0, eos_id=2)
SLOTS, CAPACITY, STEPS = 2, 64, 4
PROMPT = [5, 6, 7, 8]
CONFIG = lora.LoRA(rank=2, alpha=4, targets=("q_proj", "v_proj"))


def trained(model, base, key: int):
    """The base with an adapter whose B is drawn too: an adapter that changes what is sampled."""
    adapted, variables = lora.attach(model, base, CONFIG, key=jax.random.key(key))
    layers = dict(variables["params"]["layers"])
    for index, target in enumerate(CONFIG.targets):
        b = layers[target]["lora_b"]
        drawn = jax.random.normal(jax.random.fold_in(jax.random.key(key), 100 + index), b.shape, b.dtype)
        layers[target] = {**layers[target], "lora_b": 8.0 * drawn}
    return adapted, {**variables, "params": {**variables["params"], "layers": layers}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The base directory and three adapter directories, a, b and c."""
    root = tmp_path_factory.mktemp("serve-lora")
    model = tiny_model(vocab_size=512, emb_features=128, mlp_features=512, max_seq_len=CAPACITY)
    base = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    Pretrained.from_model(model).save(base, root / NAME, dtype=None)
    adapters = {}
    for key, name in enumerate("abc", start=1):
        adapted, variables = trained(model, base, key)
        adapters[name] = save_adapter(root / f"adapter-{name}", adapted, variables,
                                      base_model_name_or_path=str(root / NAME))
    return root / NAME, adapters


def probe(base_directory, adapter_directory, prompt, budget: int, seed: int) -> list[int]:
    """What an in-process Server draws from the base (adapter None) or base plus adapter."""
    pretrained, variables = load_pretrained(base_directory, tokenizer=False)
    model = pretrained.model
    if adapter_directory is not None:
        model, variables = load_adapter(adapter_directory, model, variables)
    server = Server.from_task(ServeTask(model=model, variables=variables, sampling=SAMPLING), slots=1,
                              capacity=CAPACITY, steps=STEPS)
    server.add(0, prompt, budget, seed=seed)
    draws = {}
    while server.busy:
        draws.update(server.step())
    return draws[0].ids.tolist()


@pytest.fixture(scope="module")
def served(checkpoint):
    """`dew serve` in process: the base and adapters a and b, development routes on."""
    base_directory, adapters = checkpoint
    base = ServedPolicy.load(base_directory, slots=SLOTS, capacity=CAPACITY, sampling=SAMPLING, steps=STEPS,
                             served_model_name=NAME)
    base.warm_up()
    models = ServedModels(base)
    try:
        models.add("a", adapters["a"])
        models.add("b", adapters["b"])
        with running(create_app(models, dev_endpoints=True)) as url:
            yield models, url
    finally:
        models.close()


def completion(url: str, model: str, prompt=PROMPT, budget: int = 10, seed: int = 3) -> dict:
    answer = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": budget,
                                                         "seed": seed, "return_token_ids": True, "logprobs": 0,
                                                         "return_tokens_as_token_ids": True},
                        timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == model
    return answer.json()["choices"][0]


def ids(url: str, model: str, **request) -> list[int]:
    return completion(url, model, **request)["token_ids"]


def test_each_model_name_draws_from_its_adapter_and_the_base_name_from_the_base(served, checkpoint):
    models, url = served
    base_directory, adapters = checkpoint
    drawn = {name: ids(url, name) for name in (NAME, "a", "b")}
    assert drawn[NAME] == probe(base_directory, None, PROMPT, 10, 3)
    assert drawn["a"] == probe(base_directory, adapters["a"], PROMPT, 10, 3)
    assert drawn["b"] == probe(base_directory, adapters["b"], PROMPT, 10, 3)
    likelihoods = {tuple(completion(url, name)["logprobs"]["token_logprobs"]) for name in (NAME, "a", "b")}
    assert len(likelihoods) == 3, "each adapter changes the model"
    listed = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(m["id"], m["object"], m["parent"], m["root"]) for m in listed] == [
        (NAME, "model", None, str(base_directory)),
        ("a", "model", NAME, str(adapters["a"])), ("b", "model", NAME, str(adapters["b"]))]
    missing = httpx.post(f"{url}/v1/completions", json={"model": "z", "prompt": PROMPT, "max_tokens": 2})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    assert f"`{NAME}`, `a`, `b`" in missing.json()["error"]["message"]


def test_adapters_share_the_base_arrays_and_its_compiled_programs(served, checkpoint):
    models, url = served
    base_directory, adapters = checkpoint
    base_layers = models.base.native.server.variables["params"]["layers"]
    for name in ("a", "b"):
        layers = models.adapters[name].native.server.variables["params"]["layers"]
        assert layers["q_proj"]["kernel"] is base_layers["q_proj"]["kernel"]  # the same array, not a copy
        assert layers["up_proj"]["kernel"] is base_layers["up_proj"]["kernel"]
        assert layers["q_proj"]["lora_a"].shape == (2, 128, 2)
    ids(url, "a")  # every program a draw of this shape needs exists now
    compiled = dict(models.adapters["a"].native.server.compilations)
    traces = sum(engine.TRACES.values())
    assert models.adapters["b"].native.server.compilations == compiled  # one set of programs for both

    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])},
                        timeout=120)
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'c' added successfully.")
    assert ids(url, "c") == probe(base_directory, adapters["c"], PROMPT, 10, 3)
    assert models.adapters["c"].native.server.compilations == compiled
    assert sum(engine.TRACES.values()) == traces, "a third adapter, loaded at runtime, compiled nothing"
    assert "c" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]

    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
    gone = httpx.post(f"{url}/v1/completions", json={"model": "c", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and "`c`" in gone.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [NAME, "a", "b"]


def test_runtime_lora_route_refusals_have_vllm_shapes(served, checkpoint, tmp_path):
    _, url = served
    _, adapters = checkpoint

    def post(route, body):
        answer = httpx.post(f"{url}{route}", json=body, timeout=60)
        return answer.status_code, answer.json()["error"]["type"], answer.json()["error"]["message"]

    assert post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])}) == (
        400, "InvalidUserInput", "The lora adapter 'a' has already been loaded.")
    assert post("/v1/load_lora_adapter", {"lora_name": "", "lora_path": str(adapters["a"])}) == (
        400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided.")
    status, kind, message = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert (status, kind) == (404, "NotFoundError") and "No adapter found" in message
    assert post("/v1/unload_lora_adapter", {"lora_name": "x"}) == (
        404, "NotFoundError", "The lora adapter 'x' cannot be found.")
    assert post("/v1/unload_lora_adapter", {"lora_name": ""}) == (
        400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter.")
    status, _, message = post("/collective_rpc", {"method": "reload_weights"})
    assert status == 400 and "unload them first" in message  # the adapters share the base's arrays


def test_adapter_pushes_serve_the_latest_version_and_retire_the_older_ones(checkpoint, tmp_path):
    """A GRPO-like sequence of versions 0..3 pushed with AdapterReload: draws name the adapter of
    their version, the one before stays loaded, older ones are unloaded and their files removed."""
    base_directory, _ = checkpoint
    pretrained, base = load_pretrained(base_directory, tokenizer=False)
    adapted, _ = trained(pretrained.model, base, 7)
    policy = Pretrained.from_model(adapted)
    served_policy = ServedPolicy.load(base_directory, slots=SLOTS, capacity=CAPACITY, sampling=SAMPLING,
                                      steps=STEPS, served_model_name=NAME)
    models = ServedModels(served_policy)
    try:
        with running(create_app(models, dev_endpoints=True)) as url:
            push = AdapterReload(policy, base_directory, (url,), prefix="grpo")
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
            with OpenAIRolloutServer(OpenAICompletion(NAME, client), SAMPLING, Publication(push, version=0),
                                     adapter=push.name) as remote:
                versions = {}
                for version in range(4):
                    versions[version] = trained(pretrained.model, base, 10 + version)[1]
                    remote.load(versions[version], version)
                    assert sorted(models.adapters) == [f"grpo-v{v}" for v in range(max(version - 1, 0), version + 1)]
                    assert sorted(p.name for p in (base_directory / "adapters").iterdir()) == sorted(models.adapters)
                draw = remote.submit(PROMPT, 10, seed=3).result(timeout=60)
                assert draw.version == 3
                assert draw.ids.tolist() == probe(base_directory, push.path(3), PROMPT, 10, 3)
                # A draw in flight while version 4 replaces 3 finishes on 3: the engine holds it
                # (paused), the push loads v4 and retires v2, and the draw then runs on v3.
                assert httpx.post(f"{url}/pause", params={"mode": "wait"}).status_code == 200
                pending = remote.submit(PROMPT, 10, seed=5)
                time.sleep(0.2)
                assert not pending.done()
                remote.load(trained(pretrained.model, base, 14)[1], 4)
                assert sorted(models.adapters) == ["grpo-v3", "grpo-v4"]
                assert httpx.post(f"{url}/resume").status_code == 200
                held = pending.result(timeout=60)
                assert held.version == 3 and held.ids.tolist() == probe(base_directory, push.path(3), PROMPT, 10, 5)
                after = remote.submit(PROMPT, 10, seed=5).result(timeout=60)
                assert after.version == 4 and after.ids.tolist() == probe(base_directory, push.path(4), PROMPT, 10, 5)
            full = tmp_path / "full"
            policy.save(versions[3], full, dtype=jnp.bfloat16)  # what SafetensorsReload would write
            ratio = push.written[-1] / directory_bytes(full)
            print(f"adapter push: {push.written[-1]} bytes, full push: {directory_bytes(full)} bytes, "
                  f"ratio {ratio:.4f}")
            assert len(push.written) == 5 and ratio < 0.02
            # the versions before 2 are gone from the engine: asking for one is a 404
            gone = httpx.post(f"{url}/v1/completions", json={"model": "grpo-v1", "prompt": PROMPT, "max_tokens": 2})
            assert gone.status_code == 404
    finally:
        models.close()


def test_dew_serve_command_serves_lora_flags(checkpoint):
    base_directory, adapters = checkpoint
    arguments = [str(base_directory), "--port", "0", "--slots", "2", "--capacity", str(CAPACITY), "--steps",
                 str(STEPS), "--served-model-name", NAME, *(f for n in "ab" for f in ("--lora", f"{n}={adapters[n]}"))]
    with launched_serve(arguments) as (process, started, seen):
        assert "adapters a, b" in started, started
        url = started.split(" on ")[1].split()[0]
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]] == [NAME, "a", "b"]
        drawn = ids(url, "b")  # served with the checkpoint's EOS ids: the probe's draw, up to its stop
        assert drawn == probe(base_directory, adapters["b"], PROMPT, 10, 3)[:len(drawn)]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, "".join(seen)


def test_lora_flags_need_a_name_and_a_path():
    from dew_lib.serve.adapters import parse_lora_modules

    assert parse_lora_modules(["a=/x", "b = /y"]) == {"a": "/x", "b": "/y"}
    for bad in (["a"], ["=/x"], ["a="], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora"):
            parse_lora_modules(bad)


# ---- adapter pushes against the engines' stand-ins --------------------------------------------

@contextlib.contextmanager
def lora_engines(router, count: int = 2):
    """`count` stand-in replicas (a, b, ...) serving the LoRA routes of `router`: (journal, replicas, urls)."""
    from standin_completions import app, serve
    from standin_lora import LoRAReplica
    from standin_weights import Journal

    journal = Journal()
    with contextlib.ExitStack() as stack:
        replicas = [LoRAReplica(name, journal) for name in "abcd"[:count]]
        yield journal, replicas, [stack.enter_context(serve(app(router(replica)))) for replica in replicas]


@pytest.fixture(scope="module")
def lora_policy(checkpoint):
    """The adapted model's Pretrained and trained variables for versions 0..3."""
    pretrained, base = load_pretrained(checkpoint[0], tokenizer=False)
    adapted, _ = trained(pretrained.model, base, 7)
    return Pretrained.from_model(adapted), [trained(pretrained.model, base, 20 + v)[1] for v in range(4)]


@pytest.mark.parametrize("provider", ["vllm", "sglang"])
def test_adapter_push_speaks_each_engines_lora_routes(provider, checkpoint, lora_policy, tmp_path):
    from standin_lora import sglang_lora_router, vllm_lora_router

    policy, versions = lora_policy
    router = vllm_lora_router if provider == "vllm" else sglang_lora_router
    load, unload = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") if provider == "vllm" else (
        "/load_lora_adapter", "/unload_lora_adapter")
    with lora_engines(router) as (journal, (a, b), urls):
        push = AdapterReload(policy, tmp_path, urls, engine=provider, timeout=10)
        publication = Publication(push, version=0)
        for version in range(3):
            publication.load(versions[version], version)
        assert a.adapters == b.adapters == {f"dew-lora-v{v}": str(push.path(v)) for v in (1, 2)}
        assert journal.endpoints("a") == [f"POST {load}"] * 3 + [f"POST {unload}"]
        assert [call.body for call in journal.of("a")][2:] == [
            {"lora_name": "dew-lora-v2", "lora_path": str(push.path(2))}, {"lora_name": "dew-lora-v0"}]
        assert not push.path(0).exists() and push.path(1).exists()
        assert json.loads((push.path(2) / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
            tmp_path)

        b.fail(load, "status", status=500)  # b cannot load version 3: the push fails as a whole
        with pytest.raises(PushFailed, match=f"POST {load}"):
            publication.load(versions[3], 3)
        assert publication.version == 2 and push.name(2) == "dew-lora-v2" and push.loaded == [1, 2]
        assert "dew-lora-v3" not in a.adapters and not push.path(3).exists()  # a dropped it again

        publication.load(versions[3], 3)  # the next push succeeds and retires version 1
        assert a.adapters == b.adapters == {f"dew-lora-v{v}": str(push.path(v)) for v in (2, 3)}


def test_completion_requests_name_the_adapter_each_engines_way():
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused")
    vllm = OpenAICompletion("base", client, "vllm").request([1, 2], max_tokens=4, sampling=SAMPLING, seed=1,
                                                          adapter="dew-lora-v3")
    sglang = OpenAICompletion("base", client, "sglang").request([1, 2], max_tokens=4, sampling=SAMPLING, seed=1,
                                                              adapter="dew-lora-v3")
    assert vllm["model"] == "dew-lora-v3" and "lora_path" not in vllm
    assert (sglang["model"], sglang["lora_path"]) == ("base", "dew-lora-v3")
    assert "lora_path" not in OpenAICompletion("base", client, "sglang").request([1], max_tokens=1,
                                                                                 sampling=SAMPLING, seed=1)


def test_remote_server_pushes_adapters_alone_for_an_adapted_model(checkpoint, lora_policy):
    from dew_lib.inference import SafetensorsReload
    from dew_lib.recipes.remote import RemoteEngine, pushes

    policy, _ = lora_policy
    engine = RemoteEngine(url="http://127.0.0.1:9", directory=str(checkpoint[0]))
    assert isinstance(pushes(engine, policy), AdapterReload)
    assert isinstance(pushes(engine, load_pretrained(checkpoint[0], tokenizer=False).pretrained), SafetensorsReload)
    with pytest.raises(ValueError, match="adapted model's Pretrained"):
        AdapterReload(load_pretrained(checkpoint[0], tokenizer=False).pretrained, checkpoint[0], ["http://127.0.0.1:9"])

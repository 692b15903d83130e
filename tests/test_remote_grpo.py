"""Asynchronous GRPO against a remote engine, end to end over real HTTP on 127.0.0.1.

`dew serve` stands in for vLLM: the RolloutScheduler draws through `OpenAIRolloutServer`
(vLLM's completions wire format with token-id prompts), and pushes each update's weights with
`SafetensorsReload` behind a `Publication` (the policy rewritten in bf16 into the directory the
engine was launched on, then vLLM's pause, collective_rpc reload_weights, reset_prefix_cache,
update_weight_version and resume). The engine ends up serving exactly what was pushed last, and
every draw is labelled with the version served when it was submitted.
"""

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import SHARED_DATA, tiny_model

from dew_lib import Dataset, Trainer
from dew_lib.models.pretrained import Pretrained, load_pretrained
from dew_lib.objectives import GRPOObjective
from dew_lib.recipes import RemoteEngine, remote_server
from dew_lib.rollouts import PromptSource, RolloutScheduler, prompt_tasks
from dew_lib.sampling import Sampling
from dew_lib.serve import ServedPolicy, create_app, running

TOKENIZER = os.path.join(SHARED_DATA, "tokenizers", "minimind")
PROMPT, NEW = 6, 6
WIDTH = PROMPT + NEW
SAMPLING = Sampling(temperature=1.0, eos_id=2)


def reward(data_source, completion, ground_truth, extra_info):
    """The share of even ids in the completion (token-id text): every group has a spread."""
    ids = [int(word) for word in completion.split()]
    return sum(i % 2 == 0 for i in ids) / max(len(ids), 1)


def prompts():
    rng = np.random.default_rng(0)
    for i in itertools.count():
        yield {"task_id": np.array([2 * i, 2 * i + 1]), "prompt": rng.integers(10, 6000, (2, PROMPT)).astype(np.int32),
               "prompt_length": np.full(2, PROMPT, np.int32)}


def bf16(tree):
    return jax.tree.map(lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float32), tree)


def differs(a, b) -> bool:
    return any(jax.tree.leaves(jax.tree.map(lambda x, y: not np.array_equal(x, y), a, b)))


def record_pushes(server) -> list:
    """Wrap `server.load` to keep a host copy of every tree the scheduler pushes, by version."""
    pushed, load = [], server.load

    def recorded(variables, version):
        pushed.append((version, jax.tree.map(np.array, jax.device_get(variables))))
        load(variables, version)

    server.load = recorded
    return pushed


@pytest.mark.slow
def test_async_grpo_trains_against_dew_serve_with_every_update_pushed(tmp_path):
    if not os.path.isdir(TOKENIZER):
        pytest.skip(f"no MiniMind tokenizer at {TOKENIZER}; set DEW_SHARED_DATA")
    from transformers import AutoTokenizer

    model = tiny_model(vocab_size=6400, emb_features=32, max_seq_len=32, tie_embeddings=True)
    objective = GRPOObjective(model, seq_len=WIDTH - 1, behavior_importance=2.0)
    pretrained = Pretrained.from_model(model, tokenizer=AutoTokenizer.from_pretrained(TOKENIZER))
    launch = tmp_path / "launch"
    # The engine starts on other weights: the stage's first push must replace them.
    pretrained.save(jax.jit(model.init)(jax.random.key(9), jnp.zeros((1, 8), jnp.int32)), launch, dtype=jnp.bfloat16)
    policy = ServedPolicy.load(launch, slots=8, capacity=32, sampling=SAMPLING, steps=4, served_model_name="policy")
    records, settled = [], []
    try:
        with running(create_app(policy, dev_endpoints=True)) as url:
            server = remote_server(RemoteEngine(url=url, directory=str(launch)), pretrained)(SAMPLING)
            pushed = record_pushes(server)
            with server, PromptSource(server, reward, max_new_tokens=NEW, workers=8) as source:
                scheduler = RolloutScheduler(objective, source, server, width=WIDTH, rows=8, groups=4,
                                             tasks=prompt_tasks, truncation="score", log=records.append,
                                             session_log=settled.append)
                trainer = Trainer(objective, optax.adam(3e-2), key=jax.random.key(1), rollout=scheduler)
                start = bf16(trainer.initial_state().params)
                trainer.fit(scheduler.tasks(Dataset(train=lambda part: prompts(), batch=2)), steps=3, log_every=1,
                            sinks=[])
                scheduler.close()
                assert server.version == 2 and policy.weight_version == "2"  # pushed before each call
    finally:
        policy.close()

    assert [r.updates for r in records] == [0, 1, 2] and all(0 <= r.lag <= 1 for r in records)
    admitted = [(log.update, s) for log in settled for s, cause in zip(log.sessions, log.causes, strict=True)
                if cause == "admitted"]
    assert len(admitted) == 3 * 8 and all(s.status.value in ("completed", "truncated") for _, s in admitted)
    versions = {(update, call.version) for update, s in admitted for call in s.calls}
    assert all(update - 1 <= version <= update for update, version in versions), versions
    assert any(version >= 1 for _, version in versions)  # drawn from pushed weights
    assert all(call.raw_log_probs is None for _, s in admitted for call in s.calls)  # remote: behavior only
    # What the engine re-read last is exactly the policy of the last push, in bf16.
    assert [version for version, _ in pushed] == [0, 1, 2]  # the first before anything is drawn
    assert not differs(bf16(pushed[0][1]), start)
    _, served = load_pretrained(launch)
    served = jax.tree.map(lambda a: np.asarray(a, np.float32), served)
    assert differs(served, start) and not differs(served, bf16(pushed[-1][1]))


@pytest.mark.slow
def test_the_pipelines_grpo_stage_draws_on_a_remote_engine(prefect_harness, tmp_path):
    """`grpo.rollout.server` set to a `dew serve` URL: the stage pushes every update to the engine
    and records the sessions it drew there, each call with its version."""
    import shutil

    from test_pipeline import TINY

    from dew_lib.store import Store
    from flows.pipeline import pipeline
    from tasks.params import PipelineParams

    def run(name, **grpo):
        return pipeline(PipelineParams(root=str(tmp_path), name=name, **{
            **TINY, "stages": ("grpo",), "grpo": {**TINY["grpo"], "steps": 1, **grpo}}))

    run("first")  # writes the fresh policy the stage starts from: the engine's launch weights
    launch = tmp_path / "engine"
    shutil.copytree(tmp_path / "first" / "init", launch)
    policy = ServedPolicy.load(launch, slots=8, sampling=Sampling(temperature=1.0), steps=4)
    try:
        with running(create_app(policy, dev_endpoints=True)) as url:
            result = run("remote", steps=3, mode="async", slots=8,
                         rollout={"server": url, "directory": str(launch)})
            assert policy.weight_version == "2"  # pushed before each of the three updates
    finally:
        policy.close()
    _, drawn = Store(str(tmp_path)).rows(
        "SELECT s.update, list(DISTINCT c.version ORDER BY c.version) FROM sessions s JOIN calls c USING "
        "(session_uid) WHERE s.run = ? AND s.cause = 'admitted' GROUP BY s.update ORDER BY s.update",
        [result["run"]])
    assert [update for update, _ in drawn] == [0, 1, 2]
    assert all(set(versions) <= {update - 1, update} for update, versions in drawn), drawn
    assert result["reused"]["grpo"] is False and 0 <= result["accuracy"]["grpo"] <= 1


@pytest.mark.slow
def test_the_tool_tasks_episodes_draw_every_turn_on_a_remote_engine(prefect_harness, tmp_path):
    """The tool task's asynchronous GRPO with `grpo.rollout.server`: each episode's turns are
    completions `dew serve` draws (the calculator's replies in between), and every update's
    weights reach the engine before the next batch is drawn."""
    import shutil

    from test_tool_pipeline import TINY as TOOLS

    from dew_lib.store import Store
    from flows.pipeline import pipeline
    from tasks.params import PipelineParams

    def run(name, **grpo):
        return pipeline(PipelineParams(root=str(tmp_path), name=name, **{
            **TOOLS, "stages": ("grpo",), "grpo": {**TOOLS["grpo"], "steps": 1, **grpo}}))

    run("first")
    launch = tmp_path / "engine"
    shutil.copytree(tmp_path / "first" / "init", launch)
    policy = ServedPolicy.load(launch, slots=8, sampling=Sampling(temperature=1.0), steps=4)
    try:
        with running(create_app(policy, dev_endpoints=True)) as url:
            result = run("remote", steps=2, mode="async", rollout={"server": url, "directory": str(launch)})
            assert policy.weight_version == "1"  # pushed before each of the two updates
    finally:
        policy.close()
    _, drawn = Store(str(tmp_path)).rows(
        "SELECT s.update, count(DISTINCT s.session_uid), list(DISTINCT c.version ORDER BY c.version) "
        "FROM sessions s JOIN calls c USING (session_uid) WHERE s.run = ? AND s.cause = 'admitted' "
        "GROUP BY s.update ORDER BY s.update", [result["run"]])
    assert [update for update, *_ in drawn] == [0, 1]
    assert all(sessions == 2 * 4 for _, sessions, _ in drawn), drawn  # batch 2 x groups 4
    assert all(set(versions) <= {update - 1, update} for update, _, versions in drawn), drawn
    assert result["reused"]["grpo"] is False

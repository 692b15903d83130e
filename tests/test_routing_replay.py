"""Mixture-of-experts policies in the losses: routing replay (verl's R3) and the router's terms.

The constructed case: the router's columns for experts 1 and 2 are equal, so every token ties
between them. The trainer breaks the tie towards expert 1 (the lower index, as torch.topk does);
an engine that broke it the other way drew with expert 2. Replaying the engine's routes scores
the sampled tokens exactly as the engine did; routing freely does not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_model

from dew_lib import Dataset, Trainer
from dew_lib.objectives import GRPOObjective, LMObjective
from dew_lib.objectives.ppo import PPOObjective, ValueHead
from dew_lib.records.sessions import Call, Session
from dew_lib.rollouts import pack
from dew_lib.train.sinks import MemorySink

LAYERS, EXPERTS, TOP_K, WIDTH = 2, 4, 2, 16


def moe_model(**overrides):
    options = dict(num_layers=LAYERS, experts=EXPERTS, experts_per_token=TOP_K, expert_features=16,
                   router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    return tiny_model(**{**options, **overrides})


@pytest.fixture(scope="module")
def tied():
    """An MoE model whose router ties experts 1 and 2 on every token: its columns are
    `[2u, u, u, -u]`, so each token's top two are 0 and a tie of 1 and 2 (or 3 and the tie)."""
    model = moe_model()
    variables = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    u = jax.random.normal(jax.random.key(1), (LAYERS, 16, 1))
    router = jnp.concatenate([2 * u, u, u, -u], axis=-1)
    params = dict(variables["params"])
    # experts of weight ~0.5 rather than the init's 0.02, so which one a token uses shows in its logits
    experts = {name: 25 * w for name, w in params["layers"]["experts"].items()}
    params["layers"] = {**params["layers"], "router": {"kernel": router}, "experts": experts}
    return model, {"params": params}


def free_routes(model, variables, ids):
    _, routing = model.apply(variables, ids, method=model.hidden, return_routing=True)
    return np.asarray(routing.experts)


def engine_routes(free):
    """What an engine that broke the 1-2 tie the other way chose: 2 wherever the trainer took 1."""
    return np.where(free == 1, 2, free)


def session_batch(model, variables, seed=0):
    """Two one-call sessions drawn by the 'engine' (the tie broken towards expert 2), packed
    into rows of WIDTH ids: the engine's routes and its log-probs of the sampled ids."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 32, size=5), rng.integers(3, 32, size=4)]
    sampled = [rng.integers(3, 32, size=6), rng.integers(3, 32, size=7)]
    sessions = []
    for index, (prompt, drawn) in enumerate(zip(prompts, sampled, strict=True)):
        ids = jnp.asarray(np.concatenate([prompt, drawn]))[None]
        routes = engine_routes(free_routes(model, variables, ids))
        log_probs = engine_log_probs(model, variables, ids, routes)[0, prompt.size - 1:]
        call = Call(prompt_ids=prompt, sampled_ids=drawn, behavior_log_probs=np.asarray(log_probs),
                    routed_experts=routes[0])
        sessions.append(Session(task="t", sample=index, calls=(call,), reward=float(index)))
    return pack(sessions, width=WIDTH, rows=2)


def engine_log_probs(model, variables, ids, routes):
    """log p(ids[1:]) as the engine computed them, with its own routes."""
    from dew_lib.objectives.lm import score_targets

    routed = jnp.ones(ids.shape, bool)[:, :-1]
    log_probs, _ = score_targets(model, variables, ids[:, :-1], ids[:, 1:],
                                 routes=(jnp.asarray(routes)[:, :-1], routed))
    return np.asarray(log_probs)


def test_the_tie_breaks_towards_the_lower_expert(tied):
    model, variables = tied
    free = free_routes(model, variables, jnp.arange(3, 13)[None])
    assert set(np.unique(free)) <= {0, 1, 3} and (free == 1).any()


def test_replayed_log_probs_equal_the_engine_s_and_free_routing_does_not(tied):
    model, variables = tied
    batch = session_batch(model, variables)
    mask = batch["response_mask"][:, 1:] > 0
    behavior = batch["behavior_log_probs"][:, 1:]
    replay = GRPOObjective(model, WIDTH - 1, routing_replay="rollout")
    free = GRPOObjective(model, WIDTH - 1)
    replay.check_batch(batch)
    replayed = np.asarray(replay.target_log_probs(variables, batch))
    routed = np.asarray(free.target_log_probs(variables, batch))
    np.testing.assert_allclose(replayed[mask], behavior[mask], atol=1e-6)
    assert np.abs(routed[mask] - behavior[mask]).max() > 1e-3
    # the experts the replayed forward used are exactly the packed ones, where they were recorded
    _, routing = replay.target_log_probs(variables, batch, return_routing=True)
    recorded = batch["routed"][:, :-1]
    np.testing.assert_array_equal(np.asarray(routing.experts)[recorded], batch["routed_experts"][:, :-1][recorded])


def test_replay_keeps_the_router_learning_and_adds_its_terms_to_the_loss(tied):
    model, variables = tied
    batch = session_batch(model, variables)
    objective = GRPOObjective(model, WIDTH - 1, routing_replay="rollout")

    def loss(params):
        terms = objective.terms(params, batch, step=jnp.zeros((), jnp.int32), reference=None, key=None)
        return terms.total / terms.weight, terms.metrics

    grads, metrics = jax.grad(loss, has_aux=True)(variables)
    assert float(jnp.abs(grads["params"]["layers"]["router"]["kernel"]).max()) > 0
    for name in ("router/aux_loss", "router/z_loss", "router/load_max"):
        value, count = metrics[name]
        assert np.isfinite(float(value)) and float(count) == 1.0
    pg, normalizer = metrics["pg_loss"]
    total, _ = metrics["loss"]
    aux, z = metrics["router/aux_loss"][0], metrics["router/z_loss"][0]
    np.testing.assert_allclose(float(total / normalizer), float(pg / normalizer + 0.01 * aux + 0.001 * z),
                               atol=1e-8)


def test_tokens_without_a_record_route_freely(tied):
    model, variables = tied
    batch = session_batch(model, variables)
    unrecorded = {**batch, "routed": np.zeros_like(batch["routed"])}
    replay = GRPOObjective(model, WIDTH - 1, routing_replay="rollout")
    free = GRPOObjective(model, WIDTH - 1)
    np.testing.assert_array_equal(np.asarray(replay.target_log_probs(variables, unrecorded)),
                                  np.asarray(free.target_log_probs(variables, batch)))


def test_replay_is_refused_on_a_dense_model_without_routes_and_with_another_model_s_routes(tied):
    model, variables = tied
    with pytest.raises(ValueError, match="this model has none"):
        GRPOObjective(tiny_model(), WIDTH - 1, routing_replay="rollout")
    with pytest.raises(ValueError, match="routing_replay"):
        GRPOObjective(model, WIDTH - 1, routing_replay="old-policy")
    batch = session_batch(model, variables)
    replay = GRPOObjective(model, WIDTH - 1, routing_replay="rollout")
    without = {k: v for k, v in batch.items() if k not in ("routed_experts", "routed")}
    with pytest.raises(KeyError, match="--enable-return-routed-experts"):
        replay.check_batch(without)
    other = {**batch, "routed_experts": batch["routed_experts"][..., :1]}
    with pytest.raises(ValueError, match="experts_per_token=2"):
        replay.check_batch(other)


def test_ppo_replays_for_its_policy(tied):
    model, variables = tied
    ppo = PPOObjective(model, WIDTH - 1, critic=ValueHead(tiny_model()), routing_replay="rollout")
    assert ppo.actor.routing_replay == "rollout"


def test_sft_on_an_moe_model_trains_with_the_router_terms():
    model = moe_model()
    rows = np.random.default_rng(0).integers(1, 32, size=(4, 9)).astype(np.int32)
    sink = MemorySink()
    trainer = Trainer(LMObjective(model, seq_len=8, ema_decay=None), optax.adam(1e-2), key=jax.random.key(0))
    trainer.fit(Dataset(train=lambda p: iter([{"text": rows}] * 6), batch=4), steps=6, log_every=3, sinks=[sink])
    losses = [value for _, value in sink.series("loss")]
    assert losses[-1] < losses[0]
    assert all(np.isfinite(v) for _, v in sink.series("router/aux_loss"))


def test_the_pipeline_refuses_replay_on_a_model_without_experts():
    from tasks.params import ModelParams, PipelineParams

    moe = {"experts": 4, "experts_per_token": 2}
    with pytest.raises(ValueError, match="the embedded decoder has none"):
        PipelineParams(grpo={"routing_replay": "rollout"})
    tools = {"data": {"source": "tools"}, "stages": ["grpo"]}
    for mode, where in (("sync", {}), ("async", {}), ("sync", {"rl": "ppo"}), ("sync", tools), ("async", tools)):
        # generate, lock-step episodes and the native server all record the routes
        params = PipelineParams(model=moe, grpo={"routing_replay": "rollout", "mode": mode}, **where)
        assert params.grpo.routing_replay == "rollout"
    with pytest.raises(ValueError, match="experts_per_token=3 exceeds experts=2"):
        ModelParams(experts=2, experts_per_token=3)


def test_a_model_without_experts_keeps_the_initial_policy_s_key():
    from tasks.manifests import fingerprint, keyed
    from tasks.params import ModelParams

    before = {"pretrained": None, "emb_features": 128, "num_layers": 4, "num_heads": 4, "mlp_features": 384,
              "max_seq_len": 128}  # the fields ModelParams had before experts
    assert fingerprint("init", keyed(ModelParams())) == fingerprint("init", before)
    assert fingerprint("init", keyed(ModelParams(experts=4))) != fingerprint("init", before)


def test_a_remote_engine_reads_routes_of_the_policy_s_shape():
    from dew_lib.recipes.remote import RemoteEngine, routing_shape

    engine = RemoteEngine(url="http://127.0.0.1:8000", directory="/tmp/launch", routing=True)
    assert routing_shape(engine, moe_model()) == (LAYERS, TOP_K)
    assert routing_shape(RemoteEngine(url="http://127.0.0.1:8000", directory="/tmp/launch"), moe_model()) is None
    with pytest.raises(ValueError, match="experts=0"):
        routing_shape(engine, tiny_model())

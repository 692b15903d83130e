"""Dew's own samplers record routes: the native server and `generate` report, for every prompt and
sampled id of a mixture-of-experts policy, the experts each layer chose, exactly as a forward
pass over the whole sequence routes them, so routing replay can train on them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_model

from dew_lib.inference import Server, ServeTask
from dew_lib.sampling import Sampling, generate

LAYERS, TOP_K = 2, 2
MODEL = tiny_model(num_layers=LAYERS, experts=4, experts_per_token=TOP_K, expert_features=16, max_seq_len=48)
# Three layers, the middle one dense: routes hold the two sparse layers only, as the engines report.
MIXED = tiny_model(num_layers=3, dense_layers=(1,), experts=4, experts_per_token=TOP_K, expert_features=16,
                   max_seq_len=48)
POLICIES = {"sparse": MODEL, "mixed": MIXED}
SAMPLING = Sampling(temperature=0.9, eos_id=3)
PROMPTS = [np.array(p, np.int32) for p in ([5, 6, 7, 8, 9, 10], [11], [12, 13, 14], list(range(4, 22)))]


@functools.cache
def weights(model):
    """`model`'s weights, made once, on first use, not at import: every xdist worker imports every
    module, and compiles at import would run with all of XLA's optimizations (conftest.py turns
    them off per module)."""
    return jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))


def forward_routes(ids, model=MODEL):
    """The experts a whole-sequence forward routes `ids` to, `[len(ids), sparse layers, k]`: the
    first rows of a forward over `ids` padded to the model's max_seq_len. Attention is causal, so
    nothing after an id changes its route, and every length is one compiled shape."""
    padded = np.zeros((1, model.max_seq_len), np.int32)
    padded[0, :len(ids)] = ids
    return np.asarray(_routed(model, weights(model), padded))[:len(ids)]


@functools.partial(jax.jit, static_argnums=0)
def _routed(model, variables, ids):
    _, routing = model.apply(variables, ids, method=model.hidden, return_routing=True)
    return routing.experts[0]


def check(routes, prompt, ids, model=MODEL):
    """`routes` covers the prompt and every sampled id; the last sampled id, never fed, has zeros."""
    sequence = np.concatenate([prompt, ids])
    assert routes.shape == (sequence.size, LAYERS, TOP_K) and routes.dtype == np.int32
    np.testing.assert_array_equal(routes[:-1], forward_routes(sequence[:-1], model))
    assert not routes[-1].any()


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_the_server_reports_each_draw_s_routes_as_a_forward_pass_routes_them(kind):
    model = POLICIES[kind]
    server = Server.from_task(ServeTask(model=model, variables=weights(model), sampling=SAMPLING),
                              slots=2, capacity=40, steps=3, routing=True)
    waiting, draws = list(range(len(PROMPTS))), {}
    while waiting or server.busy:  # the later requests take the slots the first ones free
        while waiting and server.free:
            name = waiting.pop(0)
            server.add(name, PROMPTS[name], 10, seed=name)
        draws.update(server.step())
    assert sorted(draws) == [0, 1, 2, 3]
    for name, prompt in enumerate(PROMPTS):
        check(draws[name].routed_experts, prompt, draws[name].ids, model)


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_generate_reports_the_routes_of_each_left_padded_row(kind):
    model = POLICIES[kind]
    width = 18
    prompt = np.zeros((len(PROMPTS), width), np.int32)
    for row, ids in enumerate(PROMPTS):
        prompt[row, width - ids.size:] = ids
    drawn = generate(model, weights(model), prompt, [p.size for p in PROMPTS], key=jax.random.key(1),
                     max_new_tokens=8, sampling=SAMPLING, return_routes=True)
    assert drawn.routes.shape == (len(PROMPTS), width + 8, LAYERS, TOP_K)
    for row, ids in enumerate(PROMPTS):
        count = int(drawn.lengths[row])
        check(np.asarray(drawn.routes[row, :ids.size + count]), ids, np.asarray(drawn.tokens[row, :count]), model)
        assert not np.asarray(drawn.routes[row, ids.size + count:]).any()


def test_routes_of_a_dense_model_are_refused():
    dense = tiny_model()
    variables = weights(dense)
    with pytest.raises(ValueError, match="experts=0"):
        Server(dense, variables, sampling=SAMPLING, slots=1, capacity=16, routing=True)
    with pytest.raises(ValueError, match="experts=0"):
        generate(dense, variables, np.ones((1, 4), np.int32), [4], key=jax.random.key(0), max_new_tokens=2,
                 return_routes=True)
    server = Server(MODEL, weights(MODEL), sampling=SAMPLING, slots=1, capacity=16)
    server.add("a", PROMPTS[0], 2)
    draws = {}
    while server.busy:
        draws.update(server.step())
    assert draws["a"].routed_experts is None  # a server records routes only when asked


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_grpo_replays_the_routes_its_own_rollouts_recorded(mode):
    """Through the recipe the pipeline uses: `generate` (sync) or the native server (async) records
    the routes, and the objective refuses a batch without them, so a finished fit replayed them."""
    import json

    import optax

    from dew_lib import Trainer
    from dew_lib.data import Loading, Prompts
    from dew_lib.recipes import GRPOOptions, build_grpo
    from dew_lib.train.sinks import MemorySink

    records = tuple(json.dumps({"prompt": [3, 4, 5 + n], "ground_truth": "1"}) for n in range(4))
    data = Prompts(records=records, max_prompt_len=4, loading=Loading(seed=None))
    options = GRPOOptions(steps=2, batch=2, groups=2, max_new_tokens=4, mode=mode, slots=4,
                          routing_replay="rollout")
    built = build_grpo(MODEL, weights(MODEL), data, options, reward=lambda source, text, truth, extra: len(text) / 16,
                       eos_id=2)
    sink = MemorySink()
    try:
        trainer = Trainer(built.objective, optax.adam(1e-2), key=jax.random.key(0), rollout=built.rollout)
        trainer.fit(built.dataset, steps=2, log_every=1, sinks=[sink])
    finally:
        built.close()
    assert built.objective.routing_replay == "rollout"
    assert len(sink.series("router/aux_loss")) == 2
    if mode == "sync":
        call = built.rollout.last_sessions[0].calls[0]
        assert call.routed_experts.shape == (len(call.prompt_ids) + len(call.sampled_ids), LAYERS, TOP_K)


class Answer:
    """A one-turn environment on `QUERY n`: any answer ends the episode."""

    def __init__(self, task, identity):
        self.n = int(task.id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def reset(self):
        from dew_lib.records.episodes import Observation

        return Observation(np.array([5, 6 + self.n], np.int32))

    def step(self, action):
        from dew_lib.records.episodes import Observation

        if action.step == 0 and action.terminated:  # a second turn after the tool's reply
            return Observation(np.concatenate([action.context, action.tokens, [7]]).astype(np.int32))
        return Observation(status="completed", detail="answered")


def test_lock_step_episodes_record_each_turn_s_routes_and_a_resumed_collection_keeps_them(tmp_path):
    """`TextGeneration(routing=True)` puts every turn's routes into its action and call, as a
    forward over the turn's context and draw routes them; the journal hands them back on resume."""
    from dew_lib.inference import TextGeneration
    from dew_lib.rollouts import EpisodeJournal, EpisodeRollout, project

    def rollout(journal=None):
        return EpisodeRollout(TextGeneration(MODEL, routing=True), Answer, lambda task, episode: 1.0,
                              max_prompt_tokens=20, max_new_tokens=4, max_turns=2, groups=2,
                              sampling=Sampling(temperature=0.9, eos_id=tuple(range(8, 32))), journal=journal)

    batch = {"task_id": np.array([0, 1], np.int32)}
    results = rollout().collect(weights(MODEL), batch, jax.random.key(3))
    turns = [(t.action, c) for r in results for t, c in zip(r.episode.transitions, r.session.calls, strict=True)]
    assert len(turns) > len(results)  # some episodes took two turns
    for action, call in turns:
        check(action.routed_experts, action.context, action.tokens)
        assert call.routed_experts is action.routed_experts
    packed = project(results, width=24, rows=8)
    last = [r.episode.transitions[-1].action for r in results]  # a row holds an episode's whole transcript
    assert packed["routed"].sum() == sum(a.context.size + a.tokens.size for a in last)

    with EpisodeJournal(tmp_path, rank=0) as journal:  # a round saved, then the process died
        log = journal.open_collection(_identity(rollout(journal), batch))
        first = {n: _pending(a) for n, (a, _) in enumerate(turns[:2])}
        log.pending(0, first)
    with EpisodeJournal(tmp_path, rank=0) as journal:
        restored = journal.open_collection(_identity(rollout(journal), batch)).restored()
    for n, draw in restored.draws[0].items():
        assert draw.routed_experts.shape == (draw.context.size + draw.tokens.size, LAYERS, TOP_K)
        np.testing.assert_array_equal(draw.routed_experts, first[n].routed_experts)
        assert draw.routed_experts.dtype == first[n].routed_experts.dtype


def _pending(action):
    from dew_lib.rollouts.journal_records import PendingDraw

    return PendingDraw(action.context, action.tokens, action.raw_log_probs, action.behavior_log_probs,
                       action.terminated, action.routed_experts)


def _identity(collector, batch):
    from dew_lib.rollouts.journal_records import collection_identity

    return collection_identity(weights(MODEL), jax.random.key(3), step=0, policy_step=0, tasks=list(batch["task_id"]),
                               groups=collector.groups, max_prompt_tokens=collector.max_prompt_tokens,
                               max_new_tokens=collector.max_new_tokens, max_turns=collector.max_turns,
                               sampling=collector.sampling)


@pytest.mark.parametrize("rl", ["grpo", "ppo"])
def test_lock_step_grpo_and_ppo_replay_the_routes_of_their_episodes(rl):
    """Through the recipe the pipeline uses for tool episodes and PPO: the objectives refuse a
    batch without routes, so a finished fit replayed the ones each turn recorded."""
    import json

    import optax

    from dew_lib import Trainer
    from dew_lib.data import Loading, Prompts
    from dew_lib.recipes import EpisodeOptions, GRPOOptions, PPOOptions, build_episode_grpo

    records = tuple(json.dumps({"prompt": [5, 6 + n], "ground_truth": "1"}) for n in range(4))
    data = Prompts(records=records, max_prompt_len=4, loading=Loading(seed=None))
    options = GRPOOptions(steps=2, batch=2, groups=2, max_new_tokens=4, routing_replay="rollout")
    built = build_episode_grpo(MODEL, weights(MODEL), data, options, EpisodeOptions(max_turns=2, max_prompt_len=16),
                               environment=Answer, verifier=lambda task, episode: float(episode.transitions[0]
                                                                                         .action.tokens[0] % 2),
                               eos_id=tuple(range(8, 32)), ppo=PPOOptions() if rl == "ppo" else None)
    trainer = Trainer(built.objective, optax.adam(1e-2), key=jax.random.key(0), rollout=built.rollout)
    state = trainer.fit(built.dataset, steps=2, sinks=[])
    assert int(state.step) == 2

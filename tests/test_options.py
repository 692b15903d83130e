"""Every stage option is declared once (dew_lib/recipes/options.py) and reaches every surface: the
Prefect form, a parameters file, the Recipe and the built objective; old stage keys still hold."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from pydantic import ValidationError

from dew_lib.data import Loading, Prompts
from dew_lib.recipes import (
    DPOOptions,
    EpisodeOptions,
    GRPOOptions,
    OneTurn,
    Options,
    PPOOptions,
    SFTOptions,
    Stage,
    build_episode_grpo,
    build_grpo,
    optimizer,
)
from tasks.manifests import DataManifest, PolicyRef, fingerprint, keyed
from tasks.params import FlowPipelineParams, GRPOParams, PipelineParams, command_line
from tasks.stage_run import stage_inputs

DATA = DataManifest(directory="d", tokenizer=None, chat_path="c", chat_val_path=None, pairs_path="p",
                    prompts_path="q", eval_path="e", fingerprint="data")
START = PolicyRef(path="p", fingerprint="start")


def test_the_demo_s_stage_keys_are_the_ones_earlier_runs_recorded():
    """Computed by the code before the options were declared once (and before the fields of
    `LATER` existed), so every finished stage of an earlier demo run is still reused."""
    p, flow = PipelineParams(), FlowPipelineParams()
    tools = DATA.model_copy(update={"tool": "calculator"})
    assert stage_inputs("sft", p.sft, DATA, START, 0)[0] == "daafbca62bb880b8"
    assert stage_inputs("dpo", p.dpo, DATA, START, 0)[0] == "d1665fde1e3bea0c"
    assert stage_inputs("grpo", p.grpo, DATA, START, 0, p.reward)[0] == "388a83b68353a24c"
    asynchronous = p.grpo.model_copy(update={"mode": "async"})
    assert stage_inputs("grpo", asynchronous, DATA, START, 0, p.reward)[0] == "f7f733f68d5d1842"
    assert stage_inputs("grpo", p.grpo, tools, START, 0, p.reward, p.tools)[0] == "95d688689b062442"
    pretrain = flow.pretrain.model_copy(update={"log_every": 1, "max_minutes": None})
    assert fingerprint("flow_pretrain", keyed(pretrain), flow.model, "data", 0) == "981766c7fdbcfc3c"
    grpo = flow.grpo.model_copy(update={"log_every": 1, "max_minutes": None})
    assert fingerprint("flow_grpo", keyed(grpo), "start", 0) == "9f8ada04567d13e0"


def test_a_later_option_enters_the_key_once_it_leaves_its_default():
    base, inputs = stage_inputs("grpo", GRPOParams(), DATA, START, 0)
    assert "policy_loss" not in inputs["params"]
    chosen, inputs = stage_inputs("grpo", GRPOParams(policy_loss="gspo"), DATA, START, 0)
    assert chosen != base and inputs["params"]["policy_loss"] == "gspo"


def test_a_renamed_option_reads_its_earlier_name_and_keeps_its_key(tmp_path):
    # sft.seq_len was the row less one; sft.max_length is the row (TRL's max_length).
    with pytest.warns(FutureWarning, match=r"SFTParams.seq_len is now max_length \(= seq_len \+ 1\)"):
        earlier = PipelineParams(sft=dict(seq_len=416), dpo=dict(seq_len=512), tools=dict(max_context=40))
    assert (earlier.sft.max_length, earlier.dpo.max_length, earlier.tools.max_prompt_len) == (417, 512, 40)
    assert earlier == PipelineParams(sft=dict(max_length=417), dpo=dict(max_length=512),
                                     tools=dict(max_prompt_len=40))
    # The key reads the earlier name and value, as runs before the rename wrote it.
    key, inputs = stage_inputs("sft", earlier.sft, DATA, START, 0)
    assert inputs["params"]["seq_len"] == 416 and "max_length" not in inputs["params"]
    assert stage_inputs("sft", PipelineParams().sft, DATA, START, 0)[0] == "daafbca62bb880b8"
    # A parameters file with the earlier name loads the same way; both names at once are refused.
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"params": {"sft": {"seq_len": 95}}}))
    with pytest.warns(FutureWarning):
        assert command_line(["--params", str(path)], PipelineParams(), prog="p", description="").sft.max_length == 96
    with pytest.raises(ValidationError, match="given both 'seq_len' and 'max_length'"):
        PipelineParams(sft=dict(seq_len=95, max_length=96))
    # Flow-GRPO's one clip_range was both bounds; equal bounds are keyed as it, unequal ones apart.
    with pytest.warns(FutureWarning, match="FlowGRPOParams.clip_range is now epsilon_low"):
        flow = FlowPipelineParams(grpo=dict(clip_range=2e-4))
    assert (flow.grpo.epsilon_low, flow.grpo.epsilon_high) == (2e-4, 2e-4)
    assert keyed(flow.grpo)["clip_range"] == 2e-4 and "epsilon_high" not in keyed(flow.grpo)
    wider = keyed(flow.grpo.model_copy(update={"epsilon_high": 3e-4}))
    assert (wider["clip_range"], wider["epsilon_high"]) == (2e-4, 3e-4)


def test_ppo_is_a_stage_of_its_own_keyed_with_its_critic_options():
    key, inputs = stage_inputs("ppo", GRPOParams(), DATA, START, 0, ppo=PPOOptions(gamma=0.9))
    assert key != stage_inputs("grpo", GRPOParams(), DATA, START, 0)[0]
    # One-turn prompts: the critic options are the PPO group, not the tool group.
    assert inputs["ppo"]["gamma"] == 0.9 and "tools" not in inputs
    assert PipelineParams(rl="ppo").stage_name("grpo") == "ppo"
    assert PipelineParams().stage_name("grpo") == "grpo" and PipelineParams().stage_name("dpo") == "dpo"


def test_no_option_of_the_library_is_declared_again_by_the_pipeline():
    """tasks/params.py (and the image forms it imports from tasks/params_image.py) subclasses the
    options; a field it wrote again would be a second declaration, free to drift (as DPO's beta
    and GRPO's groups once did)."""
    from tasks import params

    checked = 0
    for cls in vars(params).values():
        if (not isinstance(cls, type) or not issubclass(cls, Options)
                or not cls.__module__.startswith("tasks.params")):
            continue
        library = {name for base in cls.__mro__ if base.__module__.startswith("dew_lib.recipes.options")
                   for name in getattr(base, "model_fields", {})}
        restated = library & set(vars(cls).get("__annotations__", {}))
        assert not restated, f"{cls.__name__} declares {restated} again"
        checked += bool(library)
    assert checked >= 9  # the text, distill and image stages' forms, the tools and the PPO options


def test_every_algorithm_choice_shows_in_the_form_and_reads_from_a_parameters_file(tmp_path):
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline

    schema = json.dumps(parameter_schema(pipeline).model_dump())
    for name in ("policy_loss", "aggregation", "kl_estimator", "advantage_estimator", "epsilon_low",
                 "epsilon_high", "dual_clip", "sequence_mask", "geometric_mask", "behavior_importance",
                 "critic_learning_rate", "weight_decay", "schedule", "max_grad_norm"):
        assert f'"{name}"' in schema, name
    assert '"gspo"' in schema and '"session-mean"' in schema and '"rloo"' in schema
    (tmp_path / "cispo.yaml").write_text("grpo:\n  policy_loss: cispo\n  aggregation: session-mean\n"
                                         "  kl_estimator: k3\n  advantage_estimator: rloo\n")
    params = command_line(["--params", str(tmp_path / "cispo.yaml")], PipelineParams(), prog="p",
                          description="")
    assert (params.grpo.policy_loss, params.grpo.aggregation, params.grpo.advantage_estimator) == (
        "cispo", "session-mean", "rloo")
    # Library and form share their defaults: one declaration, one value.
    assert PipelineParams().dpo.beta == DPOOptions(steps=1).beta == 1.0
    assert PipelineParams().grpo.groups == GRPOOptions().groups == 8


def test_each_rule_between_fields_has_one_message_everywhere():
    from dew_lib.rollouts import RolloutScheduler

    expected = r"max_lag=1 is below ahead \+ sync_every - 1 = 2: .* Raise max_lag to 2"
    with pytest.raises(ValidationError, match=r"GRPOOptions\." + expected):
        GRPOOptions(mode="async", ahead=2)
    with pytest.raises(ValidationError, match=r"GRPOOptions\." + expected):
        PipelineParams(grpo=dict(mode="async", ahead=2))
    with pytest.raises(ValueError, match=r"RolloutScheduler\." + expected):
        RolloutScheduler(None, None, None, width=8, rows=4, groups=2, ahead=2, max_lag=1)
    for groups in ({"groups": 1},):
        with pytest.raises(ValidationError, match="greater than or equal to 2"):
            GRPOOptions(**groups)
    with pytest.raises(ValueError, match=r"RolloutScheduler.groups must be an integer >= 2"):
        RolloutScheduler(None, None, None, width=8, rows=4, groups=1)
    with pytest.raises(ValidationError, match=r"sequence_mask=\(1.5, 2.0\) must satisfy 0 <= low < 1 < high"):
        GRPOOptions(sequence_mask=(1.5, 2.0))
    with pytest.raises(ValidationError, match=r"rl='ppo': PPO trains with policy_loss='ppo'.*policy_loss='gspo'"):
        PipelineParams(rl="ppo", grpo=dict(policy_loss="gspo"))


MODEL_OPTIONS = dict(vocab_size=32, emb_features=16, num_layers=1, num_heads=2, mlp_features=32, max_seq_len=32)
CHOSEN = dict(steps=1, batch=2, groups=2, max_new_tokens=4, policy_loss="cispo", aggregation="session-mean",
              kl_estimator="k1", epsilon_low=0.1, epsilon_high=0.28, dual_clip=None, advantage_estimator="rloo",
              sequence_mask=(0.5, 2.0), geometric_mask=(0.8, 1.25), beta=0.02, temperature=0.9)


def prompts():
    records = tuple(json.dumps({"prompt": [3, 4, 5], "ground_truth": "1"}) for _ in range(4))
    return Prompts(records=records, max_prompt_len=4, loading=Loading(seed=None))


def assert_chosen(objective):
    assert (objective.policy_loss, objective.aggregation, objective.kl_estimator) == ("cispo", "session-mean", "k1")
    assert tuple(objective.clip) == (0.1, 0.28, None)
    assert (objective.sequence_mask, objective.geometric_mask) == ((0.5, 2.0), (0.8, 1.25))
    assert (objective.beta, objective.sampling_temperature) == (0.02, 0.9)


def test_every_choice_reaches_the_objective_and_rollout_of_each_mode():
    from dew_lib import models

    model = models.build("causal_transformer", **MODEL_OPTIONS)
    variables = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32))
    options = GRPOOptions(**CHOSEN)
    built = build_grpo(model, variables, prompts(), options, reward=lambda *a: 1.0, eos_id=2)
    assert_chosen(built.objective)
    assert built.objective.behavior_importance is None
    assert built.rollout.estimator == "rloo" and built.rollout.sampling.temperature == 0.9
    lagged = build_grpo(model, variables, prompts(), options.model_copy(update={"mode": "async", "slots": 2}),
                        reward=lambda *a: 1.0, eos_id=2)
    try:
        assert_chosen(lagged.objective)
        assert lagged.objective.behavior_importance == 2.0
        assert lagged.rollout.scheduler.estimator == "rloo"
        assert lagged.rollout.server.server.mesh is None  # one device unless asked
    finally:
        lagged.close()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 devices; this process has 1"):
        build_grpo(model, variables, prompts(), options.model_copy(update={"mode": "async", "tensor_parallel_size": 2}),
                   reward=lambda *a: 1.0, eos_id=2)
    episodes = build_episode_grpo(model, variables, prompts(), options, EpisodeOptions(max_turns=1, max_prompt_len=4),
                                  environment=OneTurn, verifier=lambda task, episode: 1.0, eos_id=2)
    assert_chosen(episodes.objective)
    assert episodes.rollout.estimator == "rloo"
    with pytest.raises(ValueError, match="PPO trains with policy_loss='ppo'"):
        build_episode_grpo(model, variables, prompts(), options, EpisodeOptions(max_turns=1, max_prompt_len=4),
                           environment=OneTurn, verifier=lambda task, episode: 1.0, eos_id=2, ppo=PPOOptions())
    ppo_side = GRPOOptions(steps=1, batch=2, groups=2, max_new_tokens=4, epsilon_high=0.28, dual_clip=None,
                           kl_estimator="k2", beta=0.02)
    ppo = build_episode_grpo(model, variables, prompts(), ppo_side, EpisodeOptions(max_turns=1, max_prompt_len=4),
                             environment=OneTurn, verifier=lambda task, episode: 1.0, eos_id=2,
                             ppo=PPOOptions(value_clip=0.5))
    assert tuple(ppo.objective.actor.clip) == (0.2, 0.28, None) and ppo.objective.actor.kl_estimator == "k2"
    assert ppo.objective.value_clip == 0.5


def test_ppo_on_episodes_with_lora_trains_the_policy_s_adapters_and_the_critic_s_adapters_and_head():
    """The lora group of the RL stage's options reaches PPO through the builder: the policy trains
    its adapters against its base (no reference copy), the critic its own adapters and value head."""
    import optax

    from dew_lib.models import lora
    from dew_lib.recipes import LoRAOptions
    from dew_lib.train import Trainer

    model = models_build()
    variables = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32))
    side = GRPOOptions(steps=1, batch=2, groups=2, max_new_tokens=4, lora=LoRAOptions(rank=2, targets="all-linear"))
    ppo = build_episode_grpo(model, variables, prompts(), side, EpisodeOptions(max_turns=1, max_prompt_len=4),
                             environment=OneTurn, verifier=lambda task, episode: 1.0, eos_id=2, ppo=PPOOptions())
    assert ppo.model.lora == side.lora.config()
    trainer = Trainer(ppo.objective, optax.adam(1e-3), key=jax.random.key(0))
    assert trainer.reference_is_base and trainer.initial_state().ema is None
    trained = [(jax.tree_util.keystr(path), lora.is_adapter(path))
               for path, marked in jax.tree_util.tree_leaves_with_path(trainer.trainable_marks) if marked]
    assert all(adapter for name, adapter in trained if "'policy'" in name)  # the policy: adapters only
    critic = [name for name, adapter in trained if "'critic'" in name and not adapter]
    assert critic and not any("backbone" in name for name in critic)  # its head, not its base


def test_async_grpo_trains_in_verl_s_bypass_mode_when_chosen():
    import optax

    from dew_lib.train import Trainer

    model = models_build()
    variables = jax.jit(model.init)(jax.random.key(0), np.zeros((1, 8), np.int32))
    with pytest.raises(ValidationError, match="proximal='bypass' chooses the proximal policy of lagged"):
        GRPOOptions(proximal="bypass")  # sync draws have no lag to correct
    options = GRPOOptions(steps=2, batch=2, groups=2, max_new_tokens=3, mode="async", slots=4, proximal="bypass")
    built = build_grpo(model, variables, prompts(), options, reward=lambda *a: 1.0, eos_id=2)
    batches = []
    try:
        assert built.objective.behavior_importance is None  # the ratio is already current over behavior
        assert built.rollout.scheduler.proximal == "bypass"
        rollout = built.rollout

        def recording(state, batch, key):
            batches.append(rollout(state, batch, key))
            return batches[-1]

        state = Trainer(built.objective, optax.sgd(1e-3), key=jax.random.key(1), rollout=recording).fit(
            built.dataset, steps=2, sinks=[])
    finally:
        built.close()
    assert int(state.step) == 2 and [b.proximal for b in batches] == ["bypass", "bypass"]
    assert all("old_log_probs" not in b for b in batches)
    with pytest.raises(ValueError, match="PPO trains with .*proximal='in_update'"):
        options.check_ppo()


def models_build():
    from dew_lib import models

    return models.build("causal_transformer", **MODEL_OPTIONS)


def test_a_recipe_stage_takes_the_same_options():
    stage = Stage(name="g", data=prompts(), options=GRPOOptions(**CHOSEN), reward=lambda *a: 1.0)
    assert stage.options.policy_loss == "cispo"
    with pytest.raises(ValidationError, match="greater than 0"):
        GRPOOptions(temperature=0)  # greedy draws carry no group-relative signal


def test_the_optimizer_follows_the_options():
    """SFT's warmup-cosine schedule at its first step (a rate of 0), and a constant rate."""
    params = {"w": np.ones(3, np.float32)}
    grads = {"w": np.full(3, 100.0, np.float32)}

    warm = optimizer(SFTOptions(steps=100, weight_decay=0.0))
    updates, _ = warm.update(grads, warm.init(params), params)
    np.testing.assert_array_equal(updates["w"], 0.0)  # the warmup starts at a rate of 0
    plain = optimizer(GRPOOptions(learning_rate=0.5, weight_decay=0.0, max_grad_norm=None))
    updates, _ = plain.update(grads, plain.init(params), params)
    # Adam's first step is the rate, signed (up to float32's rounding of its bias correction, 1 - 0.999)
    np.testing.assert_allclose(updates["w"], -0.5, rtol=1e-5)

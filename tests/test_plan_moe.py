"""The memory planner on mixtures of experts: parameters counted exactly from a config (the
published totals of Qwen3-30B-A3B and others, a tiny config counted by hand, the decoder's own
tree), the `expert` axis's share of the state, the dispatch's buffers, and `dew plan --suggest`
choosing among the meshes an `expert` axis allows."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import run_on_host_devices

from dew_lib import models
from dew_lib.models.pretrained.families import decoder_options
from dew_lib.plan_tables import MODELS, MOE_MODELS
from dew_lib.train import plan_moe
from dew_lib.train.plan import MemoryPlan, _expert_advice

# A Qwen2-MoE whose layers 1 and 3 are sparse: 0 is in mlp_only_layers, 2 fails decoder_sparse_step=2.
MIXED = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 32, "hidden_size": 16,
         "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 24,
         "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20, "num_experts": 4,
         "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [0], "tie_word_embeddings": False}


def test_published_totals_of_the_moe_presets():
    expected = {"qwen3-30b-a3b": (30.5, 3.3), "qwen3-235b-a22b": (235, 22), "qwen1.5-moe-a2.7b": (14.3, 2.7),
                "qwen2-57b-a14b": (57, 14), "mixtral-8x7b": (46.7, 12.9)}
    for name, (total, active) in expected.items():
        counted = plan_moe.count_parameters(MOE_MODELS[name])
        assert abs(counted.total / 1e9 - total) < 0.02 * total + 0.05, (name, counted.total)
        assert abs(counted.active / 1e9 - active) < 0.03 * active + 0.06, (name, counted.active)
    q = plan_moe.count_parameters(MODELS["qwen3-30b-a3b"])
    # 48 layers of attention (q, o 2048x4096; k, v 2048x512; q/k norms), 128 experts of 3 x 2048x768,
    # a 2048x128 router and two norms; the embedding and the untied head; the final norm.
    layer = 2 * 2048 * 4096 + 2 * 2048 * 512 + 2 * 128 + 128 * 3 * 2048 * 768 + 2048 * 128 + 2 * 2048
    assert q.total == 48 * layer + 2 * 151_936 * 2048 + 2048 == 30_532_122_624
    assert q.active == q.total - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704
    assert q.sparse_layers == tuple(range(48)) and (q.expert_count, q.per_token) == (128, 8)
    assert "30.53B parameters, 3.35B active a token (128 experts, 8 a token" in q.describe()


def test_a_mixed_config_counted_by_hand():
    counted = plan_moe.count_parameters(MIXED)
    assert counted.sparse_layers == (1, 3)
    attention = (16 * 16 + 16) + 2 * (16 * 8 + 8) + 16 * 16  # q and k/v with Qwen2's biases, o; head_dim 8
    dense_mlp = 3 * 16 * 24
    sparse = 16 * 4 + 4 * 3 * 16 * 12 + (3 * 16 * 20 + 16)  # router, 4 experts, shared expert and its gate
    by_hand = 2 * 32 * 16 + 4 * attention + (4 * 2 * 16 + 16) + 2 * dense_mlp + 2 * sparse
    assert counted.total == by_hand == 13_360
    assert counted.active == by_hand - 2 * 2 * 3 * 16 * 12 == 11_056  # 2 of the 4 experts idle per sparse layer
    assert (counted.dense_mlp, counted.shared, counted.router) == (2 * dense_mlp, 2 * 976, 2 * 64)
    assert "2 sparse layers and 2 dense" in counted.describe()
    # the decoder builds the same layers: layers 1 and 3 sparse, 0 and 2 dense
    _, options = decoder_options(MIXED)
    model = models.build("causal_transformer", **options)
    assert model.moe_layers == counted.sparse_layers
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
    assert sum(leaf.size for leaf in jax.tree.leaves(shapes["params"])) == 13_360


def test_dew_plan_plans_a_config_that_mixes_dense_and_sparse_layers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXED))
    done = subprocess.run([sys.executable, "-m", "dew_lib.cli", "plan", "--model", str(path), "--stage", "sft",
                           "--seq-len", "8", "--batch", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "model: 13,360 parameters, 11,056 active a token (4 experts, 2 a token, in 2 sparse " \
           "layers and 2 dense" in done.stdout


@pytest.mark.parametrize("config", ["tests/fixtures/hf/qwen3_moe", "tests/fixtures/hf/qwen2_moe",
                                    "tests/fixtures/hf/qwen2_moe_mixed", "tests/fixtures/hf/mixtral",
                                    "tests/fixtures/hf/qwen3", "qwen3-30b-a3b"])
def test_the_count_is_the_decoders_own_tree(config):
    from dew_lib.train.plan import model_config

    found = model_config(config if "/" not in config else f"{config}/config.json")
    _, options = decoder_options(found)
    model = models.build("causal_transformer", **options, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
    leaves = jax.tree.leaves(shapes["params"])
    assert sum(leaf.size for leaf in leaves) == plan_moe.count_parameters(found).total


def test_candidate_meshes_divide_the_experts():
    def groups(devices, experts, tensor=1):
        return [mesh["expert"] for mesh in plan_moe.candidate_meshes(devices, experts, tensor)]

    assert groups(8, 128) == [1, 2, 4, 8]
    assert groups(8, 60) == [1, 2, 4]  # Qwen1.5-MoE: 8 does not divide 60
    assert groups(16, 8, tensor=2) == [1, 2, 4, 8]
    assert groups(8, 0) == [1]  # dense: fsdp alone
    assert plan_moe.candidate_meshes(8, 128)[1] == {"data": 1, "fsdp": 4, "expert": 2, "tensor": 1}


def test_the_dispatch_buffers_of_an_expert_group():
    config = MOE_MODELS["qwen3-30b-a3b"]
    one = plan_moe.dispatch_bytes(config, {"fsdp": 8}, 4096, 2)
    group = plan_moe.dispatch_bytes(config, {"expert": 8}, 4096, 2)
    # one device: its 4,096 tokens' 32,768 slots over all 128 experts, padded to 64-row blocks
    assert (one["rows"], one["slots"], one["local_experts"]) == (4096, 32_768, 128)
    assert one["block_rows"] == 64 * (32_768 // 64 + 127) and one["gathered rows"] == 0
    assert one["experts' weights"] == 128 * 3 * 2048 * 768 * 2 and one["their float32 gradients"] == 2 * one[
        "experts' weights"]
    # expert=8: the group's 8 x 4,096 rows gathered, 262,144 slots sized for 16 experts
    assert (group["rows"], group["slots"], group["local_experts"]) == (32_768, 262_144, 16)
    assert group["gathered rows"] == 32_768 * 2048 * 2 and group["block_rows"] == 64 * (4096 + 15)
    assert group["gate and up products"] == 2 * group["block_rows"] * 768 * 2
    assert group["experts' weights"] == one["experts' weights"] // 8
    tensor = plan_moe.dispatch_bytes(config, {"expert": 4, "tensor": 2}, 4096, 2)
    assert tensor["gate and up products"] == 2 * tensor["block_rows"] * 384 * 2
    layer = (30_532_122_624 - 2 * 151_936 * 2048 - 2048) // 48  # a layer's parameters: 623,120,640
    others = layer - 128 * 3 * 2048 * 768  # outside the experts: attention, norms, router
    # fsdp=8: 7/8 of the layer gathered forward, again backward, and its gradient reduce-scattered
    assert plan_moe.layer_traffic(config, {"fsdp": 8}, 4096, 2) == (3 * 7 * layer * 2 // 8, 0, 0)
    # expert=8: 7 x 4,096 rows of 2,048 gathered and reduce-scattered, forward and backward, and the
    # gradients of the weights outside the experts (whole on all 8 devices) all-reduced
    assert plan_moe.layer_traffic(config, {"expert": 8}, 4096, 2) == (0, 4 * 7 * 4096 * 2048 * 2,
                                                                      2 * 7 * others * 2 // 8)

@pytest.mark.slow
def test_the_expert_axis_splits_the_experts_and_their_moments():
    out = run_on_host_devices("""
        import json, jax, optax
        from dew_lib import LMObjective, Trainer, models
        from dew_lib.models.pretrained.families import decoder_options
        from dew_lib.plan_tables import MODELS
        from dew_lib.train.mesh import MeshSpec
        from dew_lib.train.plan import _held

        options = decoder_options(MODELS["qwen3-30b-a3b"])[1]
        model = models.build("causal_transformer", **options, dtype="bfloat16", param_dtype="bfloat16")
        held = {}
        for text in ("fsdp=8", "expert=8", "fsdp=2,expert=4"):
            trainer = Trainer(LMObjective(model, seq_len=64, ema_decay=None), optax.adamw(1e-6),
                              key=jax.random.key(0), mesh=MeshSpec.parse(text))
            state = trainer.abstract_state()
            held[text] = [_held(state.params), _held(state.opt_state)]
        print(json.dumps(held))
        """, devices=8, timeout=300)
    held = json.loads(out.splitlines()[-1])
    counted = plan_moe.count_parameters(MODELS["qwen3-30b-a3b"])
    experts, others = counted.experts, counted.total - counted.experts
    for text, (fsdp, group) in {"fsdp=8": (8, 1), "expert=8": (8 // 8, 8), "fsdp=2,expert=4": (2, 4)}.items():
        params, moments = held[text]
        # bfloat16: the experts split over fsdp x expert, the rest over fsdp alone (the norms too)
        assert params == pytest.approx(2 * (experts / (fsdp * group) + others / fsdp), rel=1e-4), text
        assert moments == pytest.approx(2 * params, abs=64), text  # Adam's two moments and its counts
    assert held["fsdp=8"][0] == pytest.approx(7.633e9, rel=1e-3) and held["expert=8"][0] == pytest.approx(
        10.334e9, rel=1e-3)


def _plan(mesh, total, fits, stage="sft"):
    return MemoryPlan(stage=stage, mesh={"data": 1, **mesh, "tensor": 1}, rows=8, width=4096, parameters=total,
                      optimizer=0, reference=0, gradients=0, batch=0, temporary=0,
                      device_bytes=None if fits is None else (total + 1 if fits else total - 1))


def test_the_choice_among_meshes_and_its_reasons():
    config = MOE_MODELS["qwen3-30b-a3b"]
    plans = [_plan({"fsdp": 8, "expert": 1}, 62 * 10**9, True), _plan({"fsdp": 4, "expert": 2}, 70 * 10**9, True),
             _plan({"fsdp": 1, "expert": 8}, 90 * 10**9, True)]
    chosen = plan_moe.choose(config, plans, 2)
    assert chosen is plans[2]  # expert=8 gathers no weights: 0.54 GB a layer and step against 3.27
    why = "\n".join(plan_moe.reasons(config, plans, chosen, 2))
    assert "chosen: expert=8 (90.0 GB a device)" in why and "16 of the 128 experts" in why
    assert "fsdp=8 (62.0 GB, fits) gathers every expert of a layer instead: 3.27 GB of weights" in why
    assert "0.47 GB of tokens exchanged (expert), 0.07 GB of gradients summed over replicas" in why
    assert "fsdp=8 holds the least (62.0 GB a device)" in why and "sizes its blocks for 262,144 slots" in why
    plans[2] = _plan({"fsdp": 1, "expert": 8}, 90 * 10**9, False)  # expert=8 over: fsdp=4,expert=2 moves less
    assert plan_moe.choose(config, plans, 2) is plans[1]
    assert plan_moe.choose(config, [_plan({"fsdp": 8, "expert": 1}, 1, None), plans[1]], 2).total == 1
    over = [_plan({"fsdp": 8, "expert": 1}, 200 * 10**9, False)]
    assert plan_moe.choose(config, over, 2) is None
    assert "none of the 1 meshes fits; the least loaded is fsdp=8" in plan_moe.reasons(config, over, None, 2)[0]


@pytest.mark.slow
def test_dew_plan_suggests_meshes_for_a_small_moe_model(tmp_path):
    config = json.load(open("tests/fixtures/hf/qwen3_moe/config.json"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "dew_lib.cli", "plan", "--model", str(path), "--suggest", "2",
                           "--stage", "sft", "--seq-len", "64", "--batch", "2", "--device-bytes", "1000"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr  # 1,000 bytes: nothing fits
    out = done.stdout
    assert "fsdp=2 " in out and "expert=2 " in out and out.count("does NOT fit") == 2
    assert "(8 experts, 2 a token, in 2 sparse layers" in out
    assert "none of the 2 meshes fits; the least loaded is" in out and "its advice:" in out
    assert "remat recomputes each layer's activations" in out


def test_a_plan_that_does_not_fit_names_the_expert_axis():
    config = MOE_MODELS["qwen3-30b-a3b"]
    over = _plan({"fsdp": 8, "expert": 1}, 200 * 10**9, False)
    (line,) = _expert_advice(config, over)
    assert "the experts hold 95% of the parameters: expert=N (N dividing 128: 2, 4, 8, 16, ...)" in line
    assert "`dew plan --suggest 8` plans every fsdp x expert mesh of 8 devices" in line
    assert _expert_advice(config, _plan({"fsdp": 8, "expert": 1}, 1, True)) == []
    assert _expert_advice(MODELS["qwen3-8b"], over) == []  # a dense model: fsdp's advice alone

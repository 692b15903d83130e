"""Expert parallelism: an `expert` mesh axis splits a mixture of experts' experts (and the batch),
and the sharded model computes what the unsharded one does.

The equality checks run on 8 host devices in a fresh process (`run_on_host_devices`): an MoE
decoder's logits, loss (with the router's aux loss) and every gradient under `expert=2`,
`expert=4`, `fsdp=2,expert=4`, `data=2,fsdp=2,expert=2` and `expert=2,tensor=2` against one
device, once with the router's choices spread and once with every token sent to experts 0 and 1
(one device of each expert group computes every slot: dropless at the worst imbalance); then
SFT and GRPO steps through the Trainer. Sharded and whole runs are the same arithmetic summed
in another order, so they agree to float32 rounding.
"""

import json
import os

import numpy as np
import pytest
from conftest import ROOT, run_on_host_devices
from jax.sharding import AbstractMesh, PartitionSpec

from dew_lib.models import partitioning
from dew_lib.train.mesh import MeshSpec

pytestmark = pytest.mark.timeout(900)

ADAM_ROUNDING = 1e-5  # as tests/test_sharding.py: Adam steps on 8 devices, data against sharded


def mesh(**sizes):
    spec = MeshSpec(**sizes)
    return AbstractMesh(tuple(spec.shape(8).values()), partitioning.MESH_AXES)


def test_the_expert_axis_is_read_from_text_splits_the_batch_and_leaves_other_meshes_as_they_were():
    assert MeshSpec.parse("fsdp=2,expert=4") == MeshSpec(fsdp=2, expert=4)
    assert MeshSpec.parse("expert=4").shape(8) == {"data": 2, "fsdp": 1, "expert": 4, "tensor": 1}
    assert str(MeshSpec(fsdp=2, expert=4)) == "fsdp=2,expert=4,tensor=1"
    assert str(MeshSpec(fsdp=8)) == "fsdp=8,tensor=1"  # expert=1 is not written: old texts read the same
    assert MeshSpec(data=2, fsdp=2, expert=2).devices() == 8
    with pytest.raises(ValueError, match="the mesh data=2 x fsdp=1 x expert=2 x tensor=1 does not cover the job's 8"):
        MeshSpec(data=2, expert=2).shape(8)
    with pytest.raises(ValueError, match="MeshSpec.expert must be a whole number >= 1, got 0"):
        MeshSpec(expert=0)
    assert partitioning.BATCH_AXES == ("data", "fsdp", "expert")
    assert partitioning.splits_parameters(mesh(expert=4))
    # the experts over `expert`, their width over `fsdp` and hidden units over `tensor`, as before
    experts = ("layers", "experts", "embed", "mlp")
    assert partitioning.spec_for(experts, (2, 8, 16, 24), mesh(fsdp=2, expert=4), "w") == PartitionSpec(
        None, "expert", "fsdp")
    assert partitioning.spec_for(experts, (2, 8, 16, 24), mesh(expert=2, tensor=2), "w") == PartitionSpec(
        None, "expert", None, "tensor")
    assert partitioning.spec_for(("layers", "embed", "mlp"), (2, 16, 24), mesh(expert=4), "w") == PartitionSpec()


def test_experts_the_expert_axis_does_not_divide_are_refused_naming_the_field():
    gate = {"params": {"layers": {"experts": {"gate_proj": np.zeros((2, 6, 16, 24))}}}}
    with pytest.raises(ValueError, match=r"the parameter params/layers/experts/gate_proj \(2, 6, 16, 24\): its "
                                         r"experts dimension of 6 does not divide across the mesh's expert=4"):
        partitioning.tree_specs(gate, mesh(expert=4), required=True)


EQUAL = """
    import json, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from conftest import tiny_model
    from dew_lib.models import partitioning
    from dew_lib.train.mesh import MeshSpec

    model = tiny_model(experts=8, experts_per_token=2, expert_features=24, shared_expert_features=8)
    ids = jnp.asarray(np.random.default_rng(0).integers(1, 32, (8, 12)), jnp.int32)
    segments = jnp.asarray((np.arange(12)[None] < np.array([12, 9, 12, 5, 12, 12, 7, 12])[:, None]), jnp.int32)
    spread = jax.jit(model.init)(jax.random.key(0), ids[:1])
    # a zero router ties every expert, and ties go to the lower index: all slots on experts 0 and 1
    skewed = jax.tree.map(lambda x: x, spread)  # a copy of the nested dicts
    skewed["params"]["layers"]["router"]["kernel"] = jnp.zeros_like(spread["params"]["layers"]["router"]["kernel"])

    def loss(variables, ids):
        hidden, routing = model.apply(variables, ids, segments, method=model.hidden, return_routing=True)
        logits = model.apply(variables, hidden, method=model.logits)
        log_probs = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), ids[:, 1:, None], -1)[..., 0]
        real = segments[:, 1:]
        return -(log_probs * real).sum() / real.sum() + 0.01 * routing.aux_loss, (logits, routing.experts)

    def compiled(text):  # the loss and gradients on a mesh, compiled once for both routers (same shapes)
        mesh = MeshSpec.parse(text).build()

        def sharded(variables, ids):
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return jax.value_and_grad(loss, has_aux=True)(variables, ids)

        placed = partitioning.place(spread, mesh)
        rows = jax.device_put(ids, NamedSharding(mesh, PartitionSpec(partitioning.BATCH_AXES)))
        lowered = jax.jit(sharded).lower(placed, rows)
        return mesh, rows, lowered.compile(), lowered.as_text().count("sdy.manual_computation")

    whole = jax.jit(jax.value_and_grad(loss, has_aux=True))
    meshes = {"spread": ("expert=2", "expert=4", "fsdp=2,expert=4", "data=2,fsdp=2,expert=2", "expert=2,tensor=2"),
              "skewed": ("expert=4", "data=2,fsdp=2,expert=2")}
    programs = {}
    for name, variables in (("spread", spread), ("skewed", skewed)):
        # compared on the host (NumPy's float32 differences are XLA's): no small program per leaf and mesh
        (total, (logits, experts)), grads = jax.device_get(whole(variables, ids))
        for text in meshes[name]:
            if text not in programs:
                programs[text] = compiled(text)
            mesh, rows, program, manual = programs[text]
            placed = partitioning.place(variables, mesh)
            (s_total, (s_logits, s_experts)), s_grads = jax.device_get(program(placed, rows))
            print(json.dumps(dict(
                name=name, mesh=text, manual=manual,
                held=placed["params"]["layers"]["experts"]["gate_proj"].addressable_shards[0].data.shape,
                skewed=bool((np.sort(experts, -1) == np.array([0, 1])).all()),
                same_experts=bool((s_experts == experts).all()), total=float(total),
                loss=abs(float(s_total - total)),
                logits=float(np.abs(s_logits - logits).max()),
                grads=max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(s_grads),
                                                                     jax.tree.leaves(grads))),
                scale=max(float(np.abs(g).max()) for g in jax.tree.leaves(grads)))))
"""


@pytest.mark.slow
def test_an_moe_decoder_s_logits_loss_and_gradients_under_expert_meshes_equal_one_device():
    out = run_on_host_devices(EQUAL, devices=8, timeout=600)
    found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(case["name"], case["mesh"]) for case in found] == [
        ("spread", "expert=2"), ("spread", "expert=4"), ("spread", "fsdp=2,expert=4"),
        ("spread", "data=2,fsdp=2,expert=2"), ("spread", "expert=2,tensor=2"), ("skewed", "expert=4"),
        ("skewed", "data=2,fsdp=2,expert=2")], out
    for case in found:
        spec = MeshSpec.parse(case["mesh"])
        assert case["held"] == [2, 8 // spec.expert, 16 // spec.fsdp, 24 // spec.tensor], case  # its experts' share
        assert case["manual"] > 0, case  # the expert-parallel path ran: shard_map's manual computation
        assert case["skewed"] == (case["name"] == "skewed"), case  # every slot on experts 0 and 1
        assert case["same_experts"], case
        assert case["loss"] <= 1e-6 * abs(case["total"]) and case["logits"] <= 1e-6, case  # a loss of ~3.5
        assert case["grads"] <= 1e-6 * max(1.0, case["scale"]), case


TRAIN = """
    import functools, json, jax, numpy as np, optax
    from conftest import tiny_model
    from dew_lib import Dataset, LMObjective, Trainer
    from dew_lib.objectives import GRPOObjective
    from dew_lib.rollouts import SampledRollout
    from dew_lib.sampling import Sampling
    from dew_lib.train.mesh import MeshSpec

    def model(experts=8):
        return tiny_model(experts=experts, experts_per_token=2, expert_features=24, router_aux_loss_coef=0.01,
                          router_z_loss_coef=0.001)

    rng = np.random.default_rng(3)
    sft = []
    for _ in range(3):
        text = rng.integers(1, 32, size=(8, 9)).astype(np.int32)
        segments = (np.arange(9)[None] < rng.integers(3, 10, size=8)[:, None]).astype(np.int32)
        sft.append({"text": text * segments, "text_segment_ids": segments})
    prompts = [{"prompt": rng.integers(3, 32, size=(4, 3)).astype(np.int32), "prompt_length": np.full(4, 3, np.int32),
                "ground_truth": np.full((4, 1), ord("7"), np.int32),
                "data_source": np.tile(np.frombuffer(b"toy", np.uint8).astype(np.int32), (4, 1)),
                "extra_info": np.zeros((4, 0), np.int32)} for _ in range(3)]

    def sevens(data_source, completion, ground_truth, extra_info):
        return float(completion.split().count("7"))

    @functools.cache  # once per recipe, not per mesh; compiled, as fit builds it (op by op took seconds more)
    def initial(recipe):
        objective = LMObjective(model(), seq_len=8) if recipe == "sft" else GRPOObjective(model(), seq_len=8)
        trainer = Trainer(objective, optax.sgd(0.0), key=jax.random.key(0), devices=jax.devices()[:1])
        return [np.asarray(x) for x in jax.tree.leaves(jax.jit(trainer.initial_state)().params)]

    def train(recipe, optimizer, **placement):
        if recipe == "sft":
            objective, rollout, batches = LMObjective(model(), seq_len=8), None, sft
        else:
            objective = GRPOObjective(model(), seq_len=8)
            sampled = SampledRollout(objective, reward=sevens, groups=2, max_new_tokens=6,
                                     sampling=Sampling(temperature=1.0, eos_id=2),
                                     decode=lambda ids: " ".join(map(str, ids)), workers=1)
            rollout, batches = (lambda state, batch, key: sampled(state, batch, key)), prompts
        trainer = Trainer(objective, optimizer, key=jax.random.key(0), rollout=rollout, **placement)
        state = trainer.fit(Dataset(train=lambda p: iter(batches), batch=8), steps=3, sinks=[])
        return [np.asarray(x) for x in jax.tree.leaves(state.params)]

    # SGD against one device: the step's arithmetic. Adam against the same batches on `data=8`
    # (as tests/test_sharding.py): Adam divides a near-zero gradient by its own size, which
    # turns float32 rounding into ~1e-5 moves (`data=8` itself ends 9e-6 from one device).
    runs = (("sft", "sgd", "one device", ("fsdp=2,expert=4", "data=2,fsdp=2,expert=2")),
            ("sft", "adam", "data=8", ("fsdp=2,expert=4",)),
            ("grpo", "adam", "data=8", ("fsdp=2,expert=4",)))
    for recipe, name, baseline, meshes in runs:
        optimizer = optax.sgd(0.5) if name == "sgd" else optax.adam(1e-2)
        placement = dict(devices=jax.devices()[:1]) if baseline == "one device" else dict(mesh=MeshSpec.parse(baseline))
        base = train(recipe, optimizer, **placement)
        for text in meshes:
            split = train(recipe, optimizer, mesh=MeshSpec.parse(text))
            gap = max(float(np.abs(a - b).max()) for a, b in zip(split, base, strict=True))
            moved = min(float(np.abs(a - b).max()) for a, b in zip(base, initial(recipe), strict=True))
            print(json.dumps(dict(recipe=recipe, optimizer=name, baseline=baseline, mesh=text, gap=gap, moved=moved)))

    try:
        Trainer(LMObjective(model(experts=6), seq_len=8), optax.adam(1e-2), key=jax.random.key(0),
                mesh=MeshSpec(expert=4))
    except ValueError as error:
        print("refused", " ".join(str(error).split()))
"""


@pytest.mark.slow
def test_sft_and_grpo_steps_under_expert_meshes_reach_the_parameters_of_one_device():
    out = run_on_host_devices(TRAIN, devices=8, timeout=600)
    found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(run["recipe"], run["optimizer"], run["mesh"]) for run in found] == [
        ("sft", "sgd", "fsdp=2,expert=4"), ("sft", "sgd", "data=2,fsdp=2,expert=2"),
        ("sft", "adam", "fsdp=2,expert=4"), ("grpo", "adam", "fsdp=2,expert=4")], out
    for run in found:
        tolerance = 1e-6 if run["optimizer"] == "sgd" else ADAM_ROUNDING
        assert run["gap"] <= tolerance, found
        assert run["moved"] > 10 * tolerance, found  # every leaf trained further than the tolerance
    refused = next(line for line in out.splitlines() if line.startswith("refused"))
    assert "experts dimension of 6 does not divide across the mesh's expert=4" in refused, refused


@pytest.mark.slow
def test_the_plan_divides_the_experts_weights_and_moments_by_the_expert_axis():
    out = run_on_host_devices(f"""
        import json
        from dew_lib.train.mesh import MeshSpec
        from dew_lib.train.plan import model_config, plan

        config = model_config({os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_moe")!r})  # 8 experts, 64 by 32
        for text in ("fsdp=2", "fsdp=2,expert=4"):
            found = plan(config, stage="sft", mesh=MeshSpec.parse(text), seq_len=9, batch=8, dtype="float32")
            print(json.dumps(dict(mesh=text, parameters=found.parameters, optimizer=found.optimizer,
                                  head=found.report().splitlines()[0])))
        """, devices=8, timeout=600)
    whole, split = (json.loads(line) for line in out.splitlines() if line.startswith("{"))
    experts = 3 * 2 * 8 * 64 * 32 * 4  # gate, up and down of every layer's experts, float32 bytes
    # the rest is split alike under both; the experts over fsdp=2, then also over expert=4
    assert whole["parameters"] - split["parameters"] == experts // 2 - experts // 8
    assert whole["optimizer"] - split["optimizer"] == 2 * (experts // 2 - experts // 8)  # Adam's two moments
    assert "on data=4 x fsdp=2 x tensor=1" in whole["head"]
    assert "on data=1 x fsdp=2 x expert=4 x tensor=1" in split["head"]

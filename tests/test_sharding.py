"""Sharded training on a named mesh: FSDP, tensor parallelism and both with data parallelism
train every recipe to the parameters data parallelism reaches on the same global batches, each
device holds its share of every split leaf, and checkpoints restore under another mesh.

The runs are tests/distributed_worker.py's on 8 host devices (`--mesh`): those of one process one
after another in a single process (`in_one_process`), the one of two processes as a `dew launch`
job. Sharded and replicated steps are the same arithmetic partitioned differently, so they agree
to float32 rounding: XLA sums a split contraction's partial products in another order.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import npz_leaves, run_on_host_devices, worker_job, xla_flags
from jax.sharding import AbstractMesh, PartitionSpec

from dew_lib.models import partitioning
from dew_lib.train.mesh import MeshSpec

pytestmark = pytest.mark.timeout(900)

ROUNDING = dict(rtol=1e-5, atol=1e-5)
ALL = ("sft", "dpo", "grpo", "ppo", "flow")
MESHES = {"fsdp": ("fsdp=8", ALL), "tensor": ("fsdp=4,tensor=2", ALL[:4]),
          "mixed": ("data=2,fsdp=2,tensor=2", ALL[:4])}


def mesh(**sizes):
    spec = MeshSpec(**sizes)
    return AbstractMesh(tuple(spec.shape(8).values()), partitioning.MESH_AXES)


def test_a_mesh_is_read_from_its_text_and_must_cover_the_devices():
    assert MeshSpec.parse("data=2, fsdp=2,tensor=2") == MeshSpec(data=2, fsdp=2, tensor=2)
    assert MeshSpec.parse("fsdp=4").shape(8) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    with pytest.raises(ValueError, match="the mesh data=2 x fsdp=2 x tensor=1 does not cover the job's 8 devices"):
        MeshSpec(data=2, fsdp=2).shape(8)
    with pytest.raises(ValueError, match="cannot read the mesh 'fsdp:8'.*axis=size pairs"):
        MeshSpec.parse("fsdp:8")
    with pytest.raises(ValueError, match="MeshSpec.tensor must be a whole number >= 1, got 0"):
        MeshSpec(tensor=0)


def test_a_parameter_s_logical_axes_decide_its_split_and_a_mesh_axis_serves_one_dimension():
    q = ("params", "layers", "q_proj", "kernel")
    assert partitioning.logical_axes(q, 3) == ("layers", "embed", "heads")
    assert partitioning.logical_axes(("opt", "mu", *q), 3) == ("layers", "embed", "heads")  # Adam's moment
    assert partitioning.logical_axes(q, 2) is None  # a leaf of another rank is not this parameter
    spec = partitioning.spec_for(("layers", "embed", "heads"), (2, 16, 16), mesh(fsdp=4, tensor=2), "q")
    assert spec == PartitionSpec(None, "fsdp", "tensor")
    # a width-by-width kernel whose both sides are `embed` is split on the first only
    assert partitioning.spec_for(("embed", "embed"), (16, 16), mesh(fsdp=8), "w") == PartitionSpec("fsdp")
    assert partitioning.spec_for(("layers", "norm"), (2, 16), mesh(fsdp=8), "n") == PartitionSpec()


def test_a_dimension_the_mesh_does_not_divide_and_an_undeclared_parameter_are_refused_by_name():
    with pytest.raises(ValueError, match=r"the parameter params/layers/k_proj/kernel \(2, 16, 6\): its kv_heads "
                                         r"dimension of 6 does not divide across the mesh's tensor=4"):
        partitioning.tree_specs({"params": {"layers": {"k_proj": {"kernel": np.zeros((2, 16, 6))}}}},
                                mesh(fsdp=2, tensor=4), required=True)
    with pytest.raises(ValueError, match=r"the parameter params/mystery/kernel \(4, 4\) has no declared logical "
                                         r"axes.*partitioning.declare"):
        partitioning.tree_specs({"params": {"mystery": {"kernel": np.zeros((4, 4))}}}, mesh(fsdp=8), required=True)
    # undeclared leaves of another tree (an optimizer's step count, a custom state) stay whole
    assert partitioning.tree_specs({"count": np.zeros(()), "other": np.zeros(4)}, mesh(fsdp=8)) == {
        "count": PartitionSpec(), "other": PartitionSpec()}


def test_each_device_holds_its_share_of_the_parameters_and_adam_s_moments():
    out = run_on_host_devices("""
        import jax, optax
        from conftest import lm_batches, tiny_model
        from dew_lib import Dataset, LMObjective, Trainer
        from dew_lib.train.mesh import MeshSpec

        batches = list(lm_batches(0, 8, 9, count=2))
        for mesh in (MeshSpec(fsdp=8), MeshSpec(fsdp=4, tensor=2)):
            trainer = Trainer(LMObjective(tiny_model(), seq_len=8), optax.adamw(1e-2), key=jax.random.key(0),
                              mesh=mesh)
            state = trainer.fit(Dataset(train=lambda p: iter(batches), batch=8), steps=2, sinks=[])
            layers, moments = state.params["params"]["layers"], state.opt_state[0].mu["params"]["layers"]
            for name, leaf in (("q", layers["q_proj"]["kernel"]), ("mu", moments["q_proj"]["kernel"]),
                               ("down", layers["down_proj"]["kernel"]), ("norm", layers["input_layernorm"]["weight"]),
                               ("embed", state.params["params"]["embed_tokens"]["embedding"])):
                print(mesh, name, leaf.shape, leaf.addressable_shards[0].data.shape)
        """, devices=8, timeout=300)
    held = {" ".join(line.split()[:2]): line.split(maxsplit=2)[2] for line in out.splitlines()}
    # FSDP splits the model width of each weight 8 ways; norms stay whole.
    assert held["fsdp=8,tensor=1 q"] == "(2, 16, 16) (2, 2, 16)"
    assert held["fsdp=8,tensor=1 mu"] == "(2, 16, 16) (2, 2, 16)"
    assert held["fsdp=8,tensor=1 down"] == "(2, 32, 16) (2, 32, 2)"
    assert held["fsdp=8,tensor=1 norm"] == "(2, 16) (2, 16)"
    # Tensor parallelism splits heads and the MLP's units in two, FSDP the width in four.
    assert held["fsdp=4,tensor=2 q"] == "(2, 16, 16) (2, 4, 8)"
    assert held["fsdp=4,tensor=2 mu"] == "(2, 16, 16) (2, 4, 8)"
    assert held["fsdp=4,tensor=2 down"] == "(2, 32, 16) (2, 16, 4)"
    assert held["fsdp=4,tensor=2 embed"] == "(32, 16) (16, 4)"


def in_one_process(runs, timeout=840):
    """Run tests/distributed_worker.py once for each `(name, arguments)` of `runs`, one run after
    another in a single process on 8 host devices, as `worker_job(1, 8, *arguments)` runs it in a
    process of its own: each run builds its own trainers and compiles its own programs (its
    parameters are bit for bit those of a process of its own), only the start (imports, devices)
    is shared, and no launcher runs (for one process it adds nothing but the `[0] ` prefix).
    Returns each run's output, its logged steps included, by name."""
    script = textwrap.dedent(f"""
        import sys
        import distributed_worker
        sys.stderr = sys.stdout  # the steps' lines, and any traceback, with the rest as `dew launch` relays them
        for name, arguments in {[(name, [str(a) for a in arguments]) for name, arguments in runs]!r}:
            print("---", name, flush=True)
            sys.argv = ["distributed_worker.py", *arguments]
            distributed_worker.main()
        """)
    tests = os.path.dirname(__file__)
    env = dict(os.environ, XLA_FLAGS=xla_flags("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    blocks = ("\n" + done.stdout).split("\n--- ")[1:]  # each: "<name>\n<the run's lines>"
    return dict(block.split("\n", 1) for block in blocks)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Three steps of each recipe on 8 host devices: all on `data`, and under each mesh; then two
    steps of SFT under FSDP that checkpoint each step (`written`, which the resume test starts
    from). One process runs them all: a job per run started the launcher and the worker (imports,
    devices) each time, about 8 s of CPU a run before it compiled anything."""
    where = tmp_path_factory.mktemp("meshes")
    runs = [("data", [",".join(ALL), where / "data"])]
    runs += [(name, [",".join(recipes), where / name, "--mesh", spec]) for name, (spec, recipes) in MESHES.items()]
    runs.append(("written", ["sft", where / "written", "--steps", "2", "--directory", where / "checkpoints",
                             "--mesh", "fsdp=8"]))
    return where, in_one_process(runs)


@pytest.mark.slow
def test_every_recipe_trains_under_fsdp_and_tensor_parallelism_like_data_parallelism(trained):
    where, outputs = trained
    for name, (_, recipes) in MESHES.items():
        for recipe in recipes:
            assert f"{recipe} process 0 of 1 devices 8 step 3" in outputs[name]
            for replicated, split in zip(npz_leaves(where / f"data-{recipe}.npz"),
                                         npz_leaves(where / f"{name}-{recipe}.npz"), strict=True):
                np.testing.assert_allclose(split, replicated, **ROUNDING, err_msg=f"{recipe} under {name}")


@pytest.mark.slow
def test_every_split_leaf_holds_its_bytes_over_its_axes_on_each_device(trained):
    _, outputs = trained
    held = {}
    for name, out in outputs.items():
        assert "uneven" not in out, out
        for line in out.splitlines():
            if line.startswith("split "):  # "split sft 59 leaves 12812 bytes on device 0 of 91660"
                words = line.split()
                held[name, words[1]] = int(words[4]) / int(words[-1])
    assert all(held["data", recipe] == 1 for recipe in ALL)
    for recipe in ALL:  # all but the norms, biases and step counts split 8 ways
        assert held["fsdp", recipe] < 0.25, (recipe, held["fsdp", recipe])
    for recipe in MESHES["mixed"][1]:  # data replicates: split 4 ways
        assert held["mixed", recipe] < 0.35, (recipe, held["mixed", recipe])


@pytest.mark.slow
def test_a_checkpoint_written_under_fsdp_resumes_under_every_other_mesh(trained, tmp_path):
    """The fixture's `written` run checkpointed SFT at step 2 under fsdp=8; a copy of it resumes
    for step 3 under each other mesh, all in one process, and ends where data parallelism did."""
    where, outputs = trained
    assert "step 2/2" in outputs["written"]
    specs = ("data=8", "fsdp=4,tensor=2", "data=2,fsdp=2,tensor=2")
    for index in range(len(specs)):
        shutil.copytree(where / "checkpoints", tmp_path / f"resumed-{index}")
    resumed = in_one_process([(spec, ["sft", tmp_path / f"resumed-{index}", "--steps", "3", "--directory",
                                      tmp_path / f"resumed-{index}", "--mesh", spec])
                              for index, spec in enumerate(specs)])
    for index, spec in enumerate(specs):
        assert "resuming from the checkpoint" in resumed[spec] and "step 3/3" in resumed[spec]
        for replicated, split in zip(npz_leaves(where / "data-sft.npz"),
                                     npz_leaves(tmp_path / f"resumed-{index}-sft.npz"), strict=True):
            np.testing.assert_allclose(split, replicated, **ROUNDING, err_msg=spec)


@pytest.mark.slow
def test_two_processes_train_under_fsdp_over_both_like_one_process(trained, tmp_path):
    where, _ = trained
    two = worker_job(2, 4, "sft,dpo", tmp_path / "two", "--mesh", "fsdp=8")
    for recipe in ("sft", "dpo"):
        assert f"[1] {recipe} process 1 of 2 devices 8 step 3" in two.stdout
        for one, split in zip(npz_leaves(where / f"fsdp-{recipe}.npz"), npz_leaves(tmp_path / f"two-{recipe}.npz"),
                              strict=True):
            np.testing.assert_allclose(split, one, **ROUNDING, err_msg=recipe)

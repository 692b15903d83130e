"""The memory planner: what it predicts for a small model is what the real trained state holds
and what the real compiled step's XLA analysis says; `dew plan` prints a verdict and refuses
what it cannot read."""

import json
import subprocess
import sys

import pytest
from conftest import run_on_host_devices

from dew_lib.plan_tables import DEVICE_BYTES, MODELS

SMALL = {**MODELS["qwen3-0.6b"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 256,
         "max_position_embeddings": 64, "tie_word_embeddings": False}


def dew_plan(*argv):
    return subprocess.run([sys.executable, "-m", "dew_lib.cli", "plan", *map(str, argv)], capture_output=True,
                          text=True, timeout=600)


def test_the_plan_of_a_small_model_is_what_its_trained_state_holds_and_its_step_uses():
    out = run_on_host_devices(f"""
        import json, jax, numpy as np, optax
        from dew_lib import Dataset, LMObjective, Trainer, models
        from dew_lib.models.pretrained.families import decoder_options
        from dew_lib.train.mesh import MeshSpec
        from dew_lib.train.plan import plan

        config, mesh = {SMALL!r}, MeshSpec(fsdp=4, tensor=2)
        predicted = plan(config, stage="sft", mesh=mesh, seq_len=33, batch=8, dtype="float32", device=10**9)
        options = decoder_options(config)[1]
        model = models.build("causal_transformer", **options, attention_kernel="blockwise")
        objective = LMObjective(model, seq_len=32, ema_decay=None)
        trainer = Trainer(objective, optax.adamw(1e-6), key=jax.random.key(0), mesh=mesh)
        rows = np.random.default_rng(0).integers(1, 256, (8, 33)).astype(np.int32)
        batch = {{"text": rows, "text_segment_ids": np.ones_like(rows)}}
        state = trainer.fit(Dataset(train=lambda p: iter([batch]), batch=8), steps=1, sinks=[])
        held = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
        compiled = trainer._steps[True].lower(state, trainer._shard(batch)).compile()
        print(json.dumps(dict(planned=[predicted.parameters, predicted.optimizer, predicted.reference],
                              held=[held(state.params), held(state.opt_state), 0],
                              whole=sum(x.nbytes for x in jax.tree.leaves(state.params)),
                              temporary=[predicted.temporary, compiled.memory_analysis().temp_size_in_bytes],
                              fits=predicted.fits)))
        """, devices=8, timeout=300)
    found = json.loads(out.splitlines()[-1])
    assert found["planned"] == found["held"]  # the state's bytes are exact
    assert found["held"][0] < found["whole"] / 4  # split over fsdp=4 x tensor=2 but for norms
    planned, real = found["temporary"]
    assert abs(planned - real) <= 0.1 * real, found["temporary"]
    assert found["fits"] is True


@pytest.mark.slow
def test_dew_plan_gives_the_verdicts_of_qwen3_sizes_on_h200s():
    small = dew_plan("--model", "qwen3-0.6b", "--mesh", "fsdp=8", "--stage", "sft", "--seq-len", 2048,
                     "--batch", 16, "--device", "h200", "--remat")
    assert small.returncode == 0, small.stderr
    assert "fits:" in small.stdout and "optimizer state" in small.stdout
    # 32B on one H200: its bfloat16 weights alone are 65 GB, and Adam's moments twice that.
    large = dew_plan("--model", "qwen3-32b", "--stage", "sft", "--seq-len", 1024, "--batch", 1, "--device",
                     "h200", "--remat")
    assert large.returncode == 2, large.stderr
    assert "does NOT fit" in large.stdout and "twice the fsdp halves it" in large.stdout


def test_dew_plan_refuses_what_it_cannot_read():
    unknown = dew_plan("--model", "llama-9000", "--stage", "sft", "--seq-len", 8, "--batch", 1)
    assert unknown.returncode == 1
    assert "'llama-9000' is neither a known model (qwen3-0.6b" in unknown.stderr
    mesh = dew_plan("--model", "qwen3-0.6b", "--mesh", "fsdp:8", "--stage", "sft", "--seq-len", 8, "--batch", 1)
    assert mesh.returncode == 1 and "cannot read the mesh 'fsdp:8'" in mesh.stderr
    uneven = dew_plan("--model", "qwen3-0.6b", "--mesh", "fsdp=2", "--stage", "dpo", "--seq-len", 8, "--batch", 3)
    assert uneven.returncode == 1
    assert "3 rows a micro-step do not split over the mesh's data x fsdp = 2" in uneven.stderr
    assert DEVICE_BYTES["h200"] == 143_771 * 2**20


def test_distill_plans_the_student_and_a_frozen_teacher_copy_as_a_real_step_holds_them():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from dew_lib import Trainer, models
    from dew_lib.models.pretrained.families import decoder_options
    from dew_lib.objectives import DistillObjective
    from dew_lib.train.mesh import MeshSpec
    from dew_lib.train.plan import _batch, plan

    mesh = MeshSpec()
    predicted = plan(SMALL, stage="distill", mesh=mesh, seq_len=33, batch=8, dtype="float32", device=10**9)
    # The student and its optimizer, and the teacher (of the student's config) frozen beside them.
    assert predicted.reference == predicted.parameters and predicted.fits is True
    assert predicted.report().startswith("distill: 8 rows of 33 ids a step")
    # A real distillation from a teacher of that config holds those bytes, and its step compiles to that peak.
    model = models.build("causal_transformer", **decoder_options(SMALL)[1], attention_kernel="blockwise")
    teacher = jax.jit(model.init)(jax.random.key(1), jnp.zeros((1, 8), jnp.int32))
    objective = DistillObjective(model, 32, teacher_model=model, teacher=teacher, loss="jsd")
    trainer = Trainer(objective, optax.adamw(1e-6), key=jax.random.key(0), mesh=mesh)
    state = trainer.initial_state()

    def held(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree))

    assert [held(state.params), held(state.opt_state), held(state.ema)] == [
        predicted.parameters, predicted.optimizer, predicted.reference]
    batch = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), _batch("distill", 8, 33, objective))
    real = trainer._steps[True].lower(state, trainer._shard(batch)).compile().memory_analysis().temp_size_in_bytes
    assert abs(predicted.temporary - real) <= 0.1 * real, (predicted.temporary, real)

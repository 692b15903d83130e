"""The GPU path, checked on the CPU.

`attention_kernel="dot_product"` (`jax.nn.dot_product_attention`, cuDNN's kernel on an NVIDIA
GPU) gives the dense and blockwise attention's numbers on plain, left-padded and packed rows
with grouped heads, forward and backward; "auto" picks the fused kernel on the CPU, dot_product
on a GPU that cuDNN serves and blockwise elsewhere; bfloat16 compute with float32 parameters
trains; `bench/gpu.py --dry-run` runs every part.

Not checked here (no GPU): that cuDNN compiles and runs the masked call, and its numbers. On the
CPU the dot_product kernel runs JAX's XLA form; the cuDNN branch is exercised with the XLA form
standing in for the cuDNN call.
"""

import functools
import importlib.util
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import dense_mask, tiny_model, xla_flags

from dew_lib import Dataset, LMObjective, Trainer
from dew_lib.models import decoder_attention
from dew_lib.models.decoder_attention import attend, attend_causal, pick_kernel
from dew_lib.objectives.lm import score_targets
from dew_lib.train.sinks import MemorySink

ROOT = Path(__file__).resolve().parents[1]
SEGMENTS = {  # 3 rows of 12: one document each; left-padded; packed with trailing padding
    "plain": np.ones((3, 12), np.int32),
    "padded": np.array([[0] * 4 + [1] * 8, [0] * 7 + [1] * 5, [1] * 12], np.int32),
    "packed": np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 3 + [2] * 3 + [3] * 6, [1] * 12], np.int32),
}


def random_heads(seed, s=12, d=8):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (3, s, 4, d))
    k = jax.random.normal(keys[1], (3, s, 2, d))  # grouped: 2 query heads per key head
    v = jax.random.normal(keys[2], (3, s, 2, d))
    return q, k, v, jax.random.normal(keys[3], (3, s, 4 * d))


def outputs_and_grads(f, q, k, v, mix):
    out = f(q, k, v)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * mix), argnums=(0, 1, 2))(q, k, v)
    return out, grads


@pytest.mark.parametrize("layout", sorted(SEGMENTS))
def test_dot_product_attention_equals_dense_and_blockwise_with_gradients(layout):
    segments = jnp.asarray(SEGMENTS[layout])
    q, k, v, mix = random_heads(1)
    got = outputs_and_grads(lambda *a: attend_causal(*a, segments, 5, "dot_product"), q, k, v, mix)
    dense = outputs_and_grads(lambda *a: attend(*a, dense_mask(segments)), q, k, v, mix)
    blockwise = outputs_and_grads(lambda *a: attend_causal(*a, segments, 5, "blockwise"), q, k, v, mix)
    for want in (dense, blockwise):
        np.testing.assert_allclose(got[0], want[0], atol=1e-6)
        for g, w in zip(got[1], want[1], strict=True):
            np.testing.assert_allclose(g, w, atol=1e-5)


def model_outputs(model, variables, segments):
    tokens = np.random.default_rng(0).integers(1, 32, (3, 13)).astype(np.int32)
    positions = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0],  # the packed rows' positions
                          [0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 5], list(range(12))], np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss(params):
        log_probs = score_targets(model, params, inputs, targets, segments, positions)[0]
        return -jnp.sum(log_probs * (segments > 0))

    return model.apply(variables, inputs, segments, positions), jax.grad(loss)(variables)


def test_decoder_with_dot_product_attention_matches_blockwise_on_packed_rows():
    segments = SEGMENTS["packed"]
    reference = tiny_model(attention_kernel="blockwise", attention_block=4, head_dim=8)
    variables = jax.jit(reference.init)(jax.random.key(2), jnp.zeros((1, 8), jnp.int32))
    want_logits, want_grads = model_outputs(reference, variables, segments)
    logits, grads = model_outputs(tiny_model(attention_kernel="dot_product", head_dim=8), variables,
                                  segments)
    np.testing.assert_allclose(logits, want_logits, atol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), grads, want_grads)


@pytest.fixture
def backend(monkeypatch):
    """Set what `jax.default_backend()` answers to decoder_attention (JAX itself keeps the CPU)."""
    decoder_attention._warn_blockwise.cache_clear()
    decoder_attention._cudnn_refusal.cache_clear()

    def use(name, cudnn_takes=None):
        monkeypatch.setattr(jax, "default_backend", lambda: name)
        if cudnn_takes is not None:
            monkeypatch.setattr(decoder_attention, "cudnn_refusal",
                                lambda *a: None if cudnn_takes else "refused for the test")

    yield use
    decoder_attention._warn_blockwise.cache_clear()
    decoder_attention._cudnn_refusal.cache_clear()


def shapes(d=8, dtype=jnp.bfloat16):
    return (jax.ShapeDtypeStruct((2, 16, 4, d), dtype), jax.ShapeDtypeStruct((2, 16, 2, d), dtype))


def test_auto_picks_fused_on_the_cpu_dot_product_on_a_gpu_and_blockwise_elsewhere(backend):
    backend("cpu")
    assert pick_kernel("auto", *shapes()) == "fused"
    assert pick_kernel("auto", *shapes(d=12)) == "blockwise"  # the fused kernel tiles by 8
    for gpu in ("gpu", "cuda", "rocm"):
        backend(gpu, cudnn_takes=True)
        assert pick_kernel("auto", *shapes()) == "dot_product"
    backend("tpu", cudnn_takes=True)
    assert pick_kernel("auto", *shapes()) == "blockwise"
    for kernel in ("blockwise", "dot_product"):  # asked for by name: run as asked, anywhere
        assert pick_kernel(kernel, *shapes()) == kernel
    with pytest.raises(ValueError, match="attention kernel must be one of .*'cudnn'"):
        pick_kernel("cudnn", *shapes())


def test_fused_kernel_off_the_cpu_is_a_clear_error(backend):
    backend("gpu", cudnn_takes=True)
    with pytest.raises(ValueError, match="'fused' is Dew's XLA:CPU kernel.*'gpu'.*dot_product"):
        pick_kernel("fused", *shapes())


def test_auto_on_a_gpu_without_cudnn_warns_and_runs_blockwise(backend):
    backend("gpu")  # the real question to JAX: on this machine there is no cuDNN to ask
    refusal = decoder_attention.cudnn_refusal((2, 16, 4, 8), (2, 16, 2, 8), jnp.bfloat16)
    assert refusal is not None and "cuDNN" in refusal
    with pytest.warns(RuntimeWarning, match="blockwise attention: cuDNN's attention does not take"):
        assert pick_kernel("auto", *shapes()) == "blockwise"


def test_cudnn_refusal_off_a_gpu_says_so():
    assert "not a GPU" in decoder_attention.cudnn_refusal((1, 4, 2, 8), (1, 4, 2, 8), jnp.float32)


@pytest.mark.parametrize("s", [12, 11])
def test_the_cudnn_branch_on_a_gpu_changes_no_numbers(backend, monkeypatch, s):
    # On a "gpu" whose cuDNN takes the inputs, "auto" runs the cuDNN call; here JAX's XLA form
    # stands in for it. An odd length is padded by one position of its own segment.
    backend("gpu", cudnn_takes=True)
    asked = []
    xla = decoder_attention._dot_product

    def stand_in(q, k, v, segment_ids, implementation):
        asked.append((implementation, q.shape[1]))
        return xla(q, k, v, segment_ids, "xla")

    monkeypatch.setattr(decoder_attention, "_dot_product", stand_in)
    segments = jnp.asarray(SEGMENTS["packed"][:, :s])
    q, k, v, mix = (x[:, :s] for x in random_heads(3))
    got = outputs_and_grads(jax.jit(lambda *a: attend_causal(*a, segments, 5)), q, k, v, mix)
    assert asked and all(a == ("cudnn", s + s % 2) for a in asked)
    want = outputs_and_grads(lambda *a: attend(*a, dense_mask(segments)), q, k, v, mix)
    np.testing.assert_allclose(got[0], want[0], atol=1e-6)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)


def train(dtype, kernel, steps=2):
    """Losses, final state, starting parameters and model of a tiny model trained in `dtype`."""
    model = tiny_model(dtype=dtype, param_dtype=jnp.float32, head_dim=8, attention_kernel=kernel)
    rows = np.random.default_rng(0).integers(1, 32, (4, 17)).astype(np.int32)
    trainer = Trainer(LMObjective(model, seq_len=16, ema_decay=None),
                      optax.sgd(0.5, momentum=0.9), key=jax.random.key(0))
    sink = MemorySink()
    start = trainer.initial_state().params
    state = trainer.fit(Dataset(train=lambda p: itertools.repeat({"text": rows}), batch=4),
                        steps=steps, log_every=1, sinks=[sink])
    return [m["loss"] for _, m in sink.history], state, start, model


@functools.cache
def float32_run():
    """The float32 reference, once: the kernels agree to float32 rounding (tests above)."""
    return train(jnp.float32, "blockwise")


@pytest.mark.parametrize("kernel", ["auto", "blockwise", "dot_product"])  # auto: the fused kernel
def test_bfloat16_compute_keeps_float32_master_weights_and_the_float32_run(kernel):
    losses, state, start, model = train(jnp.bfloat16, kernel)
    want_losses, want_state, want_start, _ = float32_run()
    jax.tree.map(np.testing.assert_array_equal, start, want_start)  # same float32 initialization
    assert all(np.isfinite(losses))
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype  # parameters, momentum
    assert jax.tree.leaves(state.opt_state)  # the momentum is there, and float32
    np.testing.assert_allclose(losses, want_losses, rtol=1e-3)
    # the parameters moved as the float32 run's did, within bfloat16's rounding of the
    # gradients (its 8-bit mantissa: a relative error of about 0.4%, 0.5% measured)
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: a - b, state.params, start))
    want_moved = jax.tree.leaves(jax.tree.map(lambda a, b: a - b, want_state.params, want_start))
    differ = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(moved, want_moved, strict=True)))
    size = np.sqrt(sum(np.sum(b**2) for b in want_moved))
    assert 0 < differ < 0.02 * size, (differ, size)  # 0 would mean no bfloat16 arithmetic ran
    # and the matmuls did run in bfloat16: the forward pass's products take bfloat16 operands
    tokens = jnp.zeros((1, 8), jnp.int32)
    text = str(jax.make_jaxpr(model.apply)(state.params, tokens))
    products = [line for line in text.splitlines() if "dot_general" in line]
    assert products and sum("bf16[" in line for line in products) >= len(products) // 2


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_peak_table_and_flop_count():
    bench = load_bench()
    assert bench.table_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert bench.table_peak("NVIDIA H100 PCIe") == 756e12
    assert bench.table_peak("NVIDIA H200") == 989e12
    assert bench.table_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert bench.table_peak("NVIDIA L40S") == 362e12
    assert bench.table_peak("NVIDIA L4") == 121e12
    assert bench.table_peak("NVIDIA L40") is None and bench.table_peak("cpu") is None  # measured
    # 6 x the matmul parameters: every parameter but the norms' (the tied head counted once)
    shape = bench.model_shape(dry_run=True)
    from dew_lib import models

    model = models.build("causal_transformer", **shape)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    norms = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
                if "norm" in jax.tree_util.keystr(path))
    total = sum(x.size for x in jax.tree.leaves(params))
    attention = 12 * shape["num_layers"] * shape["num_heads"] * shape["head_dim"] * 32
    assert bench.flops_per_token(shape, 32) == 6 * (total - norms) + attention


@pytest.mark.slow  # five processes compile a tiny model each: about a minute on 2 cores
def test_bench_gpu_dry_run_runs_every_part_on_the_cpu():
    env = dict(os.environ, XLA_FLAGS=xla_flags())  # no host device count: the bench sets its own
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu.py"), "--dry-run"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = done.stdout
    assert out.startswith("cpu: ")  # the machine header every bench prints
    values = dict(re.findall(r"^(.+?)\s{2,}(.+)$", out, re.MULTILINE))
    assert values["device"].startswith("cpu x 1 (cpu")
    assert float(values["SFT 4x32: tokens/s"].replace(",", "")) > 0
    # On a CPU the "peak" is a matmul rate measured in another process at another moment; on a
    # shared machine the step can run while that matmul ran crowded, so only a datasheet peak
    # bounds this ratio by 1. Here it must be a number the formula produced, nothing more.
    assert float(values["SFT: MFU (model FLOP/s / device peak)"]) > 0
    assert values["SFT: attention kernel, parameter dtypes"] == "fused, float32"
    grpo = values["GRPO 4 rows x 16: tokens/s (prompt + completion, whole step)"]
    assert float(grpo.replace(",", "")) > 0
    assert values["GRPO / prime-rl 13.3k tokens/s (Qwen3-0.6B RL, one H100)"].endswith("x")
    assert float(values["SFT, 2 processes x 1 device: tokens/s"].replace(",", "")) > 0
    fsdp = values["SFT 4x32, FSDP 2, float32 parameters: tokens/s"]
    assert float(fsdp.split()[0].replace(",", "")) > 0
    assert re.fullmatch(r"[\d.]+ MB \(state [\d.]+ MB, temporary [\d.]+ MB\)",
                        values["SFT, FSDP 2: planned bytes per device (dew plan, XLA:CPU)"])
    assert values["SFT, FSDP 2: measured peak on device 0"] == "not reported (cpu gives no memory_stats)"
    assert "note" not in values, values["note"]  # nothing failed over to another kernel

"""The compiled XLA:CPU attention kernel: the dense attention's numbers on rows of several
tiles (packed, padded, grouped heads), any dtype in, one build per machine, a clear error
without a compiler, and a batch split over host devices without gathering it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import dense_mask, run_on_host_devices

from dew_lib.kernels import KernelBuildError, build
from dew_lib.models import decoder_attention
from dew_lib.models.decoder_attention import attend, attend_causal
from dew_lib.models.fused_attention import causal_attention


def random_heads(seed, b, s, h, kv, d):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (b, s, h, d)), jax.random.normal(keys[1], (b, s, kv, d)),
            jax.random.normal(keys[2], (b, s, kv, d)), jax.random.normal(keys[3], (b, s, h * d)))


# 150 queries: tiles of 64, 64 and 22. Row 0 is one document; row 1 packs a document that
# ends inside the first tile and one that fills the rest, so its last tile never meets the
# first; row 2 is left-padded across a tile boundary.
SEGMENTS = np.array([[1] * 150,
                     [1] * 40 + [2] * 110,
                     [0] * 70 + [1] * 80], np.int32)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (2, 2, 64), (6, 1, 8)])
def test_fused_attention_equals_dense_attention_over_several_tiles(heads, kv_heads, dim):
    q, k, v, mix = random_heads(0, 3, 150, heads, kv_heads, dim)
    segments = jnp.asarray(SEGMENTS)

    def fused(q, k, v):
        return attend_causal(q, k, v, segments, 64, kernel="fused")

    def dense(q, k, v):
        return attend(q, k, v, dense_mask(segments))

    np.testing.assert_allclose(fused(q, k, v), dense(q, k, v), atol=2e-6)
    grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * mix), argnums=(0, 1, 2)))(q, k, v)
             for f in (fused, dense)]
    for got, want in zip(*grads, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_fused_attention_takes_bfloat16_and_returns_it():
    q, k, v, _ = random_heads(1, 2, 70, 4, 2, 16)
    segments = jnp.ones((2, 70), jnp.int32)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = causal_attention(*low, segments)
    assert out.dtype == jnp.bfloat16
    want = causal_attention(*(x.astype(jnp.float32) for x in low), segments)
    np.testing.assert_array_equal(out, want.astype(jnp.bfloat16))


def heads_of(dim, heads=2, kv_heads=2):
    """Queries and keys of one row of 8 as shapes: what `pick_kernel` reads."""
    return (jax.ShapeDtypeStruct((1, 8, heads, dim), jnp.float32),
            jax.ShapeDtypeStruct((1, 8, kv_heads, dim), jnp.float32))


def test_fused_attention_refuses_a_head_dim_it_cannot_tile():
    q, k, v, _ = random_heads(2, 1, 8, 2, 2, 12)
    with pytest.raises(ValueError, match="multiple of 8.*head_dim=12.*blockwise"):
        causal_attention(q, k, v, jnp.ones((1, 8), jnp.int32))
    # "auto" picks the blockwise form for it instead
    assert decoder_attention.pick_kernel("auto", *heads_of(12)) == "blockwise"
    assert decoder_attention.pick_kernel("auto", *heads_of(16)) == "fused"


def test_the_kernel_builds_once_per_machine_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DEW_KERNEL_CACHE", str(tmp_path))
    library = build.build("causal_attention")
    assert library.parent == tmp_path and library.suffix == ".so"
    built = library.stat().st_mtime_ns
    assert build.build("causal_attention") == library
    assert library.stat().st_mtime_ns == built
    assert [p.name for p in tmp_path.iterdir()] == [library.name]  # no partial files left


def test_an_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DEW_KERNEL_CACHE", str(blocker / "kernels"))
    with pytest.raises(KernelBuildError, match="cannot write the kernel cache.*DEW_KERNEL_CACHE"):
        build.build("causal_attention")


def test_no_compiler_is_a_clear_error_and_auto_warns_and_runs_blockwise(tmp_path, monkeypatch):
    monkeypatch.setenv("DEW_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(KernelBuildError, match="`no-such-compiler` is not on PATH.*blockwise"):
        build.build("causal_attention")

    def missing():
        raise KernelBuildError("no C++ compiler")

    monkeypatch.setattr(decoder_attention, "load_causal_attention", missing)
    decoder_attention._warn_blockwise.cache_clear()
    with pytest.warns(RuntimeWarning, match="blockwise attention: no C\\+\\+ compiler"):
        assert decoder_attention.pick_kernel("auto", *heads_of(16)) == "blockwise"


def test_a_sharded_batch_runs_on_each_device_without_gathering():
    out = run_on_host_devices("""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec
        from dew_lib.models.fused_attention import causal_attention

        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (4, 80, 4, 16))
        k, v = (jax.random.normal(key, (4, 80, 2, 16)) for key in keys[1:3])
        mix = jax.random.normal(keys[3], q.shape)
        segments = jnp.asarray(np.repeat([[1] * 30 + [2] * 50], 4, axis=0), jnp.int32)
        loss = jax.jit(jax.value_and_grad(
            lambda q, k, v, s: jnp.sum(causal_attention(q, k, v, s) * mix), argnums=(0, 1, 2)))
        batch = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec("data"))
        placed = [jax.device_put(x, batch) for x in (q, k, v, segments)]
        one, split = loss(q, k, v, segments), loss(*placed)
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(split)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        program = loss.lower(*placed).compile().as_text()
        calls = [line for line in program.splitlines() if "custom_call_target=\\"dew_causal" in line]
        on_batch = all(g.sharding.spec == PartitionSpec("data") for g in split[1])
        print(len(calls), "all-gather" in program, on_batch)
        print(sorted({line.split("custom-call(")[0].split("=")[-1].strip() for line in calls}))
    """)
    # one forward and one backward call, no gather, gradients still split over the batch
    assert out.splitlines()[0] == "2 False True"
    assert "f32[2,80,4,16]" in out.splitlines()[1]  # each device's half of the batch

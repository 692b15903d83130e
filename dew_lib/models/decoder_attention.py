"""The decoder's attention, in the layout of its projections: queries `[B, S, H, D]`, keys and
values `[B, S, KV, D]`, grouped-query heads.

`attend` is dense attention under any mask (the reference); `attend_causal` is causal attention
within segments, through the compiled XLA:CPU kernel (`fused_attention`), through
`jax.nn.dot_product_attention` (cuDNN's flash attention on NVIDIA GPUs), or by blocks of queries
(`attention.causal_heads`), as `attention_kernel` picks; `attend_cached` is one decode step's
query against a head-major KV cache.

Not here: the softmax kernels (`attention`, `fused_attention`), the cache (`decoder.KVCache`),
the projections around attention (`decoder_layer.Block`), a TPU kernel (TPUs run the blockwise
form).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from dew_lib.kernels import KernelBuildError, load_causal_attention
from dew_lib.models import attention, fused_attention
from dew_lib.options import choice


def attend(q, k, v, mask):
    """Grouped-query attention: q `[B, Q, H, D]`, k/v `[B, T, KV, D]`, mask `[B, Q, T]`.

    Computed heads-first with batch and kv-head merged into one batch axis (`[B*KV, G*Q, D]`):
    XLA:CPU runs a single-batch-axis product much faster than one with two batch axes. The
    dense reference for `attend_causal`, and what any other mask uses.
    """
    b, sq, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    t = k.shape[1]
    qh = q.reshape(b, sq, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b * kv, g * sq, d)
    kh = k.transpose(0, 2, 1, 3).reshape(b * kv, t, d)
    vh = v.transpose(0, 2, 1, 3).reshape(b * kv, t, d)
    return attention.heads(qh, kh, vh, mask, g).reshape(b, kv, g, sq, d).transpose(
        0, 3, 1, 2, 4).reshape(b, sq, h * d)


ATTENTION_KERNELS = ("auto", "fused", "blockwise", "dot_product")
# What `jax.default_backend()` calls a GPU: "gpu" with jaxlib's CUDA and ROCm plugins; "cuda" and
# "rocm" where a platform is named for its vendor.
GPU_BACKENDS = ("gpu", "cuda", "rocm")


def attend_causal(q, k, v, segment_ids, block: int, kernel: str = "auto"):
    """Causal self-attention within segments: q `[B, S, H, D]`, k/v `[B, S, KV, D]`,
    segment_ids `[B, S]` (a query sees earlier keys of its own segment; padding, segment 0,
    sees padding). Returns `[B, S, H * D]`.

    `kernel` picks the implementation (`pick_kernel` says which "auto" runs):
    "fused", the compiled XLA:CPU kernel of `fused_attention` (tiles kept in cache; about twice
    the blockwise form's speed on CPU), CPU only;
    "dot_product", `jax.nn.dot_product_attention` with `is_causal` and the segments as a
    boolean mask: cuDNN's flash attention on an NVIDIA GPU when cuDNN takes the inputs
    (bfloat16 or float16, head dim a multiple of 8 up to 128, 256 from Hopper on), else
    JAX's XLA form, which holds every `[S, S]` score of every head;
    "blockwise", XLA operations by blocks of `block` queries, for any backend and head size;
    "auto", "fused" on the CPU when the head dim is a multiple of 8 (and the kernel builds),
    "dot_product" on a GPU when cuDNN takes the inputs, else "blockwise" (TPUs included).
    """
    b, s, h, d = q.shape
    picked = pick_kernel(kernel, q, k)
    if picked == "fused":
        return fused_attention.causal_attention(q, k, v, segment_ids).reshape(b, s, h * d)
    if picked == "dot_product":
        return _attend_dot_product(q, k, v, segment_ids).reshape(b, s, h * d)
    return _attend_blockwise(q, k, v, segment_ids, block)


def pick_kernel(kernel: str, q, k) -> str:
    """The implementation `attend_causal(..., kernel=kernel)` runs for queries `q` and keys `k`
    (arrays or shapes-and-dtypes) on JAX's default backend: "fused", "dot_product" or
    "blockwise"."""
    choice("attention kernel", kernel, ATTENTION_KERNELS)
    backend = jax.default_backend()
    if kernel == "fused" and backend != "cpu":
        raise ValueError(
            f"attention_kernel='fused' is Dew's XLA:CPU kernel and JAX's default backend is "
            f"{backend!r}; use 'auto' (on a GPU: 'dot_product', cuDNN's flash attention) or "
            "'blockwise'")
    if kernel != "auto":
        return kernel
    _, _, h, d = q.shape
    if backend == "cpu":
        return "fused" if _fused_builds(d, h, k.shape[2]) else "blockwise"
    if backend in GPU_BACKENDS:
        refusal = cudnn_refusal(q.shape, k.shape, q.dtype)
        if refusal is None:
            return "dot_product"
        _warn_blockwise(f"cuDNN's attention does not take these inputs ({refusal}); "
                        "bfloat16 compute (dtype=jnp.bfloat16) lets it")
    return "blockwise"


def _fused_builds(head_dim: int, heads: int, kv_heads: int) -> bool:
    if not fused_attention.supported(head_dim, heads, kv_heads):
        return False
    try:
        load_causal_attention()
    except KernelBuildError as error:
        _warn_blockwise(str(error))
        return False
    return True


@functools.cache
def _warn_blockwise(reason: str) -> None:
    warnings.warn(f"attention_kernel='auto' runs the slower blockwise attention: {reason}",
                  RuntimeWarning, stacklevel=4)


def cudnn_refusal(q_shape: tuple[int, ...], kv_shape: tuple[int, ...], dtype) -> str | None:
    """Why cuDNN's attention (`implementation="cudnn"`) would not take queries of `q_shape` and
    keys and values of `kv_shape` in `dtype` under the causal segment mask, forward and
    backward; None when it takes them.

    Asked of JAX by tracing the call and its gradient on abstract values (no device work):
    its checks (a GPU with cuDNN, bfloat16/float16, the head dim) run at trace time. A refusal
    cuDNN itself gives only when the program compiles is not seen here.
    """
    return _cudnn_refusal(jax.default_backend(), tuple(q_shape), tuple(kv_shape), jnp.dtype(dtype))


@functools.cache
def _cudnn_refusal(backend, q_shape, kv_shape, dtype) -> str | None:
    if backend not in GPU_BACKENDS:
        return f"JAX's default backend is {backend!r}, not a GPU"
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    kv = jax.ShapeDtypeStruct(kv_shape, dtype)
    segments = jax.ShapeDtypeStruct(q_shape[:2], jnp.int32)

    def loss(q, k, v, segment_ids):
        return jnp.sum(_cudnn(q, k, v, segment_ids).astype(jnp.float32))

    try:
        jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, segments)
    except (NotImplementedError, RuntimeError, ValueError, TypeError) as error:
        first = str(error).splitlines()[0] if str(error) else ""
        return f"{type(error).__name__}: {first}"
    return None


def _attend_dot_product(q, k, v, segment_ids):
    """`jax.nn.dot_product_attention` under the causal segment mask: cuDNN's kernel where
    `cudnn_refusal` finds none, else JAX's XLA form."""
    if cudnn_refusal(q.shape, k.shape, q.dtype) is None:
        return _cudnn(q, k, v, segment_ids)
    return _dot_product(q, k, v, segment_ids, "xla")


def _cudnn(q, k, v, segment_ids):
    """cuDNN's attention, on a row one position longer when the length is odd: with a bias (the
    segment mask) its backward pass takes even lengths only. The added position has a segment
    of its own (-1), so no real query sees it, and its output is dropped."""
    s = q.shape[1]
    if s % 2 == 0:
        return _dot_product(q, k, v, segment_ids, "cudnn")
    q, k, v = (jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0))) for x in (q, k, v))
    segment_ids = jnp.pad(segment_ids, ((0, 0), (0, 1)), constant_values=-1)
    return _dot_product(q, k, v, segment_ids, "cudnn")[:, :s]


def _dot_product(q, k, v, segment_ids, implementation):
    # Packed rows as a boolean mask `[B, 1, S, S]` (same segment) beside `is_causal`: the
    # public call takes no segment ids, and its `query_seq_lengths` describe one run of real
    # tokens per row, not several documents. cuDNN turns the mask into an additive bias and
    # still skips the tiles above the diagonal. Every query sees at least itself, so no row
    # is fully masked.
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=same[:, None], is_causal=True,
                                        implementation=implementation)


def _attend_blockwise(q, k, v, segment_ids, block: int):
    """Causal attention by blocks of `block` queries, in XLA operations.

    Query block i reads only keys `[0, (i + 1) * block)`: the blocks above the diagonal, always
    fully masked, are never computed, which halves the score and softmax work of long
    sequences. Each block's softmax runs over every key it may see, so the result equals
    `attend` with the dense mask.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    qh = q.reshape(b, s, kv, g, d).transpose(0, 2, 3, 1, 4)  # [B, KV, G, S, D]
    kh = k.transpose(0, 2, 1, 3).reshape(b * kv, s, d)
    vh = v.transpose(0, 2, 1, 3).reshape(b * kv, s, d)
    out = attention.causal_heads(qh, kh, vh, segment_ids, g, block)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h * d)


def attend_cached(q, k, v, visible):
    """One query per row against a head-major cache: q `[B, 1, H, D]`, k/v `[B, KV, T, D]`."""
    b, _, h, d = q.shape
    kv = k.shape[1]
    g, t = h // kv, k.shape[2]
    q = q.reshape(b * kv, g, d)  # one merged batch axis, as in `attend`
    scores = jnp.einsum("ngd,ntd->ngt", q, k.reshape(b * kv, t, d), preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None, :], scores.reshape(b, kv, g, t) * (d**-0.5), attention.NEG)
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b * kv, g, t)
    return jnp.einsum("ngt,ntd->ngd", weights, v.reshape(b * kv, t, d)).reshape(b, 1, h * d)

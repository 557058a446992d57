"""Causal self-attention cores: ``q, k, v [batch, length, heads, kv]`` → ``[batch, length, heads, kv]``.

``model.attention`` picks one, at trace time (never at run time, so a supported config never
fails in a running step):

* ``xla`` — scores ``[batch, heads, length, length]`` materialised: memory grows with length².
* ``blockwise`` — flash-style online softmax over key/value blocks of ``model.attention_block``
  (a ``lax.scan``), with a written-out backward pass that recomputes each block: never
  ``[length, length]``; it saves memory, not FLOPs.
* ``cudnn`` — cuDNN's fused flash attention where it applies (:func:`cudnn_problem`), else
  ``blockwise``; inside a pipeline stage it runs fully manual (:func:`cudnn`).
* ``auto`` (default) — cuDNN where it applies, else ``xla``.

Every core keeps ``batch`` and ``heads`` as batch dims of its contractions, so a layout may
split either. Grouped-query attention (fewer key/value heads than query heads) goes to cuDNN as
it is where the layout splits ``kv_heads`` as it splits ``heads``; otherwise each key/value head
is repeated for its query heads first (:func:`repeat_kv`, local to each device). The full
description: docs/models.md, "Attention cores".
"""

from __future__ import annotations

import functools

import jax
import jax.extend.backend
import jax.numpy as jnp

from meshpar.sharding import layout as layout_lib
from meshpar.sharding import stages as pipeline
from meshpar.sharding.layout import constrain

NEG = float(jnp.finfo(jnp.float32).min)  # a masked score: exp(NEG - finite) == 0, never NaN


def attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str = "auto", block: int = 512) -> jax.Array:
    """Causal attention of ``q [batch, length, heads, kv]`` and ``k, v [batch, length, kv_heads,
    kv]`` (``kv_heads`` divides ``heads``; equal for multi-head attention) by `implementation`;
    the result has q's dtype and shape."""
    chosen = resolve(implementation, q.shape, q.dtype, block)
    if chosen == "cudnn" and pipeline.manual_problem((q.shape,), (CUDNN_DIMS,), "batch"):
        chosen = "xla" if implementation == "auto" else "blockwise"  # a stage cuDNN cannot run in (see cudnn)
    # cuDNN takes grouped heads as they are where both dims are split alike; all else repeats them.
    if k.shape[2] != q.shape[2] and not (chosen == "cudnn" and layout_lib.same_split("kv_heads", "heads")):
        k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    if chosen == "cudnn":
        return cudnn(q, k, v)
    if chosen == "blockwise":
        return blockwise(q, k, v, min(block, q.shape[1]))
    return xla(q, k, v)


# cuDNN's view of q: batch and heads split as the layout splits them, every position and each
# head's width whole on each device (the kernel is causal over the whole length).
CUDNN_DIMS = ("batch", None, "heads", None)


def cudnn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """cuDNN's fused flash attention (``k, v`` with q's heads, or with ``kv_heads`` split as
    ``heads`` is). Its partitioning rule (jax's ``custom_partitioning``) cannot run inside a
    pipeline stage, where the stage axis is manual and the others are left to the partitioner:
    there the call runs fully manual (:func:`meshpar.sharding.stages.manual`), on each device's batch
    rows and heads, a mesh axis that splits neither adding to the batch's split; where the
    batch does not divide (:func:`meshpar.sharding.stages.manual_problem`) :func:`attention` takes
    the fallback instead."""
    kv_dims = ("batch", None, "heads" if k.shape[2] == q.shape[2] else "kv_heads", None)

    def call(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5, implementation="cudnn")

    return pipeline.manual(call, (CUDNN_DIMS, kv_dims, kv_dims), CUDNN_DIMS, "batch")(q, k, v)


def repeat_kv(x: jax.Array, heads: int) -> jax.Array:
    """``[batch, length, kv_heads, kv]`` → ``[batch, length, heads, kv]``: key/value head ``j``
    repeated for query heads ``j·g .. j·g + g - 1`` (``g = heads / kv_heads``).

    The model's heads always divide (:func:`meshpar.models.decoder.check`). One device's view of a
    layout that splits the query heads but keeps the key/value heads whole (the planner traces
    the model at one device's shapes) may not: there the repeat is cut to the device's query
    heads, which is the shape and the work of what each device computes.
    """
    reps = -(-heads // x.shape[2])
    return constrain(jnp.repeat(x, reps, axis=2)[:, :, :heads], ("batch", "length", "heads", "kv"))


def resolve(implementation: str, shape: tuple[int, ...], dtype, block: int) -> str:
    """The implementation that runs for q of `shape` and `dtype`: ``xla``, ``blockwise`` or ``cudnn``."""
    if implementation not in ("auto", "xla", "blockwise", "cudnn"):
        raise ValueError(f"attention {implementation!r} is not one of auto, xla, blockwise, cudnn")
    if implementation in ("auto", "cudnn"):
        if cudnn_problem(tuple(shape), jnp.dtype(dtype), layout_lib.platform(), layout_lib.compile_only()) is None:
            return "cudnn"
        return "xla" if implementation == "auto" else "blockwise"
    return implementation


def check_block(length: int, block: int) -> str | None:
    """Why `block` cannot split `length` (None when it can): a block at least the length is one block."""
    if block < 1:
        return f"attention block must be >= 1, got {block}"
    if block < length and length % block:
        return f"attention block {block} does not divide the length {length}"
    return None


@functools.cache
def cudnn_problem(shape: tuple[int, ...], dtype: jnp.dtype, platform: str | None = None,
                  compile_only: bool = False) -> str | None:  # fmt: skip
    """Why cuDNN's fused attention cannot run q/k/v of `shape` and `dtype` on `platform` (the
    one traced for, :func:`meshpar.sharding.layout.platform`; default this host's backend), or None if it
    can. A compile-only GPU target (meshpar's are CUDA) is checked by jax's own checks on this
    host: they need cuDNN's library, which a host without a GPU usually lacks, and then say so."""
    platform = platform or jax.default_backend()
    if platform != "gpu":
        return f"backend is {platform}, not a CUDA GPU"
    if not compile_only:
        version = jax.extend.backend.get_backend().platform_version  # e.g. "cuda 12080", "rocm 60342"
        if "cuda" not in version.lower():
            return f"GPU platform is {version!r}, not CUDA"
    if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {dtype} (cuDNN flash attention takes bfloat16 or float16)"
    spec = jax.ShapeDtypeStruct(shape, dtype)

    def loss(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return out.astype(jnp.float32).sum()

    try:  # jax's own checks (cuDNN present, version, head dim, compute capability), fwd and bwd
        jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), spec, spec, spec)
    except (NotImplementedError, RuntimeError, ValueError, TypeError) as e:
        return " ".join(str(e).split()) or type(e).__name__
    return None


def xla(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Scores, mask, softmax, values: the whole ``[batch, heads, length, length]`` at once."""
    dt = q.dtype
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
    scores = constrain(scores, ("batch", "heads", "length", None))  # [batch, heads, length, length']
    length = q.shape[1]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]  # [length, length']
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)  # [batch, length, heads, kv]


def over_cache(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Decoding's attention: ``q [batch, steps, heads, kv]`` (the new tokens) against a key/value
    cache ``k, v [batch, slots, kv_heads, kv]`` holding them, each query attending to the slots
    `visible` ``[batch, steps, slots]`` allows. The arithmetic is :func:`xla`'s (float32 scores,
    the same scale and masked value), over the cache's slots instead of the window's positions."""
    if k.shape[2] != q.shape[2]:
        k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
    scores = constrain(scores, ("batch", "heads", "length", None))  # [batch, heads, steps, slots]
    scores = jnp.where(visible[:, None], scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)  # [batch, steps, heads, kv]


# ---------------------------------------------------------------------------------------------
# Blockwise (flash-style) attention. Shapes: q [b, L, h, d]; key blocks of B positions, n = L / B.

SCORES = ("batch", "heads", "length", None)  # [batch, heads, length, block]
ROWS = ("batch", "heads", "length")  # per-query statistics [batch, heads, length]
ACC = ("batch", "heads", "length", "kv")  # float32 accumulators [batch, heads, length, kv]


def _carry(x: jax.Array) -> jax.Array:
    """A scan's fresh carry, typed as varying over the manual mesh axes of the region traced in
    (a pipeline stage's ``shard_map``, where q, k and v vary over the stage axis): a carry must
    have one type in and out, and the body's output varies as anything computed from q does.
    Outside a manual region, `x` itself."""
    axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """``[b, L, h, d]`` → ``[n, b, B, h, d]``: key/value blocks, leading for ``lax.scan``."""
    b, length, h, d = x.shape
    return jnp.moveaxis(x.reshape(b, length // block, block, h, d), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
    """``[n, b, B, h, d]`` → ``[b, L, h, d]``."""
    n, b, block, h, d = x.shape
    return jnp.moveaxis(x, 0, 1).reshape(b, n * block, h, d)


def _block_scores(q: jax.Array, kj: jax.Array, j: jax.Array, block: int) -> jax.Array:
    """Masked, scaled float32 scores of every query against key block `j`: ``[b, h, L, B]``."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, kj, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    s = constrain(s, SCORES)
    causal = jnp.arange(q.shape[1])[:, None] >= (j * block + jnp.arange(block))[None, :]  # [L, B]
    return jnp.where(causal, s, NEG)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Output ``[b, L, h, d]`` (q's dtype) and per-row log-sum-exp ``[b, h, L]`` (float32)."""
    b, length, h, d = q.shape
    dt = q.dtype

    def step(carry, xs):
        m, denom, acc = carry  # running max, running sum [b, h, L]; unnormalised output [b, h, L, d]
        kj, vj, j = xs
        s = _block_scores(q, kj, j, block)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])  # [b, h, L, B]
        correction = jnp.exp(m - m_new)
        denom = constrain(denom * correction + p.sum(axis=-1), ROWS)
        pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(dt), vj, preferred_element_type=jnp.float32)
        acc = constrain(acc * correction[..., None] + pv, ACC)
        return (constrain(m_new, ROWS), denom, acc), None

    init = (
        constrain(_carry(jnp.full((b, h, length), NEG, jnp.float32)), ROWS),
        constrain(_carry(jnp.zeros((b, h, length), jnp.float32)), ROWS),
        constrain(_carry(jnp.zeros((b, h, length, d), jnp.float32)), ACC),
    )
    n = length // block
    (m, denom, acc), _ = jax.lax.scan(step, init, (_blocks(k, block), _blocks(v, block), jnp.arange(n)))
    out = jnp.swapaxes(acc / denom[..., None], 1, 2).astype(dt)  # [b, L, h, d]
    return out, m + jnp.log(denom)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def blockwise(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """Causal attention with key/value blocks of `block` positions (`block` divides the length)."""
    return _forward(q, k, v, block)[0]


def _blockwise_fwd(q, k, v, block):
    out, lse = _forward(q, k, v, block)
    return out, (q, k, v, out, lse)


def _blockwise_bwd(block, residuals, g):
    q, k, v, out, lse = residuals
    dt = q.dtype
    scale = q.shape[-1] ** -0.5
    g = g.astype(dt)
    # D_i = sum_d dO_i·O_i = sum_j P_ij dP_ij: the softmax backward's row term, [b, h, L]
    delta = constrain(jnp.einsum("bqhd,bqhd->bhq", g.astype(jnp.float32), out.astype(jnp.float32)), ROWS)

    def step(dq, xs):
        kj, vj, j = xs
        p = jnp.exp(_block_scores(q, kj, j, block) - lse[..., None])  # probabilities [b, h, L, B]
        dv = jnp.einsum("bhqk,bqhd->bkhd", p.astype(dt), g, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqhd,bkhd->bhqk", g, vj, preferred_element_type=jnp.float32)
        ds = constrain(p * (dp - delta[..., None]), SCORES).astype(dt)  # score gradients
        dq = dq + jnp.einsum("bhqk,bkhd->bqhd", ds, kj, preferred_element_type=jnp.float32) * scale
        dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q, preferred_element_type=jnp.float32) * scale
        return constrain(dq, ("batch", "length", "heads", "kv")), (dk.astype(dt), dv.astype(dt))

    n = q.shape[1] // block
    dq0 = constrain(_carry(jnp.zeros(q.shape, jnp.float32)), ("batch", "length", "heads", "kv"))
    dq, (dk, dv) = jax.lax.scan(step, dq0, (_blocks(k, block), _blocks(v, block), jnp.arange(n)))
    return dq.astype(dt), _unblocks(dk), _unblocks(dv)


blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)

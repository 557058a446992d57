"""Context parallelism: causal attention when the layout splits ``length`` over a mesh axis.

Under ``length:<axis>`` (one mesh axis of n > 1 devices) the decoder's attention runs inside a
``jax.shard_map`` manual over every mesh axis (:func:`_region`), each device holding its block
of the batch and heads as the layout splits them and its L / n positions of q, k and v (left
to the partitioner, the other axes were gathered at the region's edge before the first
collective over the length axis). ``model.context_parallel`` picks how the blocks meet:

* ``all_gather`` — K and V all-gathered along ``length`` (only the key/value heads move; they
  are repeated for the query heads after the gather), the device's query block against all of
  them, masked by the block's global offset. Autodiff reduce-scatters dK and dV back.
* ``ring`` — K/V blocks passed around the axis with ``ppermute`` (n − 1 times, unrolled)
  under an online softmax (float32 running max and sum), each step's mask from the blocks'
  global offsets; a block wholly after the query block is skipped by ``lax.cond`` (a real
  branch: its work is not done). The backward is autodiff of the loop (the reverse ring).
* ``ulysses`` — ``all_to_all`` from the sequence split to a head split (``[B, L/n, H, D]`` →
  ``[B, L, H/n, D]``), the configured core (:func:`meshpar.models.attention.attention`) on the
  whole length, and back. The query heads must divide by n times the ``heads`` split
  (:func:`problem`); key/value heads that do not are repeated for the query heads first.
* ``auto`` — ``all_gather`` for now (it moves only the key/value heads).

``all_gather`` and ``ring`` compute their blocks in :func:`meshpar.models.attention.xla`'s form
(float32 scores of a query block against a key block). Without a length split, with a split
over several mesh axes, or inside another manual region (a pipeline stage, local gradient
accumulation), attention is the configured core as before, the split left to XLA's partitioner.
What this does and does not do yet: docs/models.md, "Context parallelism".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshpar.models import attention as attention_lib
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import tracing

STRATEGIES = ("auto", "all_gather", "ring", "ulysses")
DIMS = ("batch", "length", "heads", "kv")  # q and the output


def resolve(strategy: str) -> str:
    """The strategy that runs for `strategy`: ``auto`` is ``all_gather`` (the planner's choice is to come)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"context_parallel {strategy!r} is not one of {', '.join(STRATEGIES)}")
    return "all_gather" if strategy == "auto" else strategy


def problem(strategy: str, heads: int, ways: int, heads_ways: int, length_rule: str = "length",
            heads_rule: str = "heads") -> str | None:  # fmt: skip
    """Why `strategy` cannot run `heads` query heads under a length split of `ways` (by
    `length_rule`) with the heads split `heads_ways` ways (by `heads_rule`), or None: Ulysses
    hands each device heads / ways of them, which the heads split divides again."""
    if resolve(strategy) != "ulysses" or heads % (ways * heads_ways) == 0:
        return None
    also = f" × {heads_ways} ({heads_rule})" if heads_ways > 1 else ""
    return f"ulysses splits the {heads} query heads {ways} ways ({length_rule}){also}: {heads} does not divide by {ways * heads_ways}"


def split() -> tuple[str, int] | None:
    """(mesh axis, its size) the active layout splits ``length`` over where attention runs
    context-parallel: one axis of more than one device, outside any manual region. Else None."""
    layout, mesh = layout_lib.active_layout(), layout_lib.active_mesh()
    if layout is None or mesh is None:
        return None
    axis, ways = layout.axis("length"), layout.axis_size("length")
    if not isinstance(axis, str) or ways < 2 or jax.sharding.get_abstract_mesh().manual_axes:
        return None
    return axis, ways


def attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str = "auto", block: int = 512,
              strategy: str = "auto") -> jax.Array:  # fmt: skip
    """Causal attention of ``q [batch, length, heads, kv]``, ``k, v [batch, length, kv_heads,
    kv]``: context-parallel by `strategy` under a length split (:func:`split`), else the core
    `implementation` (:func:`meshpar.models.attention.attention`)."""
    found = split()
    if found is None:
        return attention_lib.attention(q, k, v, implementation, block)
    axis, ways = found
    chosen = resolve(strategy)
    layout, mesh = layout_lib.active_layout(), layout_lib.active_mesh()
    why = problem(chosen, q.shape[2], ways, layout.axis_size("heads"))
    if why:
        raise ValueError(why)
    kv_dim = "kv_heads"
    if k.shape[2] == q.shape[2] or not layout_lib.same_split("kv_heads", "heads"):
        # Each device's key/value heads must be those of its query heads: repeated here (by the
        # partitioner) where the layout splits the two dims unlike each other.
        k, v, kv_dim = attention_lib.repeat_kv(k, q.shape[2]), attention_lib.repeat_kv(v, q.shape[2]), "heads"
    if chosen == "ulysses":
        core = attention_lib.resolve(implementation, q.shape, q.dtype, block)  # on the target, before the region
        fn = functools.partial(ulysses, implementation=core, block=block)
    else:
        fn = all_gather if chosen == "all_gather" else ring
    return _region(fn, axis, ways, layout, mesh, kv_dim)(q, k, v)


def _region(fn, axis: str, ways: int, layout: layout_lib.Layout, mesh, kv_dim: str):
    """`fn(q, k, v, axis, ways)` in a ``jax.shard_map`` manual over every mesh axis, each argument
    split as `layout` splits its dims: each device runs `fn` on its own block of the batch, the
    heads and the length (left to the partitioner instead, the other axes are gathered at the
    region's edge before a collective over `axis`). Inside, the layout splits nothing."""
    q_spec = layout.spec(DIMS)
    kv_spec = layout.spec(("batch", "length", kv_dim, "kv"))

    inner = layout.without(mesh.axis_names)  # no rules: the platform still the target's

    def body(q, k, v):
        with tracing.using(layout=inner):
            return fn(q, k, v, axis, ways)

    return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)  # fmt: skip


def _heads(x: jax.Array, heads: int) -> jax.Array:
    """Key/value heads repeated for `heads` query heads (unchanged when they are as many)."""
    return x if x.shape[2] == heads else attention_lib.repeat_kv(x, heads)


def _scores(q: jax.Array, k: jax.Array, q0, k0) -> jax.Array:
    """Float32 scores ``[b, h, Lq, Lk]`` of query positions ``q0 + i`` against key positions
    ``k0 + j`` (global offsets), those after the query masked."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    visible = (q0 + jnp.arange(q.shape[1]))[:, None] >= (k0 + jnp.arange(k.shape[1]))[None, :]
    return jnp.where(visible, s, attention_lib.NEG)


def all_gather(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, ways: int) -> jax.Array:
    """This device's query block against the whole K and V, gathered over `axis` (key/value heads)."""
    k = jax.lax.all_gather(k, axis, axis=1, tiled=True)  # [b, L, kv_heads, d]
    v = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    k, v = _heads(k, q.shape[2]), _heads(v, q.shape[2])
    s = _scores(q, k, jax.lax.axis_index(axis) * q.shape[1], 0)  # [b, h, L/n, L]
    probs = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)  # [b, L/n, h, d]


def _visit(carry, q, kb, vb, q0, k0):
    """One online-softmax step: the running max, sum and unnormalised output after key block `kb`."""
    m, denom, acc = carry  # [b, h, Lq], [b, h, Lq], [b, h, Lq, d] (float32)
    kb, vb = _heads(kb, q.shape[2]), _heads(vb, q.shape[2])
    s = _scores(q, kb, q0, k0)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    correction = jnp.exp(m - m_new)
    denom = denom * correction + p.sum(axis=-1)
    pv = jnp.einsum("bhqk,bkhd->bhqd", p.astype(q.dtype), vb, preferred_element_type=jnp.float32)
    return m_new, denom, acc * correction[..., None] + pv


def ring(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, ways: int) -> jax.Array:
    """Ring attention: at step s this device holds the K/V block of device ``i − s`` (each step
    passes the blocks one device on), visited unless it lies wholly after the query block."""
    b, length, h, d = q.shape  # this device's block
    index = jax.lax.axis_index(axis)

    rows = jnp.zeros((b, h, length), jnp.float32)
    carry = (rows + attention_lib.NEG, rows, jnp.zeros((b, h, length, d), jnp.float32))
    forward = [(j, (j + 1) % ways) for j in range(ways)]
    for step in range(ways):
        k0 = ((index - step) % ways) * length  # the held block's first position

        def visit(carry, kb, vb, k0=k0):
            return _visit(carry, q, kb, vb, index * length, k0)

        if step == 0:  # the diagonal block: always visited
            carry = visit(carry, k, v)
        else:  # block i − s lies before the query block when s <= i; after it (all masked) otherwise
            carry = jax.lax.cond(step <= index, visit, lambda c, kb, vb: c, carry, k, v)
        if step < ways - 1:
            k, v = jax.lax.ppermute(k, axis, forward), jax.lax.ppermute(v, axis, forward)
    _, denom, acc = carry
    return jnp.swapaxes(acc / denom[..., None], 1, 2).astype(q.dtype)  # [b, L/n, h, d]


def ulysses(q: jax.Array, k: jax.Array, v: jax.Array, axis: str, ways: int, implementation: str = "auto",
            block: int = 512) -> jax.Array:  # fmt: skip
    """Sequence split to head split by ``all_to_all`` (``[b, L/n, h, d]`` → ``[b, L, h/n, d]``),
    the core `implementation` on the whole length, and back."""

    def to_heads(x):
        return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    if k.shape[2] % ways:  # key/value heads that do not split: repeated for this device's query heads
        k, v = _heads(k, q.shape[2]), _heads(v, q.shape[2])
    out = attention_lib.attention(to_heads(q), to_heads(k), to_heads(v), implementation, block)
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)

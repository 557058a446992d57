"""The key/value cache of autoregressive decoding, in logical dims, and the layer loop that reads
and writes it.

A language model that can generate (:class:`meshpar.models.decoder.Decoder`, the model of the
transformer and llama families) has two methods beside ``loss``:

* ``init_cache(batch, slots, start) -> KVCache``: an empty cache of `slots` positions;
* ``decode(inputs [batch, steps], cache) -> (logits [batch, vocab] float32, cache)``: the
  ``steps`` new tokens written at the cache's ``index``, attending to every filled slot of their
  row, and the next-token logits after the last of them. A prompt is one call with all its
  tokens (prefill), each new token one call with one.

The cache holds every layer's keys and values, stacked like the layers' parameters:
``k, v [layers, batch, length, heads, kv]`` (``kv_heads`` for grouped-query attention), so a
layout places it by the same rules as everything else: ``batch`` split over the data axes,
the (key/value) heads over the model axis, ``length`` where a layout splits it. Rows are
left-padded to a common prompt length, so that every row writes the same slot at each step:
``start [batch]`` is each row's first real slot; slots before it are never attended to, and a
row's token positions (rotary angles, learned position rows) count from it, as Hugging Face's
batched generation counts them from the attention mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from meshpar.models import attention as attention_lib
from meshpar.sharding.layout import constrain


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [layers, batch, length, heads, kv] (heads: the family's key/value heads dim)
    v: jax.Array
    index: jax.Array  # int32 []: the slot the next token is written to
    start: jax.Array  # int32 [batch]: each row's first real slot (left padding before it)
    heads: str = dataclasses.field(default="heads", metadata={"static": True})  # the heads dim's name
    # The positions dim's name: "length", or another a generator lays out apart from the new
    # tokens' length (meshpar.run.decoding).
    length: str = dataclasses.field(default="length", metadata={"static": True})

    @property
    def dims(self) -> tuple[str, ...]:
        return dims(self.heads, self.length)

    @property
    def slots(self) -> int:
        return self.k.shape[2]


def dims(heads: str, length: str = "length") -> tuple[str, ...]:
    """The logical dims of a cache's ``k`` and ``v``."""
    return ("layers", "batch", length, heads, "kv")


def create(layers: int, batch: int, slots: int, heads: int, d_head: int, dtype, start: jax.Array,
           heads_dim: str = "heads") -> KVCache:  # fmt: skip
    """An empty cache (zeros, placed by the active layout) with rows starting at `start` [batch]."""
    shape = (layers, batch, slots, heads, d_head)
    zeros = constrain(jnp.zeros(shape, dtype), dims(heads_dim))
    return KVCache(zeros, zeros, jnp.zeros((), jnp.int32), jnp.asarray(start, jnp.int32), heads_dim)


def positions(cache: KVCache, steps: int) -> jax.Array:
    """The token positions ``[batch, steps]`` of the next `steps` tokens of each row (0 at the
    row's first real slot; the left padding's own positions are clipped to 0, unused)."""
    slot = cache.index + jnp.arange(steps, dtype=jnp.int32)  # [steps]
    return jnp.maximum(slot[None, :] - cache.start[:, None], 0)


def visible(cache: KVCache, steps: int) -> jax.Array:
    """``[batch, steps, slots]``: which slots each of the next `steps` tokens attends to — its
    row's real slots up to and including its own."""
    query = cache.index + jnp.arange(steps, dtype=jnp.int32)  # [steps]
    slot = jnp.arange(cache.slots, dtype=jnp.int32)  # [slots]
    return (slot[None, None, :] <= query[None, :, None]) & (slot[None, None, :] >= cache.start[:, None, None])


Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, tuple[jax.Array, jax.Array]]]
# layer(p, x, attends, positions) → (x, caches): one step of a family's layer loop on x [batch,
# steps, embed] — one layer, or a group of layers run together (a mixture-of-experts decoder's
# group of moe_every layers) — each layer i of it with attention done by `attends[i](q, k, v)`
# (which also returns that layer's updated cache (k, v)), and those caches in layer order.
CachedLayer = Callable[[dict, jax.Array, Sequence[Attend], jax.Array], tuple[jax.Array, Sequence[tuple]]]


def run_layers(layer: CachedLayer, stacked: dict[str, jax.Array], x: jax.Array, cache: KVCache,
               unroll: int = 1, group: int = 1) -> tuple[jax.Array, KVCache]:  # fmt: skip
    """`layer` over the stacked layers (a ``lax.scan``, `unroll` steps per iteration), each
    writing its new keys and values into its slice of `cache` at ``cache.index`` and attending
    over the slots :func:`visible` allows; returns x and the cache advanced past the new tokens.
    Each step of the loop runs `group` consecutive layers (`stacked`'s leading dim counts the
    groups), so the cache's ``layers`` are read as ``[layers / group, group]``: a free reshape."""
    steps = x.shape[1]
    pos, mask = positions(cache, steps), visible(cache, steps)
    layer_dims = cache.dims[1:]  # one layer's [batch, length, heads, kv]

    def grouped(a: jax.Array) -> jax.Array:  # [layers, ...] → [groups, group, ...]
        return a.reshape(a.shape[0] // group, group, *a.shape[1:])

    def body(x, xs):
        p, k_group, v_group = xs  # this group's weights; its layers' caches [group, batch, slots, heads, kv]

        def attend_in(i: int) -> Attend:
            def attend(q, k, v):
                k_all = jax.lax.dynamic_update_slice(k_group[i], k.astype(k_group.dtype), (0, cache.index, 0, 0))
                v_all = jax.lax.dynamic_update_slice(v_group[i], v.astype(v_group.dtype), (0, cache.index, 0, 0))
                k_all, v_all = constrain(k_all, layer_dims), constrain(v_all, layer_dims)
                return attention_lib.over_cache(q, k_all, v_all, mask), (k_all, v_all)

            return attend

        x, caches = layer(p, x, [attend_in(i) for i in range(group)], pos)
        return x, tuple(jnp.stack([c[j] for c in caches]) for j in (0, 1))

    x, (k, v) = jax.lax.scan(body, x, (stacked, grouped(cache.k), grouped(cache.v)), unroll=unroll)
    k, v = constrain(k.reshape(cache.k.shape), cache.dims), constrain(v.reshape(cache.v.shape), cache.dims)
    return x, dataclasses.replace(cache, k=k, v=v, index=cache.index + steps)

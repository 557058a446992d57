"""Llama-family decoder: the architecture of Llama 2 and 3 (and of Hugging Face's
``LlamaForCausalLM``), in logical dims.

``inputs [batch, length] → embed → n_layers × (RMSNorm → grouped-query attention with rotary
positions → residual; RMSNorm → SwiGLU MLP → residual) → RMSNorm → logits [batch, length, vocab]``.
No biases, no dropout; RMSNorm's epsilon is ``rms_eps``; rotary positions use base
``rope_theta``, optionally with Llama 3.1's frequency scaling (``rope_scaling: llama3``); the
output projection is its own matrix or the input embedding (``tie_embeddings``, unscaled, as
Llama 3.2 1B/3B do).

Logical dims: ``batch, length, embed, heads, kv_heads, kv, d_ff, vocab, layers``. Parameters,
every block parameter stacked along a leading ``layers`` dim (as :mod:`meshpar.hf` maps them to
and from Hugging Face's names): embedding ``embed (vocab, embed)``; ``blocks/attn_norm,
mlp_norm (layers, embed)``; ``blocks/wq (layers, embed, heads, kv)``; ``blocks/wk, wv (layers,
embed, kv_heads, kv)``; ``blocks/wo (layers, heads, kv, embed)``; ``blocks/w_gate, w_up (layers,
embed, d_ff)``; ``blocks/w_down (layers, d_ff, embed)``; ``final_norm (embed,)``; untied output
``unembed (embed, vocab)``.

Grouped-query attention: ``n_kv_heads`` key/value heads, each shared by ``n_heads /
n_kv_heads`` consecutive query heads (``n_kv_heads = n_heads`` is multi-head attention, 1 is
multi-query). Their heads have a dim of their own, ``kv_heads``. A layout that splits ``heads``
and names no rule for ``kv_heads`` splits ``kv_heads`` over the same axes where ``n_kv_heads``
divides by their size, and otherwise keeps the key/value heads whole on every device (each
device then computes all of them and uses its own query heads' share: :func:`layout_rules`). A
rule for ``kv_heads`` in the layout wins; one whose split does not divide ``n_kv_heads`` is a
one-line layout error, as for any dim.

Layer loop, ``remat``, ``attention`` and checkpoint names are the transformer's
(:mod:`meshpar.models.transformer`, :mod:`meshpar.models.layers`): each layer tags
``layer_in``, ``attn_in``, ``query``, ``key``, ``value`` (``[batch, length, kv_heads, kv]``,
after rotary), ``context``, ``attn_out``, ``attn_residual``, ``mlp_in`` and ``mlp_hidden``
(``silu(gate) · up``, ``[batch, length, d_ff]``), so the same remat and activation-offload
policies apply.

Initialisation (a fresh model; imported weights replace it): every projection normal with std
``fan_in ** -0.5``, the embedding with std 1 (``d_model ** -0.5`` when tied, so the logits start
near unit scale), norms at 1.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshpar.layout import constrain, use
from meshpar.models import attention as attention_lib
from meshpar.models import kv_cache, layers
from meshpar.models.layers import DTYPES, dense, ones, param, rms_norm


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    name: Literal["llama"] = "llama"  # the family: a Llama-style decoder (GQA, rotary, SwiGLU, RMSNorm)
    d_model: int = dataclasses.field(default=256, metadata={"min": 1})  # "embed"
    n_heads: int = dataclasses.field(default=4, metadata={"min": 1})  # query heads, "heads"
    # Key/value heads, "kv_heads"; must divide n_heads (= n_heads: multi-head, 1: multi-query).
    n_kv_heads: int = dataclasses.field(default=2, metadata={"min": 1})
    d_head: int = dataclasses.field(default=64, metadata={"min": 1})  # "kv"; even (rotary)
    d_ff: int = dataclasses.field(default=768, metadata={"min": 1})  # SwiGLU hidden width, "d_ff"
    n_layers: int = dataclasses.field(default=4, metadata={"min": 1})  # "layers"
    vocab_size: int = dataclasses.field(default=256, metadata={"min": 2})  # "vocab"
    # Longest sequence the model is meant for (rotary positions have no table: a check only).
    max_length: int = dataclasses.field(default=2048, metadata={"min": 1})
    rms_eps: float = dataclasses.field(default=1e-5, metadata={"min": 0.0})  # RMSNorm's epsilon
    rope_theta: float = dataclasses.field(default=10000.0, metadata={"min": 1.0})  # rotary base (Llama 3: 500000)
    # Rotary frequency scaling: none, or llama3 = Llama 3.1's (long wavelengths stretched by
    # rope_factor, short ones kept, smooth between; the wavelength bands are
    # rope_original_max_length / rope_low_freq_factor and / rope_high_freq_factor).
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = dataclasses.field(default=8.0, metadata={"min": 1.0})
    rope_low_freq_factor: float = dataclasses.field(default=1.0, metadata={"min": 0.0})
    rope_high_freq_factor: float = dataclasses.field(default=4.0, metadata={"min": 0.0})
    rope_original_max_length: int = dataclasses.field(default=8192, metadata={"min": 1})
    tie_embeddings: bool = False  # logits use the input embedding (unscaled)
    # Dtype the parameters are stored (and the optimizer's moments kept) in, and the dtype the
    # layers compute in. The loss (softmax cross-entropy) is float32 regardless.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = True  # run the stacked layers with lax.scan (True) or unrolled (False)
    # What each layer keeps for the backward pass (meshpar.models.remat): none = everything;
    # full = only its input, recomputing the layer; dots = its weight matmuls' outputs.
    remat: Literal["none", "full", "dots"] = "none"
    # Attention core (meshpar.models.attention): auto | xla | blockwise | cudnn, as the transformer's.
    attention: Literal["auto", "xla", "blockwise", "cudnn"] = "auto"
    # Key/value positions per block of blockwise attention; must divide the length when smaller.
    attention_block: int = dataclasses.field(default=512, metadata={"min": 1})
    # Layers per iteration of the layer scan; 0 = by backend, as the transformer's.
    scan_unroll: int = dataclasses.field(default=0, metadata={"min": 0})


BLOCK_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
# Each block parameter's dims, without the leading ``layers`` of its stack.
BLOCK_DIMS = {
    "attn_norm": ("embed",),
    "wq": ("embed", "heads", "kv"), "wk": ("embed", "kv_heads", "kv"), "wv": ("embed", "kv_heads", "kv"),
    "wo": ("heads", "kv", "embed"),
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "d_ff"), "w_up": ("embed", "d_ff"), "w_down": ("d_ff", "embed"),
}  # fmt: skip
HEADS = ("batch", "length", "heads", "kv")
KV_HEADS = ("batch", "length", "kv_heads", "kv")
EMBED = ("batch", "length", "embed")


def rope_frequencies(cfg: LlamaConfig):
    """The rotary angular frequencies ``[d_head / 2]`` of `cfg` (float32, as Hugging Face computes them)."""
    llama3 = None
    if cfg.rope_scaling == "llama3":
        llama3 = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_length)
    return layers.rope_frequencies(cfg.d_head, cfg.rope_theta, llama3)


def weight(p: dict[str, jax.Array], name: str, dtype=None) -> jax.Array:
    """Block parameter `name` of one layer's weights `p`, placed for compute by :func:`meshpar.layout.use`."""
    return use(p[name], BLOCK_DIMS[name], dtype)


def block(cfg: LlamaConfig, p: dict[str, jax.Array], x: jax.Array, key: jax.Array | None) -> jax.Array:
    """One layer on ``x [batch, length, embed]``; `p` holds this layer's (unstacked) weights."""

    def attend(q, k, v):
        return attention_lib.attention(q, k, v, cfg.attention, cfg.attention_block), None

    return layer(cfg, p, x, attend)[0]


def layer(cfg: LlamaConfig, p: dict[str, jax.Array], x: jax.Array, attend: kv_cache.Attend,
          positions: jax.Array | None = None) -> tuple[jax.Array, object]:  # fmt: skip
    """One layer with its attention core `attend(q, k, v) -> (context, cache)`: the whole window
    in training (:func:`block`), the new tokens against the key/value cache in decoding, the
    tokens at `positions` ``[batch, length]`` (None: ``0 .. length - 1``)."""
    dt, eps = DTYPES[cfg.compute_dtype], cfg.rms_eps
    inv_freq = jnp.asarray(rope_frequencies(cfg))  # [kv/2]
    x = checkpoint_name(x, "layer_in")
    h = checkpoint_name(rms_norm(x, weight(p, "attn_norm"), eps), "attn_in")  # [batch, length, embed]
    q = layers.rotary(constrain(dense(h, weight(p, "wq", dt)), HEADS), inv_freq, positions)  # [batch, length, heads, kv]
    k = layers.rotary(constrain(dense(h, weight(p, "wk", dt)), KV_HEADS), inv_freq, positions)  # [batch, length, kv_heads, kv]
    v = constrain(dense(h, weight(p, "wv", dt)), KV_HEADS)
    q, k, v = checkpoint_name(q, "query"), checkpoint_name(k, "key"), checkpoint_name(v, "value")
    o, cache = attend(q, k, v)
    o = checkpoint_name(constrain(o, HEADS), "context")
    attn = checkpoint_name(dense(o, weight(p, "wo", dt), 2), "attn_out")  # [batch, length, embed]
    x = checkpoint_name(constrain(x + attn, EMBED), "attn_residual")
    h = checkpoint_name(rms_norm(x, weight(p, "mlp_norm"), eps), "mlp_in")
    gate, up = dense(h, weight(p, "w_gate", dt)), dense(h, weight(p, "w_up", dt))
    f = checkpoint_name(constrain(jax.nn.silu(gate) * up, ("batch", "length", "d_ff")), "mlp_hidden")
    return constrain(x + dense(f, weight(p, "w_down", dt)), EMBED), cache


class Blocks(nnx.Module):
    """All `n_layers` layers, every parameter stacked along a leading ``layers`` dim."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        n, d, f, pd = cfg.n_layers, cfg.d_model, cfg.d_ff, DTYPES[cfg.param_dtype]
        self.cfg = cfg
        shapes = {"embed": d, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "kv": cfg.d_head, "d_ff": f}
        fan_in = {"wq": d, "wk": d, "wv": d, "wo": cfg.n_heads * cfg.d_head, "w_gate": d, "w_up": d, "w_down": f}
        for name in BLOCK_PARAMS:
            dims = ("layers", *BLOCK_DIMS[name])
            shape = (n, *(shapes[dim] for dim in BLOCK_DIMS[name]))
            if name in fan_in:
                setattr(self, name, param(rngs, shape, dims, fan_in[name] ** -0.5, pd))
            else:
                setattr(self, name, ones(shape, dims, pd))

    def __call__(self, x: jax.Array) -> jax.Array:
        return layers.run_layers(self.cfg, functools.partial(block, self.cfg), self.stacked(), x, None)

    def decode(self, x: jax.Array, cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
        layer_fn = functools.partial(layer, self.cfg)
        return kv_cache.run_layers(layer_fn, self.stacked(), x, cache, layers.scan_unroll(self.cfg))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in BLOCK_PARAMS}  # each [layers, ...]


def check(cfg: LlamaConfig, length: int) -> str | None:
    """What makes `cfg` unable to run sequences of `length`, or None."""
    if cfg.n_heads % cfg.n_kv_heads:
        return f"n_kv_heads {cfg.n_kv_heads} does not divide n_heads {cfg.n_heads}"
    if cfg.d_head % 2:
        return f"rotary positions need an even d_head, got {cfg.d_head}"
    if length > cfg.max_length:
        return f"sequence length {length} exceeds max_length {cfg.max_length}"
    if cfg.attention in ("blockwise", "cudnn") and attention_lib.check_block(length, cfg.attention_block):
        return f"attention_block {cfg.attention_block} does not divide the sequence length {length}"
    return None


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, length: int, *, rngs: nnx.Rngs):
        problem = check(cfg, length)
        if problem:
            raise ValueError(problem)
        d, v, pd = cfg.d_model, cfg.vocab_size, DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.embed = param(rngs, (v, d), ("vocab", "embed"), d**-0.5 if cfg.tie_embeddings else 1.0, pd)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.final_norm = ones((d,), ("embed",), pd)
        if not cfg.tie_embeddings:
            self.unembed = param(rngs, (d, v), ("embed", "vocab"), d**-0.5, pd)

    def __call__(self, inputs: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """``inputs`` int [batch, length] → logits float32 [batch, length, vocab]."""
        return self.logits(self.blocks(self.embedded(inputs)))

    def embedded(self, inputs: jax.Array) -> jax.Array:
        """``inputs`` int [batch, length] → ``[batch, length, embed]`` in the compute dtype."""
        dt = DTYPES[self.cfg.compute_dtype]
        inputs = constrain(inputs, ("batch", "length"))
        return constrain(jnp.take(use(self.embed[...], ("vocab", "embed"), dt), inputs, axis=0), EMBED)

    def logits(self, x: jax.Array) -> jax.Array:
        """The last layer's output ``[batch, length, embed]`` → float32 ``[batch, length, vocab]``."""
        cfg, dt = self.cfg, DTYPES[self.cfg.compute_dtype]
        x = rms_norm(x, use(self.final_norm[...], ("embed",)), cfg.rms_eps)
        if cfg.tie_embeddings:
            logits = jnp.einsum("ble,ve->blv", x, use(self.embed[...], ("vocab", "embed"), dt))
        else:
            logits = x @ use(self.unembed[...], ("embed", "vocab"), dt)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))  # [batch, length, vocab]

    def init_cache(self, batch: int, slots: int, start: jax.Array) -> kv_cache.KVCache:
        """An empty key/value cache of `slots` positions (:mod:`meshpar.models.kv_cache`)."""
        cfg = self.cfg
        return kv_cache.create(cfg.n_layers, batch, slots, cfg.n_kv_heads, cfg.d_head, DTYPES[cfg.compute_dtype], start, "kv_heads")

    def decode(self, inputs: jax.Array, cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
        """``inputs`` int [batch, steps] written into `cache` → the next token's logits float32
        ``[batch, vocab]`` and the cache (:mod:`meshpar.models.kv_cache`)."""
        x, cache = self.blocks.decode(self.embedded(inputs), cache)
        return self.logits(x[:, -1:])[:, 0], cache

    def loss(self, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy and accuracy (:func:`meshpar.models.layers.next_token_loss`)."""
        return layers.next_token_loss(self, batch)


def build(cfg: LlamaConfig, element_spec: dict, rngs: nnx.Rngs) -> Llama:
    return Llama(cfg, layers.window_length(element_spec), rngs=rngs)


def num_params(cfg: LlamaConfig) -> int:
    """Every parameter: embedding, layers, final norm, untied output."""
    d, v = cfg.d_model, cfg.vocab_size
    per_layer = 2 * d * (cfg.n_heads + cfg.n_kv_heads) * cfg.d_head + 3 * d * cfg.d_ff + 2 * d
    return v * d + cfg.n_layers * per_layer + d + (0 if cfg.tie_embeddings else d * v)


def flops_per_token(cfg: LlamaConfig, length: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM (Chowdhery et al. 2022, App. B)
    count with grouped-query attention::

        6 * N + 12 * n_layers * (n_heads * d_head) * length
        N = n_layers * (2 * d_model * (n_heads + n_kv_heads) * d_head + 3 * d_model * d_ff) + d_model * vocab_size

    N counts the weights used in matmuls: q and the output (``n_heads`` heads), k and v
    (``n_kv_heads`` heads), the three SwiGLU matrices, and the output projection (tied or not);
    the embedding lookup and norms do no matmul FLOPs. Attention's QKᵀ and AV run per *query*
    head over the full ``length`` (not halved for the causal mask), so GQA does not shrink them.
    """
    n = cfg.n_layers * _layer_weights(cfg) + cfg.d_model * cfg.vocab_size
    return float(6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.d_head * length)


def _layer_weights(cfg: LlamaConfig) -> int:
    return 2 * cfg.d_model * (cfg.n_heads + cfg.n_kv_heads) * cfg.d_head + 3 * cfg.d_model * cfg.d_ff


def flops_per_example(cfg: LlamaConfig, element_spec: dict) -> float:
    """Training FLOPs of one window: :func:`flops_per_token` × its length."""
    length = layers.window_length(element_spec)
    return flops_per_token(cfg, length) * length


# ---------------------------------------------------------------------------------------------
# What the planner reads (meshpar.models.Family)

# Megatron's split: attention by (query) heads, with the key/value heads following where they
# divide (layout_rules), the MLP by d_ff, the output by vocab.
SPLIT_DIMS = ("heads", "d_ff", "vocab")
FSDP_DIMS = ("embed",)  # every parameter has an embed dim
ACTIVATION_NAMES = layers.ACTIVATION_NAMES  # the transformer's names, tagged the same way
activation_all_reduces = layers.activation_all_reduces  # the transformer's Megatron split


def split_dims(cfg: LlamaConfig) -> tuple[str, ...]:
    return SPLIT_DIMS


def fsdp_dims(cfg: LlamaConfig, element_spec: dict) -> tuple[str, ...]:
    return FSDP_DIMS


def layout_rules(cfg: LlamaConfig, rules: tuple, axis_sizes: Mapping[str, int]) -> tuple:
    """`rules` with ``kv_heads`` following ``heads`` where the layout splits ``heads``, names no
    rule for ``kv_heads``, and ``n_kv_heads`` divides by the split (see the module docstring)."""
    named = dict(rules)
    if "kv_heads" in named or "heads" not in named:
        return rules
    axes = named["heads"]
    ways = 1
    for axis in (axes,) if isinstance(axes, str) else axes:
        ways *= axis_sizes.get(axis, 1)
    return (*rules, ("kv_heads", axes)) if cfg.n_kv_heads % ways == 0 else rules


def num_layers(cfg: LlamaConfig) -> int:
    return cfg.n_layers


def layer_flops(cfg: LlamaConfig, element_spec: dict) -> tuple[float, ...]:
    """Training FLOPs of one window in each layer: :func:`flops_per_token`'s per-layer terms × the length."""
    length = layers.window_length(element_spec)
    per_token = 6 * _layer_weights(cfg) + 12 * cfg.n_heads * cfg.d_head * length
    return (float(per_token * length),) * cfg.n_layers


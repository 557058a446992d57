"""Decoder-only Transformer language model, after Mesh TensorFlow's ``transformer`` example.

``inputs [batch, length] → embed → n_layers × (pre-norm causal attention, pre-norm gelu MLP)
→ final norm → logits [batch, length, vocab]``. Norms are RMSNorm (scale only, statistics in
float32, as in T5 / Mesh TensorFlow's ``layer_norm`` without bias); no projection has a bias.

Logical dims, one vocabulary for parameters and activations:
``batch, length, embed, heads, kv, d_ff, vocab, layers``. Parameters: embedding
``(vocab, embed)``, learned positions ``(length, embed)``, q/k/v ``(layers, embed, heads, kv)``,
attention output ``(layers, heads, kv, embed)``, MLP ``(layers, embed, d_ff)`` /
``(layers, d_ff, embed)``, norms ``(layers, embed)`` / ``(embed,)``, untied output ``(embed, vocab)``.

Layers are always *stored* stacked, every block parameter with a leading ``layers`` dim, and
``scan_layers`` only chooses how they are *run*: ``True`` runs one ``jax.lax.scan`` over the
stack (compile time independent of depth), ``False`` unrolls a Python loop over slices of the
same arrays (XLA may schedule across layers; easier to profile). Both are supported because
they cost nothing to keep apart: parameters, checkpoints, layouts and results are identical
(a test checks the losses agree), so the switch is purely a compile-time/runtime trade.
``scan_unroll`` sets the layers per scan iteration; its default (0) picks by backend at trace
time: on CPU, stacks of up to 8 layers without remat run with no loop at all (see
:func:`scan_unroll`), elsewhere one layer per iteration.

The attention core is ``model.attention`` (``auto | xla | blockwise | cudnn``, see
:mod:`meshpar.models.attention`); the dense projections run as 2-D matmuls over
``batch·length`` rows (see :func:`dense`).
The stack is built by hand (a leading dim on each initializer) rather than with ``nnx.vmap``,
because NNX's transforms only rewrite flax's own ``sharding_names`` metadata, not our ``dims``.

``remat`` (``none | full | dots``, see :mod:`meshpar.models.remat`) wraps the one function that
runs a layer in ``jax.checkpoint``, the same way in the scan and unrolled. Each layer tags the
values its backward pass reads with ``jax.ad_checkpoint.checkpoint_name``, so a policy can keep
(or offload) them by name: ``layer_in`` (the layer's input ``[batch, length, embed]``),
``attn_in`` (attention's normed input), ``query``, ``key``, ``value`` (``[batch, length, heads,
kv]``, after rotary), ``context`` (attention's output per head ``[batch, length, heads, kv]``),
``attn_out`` (its output projection ``[batch, length, embed]``), ``attn_residual`` (the residual
stream after attention), ``mlp_in`` (the MLP's normed input) and ``mlp_hidden`` (after gelu
``[batch, length, d_ff]``). Attention's ``[length, length]`` scores and probabilities carry no
name: a policy that keeps only named values never keeps them. Host offload of activations
(``offload.activations``, :mod:`meshpar.offload`) is such a policy, set by the train step
(:func:`meshpar.models.remat.keeping`) in place of ``remat``; with offloaded parameters each
weight is moved to the devices where :func:`meshpar.layout.use` places it, a scanned layer's
inside the layer loop.

Layouts (mesh ``data:4,model:2``), all valid for every tensor of this model:
  * ``batch:data; d_ff:model; heads:model; vocab:model`` — Mesh TensorFlow's data + model;
  * ``batch:data`` — pure data parallel;  ``d_ff:model; heads:model; vocab:model`` — pure model;
  * ``batch:data; embed:model`` — 2-D with ``embed`` split: activations ``[batch, length, embed]``
    split on both mesh axes, every weight split along ``embed``;
  * ``d_ff:model; heads:model; vocab:model; embed:data`` — 2-D weights (each matrix split 8
    ways), batch replicated.
``batch`` and ``embed`` may never share an axis (both are dims of ``[batch, length, embed]``), so
``batch:data; …; embed:data`` raises LayoutError; likewise ``embed`` with ``d_ff``/``heads``/
``vocab`` (they share weight matrices).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshpar.layout import constrain, use
from meshpar.models import attention as attention_lib
from meshpar.models import kv_cache, layers
from meshpar.models.layers import DTYPES, dense, ones, param, rms_norm, scan_unroll, window_length  # noqa: F401
BLOCK_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_in", "w_out")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    name: Literal["transformer"] = "transformer"  # the family: a decoder-only Transformer language model
    d_model: int = dataclasses.field(default=256, metadata={"min": 1})  # "embed"
    n_heads: int = dataclasses.field(default=4, metadata={"min": 1})  # "heads"
    d_head: int = dataclasses.field(default=64, metadata={"min": 1})  # "kv"
    d_ff: int = dataclasses.field(default=1024, metadata={"min": 1})  # "d_ff"
    n_layers: int = dataclasses.field(default=4, metadata={"min": 1})  # "layers"
    vocab_size: int = dataclasses.field(default=256, metadata={"min": 2})  # "vocab" (256: bytes)
    # Longest sequence: size of the learned position table; data length must not exceed it.
    max_length: int = dataclasses.field(default=512, metadata={"min": 1})
    # Dropout rate on the embeddings and on each residual branch (training only).
    dropout: float = dataclasses.field(default=0.0, metadata={"min": 0.0})
    # Where positions come in: learned = a table added to the embeddings (max_length rows);
    # rotary = rotations of query and key in every layer (needs an even d_head, no parameters).
    positions: Literal["learned", "rotary"] = "learned"
    tie_embeddings: bool = False  # logits use the input embedding (scaled by d_model**-0.5)
    # Dtype the parameters are stored (and the optimizer's moments kept) in, and the dtype the
    # layers compute in: bfloat16 compute with float32 parameters is mixed precision. The loss
    # (softmax cross-entropy) is float32 regardless.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = True  # run the stacked layers with lax.scan (True) or unrolled (False)
    # What each layer keeps for the backward pass (meshpar.models.remat): none = everything;
    # full = only its input, recomputing the layer; dots = its weight matmuls' outputs.
    remat: Literal["none", "full", "dots"] = "none"
    # Attention core (meshpar.models.attention): xla = full [length, length] scores; blockwise =
    # flash-style over key blocks of attention_block positions (memory grows with length x
    # block); cudnn = cuDNN's fused attention where it applies (CUDA GPU, bfloat16/float16,
    # supported head dim), else blockwise; auto = cuDNN where it applies, else xla.
    attention: Literal["auto", "xla", "blockwise", "cudnn"] = "auto"
    # Key/value positions per block of blockwise attention; must divide the length when smaller.
    attention_block: int = dataclasses.field(default=512, metadata={"min": 1})
    # Layers per iteration of the layer scan (lax.scan's unroll). 0 = by backend, at trace time:
    # on CPU the whole stack when it has at most UNROLL_LAYERS_CPU layers (a loop iteration
    # costs more there than the compile time it saves: stacked residuals are zero-filled,
    # sliced and copied) unless remat is on, else 1.
    scan_unroll: int = dataclasses.field(default=0, metadata={"min": 0})


def rotary(x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding of ``x [batch, length, heads, kv]``, base 10000 (at `positions`
    ``[batch, length]``, or ``0 .. length - 1``)."""
    half = x.shape[-1] // 2
    return layers.rotary(x, 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half), positions)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


# Each block parameter's dims, without the leading ``layers`` of its stack.
BLOCK_DIMS = {
    "attn_norm": ("embed",),
    "wq": ("embed", "heads", "kv"), "wk": ("embed", "heads", "kv"), "wv": ("embed", "heads", "kv"),
    "wo": ("heads", "kv", "embed"),
    "mlp_norm": ("embed",),
    "w_in": ("embed", "d_ff"), "w_out": ("d_ff", "embed"),
}  # fmt: skip


def weight(p: dict[str, jax.Array], name: str, dtype=None) -> jax.Array:
    """Block parameter `name` of one layer's weights `p`, placed for compute by :func:`meshpar.layout.use`."""
    return use(p[name], BLOCK_DIMS[name], dtype)


def block(cfg: TransformerConfig, p: dict[str, jax.Array], x: jax.Array, key: jax.Array | None) -> jax.Array:
    """One layer on ``x [batch, length, embed]``; `p` holds this layer's (unstacked) weights."""

    def attend(q, k, v):
        return attention_lib.attention(q, k, v, cfg.attention, cfg.attention_block), None

    return layer(cfg, p, x, attend, None, key)[0]


def layer(cfg: TransformerConfig, p: dict[str, jax.Array], x: jax.Array, attend: kv_cache.Attend,
          positions: jax.Array | None = None, key: jax.Array | None = None) -> tuple[jax.Array, object]:  # fmt: skip
    """One layer with its attention core `attend(q, k, v) -> (context, cache)`: the whole window
    in training (:func:`block`, dropout keyed by `key`), the new tokens against the key/value
    cache in decoding, the tokens at `positions` ``[batch, length]`` (None: ``0 .. length - 1``)."""
    dt = DTYPES[cfg.compute_dtype]
    k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
    act = ("batch", "length", "heads", "kv")
    x = checkpoint_name(x, "layer_in")
    h = rms_norm(x, weight(p, "attn_norm"))  # [batch, length, embed]
    h = checkpoint_name(h, "attn_in")
    q, k, v = (constrain(dense(h, weight(p, w, dt)), act) for w in ("wq", "wk", "wv"))
    if cfg.positions == "rotary":
        q, k = rotary(q, positions), rotary(k, positions)
    q, k, v = checkpoint_name(q, "query"), checkpoint_name(k, "key"), checkpoint_name(v, "value")
    o, cache = attend(q, k, v)
    o = checkpoint_name(constrain(o, act), "context")  # [batch, length, heads, kv]
    attn = dense(o, weight(p, "wo", dt), 2)
    attn = checkpoint_name(attn, "attn_out")
    x = constrain(x + dropout(attn, cfg.dropout, k_attn), ("batch", "length", "embed"))
    x = checkpoint_name(x, "attn_residual")
    h = checkpoint_name(rms_norm(x, weight(p, "mlp_norm")), "mlp_in")
    f = constrain(jax.nn.gelu(dense(h, weight(p, "w_in", dt))), ("batch", "length", "d_ff"))  # [batch, length, d_ff]
    f = checkpoint_name(f, "mlp_hidden")
    mlp = dense(f, weight(p, "w_out", dt))  # [batch, length, embed]
    return constrain(x + dropout(mlp, cfg.dropout, k_mlp), ("batch", "length", "embed")), cache


class Blocks(nnx.Module):
    """All `n_layers` layers, every parameter stacked along a leading ``layers`` dim."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        n, d, h, k, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff
        pd = DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.attn_norm = ones((n, d), ("layers", "embed"), pd)
        qkv = ((n, d, h, k), ("layers", "embed", "heads", "kv"), d**-0.5, pd)
        self.wq, self.wk, self.wv = param(rngs, *qkv), param(rngs, *qkv), param(rngs, *qkv)
        self.wo = param(rngs, (n, h, k, d), ("layers", "heads", "kv", "embed"), (h * k) ** -0.5, pd)
        self.mlp_norm = ones((n, d), ("layers", "embed"), pd)
        self.w_in = param(rngs, (n, d, f), ("layers", "embed", "d_ff"), d**-0.5, pd)
        self.w_out = param(rngs, (n, f, d), ("layers", "d_ff", "embed"), f**-0.5, pd)

    def __call__(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        return layers.run_layers(self.cfg, functools.partial(block, self.cfg), self.stacked(), x, key)

    def decode(self, x: jax.Array, cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
        layer_fn = functools.partial(layer, self.cfg)
        return kv_cache.run_layers(layer_fn, self.stacked(), x, cache, layers.scan_unroll(self.cfg))

    def stacked(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name)[...] for name in BLOCK_PARAMS}  # each [layers, ...]


class Transformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, length: int, *, rngs: nnx.Rngs):
        if length > cfg.max_length:
            raise ValueError(f"sequence length {length} exceeds max_length {cfg.max_length}")
        if cfg.positions == "rotary" and cfg.d_head % 2:
            raise ValueError(f"rotary positions need an even d_head, got {cfg.d_head}")
        if cfg.attention in ("blockwise", "cudnn") and attention_lib.check_block(length, cfg.attention_block):
            raise ValueError(f"attention_block {cfg.attention_block} does not divide the sequence length {length}")
        if not 0.0 <= cfg.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {cfg.dropout}")
        d, v, pd = cfg.d_model, cfg.vocab_size, DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.embed = param(rngs, (v, d), ("vocab", "embed"), 1.0, pd)
        if cfg.positions == "learned":
            self.pos = param(rngs, (cfg.max_length, d), ("length", "embed"), 1.0, pd)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.final_norm = ones((d,), ("embed",), pd)
        if not cfg.tie_embeddings:
            self.unembed = param(rngs, (d, v), ("embed", "vocab"), d**-0.5, pd)

    def __call__(self, inputs: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """``inputs`` int [batch, length] → logits float32 [batch, length, vocab]."""
        cfg = self.cfg
        train = rngs is not None and cfg.dropout > 0.0
        k_embed, k_blocks = jax.random.split(rngs.dropout()) if train else (None, None)
        x = constrain(dropout(self.embedded(inputs), cfg.dropout, k_embed), ("batch", "length", "embed"))
        return self.logits(self.blocks(x, k_blocks))

    def embedded(self, inputs: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """``inputs`` int [batch, length] (at `positions` [batch, length], or ``0 .. length - 1``)
        → ``[batch, length, embed]`` in the compute dtype, learned positions added."""
        cfg, dt = self.cfg, DTYPES[self.cfg.compute_dtype]
        inputs = constrain(inputs, ("batch", "length"))
        x = jnp.take(use(self.embed[...], ("vocab", "embed"), dt), inputs, axis=0)  # [batch, length, embed]
        if cfg.positions == "learned":
            table = use(self.pos[...], ("length", "embed"), dt)  # [max_length, embed]
            x = x + (table[: inputs.shape[1]][None] if positions is None else jnp.take(table, positions, axis=0))
        return x

    def init_cache(self, batch: int, slots: int, start: jax.Array) -> kv_cache.KVCache:
        """An empty key/value cache of `slots` positions (:mod:`meshpar.models.kv_cache`)."""
        cfg = self.cfg
        return kv_cache.create(cfg.n_layers, batch, slots, cfg.n_heads, cfg.d_head, DTYPES[cfg.compute_dtype], start)

    def decode(self, inputs: jax.Array, cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
        """``inputs`` int [batch, steps] written into `cache` → the next token's logits float32
        ``[batch, vocab]`` and the cache (:mod:`meshpar.models.kv_cache`); no dropout."""
        x = constrain(self.embedded(inputs, kv_cache.positions(cache, inputs.shape[1])), ("batch", "length", "embed"))
        x, cache = self.blocks.decode(x, cache)
        return self.logits(x[:, -1:])[:, 0], cache

    def logits(self, x: jax.Array) -> jax.Array:
        """The last layer's output ``[batch, length, embed]`` → float32 ``[batch, length, vocab]``."""
        cfg, dt = self.cfg, DTYPES[self.cfg.compute_dtype]
        x = rms_norm(x, use(self.final_norm[...], ("embed",)))
        if cfg.tie_embeddings:
            logits = jnp.einsum("ble,ve->blv", x, use(self.embed[...], ("vocab", "embed"), dt)) * cfg.d_model**-0.5
        else:
            logits = x @ use(self.unembed[...], ("embed", "vocab"), dt)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))  # [batch, length, vocab]

    def loss(self, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy and accuracy (:func:`meshpar.models.layers.next_token_loss`)."""
        return layers.next_token_loss(lambda inputs: self(inputs, rngs), batch)


def build(cfg: TransformerConfig, element_spec: dict, rngs: nnx.Rngs) -> Transformer:
    return Transformer(cfg, window_length(element_spec), rngs=rngs)


def num_params(cfg: TransformerConfig) -> int:
    """Every parameter: embedding, positions (learned: max_length × d_model), layers, norms, output."""
    d, v = cfg.d_model, cfg.vocab_size
    per_layer = 4 * d * cfg.n_heads * cfg.d_head + 2 * d * cfg.d_ff + 2 * d
    pos = cfg.max_length * d if cfg.positions == "learned" else 0
    return v * d + pos + cfg.n_layers * per_layer + d + (0 if cfg.tie_embeddings else d * v)


def flops_per_token(cfg: TransformerConfig, length: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM (Chowdhery et al. 2022, App. B) count::

        6 * N + 12 * n_layers * (n_heads * d_head) * length
        N = n_layers * (4 * d_model * n_heads * d_head + 2 * d_model * d_ff) + d_model * vocab_size

    N counts the weights used in matmuls: q, k, v, output and the two MLP matrices per layer,
    plus the output projection (tied or not); the embedding lookup, position table and norms
    do no matmul FLOPs and are left out. The attention term is QKᵀ and AV over the full
    ``length`` (2 matmuls × 2 FLOPs × 3 for backward), not halved for the causal mask.
    """
    hk = cfg.n_heads * cfg.d_head
    n = cfg.n_layers * (4 * cfg.d_model * hk + 2 * cfg.d_model * cfg.d_ff) + cfg.d_model * cfg.vocab_size
    return float(6 * n + 12 * cfg.n_layers * hk * length)


def flops_per_example(cfg: TransformerConfig, element_spec: dict) -> float:
    """Training FLOPs of one window: :func:`flops_per_token` × its length."""
    length = window_length(element_spec)
    return flops_per_token(cfg, length) * length


# ---------------------------------------------------------------------------------------------
# What the planner reads (meshpar.models.Family)

# Mesh TensorFlow's model-parallel layout: attention split by heads, the MLP by d_ff, the output
# by vocab (the Megatron column/row pattern); embed stays whole, so activations need no gather.
SPLIT_DIMS = ("heads", "d_ff", "vocab")
# Every parameter has an embed dim (norms, projections, embedding, output): FSDP along it alone
# shards every weight once.
FSDP_DIMS = ("embed",)

ACTIVATION_NAMES = layers.ACTIVATION_NAMES
activation_all_reduces = layers.activation_all_reduces


def split_dims(cfg: TransformerConfig) -> tuple[str, ...]:
    return SPLIT_DIMS


def fsdp_dims(cfg: TransformerConfig, element_spec: dict) -> tuple[str, ...]:
    return FSDP_DIMS


def num_layers(cfg: TransformerConfig) -> int:
    return cfg.n_layers


def layer_flops(cfg: TransformerConfig, element_spec: dict) -> tuple[float, ...]:
    """Training FLOPs of one window in each layer: :func:`flops_per_token`'s per-layer terms
    (the q, k, v, output and MLP matrices, and attention's two contractions) × the length."""
    length = window_length(element_spec)
    hk = cfg.n_heads * cfg.d_head
    per_token = 6 * (4 * cfg.d_model * hk + 2 * cfg.d_model * cfg.d_ff) + 12 * hk * length
    return (float(per_token * length),) * cfg.n_layers

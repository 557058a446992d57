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
The stack is built by hand (a leading dim on each initializer) rather than with ``nnx.vmap``,
because NNX's transforms only rewrite flax's own ``sharding_names`` metadata, not our ``dims``.

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
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshpar.layout import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
BLOCK_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_in", "w_out")


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    name: Literal["transformer"] = "transformer"
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
    positions: Literal["learned", "rotary"] = "learned"
    tie_embeddings: bool = False  # logits use the input embedding (scaled by d_model**-0.5)
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"  # loss is float32 regardless
    scan_layers: bool = True  # run the stacked layers with lax.scan (True) or unrolled (False)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dims: tuple[str, ...], std: float, dtype) -> nnx.Param:
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype), dims=dims)


def _ones(shape: tuple[int, ...], dims: tuple[str, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), dims=dims)


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """RMSNorm over the last (embed) dim, statistics in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding (half-split form) of ``x [batch, length, heads, kv]``."""
    length, half = x.shape[1], x.shape[-1] // 2
    freq = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [kv/2]
    angle = jnp.arange(length, dtype=jnp.float32)[:, None] * freq  # [length, kv/2]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def block(cfg: TransformerConfig, p: dict[str, jax.Array], x: jax.Array, key: jax.Array | None) -> jax.Array:
    """One layer on ``x [batch, length, embed]``; `p` holds this layer's (unstacked) weights."""
    dt = DTYPES[cfg.compute_dtype]
    k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
    act = ("batch", "length", "heads", "kv")
    h = rms_norm(x, p["attn_norm"])  # [batch, length, embed]
    q, k, v = (constrain(jnp.einsum("ble,ehk->blhk", h, p[w].astype(dt)), act) for w in ("wq", "wk", "wv"))
    if cfg.positions == "rotary":
        q, k = rotary(q), rotary(k)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) * cfg.d_head**-0.5
    scores = constrain(scores, ("batch", "heads", "length", None))  # [batch, heads, length, length']
    length = x.shape[1]
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]  # [length, length']
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    o = constrain(jnp.einsum("bhqs,bshk->bqhk", probs, v), act)  # [batch, length, heads, kv]
    attn = jnp.einsum("blhk,hke->ble", o, p["wo"].astype(dt))
    x = constrain(x + dropout(attn, cfg.dropout, k_attn), ("batch", "length", "embed"))
    h = rms_norm(x, p["mlp_norm"])
    f = constrain(jax.nn.gelu(h @ p["w_in"].astype(dt)), ("batch", "length", "d_ff"))  # [batch, length, d_ff]
    mlp = f @ p["w_out"].astype(dt)  # [batch, length, embed]
    return constrain(x + dropout(mlp, cfg.dropout, k_mlp), ("batch", "length", "embed"))


class Blocks(nnx.Module):
    """All `n_layers` layers, every parameter stacked along a leading ``layers`` dim."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        n, d, h, k, f = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_ff
        pd = DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.attn_norm = _ones((n, d), ("layers", "embed"), pd)
        qkv = ((n, d, h, k), ("layers", "embed", "heads", "kv"), d**-0.5, pd)
        self.wq, self.wk, self.wv = _param(rngs, *qkv), _param(rngs, *qkv), _param(rngs, *qkv)
        self.wo = _param(rngs, (n, h, k, d), ("layers", "heads", "kv", "embed"), (h * k) ** -0.5, pd)
        self.mlp_norm = _ones((n, d), ("layers", "embed"), pd)
        self.w_in = _param(rngs, (n, d, f), ("layers", "embed", "d_ff"), d**-0.5, pd)
        self.w_out = _param(rngs, (n, f, d), ("layers", "d_ff", "embed"), f**-0.5, pd)

    def __call__(self, x: jax.Array, key: jax.Array | None) -> jax.Array:
        cfg = self.cfg
        stacked = {name: getattr(self, name)[...] for name in BLOCK_PARAMS}  # each [layers, ...]
        keys = None if key is None else jax.random.split(key, cfg.n_layers)  # [layers] keys
        if cfg.scan_layers:
            def body(carry, xs):
                p, k = xs
                return block(cfg, p, carry, k), None

            x, _ = jax.lax.scan(body, x, (stacked, keys))
            return x
        for i in range(cfg.n_layers):
            p = {name: w[i] for name, w in stacked.items()}
            x = block(cfg, p, x, None if keys is None else keys[i])
        return x


class Transformer(nnx.Module):
    def __init__(self, cfg: TransformerConfig, length: int, *, rngs: nnx.Rngs):
        if length > cfg.max_length:
            raise ValueError(f"sequence length {length} exceeds max_length {cfg.max_length}")
        if cfg.positions == "rotary" and cfg.d_head % 2:
            raise ValueError(f"rotary positions need an even d_head, got {cfg.d_head}")
        if not 0.0 <= cfg.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {cfg.dropout}")
        d, v, pd = cfg.d_model, cfg.vocab_size, DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.embed = _param(rngs, (v, d), ("vocab", "embed"), 1.0, pd)
        if cfg.positions == "learned":
            self.pos = _param(rngs, (cfg.max_length, d), ("length", "embed"), 1.0, pd)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.final_norm = _ones((d,), ("embed",), pd)
        if not cfg.tie_embeddings:
            self.unembed = _param(rngs, (d, v), ("embed", "vocab"), d**-0.5, pd)

    def __call__(self, inputs: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """``inputs`` int [batch, length] → logits float32 [batch, length, vocab]."""
        cfg, dt = self.cfg, DTYPES[self.cfg.compute_dtype]
        train = rngs is not None and cfg.dropout > 0.0
        k_embed, k_blocks = jax.random.split(rngs.dropout()) if train else (None, None)
        inputs = constrain(inputs, ("batch", "length"))
        x = jnp.take(self.embed[...], inputs, axis=0).astype(dt)  # [batch, length, embed]
        if cfg.positions == "learned":
            x = x + self.pos[...][: inputs.shape[1]].astype(dt)[None]
        x = constrain(dropout(x, cfg.dropout, k_embed), ("batch", "length", "embed"))
        x = rms_norm(self.blocks(x, k_blocks), self.final_norm[...])
        if cfg.tie_embeddings:
            logits = jnp.einsum("ble,ve->blv", x, self.embed[...].astype(dt)) * cfg.d_model**-0.5
        else:
            logits = x @ self.unembed[...].astype(dt)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))  # [batch, length, vocab]

    def loss(self, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """Mean token cross-entropy (nats, float32) of ``targets`` given ``inputs``; plus accuracy."""
        logits = self(batch["inputs"], rngs)
        targets = batch["targets"]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        accuracy = (logits.argmax(-1) == targets).mean()
        return loss, {"accuracy": accuracy}


def build(cfg: TransformerConfig, element_spec: dict, rngs: nnx.Rngs) -> Transformer:
    (length,), _ = element_spec["inputs"]
    return Transformer(cfg, length, rngs=rngs)


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

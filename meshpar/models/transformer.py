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
import math
from typing import Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshpar import layout as layout_lib
from meshpar.layout import constrain, use
from meshpar.models import attention as attention_lib
from meshpar.models import remat as remat_lib

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
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


def dense(x: jax.Array, w: jax.Array, n: int = 1) -> jax.Array:
    """``x [batch, length, *in]`` times weight ``w [*in, *out]`` (its `n` leading dims contracted)
    → ``[batch, length, *out]``, as one matmul ``[batch·length, in] × [in, out]``.

    The reshapes are free (row-major bitcasts) and leave one contracting dim in every matmul of
    the backward pass. As a 3-D einsum, the weight gradient contracts ``batch`` and ``length``
    together, and XLA:CPU first wrote the output gradient out transposed, fused with the
    elementwise backward before it (gelu's): a strided pass that took 30% of the quickstart step.
    Merged, ``batch·length`` keeps the split of ``batch``; a layout that also splits ``length``
    still gives the same result, with XLA resharding the merged rows.
    """
    lead, inner = x.shape[: x.ndim - n], x.shape[x.ndim - n :]
    k, out = math.prod(inner), w.shape[n:]
    y = x.reshape(-1, k) @ w.reshape(k, math.prod(out))
    return y.reshape(*lead, *out)


def block(cfg: TransformerConfig, p: dict[str, jax.Array], x: jax.Array, key: jax.Array | None) -> jax.Array:
    """One layer on ``x [batch, length, embed]``; `p` holds this layer's (unstacked) weights."""
    dt = DTYPES[cfg.compute_dtype]
    k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)
    act = ("batch", "length", "heads", "kv")
    x = checkpoint_name(x, "layer_in")
    h = rms_norm(x, weight(p, "attn_norm"))  # [batch, length, embed]
    h = checkpoint_name(h, "attn_in")
    q, k, v = (constrain(dense(h, weight(p, w, dt)), act) for w in ("wq", "wk", "wv"))
    if cfg.positions == "rotary":
        q, k = rotary(q), rotary(k)
    q, k, v = checkpoint_name(q, "query"), checkpoint_name(k, "key"), checkpoint_name(v, "value")
    o = constrain(attention_lib.attention(q, k, v, cfg.attention, cfg.attention_block), act)  # [batch, length, heads, kv]
    o = checkpoint_name(o, "context")
    attn = dense(o, weight(p, "wo", dt), 2)
    attn = checkpoint_name(attn, "attn_out")
    x = constrain(x + dropout(attn, cfg.dropout, k_attn), ("batch", "length", "embed"))
    x = checkpoint_name(x, "attn_residual")
    h = checkpoint_name(rms_norm(x, weight(p, "mlp_norm")), "mlp_in")
    f = constrain(jax.nn.gelu(dense(h, weight(p, "w_in", dt))), ("batch", "length", "d_ff"))  # [batch, length, d_ff]
    f = checkpoint_name(f, "mlp_hidden")
    mlp = dense(f, weight(p, "w_out", dt))  # [batch, length, embed]
    return constrain(x + dropout(mlp, cfg.dropout, k_mlp), ("batch", "length", "embed"))


UNROLL_LAYERS_CPU = 8  # scan_unroll 0 on CPU: stacks up to this deep run without a loop


def scan_unroll(cfg: TransformerConfig) -> int:
    """Layers per iteration of the layer scan: ``scan_unroll``, or for 0 the backend's choice.

    On XLA:CPU each scan iteration costs more than its loop bookkeeping: the residuals the
    backward pass reads are stacked over ``layers`` (zero-filled, written and sliced per
    iteration, copied), and the weights are sliced out of their stacks; for the quickstart
    (2 layers) that was a third of the step. Unrolled, the layers are straight-line code whose
    weight-gradient all-reduces XLA can also combine. Compile time grows with depth, so only
    stacks up to ``UNROLL_LAYERS_CPU`` layers are unrolled. On accelerators 1: the loop's
    bookkeeping is cheap next to the layer there, and compile time matters more.
    """
    if cfg.scan_unroll:
        return min(cfg.scan_unroll, cfg.n_layers)
    # remat's saving needs the loop: in straight-line layers XLA:CPU keeps (most of) the
    # activations remat would drop (quickstart at 8 layers, remat full: 50 MiB temp unrolled,
    # 18 MiB in the loop; none: 78 MiB unrolled).
    # A name-based policy set by the step (activation offload, meshpar.models.remat.keeping)
    # needs the loop as much.
    remat_on = cfg.remat != "none" or remat_lib.kept() is not None
    if layout_lib.platform() == "cpu" and cfg.n_layers <= UNROLL_LAYERS_CPU and not remat_on:
        return cfg.n_layers
    return 1


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
        # One layer, under model.remat's jax.checkpoint policy: the scan body and the unrolled
        # loop run the same function.
        unroll = scan_unroll(cfg)
        looped = cfg.scan_layers and unroll < cfg.n_layers  # a full unroll leaves no loop
        layer = remat_lib.checkpointed(functools.partial(block, cfg), cfg.remat, in_scan=looped)
        if cfg.scan_layers:
            def body(carry, xs):
                p, k = xs
                return layer(p, carry, k), None

            x, _ = jax.lax.scan(body, x, (stacked, keys), unroll=unroll)
            return x
        for i in range(cfg.n_layers):
            p = {name: w[i] for name, w in stacked.items()}
            x = layer(p, x, None if keys is None else keys[i])
        return x


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
        x = jnp.take(use(self.embed[...], ("vocab", "embed"), dt), inputs, axis=0)  # [batch, length, embed]
        if cfg.positions == "learned":
            x = x + use(self.pos[...], ("length", "embed"), dt)[: inputs.shape[1]][None]
        x = constrain(dropout(x, cfg.dropout, k_embed), ("batch", "length", "embed"))
        x = rms_norm(self.blocks(x, k_blocks), use(self.final_norm[...], ("embed",)))
        if cfg.tie_embeddings:
            logits = jnp.einsum("ble,ve->blv", x, use(self.embed[...], ("vocab", "embed"), dt)) * cfg.d_model**-0.5
        else:
            logits = x @ use(self.unembed[...], ("embed", "vocab"), dt)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))  # [batch, length, vocab]

    def loss(self, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """Mean cross-entropy (nats, float32) of each window's next tokens; plus accuracy.

        ``batch["tokens"]`` ``[batch, length + 1]`` (token ids, in the narrowest dtype that holds
        the vocabulary: uint8 for bytes) is all the host sends; inputs (its first ``length``
        tokens) and targets (its last ``length``) are cut here, on the devices, and widened to
        int32. The window dim is unnamed, so never split: ``length + 1`` does not divide by the
        mesh axis a layout may split ``length`` over, so each device holds its rows' whole
        windows (a byte per token) and cuts its own part of ``length`` from them locally.
        """
        tokens = constrain(batch["tokens"], ("batch", None))  # [batch, length + 1]
        inputs = constrain(tokens[:, :-1].astype(jnp.int32), ("batch", "length"))  # [batch, length]
        targets = constrain(tokens[:, 1:].astype(jnp.int32), ("batch", "length"))  # [batch, length]
        logits = self(inputs, rngs)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        accuracy = (logits.argmax(-1) == targets).mean()
        return loss, {"accuracy": accuracy}


def window_length(element_spec: dict) -> int:
    """The sequence length the data's ``tokens [length + 1]`` windows give: inputs and targets
    are ``length`` tokens each."""
    (window,), _ = element_spec["tokens"]
    if window < 2:
        raise ValueError(f"token windows of {window} hold no (input, target) pair; they need length + 1 >= 2")
    return window - 1


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

# offload.activations → the names (checkpoint_name tags) each layer keeps in host memory
# (attn_out is never a residual: the residual add's backward does not read it). layer_in is the
# layer loop's carry: the step moves it to host memory, but offloading a loop's carry is known
# to free nothing on the device (jax-ml/jax#23869).
ACTIVATION_NAMES: dict[str, tuple[str, ...]] = {
    "none": (),
    "layer_outputs": ("layer_in", "attn_residual"),
    "dots": ("layer_in", "attn_residual", "query", "key", "value", "context", "attn_out", "mlp_hidden"),
}


def split_dims(cfg: TransformerConfig) -> tuple[str, ...]:
    return SPLIT_DIMS


def fsdp_dims(cfg: TransformerConfig, element_spec: dict) -> tuple[str, ...]:
    return FSDP_DIMS


def activation_all_reduces(
    cfg: TransformerConfig, element_spec: dict, rows: int, dims: tuple[str, ...]
) -> tuple[int, int]:
    """(count, elements each) of the all-reduces over the model axis per step, for `rows` batch
    rows per device with `dims` split over it (Megatron): each split sublayer (attention by
    ``heads``, the MLP by ``d_ff``) sums its output forward and its input's gradient backward,
    and once more under ``remat: full`` (the recomputed forward); the ``vocab``-split output sums
    the gradient of its input once. Each is ``[rows, length, embed]``."""
    sublayers = ("heads" in dims) + ("d_ff" in dims)
    per_layer = sublayers * (3 if cfg.remat == "full" else 2)
    count = per_layer * cfg.n_layers + ("vocab" in dims)
    return count, rows * window_length(element_spec) * cfg.d_model


def num_layers(cfg: TransformerConfig) -> int:
    return cfg.n_layers


def layer_flops(cfg: TransformerConfig, element_spec: dict) -> tuple[float, ...]:
    """Training FLOPs of one window in each layer: :func:`flops_per_token`'s per-layer terms
    (the q, k, v, output and MLP matrices, and attention's two contractions) × the length."""
    length = window_length(element_spec)
    hk = cfg.n_heads * cfg.d_head
    per_token = 6 * (4 * cfg.d_model * hk + 2 * cfg.d_model * cfg.d_ff) + 12 * hk * length
    return (float(per_token * length),) * cfg.n_layers

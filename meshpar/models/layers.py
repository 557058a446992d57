"""What the language-model families are built of: parameters in logical dims, RMSNorm, rotary
positions, 2-D dense projections, the stacked-layer loop and the next-token loss.

The decoder (:mod:`meshpar.models.decoder`, behind the transformer and llama families) writes
its layer as one function ``block(p, x, key)`` over one layer's weights ``p`` and hands it to
:func:`run_layers`, which runs the stack under ``model.remat`` the same way for every model:
one ``jax.lax.scan`` (``scan_layers``, ``scan_unroll`` layers per iteration) or an unrolled
Python loop over slices of the same stacked arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshpar.models import remat as remat_lib
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import stages as pipeline
from meshpar.sharding.layout import constrain

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def param(rngs: nnx.Rngs, shape: tuple[int, ...], dims: tuple[str, ...], std: float, dtype) -> nnx.Param:
    """A normal(0, `std`) parameter of logical `dims`, drawn in float32 and stored in `dtype`."""
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype), dims=dims)


def ones(shape: tuple[int, ...], dims: tuple[str, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype), dims=dims)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last (embed) dim, statistics in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary(x: jax.Array, inv_freq: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (half-split form, as Hugging Face's ``rotate_half``) of
    ``x [batch, length, heads, kv]`` with angular frequencies ``inv_freq [kv/2]``, at positions
    ``0 .. length - 1``, or each row's own `positions` ``[batch, length]`` (decoding)."""
    if positions is None:
        angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq  # [length, kv/2]
        sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    else:
        angle = positions.astype(jnp.float32)[..., None] * inv_freq  # [batch, length, kv/2]
        sin, cos = jnp.sin(angle)[:, :, None, :], jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def tag(x: jax.Array, *names: str) -> jax.Array:
    """`x` tagged with each of `names` (``checkpoint_name`` in turn, the last outermost): one value
    that a remat policy keeping any of the names keeps, once."""
    for name in names:
        x = checkpoint_name(x, name)
    return x


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


UNROLL_LAYERS_CPU = 8  # scan_unroll 0 on CPU: stacks up to this deep run without a loop


def scan_unroll(cfg) -> int:
    """Layers per iteration of the layer scan: ``cfg.scan_unroll``, or for 0 the backend's choice.

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
    # A name-based policy set by the step (activation offload: the trace's keep, meshpar.sharding.tracing.Trace)
    # needs the loop as much.
    remat_on = cfg.remat != "none" or remat_lib.kept() is not None
    if layout_lib.platform() == "cpu" and cfg.n_layers <= UNROLL_LAYERS_CPU and not remat_on:
        return cfg.n_layers
    return 1


Block = Callable[[dict[str, jax.Array], jax.Array, "jax.Array | None"], jax.Array]


def run_layers(cfg, block: Block, stacked: dict[str, jax.Array], x: jax.Array, key: jax.Array | None,
               aux: bool = False, maxed: tuple[str, ...] = ()):  # fmt: skip
    """``block(p, x, key)`` over the `cfg.n_layers` layers of `stacked` (each ``[layers, ...]``),
    under ``cfg.remat``'s ``jax.checkpoint`` policy: the scan body and the unrolled loop run the
    same function, so parameters, checkpoints and results do not depend on the form. Under a
    stage axis (``layers:<axis>`` in the layout) the stack runs as a pipeline of stages
    (:mod:`meshpar.sharding.stages`), each stage's layers this same way.

    With `aux`, `block` returns ``(x, values)`` (an MoE layer's statistics) and this returns x
    and the values stacked along a leading dim of the layers, in canonical order; under a stage
    axis each value is its mean over the pipeline's microbatches (:func:`meshpar.sharding.stages.run`).
    `maxed`: the entries of `stacked` whose gradients combine by max where a pipeline uses them
    once per tick (FP8 amax histories, :class:`meshpar.models.fp8.History`)."""
    sched = pipeline.active()
    if sched is not None:
        return pipeline.run(sched, lambda p, h, k: _in_order(cfg, block, p, h, k, aux), stacked, x, key, aux, maxed)
    return _in_order(cfg, block, stacked, x, key, aux)


def _in_order(cfg, block: Block, stacked: dict[str, jax.Array], x: jax.Array, key: jax.Array | None,
              aux: bool = False):  # fmt: skip
    """The layers of `stacked` (all of them, or a pipeline stage's group) one after the other."""
    n = next(iter(stacked.values())).shape[0]
    keys = None if key is None else jax.random.split(key, n)  # [layers] keys
    unroll = min(scan_unroll(cfg), n)
    looped = cfg.scan_layers and unroll < n  # a full unroll leaves no loop
    layer = remat_lib.checkpointed(block, cfg.remat, in_scan=looped, save=getattr(cfg, "remat_save", ()))
    if cfg.scan_layers:

        def body(carry, xs):
            p, k = xs
            out = layer(p, carry, k)
            return out if aux else (out, None)

        x, ys = jax.lax.scan(body, x, (stacked, keys), unroll=unroll)
        return (x, ys) if aux else x
    ys = []
    for i in range(n):
        p = {name: w[i] for name, w in stacked.items()}
        out = layer(p, x, None if keys is None else keys[i])
        x, y = out if aux else (out, None)
        ys.append(y)
    return (x, jax.tree.map(lambda *v: jnp.stack(v), *ys)) if aux else x


def window_length(element_spec: dict) -> int:
    """The sequence length the data's ``tokens [length + 1]`` windows give: inputs and targets
    are ``length`` tokens each."""
    (window,), _ = element_spec["tokens"]
    if window < 2:
        raise ValueError(f"token windows of {window} hold no (input, target) pair; they need length + 1 >= 2")
    return window - 1


def next_token_loss(logits_fn: Callable[[jax.Array], jax.Array], batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
    """Mean cross-entropy (nats, float32) of each window's next tokens; plus accuracy.

    ``batch["tokens"]`` ``[batch, length + 1]`` (token ids, in the narrowest dtype that holds
    the vocabulary: uint8 for bytes) is all the host sends; inputs (its first ``length``
    tokens) and targets (its last ``length``) are cut here, on the devices, and widened to
    int32. The window dim is unnamed, so never split: ``length + 1`` does not divide by the
    mesh axis a layout may split ``length`` over, so each device holds its rows' whole
    windows and cuts its own part of ``length`` from them locally.
    """
    tokens = constrain(batch["tokens"], ("batch", None))  # [batch, length + 1]
    inputs = constrain(tokens[:, :-1].astype(jnp.int32), ("batch", "length"))  # [batch, length]
    targets = constrain(tokens[:, 1:].astype(jnp.int32), ("batch", "length"))  # [batch, length]
    logits = logits_fn(inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    accuracy = (logits.argmax(-1) == targets).mean()
    return loss, {"accuracy": accuracy}


def rope_frequencies(d_head: int, theta: float, llama3: tuple[float, float, float, int] | None = None) -> np.ndarray:
    """Rotary angular frequencies ``[d_head / 2]`` (float32), computed as Hugging Face's Llama
    does, in float32: ``1 / theta ** (2i / d_head)``; with `llama3` = (factor, low_freq_factor,
    high_freq_factor, original context length), Llama 3.1's scaling: wavelengths longer than
    ``original / low_freq_factor`` are stretched by ``factor``, those shorter than ``original /
    high_freq_factor`` kept, the band between interpolated smoothly."""
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, d_head, 2, dtype=np.float32) / np.float32(d_head)))).astype(
        np.float32
    )
    if llama3 is None:
        return inv
    factor, low, high, original = (np.float32(v) for v in llama3)
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > original / low, inv / factor, inv).astype(np.float32)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


# offload.activations → the names (checkpoint_name tags) each layer of a language-model family
# keeps in host memory: the residuals among the tags (attn_out is tagged but never a residual: the
# residual add's backward does not read it, so no policy names it and no plan counts it). layer_in
# is the layer loop's carry: the step moves it to host memory, but offloading a
# loop's carry is known to free nothing on the device (jax-ml/jax#23869).
ACTIVATION_NAMES: dict[str, tuple[str, ...]] = {
    "none": (),
    "layer_outputs": ("layer_in", "attn_residual"),
    "dots": ("layer_in", "attn_residual", "query", "key", "value", "context", "mlp_hidden"),
}

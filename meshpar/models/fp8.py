"""FP8 matmuls: a dot whose operands are quantized to 8-bit floats, e4m3 forward and e5m2 for the
output gradient backward, each with one float32 scale per tensor (docs/fp8.md).

``model.fp8`` picks the kinds of dot (:data:`KINDS`); every other dot of the model (the
embedding, the logits, the router, attention's scores and values) stays in the compute dtype.
The scale is the tensor's own amax this step (*current scaling*): ``finfo(dtype).max / amax``,
the amax a max over the whole (global) tensor, so under any layout it is one all-reduce of one
number, and it needs no state: microbatches, pipeline ticks and replicas cannot disagree on it.

Each dot is one ``jax.custom_vjp`` whose residuals are the FP8 operands and their scales, and
whose three products (forward, both gradients) are dots of dequantized FP8 values:
``dot(convert(q_x) * (1 / s_x), convert(q_w) * (1 / s_w))``. That is the pattern XLA:GPU's
GEMM rewriter turns into one cuBLASLt FP8 GEMM (``__cublas$lt$matmul$f8``) on a GPU with FP8
tensor cores; elsewhere (XLA:CPU, an A100) the same program runs the dot on dequantized values:
the FP8 rounding is real, the speed is not (emulated). :mod:`meshpar.plan.fp8_check` reads the
compiled program for which dots became FP8 GEMMs.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# model.fp8's kinds of dot: the dense MLP's three (or two) weight matmuls, an MoE layer's expert
# matmuls, the attention's query/key/value/output projections.
KINDS = ("mlp", "experts", "attention")
# Dots that stay in the compute dtype whatever model.fp8 says (named in its error): the
# embedding's gather and the logits (their error is the loss's), the router (its softmax picks
# experts), attention's scores and values (flash kernels run them in bf16).
COMPUTE_ONLY = ("embedding", "logits", "router", "scores")
# The jaxpr name the forward product of each FP8 dot carries (jax.named_scope), by which the
# compiled-program check finds it: "fp8_<kind>_<weight>" (e.g. fp8_mlp_w_up).
SCOPE = "fp8"


def check(kinds) -> str | None:
    """What is wrong with ``model.fp8``'s list `kinds`, or None."""
    for kind in kinds:
        if kind in COMPUTE_ONLY:
            return f"{kind!r} dots stay in the compute dtype (FP8 kinds: {', '.join(KINDS)})"
        if kind not in KINDS:
            return f"unknown kind of dot {kind!r} (FP8 kinds: {', '.join(KINDS)})"
    if len(set(kinds)) != len(kinds):
        return f"lists a kind twice: {list(kinds)}"
    return None


def _max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _from_amax(amax: jax.Array, dtype) -> jax.Array:
    """float32 scalar that maps `amax` onto `dtype`'s largest finite value (1 for a zero or
    non-finite amax, which then passes through as the quantize's clip or NaN)."""
    amax = amax.astype(jnp.float32)
    s = _max(dtype) / amax
    return jnp.where(jnp.isfinite(s) & (amax > 0), s, jnp.float32(1.0))


def scale(x: jax.Array, dtype) -> jax.Array:
    """Current scaling's scale of `x`: its own amax onto `dtype`'s range (:func:`_from_amax`)."""
    return _from_amax(jnp.max(jnp.abs(x)), dtype)


def quantize(x: jax.Array, dtype, s: jax.Array) -> jax.Array:
    """`x` times scale `s`, saturated to `dtype`'s range, in `dtype` (round to nearest even)."""
    m = _max(dtype)
    return jnp.clip(x.astype(jnp.float32) * s, -m, m).astype(dtype)


def dequantize(q: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """FP8 `q` back in `dtype`: ``convert(q) * (1 / s)``, the form XLA fuses into an FP8 GEMM."""
    return q.astype(dtype) * (1.0 / s).astype(dtype)


Place = Callable[[jax.Array], jax.Array]


def unplaced(w: jax.Array) -> jax.Array:
    return w


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5))
def _fp8_einsum(spec: str, x: jax.Array, w: jax.Array, dtype, place: Place, stored: tuple) -> jax.Array:
    return _forward(spec, x, w, dtype, place, stored)[0]


def _forward(spec, x, w, dtype, place, stored):
    sx, sw = scale(x, E4M3), scale(w, E4M3)
    qx, qw = quantize(x, E4M3, sx), place(quantize(w, E4M3, sw))  # place: the weight's gather, in FP8
    y = jnp.einsum(spec, dequantize(qx, sx, dtype), dequantize(qw, sw, dtype))
    return y, (qx, sx, qw, sw)


def _gradients(spec: str, a: jax.Array, b: jax.Array, dg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two products of ``einsum(spec, a, b)``'s backward on the output gradient `dg`: its
    transposes in `a` and in `b`, and not the forward product (``jax.vjp`` would trace that too:
    dead code XLA drops, but the planner counts matmul FLOPs in traced programs)."""
    (da,) = jax.linear_transpose(lambda x: jnp.einsum(spec, x, b), a)(dg)
    (db,) = jax.linear_transpose(lambda y: jnp.einsum(spec, a, y), b)(dg)
    return da, db


def _fp8_gradients(spec, dtype, stored, operands, g, sg) -> tuple[jax.Array, jax.Array]:
    """Both gradients as dots of FP8 values: the output gradient `g` quantized to e5m2 by scale
    `sg`, against the forward's FP8 `operands` ``(qx, sx, qw, sw)``; `stored`: the weight's
    (shape, dtype) as given."""
    qx, sx, qw, sw = operands
    dg = dequantize(quantize(g, E5M2, sg), sg, dtype)
    dx, dw = _gradients(spec, dequantize(qx, sx, dtype), dequantize(qw, sw, dtype), dg)
    shape, w_dtype = stored
    return dx.astype(dtype), dw.reshape(shape).astype(w_dtype)


def _backward(spec, dtype, place, stored, res, g):
    """:func:`_fp8_gradients`, the output gradient scaled by its own amax."""
    return _fp8_gradients(spec, dtype, stored, res, g, scale(g, E5M2))


_fp8_einsum.defvjp(_forward, _backward)


class History(nnx.Variable):
    """Delayed scaling's amax histories of one stack of FP8 dots, ``[layers, 3, history]`` float32:
    per layer the input's, the weight's and the output gradient's amax of the last ``history``
    steps, newest first. Not a parameter: the train step writes each step's new histories over
    the old (:func:`meshpar.step.trainer.make_train_step`), never through the optimizer."""


HISTORY_DIMS = ("layers", "fp8_operand", "fp8_history")  # never split: a few KiB per dot
HISTORY_PREFIX = "fp8_"  # a history's name: "fp8_<its weight's>" (blocks/fp8_wq)


def is_history(path: str) -> bool:
    """Whether the state entry at `path` (``blocks/fp8_wq``, or its ``/value``) is an amax history: training state,
    not a weight, so no Hugging Face checkpoint holds one (an import starts it empty, an export
    leaves it out)."""
    return path.removesuffix("/value").rsplit("/", 1)[-1].startswith(HISTORY_PREFIX)


def history_scale(history: jax.Array, dtype) -> jax.Array:
    """Delayed scaling's float32 scale from one operand's amax history ``[history]``: the max over
    the history mapped onto `dtype`'s largest value; 1 while the history holds no amax yet."""
    return _from_amax(jnp.max(history), dtype)


def updated(history: jax.Array, amaxes: jax.Array) -> jax.Array:
    """``history [3, n]`` with this step's ``amaxes [3]`` in front and the oldest dropped."""
    return jnp.concatenate([amaxes[:, None], history[:, :-1]], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5, 6))
def _delayed_einsum(spec, x, w, history, dtype, place: Place, stored: tuple) -> jax.Array:
    return _delayed_forward(spec, x, w, history, dtype, place, stored)[0]


def _delayed_forward(spec, x, w, history, dtype, place, stored):
    sx, sw = history_scale(history[0], E4M3), history_scale(history[1], E4M3)
    qx, qw = quantize(x, E4M3, sx), place(quantize(w, E4M3, sw))
    y = jnp.einsum(spec, dequantize(qx, sx, dtype), dequantize(qw, sw, dtype))
    seen = jnp.stack([jnp.max(jnp.abs(x)), jnp.max(jnp.abs(w))]).astype(jnp.float32)  # this step's amaxes
    return y, (qx, sx, qw, sw, history, seen)


def _delayed_backward(spec, dtype, place, stored, res, g):
    """:func:`_backward` with the output gradient scaled by its history, and the "gradient" of
    `history` the updated history: the value the train step keeps (a max, never a sum, where one
    history meets several uses: :func:`meshpar.sharding.stages.fan_out_max`, the accumulation)."""
    *operands, history, seen = res
    dx, dw = _fp8_gradients(spec, dtype, stored, operands, g, history_scale(history[2], E5M2))
    amaxes = jnp.concatenate([seen, jnp.max(jnp.abs(g)).astype(jnp.float32)[None]])
    return dx, dw, updated(history, amaxes)


_delayed_einsum.defvjp(_delayed_forward, _delayed_backward)


def einsum(spec: str, x: jax.Array, w: jax.Array, dtype, place: Place = unplaced, name: str = "",
           history: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """``jnp.einsum(spec, x, w)`` with FP8 operands (e4m3; the output gradient e5m2), in and out
    in `dtype`. `w` is the weight as given (in the compute dtype and already placed for compute,
    or, with `place`, where it is stored: `place` then moves its FP8 form, so an FSDP all-gather
    moves one byte per element). `name` labels the dot for the compiled-program check. With
    `history` (``[3, n]``, :class:`History`'s slice for this dot) the scales are delayed ones."""
    with jax.named_scope(f"{SCOPE}_{name}" if name else SCOPE):
        if history is None:
            return _fp8_einsum(spec, x.astype(dtype), w, dtype, place, (w.shape, w.dtype))
        return _delayed_einsum(spec, x.astype(dtype), w, history, dtype, place, (w.shape, w.dtype))


def dense(x: jax.Array, w: jax.Array, dtype, n: int = 1, place: Place = unplaced, name: str = "",
          history: jax.Array | None = None) -> jax.Array:  # fmt: skip
    """:func:`meshpar.models.layers.dense` with FP8 operands: ``x [batch, length, *in]`` times
    ``w [*in, *out]`` as one ``[batch·length, in] × [in, out]`` FP8 matmul."""
    lead, inner = x.shape[: x.ndim - n], x.shape[x.ndim - n :]
    k, out = math.prod(inner), w.shape[n:]
    m = math.prod(out)

    def flat(v: jax.Array) -> jax.Array:
        return place(v).reshape(k, m)

    y = einsum("rk,kn->rn", x.reshape(-1, k), w, dtype, flat, name, history)
    return y.reshape(*lead, *out)

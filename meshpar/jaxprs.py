"""Reading jaxprs: every primitive name and every jaxpr parameter meshpar looks at, in one place.

The planner's memory model (:mod:`meshpar.plan.memory.analytic`), its offload profile
(:mod:`meshpar.plan.out_of_core.offload_plan`) and host offload's check of a traced step
(:mod:`meshpar.sharding.offload`) read the programs jax builds. What they ask of an equation — is it a
call whose body maps its inputs one to one, a layer under ``jax.checkpoint``, a loop and how many
times it runs, a matmul, a relabelling of its operand's bytes, a ``checkpoint_name`` tag, a move
to host memory — is answered here, and only here, so a primitive renamed or a parameter
reshaped by a new jax (scan's ``num_consts``/``num_carry`` on jax 0.10, its ``ft_in`` on 0.12)
is one edit. Nothing else in meshpar reads ``eqn.primitive.name`` or an equation's params by
name (tests/test_jaxprs.py checks).

This module imports jax only, so every meshpar module may import it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from jax.extend.core import Literal

# Primitives that only relabel their operand's bytes (bitcasts in XLA, or no op at all: stop_gradient
# lowers to its operand): a value behind one is its operand.
RELABELS = frozenset({
    "reshape", "squeeze", "expand_dims", "name", "reduce_precision", "sharding_constraint", "copy", "copy_p",
    "pvary", "mesh_cast", "stop_gradient",
})  # fmt: skip
# Cheap elementwise and data-movement primitives: XLA fuses them into their consumers and
# recomputes them there from their operands rather than keeping their outputs.
CHEAP = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "select_n", "clamp", "square",
    "integer_pow", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "floor", "ceil", "round",
    "is_finite", "rem", "nextafter", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "convert_element_type", "iota", "broadcast_in_dim", "transpose", "slice", "split", "concatenate", "pad", "rev",
    "random_wrap", "random_unwrap", "random_seed", "one_minus_square",
})  # fmt: skip
# Ops that read their operands from memory: an operand is written out before they run.
MATMULS = frozenset({"dot_general", "conv_general_dilated"})
# Reductions: each the root of a fusion of its own on XLA:GPU (the elementwise work before it fused in).
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                        "argmax", "argmin", "cumsum", "cummax", "cumlogsumexp"})  # fmt: skip
# Call-like primitives and the parameter holding their body.
CALLS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
    "remat2": "jaxpr",
}  # fmt: skip
# jax.checkpoint's primitive, by the names jax has given it.
LAYER_CALLS = frozenset({"checkpoint", "remat", "remat2"})
# Memory kinds (and jax's memory-space reprs) that are host memory.
HOST_KINDS = frozenset({"pinned_host", "unpinned_host"})


def op(eqn) -> str:
    """The equation's primitive, by name (a residual's label where it has no tag)."""
    return eqn.primitive.name


def is_literal(var) -> bool:
    """`var` is a constant written into the program, not a value of it."""
    return isinstance(var, Literal)


def nbytes(var) -> int:
    """Bytes of the value `var` stands for."""
    aval = var.aval
    return math.prod(aval.shape) * aval.dtype.itemsize


def _open(jaxpr) -> Any:
    """A ClosedJaxpr's jaxpr; an open jaxpr as it is."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    return inner if hasattr(inner, "eqns") else None


def call_body(eqn):
    """The jaxpr inside a call-like equation (a jit, a closed call, a custom-derivative call, a
    ``jax.checkpoint``), when it maps the call's inputs and outputs one to one; else None."""
    name = op(eqn)
    if name not in CALLS:
        return None
    inner = _open(eqn.params.get(CALLS[name]))
    if inner is not None and len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
        return inner
    return None


def subjaxprs(eqn) -> list:
    """Every jaxpr nested in the equation's params (a call's body, a loop's, each branch of a cond)."""
    out = []
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            inner = _open(v)
            if inner is not None:
                out.append(inner)
    return out


def nested(jaxpr) -> Iterator:
    """`jaxpr` (open or closed) and every jaxpr nested in it, outermost first."""
    jaxpr = _open(jaxpr)
    yield jaxpr
    for eqn in jaxpr.eqns:
        for sub in subjaxprs(eqn):
            yield from nested(sub)


def is_layer_call(eqn) -> bool:
    """A ``jax.checkpoint`` call: how the models run one layer under ``model.remat``."""
    return op(eqn) in LAYER_CALLS


def is_scan(eqn) -> bool:
    return op(eqn) == "scan"


def scan_length(eqn) -> int:
    """Iterations of a scan."""
    return eqn.params["length"]


def scan_parts(eqn) -> tuple:
    """A scan equation's body jaxpr, number of constants and number of carried values (its
    inputs are constants, then the carry, then the stacked inputs)."""
    p = eqn.params
    body = _open(p["jaxpr"])
    if "num_consts" in p:  # jax 0.10
        return body, p["num_consts"], p["num_carry"]
    consts, carry, _ = (list(g) for g in p["ft_in"].update(list(range(len(eqn.invars)))).unpack())  # jax 0.12
    return body, len(consts), len(carry)


def is_rolled(eqn) -> bool:
    """The scan runs as a loop (not unrolled into straight-line code): what it hands to the
    backward pass leaves the loop body as stacked outputs, which fusion cannot reach into."""
    unroll, length = eqn.params.get("unroll", 1), scan_length(eqn)
    return unroll is not True and int(unroll) < length


def is_matmul(eqn) -> bool:
    """A matmul or convolution: reads its operands from memory."""
    return op(eqn) in MATMULS


def is_reduction(eqn) -> bool:
    """A reduction over one or more dims (the root of a fusion of its own on XLA:GPU)."""
    return op(eqn) in REDUCTIONS


def is_relabel(eqn) -> bool:
    """Relabels its operand's bytes (a bitcast in XLA: reshape, squeeze, a tag, a sharding constraint)."""
    return op(eqn) in RELABELS


def is_cheap(eqn) -> bool:
    """A cheap elementwise or data-movement op that XLA fuses into its consumers."""
    return op(eqn) in CHEAP


def is_mul(eqn) -> bool:
    return op(eqn) == "mul"


def broadcast_grown(eqn) -> tuple[int, ...] | None:
    """The output dims a ``broadcast_in_dim`` adds or stretches from size 1, with the output's
    rank last; None for any other equation."""
    if op(eqn) != "broadcast_in_dim":
        return None
    out, dims = eqn.outvars[0].aval.shape, eqn.params["broadcast_dimensions"]
    src = eqn.invars[0].aval.shape
    return tuple(d for d in range(len(out)) if d not in dims or (src[dims.index(d)] == 1 and out[d] > 1))


def constraint(eqn):
    """The sharding a ``with_sharding_constraint`` places its operand in, else None."""
    return eqn.params["sharding"] if op(eqn) == "sharding_constraint" else None


def slice_bounds(eqn) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(start, limit) per dim of a static ``slice`` with unit strides, else None."""
    if op(eqn) != "slice" or any(s not in (None, 1) for s in eqn.params["strides"] or ()):
        return None
    return tuple(eqn.params["start_indices"]), tuple(eqn.params["limit_indices"])


def tag_of(eqn) -> str | None:
    """The ``checkpoint_name`` tag this equation gives its operand, else None."""
    return eqn.params["name"] if op(eqn) == "name" else None


def tags_made(jaxpr) -> dict[str, int]:
    """``checkpoint_name`` tag -> how many times `jaxpr` (and the jaxprs nested in it) computes
    the value it tags: a tag on a value its own jaxpr makes counts, one on a value handed in
    (a saved residual, through relabellings) does not. Loop bodies count once."""
    found: dict[str, int] = {}
    for inner in nested(jaxpr):
        producer = {v: e for e in inner.eqns for v in e.outvars}
        for eqn in inner.eqns:
            tag = tag_of(eqn)
            if tag is None:
                continue
            v = eqn.invars[0]
            while v in producer and is_relabel(producer[v]) and not is_literal(producer[v].invars[0]):
                v = producer[v].invars[0]
            if v in producer:
                found[tag] = found.get(tag, 0) + 1
    return found


def matmul_flops(eqn) -> tuple[float, bool]:
    """(FLOPs, has batch dims) of a dot_general: 2 × output elements × contracted elements;
    (0, False) for any other equation."""
    if op(eqn) != "dot_general":
        return 0.0, False
    lhs = eqn.invars[0].aval.shape
    (contracting, _), (batch, _) = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval
    return 2.0 * math.prod(out.shape) * math.prod(lhs[d] for d in contracting), bool(batch)


def _to_host(destination: Any) -> bool:
    kind = getattr(destination, "memory_kind", None)  # a sharding, or jax's TransferToMemoryKind
    return kind in HOST_KINDS or str(destination).endswith("Host")  # jax 0.12: core.MemorySpace.Host


def host_transfers(eqn) -> list:
    """The operands a ``device_put`` moves to host memory (none for any other equation)."""
    if op(eqn) != "device_put":
        return []
    return [v for v, d in zip(eqn.invars, eqn.params["devices"]) if not is_literal(v) and _to_host(d)]


def walk(jaxpr, copies: int = 1, in_layer: bool = False) -> Iterator[tuple[Any, int, bool]]:
    """Every equation of `jaxpr` (open or closed) and of the jaxprs nested in it, in program
    order, as ``(eqn, copies, in_layer)``: `copies`, how many times it runs (loop trip counts
    multiplied); `in_layer`, whether it is inside a ``jax.checkpoint`` call. A call-like
    equation comes before its body's equations."""
    for eqn in _open(jaxpr).eqns:
        yield eqn, copies, in_layer
        inner = copies * scan_length(eqn) if is_scan(eqn) else copies
        for sub in subjaxprs(eqn):
            yield from walk(sub, inner, in_layer or is_layer_call(eqn))

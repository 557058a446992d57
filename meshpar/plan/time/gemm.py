"""What XLA:GPU's GEMMs hold beside a matmul's operands and output, read from XLA itself.

A cuBLAS call (``__cublas$lt$matmul``, the lowering with ``xla_gpu_enable_triton_gemm`` off)
writes a workspace, the ``s8`` second element of its result; a Triton GEMM fusion (the default)
may split the contracted dim and write one float32 partial result per slice, summed by a
reduction after it. How much depends on the shapes, the GPU and XLA's heuristics, so each
distinct matmul is compiled alone for the step's device, and its GEMM's buffers are read from the
compiled program (cached per process). :mod:`meshpar.plan.memory.analytic` adds them to the backward
phase of its model of XLA:GPU's temp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from meshpar import jaxprs
from meshpar.backend import compile_cache, quiet
from meshpar.plan import hlo
from meshpar.step import parts


def matmul_scratch(
    step: parts.AbstractStep, matmuls_at: dict, compiler_options: dict | None = None
) -> tuple[int, dict[int, int]]:
    """What XLA:GPU's lowering of the backward's matmuls holds beside their operands and outputs
    (see :mod:`meshpar.plan.memory.analytic`'s docstring): (the largest workspace of any of them, alive through its call —
    one call at a time, and calls run all through the backward; place in the forward's program
    order -> the largest partial results of a matmul the backward runs there). The matmuls are
    those of the backward of each matmul at a place (`matmuls_at`: :func:`meshpar.plan.memory.trace.saved_activations`; a
    loop's, every matmul of its body, and the body's own under remat's recomputation), each
    compiled alone for the step's device with `compiler_options` (and the ``XLA_FLAGS`` in
    effect), its GEMM's own buffers read from the compiled program (:func:`gemm_scratch`)."""
    device = step.mesh.devices.flat[0]
    options = tuple(sorted((k, v) for k, v in (compiler_options or {}).items() if not k.startswith("xla_dump")))
    workspace, partials = 0, {}
    for place, (loop, eqns) in matmuls_at.items():
        found = [lone_matmul_scratch(device, options, t) for e in eqns for t in transposes(e)]
        if loop:  # a loop's body: its own matmuls run again in the backward's iteration under remat
            found += [lone_matmul_scratch(device, options, e) for e in eqns]
        workspace = max([workspace, *(w for w, _ in found)])
        partials[place] = max((p for _, p in found), default=0)  # one matmul's at a time
    return workspace, partials


def transposes(eqn) -> list:
    """The matmuls of the backward of the matmul `eqn` (its operands' cotangents)."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]

    def backward(*xs):
        out, vjp = jax.vjp(lambda *ys: eqn.primitive.bind(*ys, **eqn.params), *xs)
        return vjp(jnp.ones_like(out))

    return [e for j in jaxprs.nested(jax.make_jaxpr(backward)(*avals)) for e in j.eqns
            if jaxprs.is_matmul(e)][1:]  # fmt: skip


_SCRATCH: dict = {}  # (device, options, primitive, operands, params) -> bytes


def lone_matmul_scratch(device, options: tuple, eqn) -> tuple[int, int]:
    """(workspace, partial results): bytes the GEMM of the matmul `eqn`, compiled alone on abstract
    operands for `device`, writes beside the matmul's result (:func:`gemm_scratch`)."""
    operands = tuple((tuple(v.aval.shape), v.aval.dtype) for v in eqn.invars)
    key = (device, options, eqn.primitive, operands, repr(sorted(eqn.params.items())))
    if key not in _SCRATCH:
        sharding = jax.sharding.SingleDeviceSharding(device)
        args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in operands]
        lowered = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params)).lower(*args)
        with quiet.native_stderr_filtered(), compile_cache.suspended():
            compiled = lowered.compile(compiler_options=dict(options)) if options else lowered.compile()
        _SCRATCH[key] = gemm_scratch(compiled.as_text(), math.prod(eqn.outvars[0].aval.shape))
    return _SCRATCH[key]


def gemm_scratch(text: str, result: int) -> tuple[int, int]:
    """(workspace, partial results): bytes the GEMMs of a compiled program of one matmul write
    beside its result (of `result` elements) — a cuBLAS call's workspace (the second element of
    its result tuple), a Triton GEMM's split-K partial results (one result per slice of the
    contracted dim, summed by a reduction afterwards). Operand copies that layout assignment
    adds around a lone matmul are not counted: in the whole step, the producers write the layout
    the GEMM reads."""
    module = hlo.parse(text)
    workspace = partials = 0
    for op in module.computations[module.entry]:
        library, fused = hlo.target(op).startswith("__cublas"), "gemm" in hlo.fusion_kind(op)
        # every buffer a GEMM writes but the result itself (the model counts that as the matmul's output)
        extra = sum(hlo.shape_bytes(leaf) for leaf in hlo.leaves(op.shape) if hlo.elements(leaf) != result)
        workspace += extra if library else 0
        partials += extra if fused else 0
    return workspace, partials

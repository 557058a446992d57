"""The work of a compiled program, whatever the machine: its FLOPs (all of them, and those in
matrix products), and each op's FLOPs and bytes.

The FLOP rules are implemented in :mod:`meshpar.plan.hlo`; their spec: docs/time-model.md.
"""

from __future__ import annotations

import dataclasses

from meshpar.plan import hlo
from meshpar.plan.time import program_ops
from meshpar.plan.time.op_bytes import op_bytes


def module_flops(module: hlo.Module) -> float:
    """FLOPs per device of a parsed program (see :func:`hlo_flops`)."""
    return hlo.flops_of(module)(module.entry)


def hlo_flops(compiled) -> float:
    """FLOPs per device of a compiled program (or its HLO text), counted as XLA's cost analysis
    counts them but with every ``while`` body multiplied by its trip count, and GPU library
    calls (cuBLAS GEMMs, cuDNN attention and convolutions) from their shapes and configs."""
    return module_flops(hlo.parse(hlo.text(compiled)))


def matmul_flops(compiled) -> float:
    """The part of :func:`hlo_flops` in matrix products (dots, GEMM and convolution calls, fused
    attention): what a model's FLOP formula (6·N per token…) counts, without the elementwise
    ops, norms and optimizer updates that XLA also counts."""
    module = hlo.parse(hlo.text(compiled))
    return hlo.flops_of(module, matmuls=True)(module.entry)


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One op the program runs as a unit (a fusion, a library call, a copy…), one execution."""

    computation: str
    name: str
    opcode: str
    kind: str  # a custom-call's target, a fusion's backend kind ("__triton_gemm"…), else ""
    executions: int  # trip counts of the loops around it multiplied
    flops: float
    bytes: float  # read + written in device memory


def module_op_costs(module: hlo.Module) -> list[OpCost]:
    """FLOPs and bytes of every non-collective op a parsed program runs."""
    flops_of = hlo.flops_of(module)
    out = []
    for computation, op, times in program_ops.executed(module):
        if hlo.collective_kind(op.opcode):
            continue
        kind = hlo.target(hlo.unwrap(op)) or hlo.fusion_kind(op)
        flops, size = hlo.op_flops(module, computation, op, flops_of), op_bytes(module, computation, op)
        out.append(OpCost(computation, op.name, op.opcode, kind, times, flops, size))
    return out


def op_costs(compiled) -> list[OpCost]:
    """FLOPs and bytes of every non-collective op the compiled program (or its HLO text) runs."""
    return module_op_costs(hlo.parse(hlo.text(compiled)))

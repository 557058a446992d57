"""The collectives a compiled program runs: each one's kind, bytes per device, group size, the mesh
axes it spans and how often it runs (loops' trip counts multiplied through).

The spec: docs/time-model.md.
"""

from __future__ import annotations

import dataclasses
import math

from meshpar.plan import hlo
from meshpar.plan.time import program_ops, replica_groups


@dataclasses.dataclass(frozen=True)
class Found:
    """One collective op of the program."""

    kind: str
    bytes: int  # per device, one execution
    axis: str
    group_size: int
    executions: int  # trip counts of the enclosing loops multiplied


def found(module: hlo.Module, computation: str, op: hlo.Op, times: int, mesh_shape: dict[str, int]) -> Found | None:
    """`op` (in `computation`, run `times` times) as a collective over more than one device, else None."""
    kind = hlo.collective_kind(op.opcode)
    if not kind:
        return None
    size = sum(
        hlo.shape_bytes(module.operand_shape(computation, op, i)) for i in range(len(op.operands))
    ) or hlo.shape_bytes(op.shape)
    groups = replica_groups.groups(op, math.prod(mesh_shape.values()))
    n = max(len(g) for g in groups)
    if kind == "all-gather":
        size *= n  # the gathered buffer each device ends with
    return Found(kind, size, replica_groups.axes(groups, mesh_shape), n, times) if n > 1 else None


def find(module: hlo.Module, mesh_shape: dict[str, int]) -> list[Found]:
    """Every collective the program runs."""
    out = (found(module, c, op, times, mesh_shape) for c, op, times in program_ops.executed(module))
    return [f for f in out if f is not None]


def collectives(compiled, mesh) -> list[tuple[str, int, str]]:
    """(kind, bytes per device, mesh axis) of every collective in the compiled program (or its
    HLO text), bytes multiplied by the trip counts of the loops around it."""
    out = find(hlo.parse(hlo.text(compiled)), replica_groups.mesh_shape(mesh))
    return [(f.kind, f.bytes * f.executions, f.axis) for f in out]

"""The ops a compiled program runs as units (fusions, library calls, copies, collectives), each with
how often it runs: the list that FLOPs, bytes and collectives are counted over.

The spec: docs/time-model.md.
"""

from __future__ import annotations

from meshpar.plan import hlo

# Ops that move no data and compute nothing (buffer bookkeeping).
FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id", "after-all",
    "opt-barrier",
})  # fmt: skip

CONTROL_FLOW = ("while", "call", "conditional", "async-start")


def executed(module: hlo.Module) -> list[tuple[str, hlo.Op, int]]:
    """Every op the program runs as a unit — (computation, op, executions) — through control
    flow (while bodies and conditions times their trip counts, calls, conditional branches,
    async computations), not into fusions or reducers."""
    out = []

    def walk(computation: str, times: int) -> None:
        for op in module.computations.get(computation, []):
            if op.opcode in CONTROL_FLOW:
                inner = times * hlo.trip_count(module, op) if op.opcode == "while" else times
                for c in hlo.called(op):
                    walk(c, inner)
            elif op.opcode not in FREE and not op.opcode.endswith(("-done", "-update")):
                out.append((computation, op, times))

    walk(module.entry, 1)
    return out

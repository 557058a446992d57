"""A compiled program run as XLA scheduled it, on two streams: compute one op after another, each
collective on the link from when it is issued, an async collective hidden behind the compute
XLA placed between its start and its done.

The spec: docs/time-model.md.
"""

from __future__ import annotations

import dataclasses

from meshpar.plan import hlo
from meshpar.plan.time import collective_ops, program_ops


@dataclasses.dataclass
class Span:
    """One run of a computation: its wall time on the two streams, and what it is made of."""

    seconds: float = 0.0  # until its last op (compute or collective) is done
    compute_s: float = 0.0  # its compute ops, one after another
    kernels: int = 0  # kernels launched (fusions, library calls, copies…)
    components: dict[str, float] = dataclasses.field(default_factory=dict)  # compute seconds by component

    def add(self, other: Span, times: int = 1) -> None:
        self.compute_s += times * other.compute_s
        self.kernels += times * other.kernels
        for name, seconds in other.components.items():
            self.components[name] = self.components.get(name, 0.0) + times * seconds


class Pricer:
    """Prices a parsed program on a machine: every op by `op_seconds`, every collective by
    `collective_seconds`, run as XLA scheduled them (see :meth:`run`)."""

    def __init__(self, module: hlo.Module, mesh_shape: dict[str, int], op_seconds, collective_seconds):
        self.module, self.mesh_shape = module, mesh_shape
        self.op_seconds, self.collective_seconds = op_seconds, collective_seconds
        self.memo: dict[str, Span] = {}

    def run(self, computation: str) -> Span:
        """One run of `computation` (memoised): its ops in the order of the scheduled text, on two
        streams. A compute op runs on the compute stream after the one before it. An async
        collective (``X-start`` … ``X-done``) starts when it is issued and the collective
        stream is free, and its ``-done`` waits for it: compute XLA placed between the two hides
        it, up to that compute. A synchronous collective waits for both streams and holds both.
        A loop, call or conditional runs its bodies (a loop: its trip count times) on the
        compute stream."""
        if computation in self.memo:
            return self.memo[computation]
        span, compute_t, link_t, pending = Span(), 0.0, 0.0, {}
        for op in self.module.computations.get(computation, []):
            code = op.opcode
            if code in program_ops.FREE:
                continue
            if code.endswith("-update"):  # an async chain's middle: its -done waits on what its -start began
                if op.operands and op.operands[0] in pending:
                    pending[op.name] = pending.pop(op.operands[0])
                continue
            if code.endswith("-done"):
                started = pending.pop(op.operands[0], None) if op.operands else None
                if started is not None:
                    compute_t = max(compute_t, started)
                continue
            collective = self._collective_op(op)
            if hlo.collective_kind(code) or collective is not op:
                found = collective_ops.found(self.module, computation, collective, 1, self.mesh_shape)
                seconds = self.collective_seconds(found) if found else 0.0
                begin = max(compute_t, link_t)
                link_t = begin + seconds
                if code.endswith("-start"):
                    pending[op.name] = link_t
                else:
                    compute_t = link_t
                continue
            if code in program_ops.CONTROL_FLOW:
                inner = self._control_flow(op)
                compute_t += inner.seconds
                span.add(inner)
                continue
            seconds, launches, component = self.op_seconds(computation, op)
            compute_t += seconds
            span.compute_s += seconds
            span.kernels += launches
            span.components[component] = span.components.get(component, 0.0) + seconds
        span.seconds = max(compute_t, link_t, *pending.values())
        self.memo[computation] = span
        return span

    def _control_flow(self, op: hlo.Op) -> Span:
        """A loop, call, conditional or async computation run on the compute stream: its bodies
        (a conditional: its longest branch) once, a loop's its trip count times."""
        inner = Span()
        runs = [self.run(c) for c in hlo.called(op)]
        if op.opcode == "conditional":
            runs = [max(runs, key=lambda r: r.seconds)] if runs else []
        for r in runs:
            inner.seconds += r.seconds
            inner.add(r)
        times = hlo.trip_count(self.module, op) if op.opcode == "while" else 1
        out = Span(times * inner.seconds)
        out.add(inner, times)
        return out

    def _collective_op(self, op: hlo.Op) -> hlo.Op:
        """A generic ``async-start``'s wrapped collective (the op its called computation runs),
        else the op itself."""
        if op.opcode != "async-start":
            return op
        for c in hlo.called(op):
            for inner in self.module.computations.get(c, []):
                if hlo.collective_kind(inner.opcode):
                    return dataclasses.replace(inner, operands=op.operands)
        return op

"""Step time of a compiled train step on a topology: its ops priced by the machine's components,
its collectives on the links of the mesh axes they span, run as XLA scheduled them on two streams,
plus the part of the feed not hidden behind compute.

Its parts: the ops a program runs (:mod:`~meshpar.plan.time.program_ops`), their FLOPs and bytes
(:mod:`~meshpar.plan.time.work`, :mod:`~meshpar.plan.time.op_bytes`; the FLOP rules in
:mod:`meshpar.plan.hlo`), its collectives (:mod:`~meshpar.plan.time.collective_ops`,
:mod:`~meshpar.plan.time.replica_groups`), each op's seconds (:mod:`~meshpar.plan.time.op_pricing`,
:mod:`~meshpar.plan.time.memory_rates`, :mod:`~meshpar.plan.time.kernels`) and the two-stream
schedule (:mod:`~meshpar.plan.time.schedule`). The spec: docs/time-model.md.
"""

from __future__ import annotations

import dataclasses
import json
import math

from meshpar.plan import cost, hlo
from meshpar.plan.time import collective_ops, op_pricing, replica_groups, schedule
from meshpar.plan.time.collective_ops import collectives
from meshpar.plan.time.memory_rates import host_cache_bytes, memory
from meshpar.plan.time.work import OpCost, hlo_flops, matmul_flops, module_flops, op_costs

# Importable from here too: what callers of the step-time model use beside `predict`.
__all__ = [
    "Collective", "OpCost", "StepTime", "basis", "collectives", "hlo_flops", "host_cache_bytes", "matmul_flops",
    "memory", "op_costs", "predict", "to_json",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the step (all its executions together)."""

    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    bytes: int  # per device, as the HLO op moves it (× trip count of enclosing loops)
    axis: str  # mesh axis (or "a,b") its replica groups span
    seconds: float


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted time of one train step, by term."""

    flops: float  # per device, loop bodies multiplied by their trip counts
    compute_s: float
    collectives: tuple[Collective, ...]
    collective_s: float
    feed_s: float  # placement time of one batch (from feed_time), 0 if not asked
    exposed_feed_s: float  # the part not hidden behind compute (prefetch >= 1 overlaps)
    total_s: float  # compute + collectives - hidden_s + exposed feed
    # The compute term's two bounds, summed over the ops alone (compute_s is per op the larger):
    flops_s: float = 0.0  # the ops' FLOPs at peak × efficiency
    bytes: float = 0.0  # per device, bytes the ops read and write in device memory (loops multiplied)
    memory_s: float = 0.0  # those bytes at the device's memory rates (see `memory`)
    # Collective time hidden behind compute XLA scheduled beside it (total = compute +
    # collectives - hidden + exposed feed), the kernels the step launches, what their fixed
    # cost adds, and one line saying what the figures rest on.
    hidden_s: float = 0.0
    kernels: int = 0
    launch_s: float = 0.0
    basis: str = ""
    # Compute seconds by component: gemm, attention, memory-bound kernels (each with its launch
    # cost), or on a roofline machine flop-bound and memory-bound ops.
    components: dict = dataclasses.field(default_factory=dict)
    # Of `collectives`, the all-to-alls (a mixture of experts' routed tokens, moved between the
    # batch's and the experts' axes): bytes per device and seconds, each on its axis's link.
    all_to_all_bytes: int = 0
    all_to_all_s: float = 0.0


def basis(topology) -> str:
    """One line: what a step time predicted on `topology` rests on."""
    if topology.kernels is None:
        return (f"{topology.name}: each op at the roofline of {topology.source or 'its figures'}; collectives as rings "
                "of the measured all-reduce; run in program order")  # fmt: skip
    curve = topology.device_link.curve
    links = f"collectives from {curve.source}" if curve else "collectives as rings of the datasheet link"
    return (f"{topology.name}: kernels from {topology.kernels.source}; {links}; async collectives hidden behind "
            "the compute XLA scheduled beside them")  # fmt: skip


def predict(step, compiled, topology, feed_s: float = 0.0) -> StepTime:
    """Predicted time of one train step of the built `step` (a
    :class:`meshpar.step.parts.AbstractStep`; `compiled`: its compiled program or HLO text) on
    `topology`, with `feed_s` seconds to place one batch (see :mod:`meshpar.plan.time.feed_time`)."""
    return predict_program(compiled, step.mesh, step.traits.compute_dtype, step.cfg.feed.prefetch, topology, feed_s)


def predict_program(compiled, mesh, compute_dtype: str, prefetch: int, topology, feed_s: float = 0.0) -> StepTime:
    """:func:`predict` for a program with no built step beside it (a published program's HLO):
    `mesh` (a Mesh or its axis sizes) is the one it was compiled for, `compute_dtype` the dtype
    its matmuls run in, `prefetch` the batches placed ahead (``feed.prefetch``)."""
    module = hlo.parse(hlo.text(compiled))
    mesh_shape = replica_groups.mesh_shape(mesh)
    flop_rate = topology.peak(compute_dtype) * topology.efficiency
    rates = memory(topology, math.prod(mesh_shape.values()))
    _, op_flops, op_bytes, memory_s = op_pricing.roofline(module, flop_rate, rates)
    if topology.kernels is not None and topology.gpu is not None:
        op_seconds = op_pricing.gpu_op_seconds(module, topology)
    else:
        op_seconds = op_pricing.roofline_op_seconds(module, flop_rate, rates)

    def collective_seconds(f: collective_ops.Found) -> float:
        return cost.collective_seconds(f.kind, f.bytes, f.group_size, cost.axis_link(topology, mesh_shape, f.axis))

    span = schedule.Pricer(module, mesh_shape, op_seconds, collective_seconds).run(module.entry)
    merged: dict[tuple[str, str], list] = {}
    for f in collective_ops.find(module, mesh_shape):
        entry = merged.setdefault((f.kind, f.axis), [0, 0.0])
        entry[0] += f.bytes * f.executions
        entry[1] += f.executions * collective_seconds(f)
    parts = tuple(Collective(kind, b, axis, sec) for (kind, axis), (b, sec) in merged.items())
    collective_s = sum(c.seconds for c in parts)
    routed = [c for c in parts if c.kind == "all-to-all"]
    hidden = max(span.compute_s + collective_s - span.seconds, 0.0)
    exposed = cost.exposed_feed_seconds(feed_s, span.compute_s, prefetch)
    launch = topology.kernels.launch_s * span.kernels if topology.kernels is not None else 0.0
    return StepTime(
        module_flops(module), span.compute_s, parts, collective_s, feed_s, exposed, span.seconds + exposed,
        flops_s=op_flops / flop_rate, bytes=op_bytes, memory_s=memory_s, hidden_s=hidden, kernels=span.kernels,
        launch_s=launch, basis=basis(topology), components=dict(sorted(span.components.items())),
        all_to_all_bytes=sum(c.bytes for c in routed), all_to_all_s=sum(c.seconds for c in routed),
    )  # fmt: skip


def to_json(t: StepTime) -> dict:
    """A StepTime as plain JSON data."""
    out = dataclasses.asdict(t)
    out["collectives"] = [dataclasses.asdict(c) for c in t.collectives]
    return json.loads(json.dumps(out))

"""Step time of a compiled train step on a topology: compute from its FLOPs and bytes, collectives from its HLO.

**FLOPs.** ``compiled.cost_analysis()`` counts a ``while`` body once whatever its trip count (a
layer scan of 4 and of 16 layers report the same FLOPs), and it gives only the module's total.
So the FLOPs are counted here from the optimised HLO text (``compiled.as_text()``), with XLA's
own rules (``HloCostAnalysis``): a dot is 2 × output elements × contracted elements, a
convolution 2 × output elements × kernel elements per output feature, an elementwise op one
FLOP per output element (transcendentals are not FLOPs), a reduce one application of its
reducer per input element it folds, an all-reduce one per element; fusions, calls and async
computations count their bodies. A ``while`` counts its body and condition times its trip
count (``known_trip_count`` from its backend config, else the constant its condition compares
the induction variable against), nested loops multiplied through. Without loops the total
equals ``cost_analysis()``'s (a test keeps it so).

**Collectives.** Every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute in the HLO (sync, ``-start`` and ``async-start`` forms; ``-done`` halves are
not counted again), times the trip counts of the loops around it. Its bytes per device come
from its operands' shapes (all-gather: the gathered result), its devices from
``replica_groups`` (explicit ``{{0,1},...}``, iota ``[4,2]<=[8]``, or mesh-axes
``mesh[...] {...}`` form) or ``source_target_pairs``, mapped onto the mesh by partition index
(partition i is the i-th device of the mesh in row-major order), so the axis is the set of
mesh axes a group spans. It runs on the link of that axis (``Topology.axis_link``), priced as a
ring collective (:func:`meshpar.plan.cost.collective_seconds`: bytes × ring factor / bandwidth +
latency × steps).

**Compute.** Each op the program runs (a fusion, a dot, a copy; loop bodies once per trip)
takes the longer of its FLOPs at the device's peak for the compute dtype × the topology's
efficiency, and its bytes (operands read + result written) at the device's memory bandwidth —
a roofline per op, summed. The FLOP bound alone (``flops_s``) is what a plain FLOPs / peak model
gives; it undercounts every step whose ops are small or elementwise (optimizer updates,
norms, softmax, thin matmuls), which are bound by memory on GPUs and CPUs alike. Simulated CPU
devices share the host's memory and caches: each gets a share of the host's rates, faster
for ops whose data fits in the host's last-level cache (:func:`memory`). Per-op launch costs
are not modelled.

**What the model takes from the backend.** The HLO read is the one compiled for the devices in
hand; XLA's CPU backend may pick other collectives than a GPU compile of the same program
(an all-reduce where GPU would reduce-scatter then all-gather, or none of the GPU's async
forms). The model prices what the compiled program does, so a prediction for a GPU topology
from a CPU compile prices the CPU's choice: for a gradient all-reduce that is the same bytes
on the wire as GPU's reduce-scatter + all-gather pair (2(n−1)/n either way), so the totals
agree even where the op names differ. Its fusion choices differ too (the bytes term sees
CPU's fusions). Collectives are assumed not to overlap compute (true of XLA:CPU, which runs
them in program order; on GPU async collectives may hide part of them, so the figure is an
upper bound there). The feed overlaps compute when ``feed.prefetch`` ≥ 1 (a background
thread places the next batch while the step runs): only the part of the feed longer than the
compute is exposed; with prefetch 0 the whole feed is.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import re

import numpy as np

from meshpar import throughput
from meshpar.plan import cost, hlo

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Opcodes XLA's cost analysis counts as one FLOP per output element.
_ELEMENTWISE = frozenset(
    "abs add and ceil clamp compare complex convert count-leading-zeros divide floor imag is-finite maximum minimum "
    "multiply negate not or popcnt real reduce-precision remainder round-nearest-afz round-nearest-even select "
    "shift-left shift-right-arithmetic shift-right-logical sign stochastic-convert subtract xor".split()
)


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
    total_s: float  # compute + collectives + exposed feed
    # The compute term's two bounds, summed over the ops alone (compute_s is per op the larger):
    flops_s: float = 0.0  # the ops' FLOPs at peak × efficiency
    bytes: float = 0.0  # per device, bytes the ops read and write in device memory (loops multiplied)
    memory_s: float = 0.0  # those bytes at the device's memory rates (see `memory`)


# ---------------------------------------------------------------------------------------------
# FLOPs


def _op_flops(module: hlo.Module, computation: str, op: hlo.Op, flops) -> float:
    code = op.opcode
    if code in _ELEMENTWISE:
        return hlo.elements(op.shape)
    if code == "dot":
        lhs = hlo.arrays(module.operand_shape(computation, op, 0))
        dims = lhs[0][1] if lhs else ()
        width = math.prod(dims[d] for d in hlo.ints(hlo.attr(op, "lhs_contracting_dims")) if d < len(dims))
        return 2.0 * hlo.elements(op.shape) * width
    if code == "convolution":
        kernel = hlo.arrays(module.operand_shape(computation, op, 1))
        labels = re.search(r"dim_labels=\w+_(\w+)->", op.attrs)
        if not kernel or not labels or "o" not in labels.group(1):
            return 0.0
        dims = kernel[0][1]
        per_output = math.prod(dims) / dims[labels.group(1).index("o")]
        groups = hlo.ints(hlo.attr(op, "batch_group_count")) or [1]
        return 2.0 * hlo.elements(op.shape) * per_output / groups[0]
    called = hlo.called(op)
    if code in ("reduce", "reduce-window", "map", "scatter", "sort", "select-and-scatter") and not called:
        return 0.0
    if code == "reduce":
        folded = hlo.elements(module.operand_shape(computation, op, 0)) - hlo.elements(op.shape, first=True)
        return folded * flops(called[0])
    if code == "reduce-window":
        window = re.search(r"size=([\dx]+)", op.attrs)
        size = math.prod(int(x) for x in window.group(1).split("x")) if window else 1
        return (size - 1) * hlo.elements(op.shape, first=True) * flops(called[0])
    if code == "map":
        return hlo.elements(op.shape) * flops(called[0])
    if code == "scatter":
        n = (len(op.operands) - 1) // 2
        return hlo.elements(module.operand_shape(computation, op, n + 1)) * flops(called[0])
    if code == "sort":
        n = hlo.elements(module.operand_shape(computation, op, 0))
        return n * math.ceil(math.log2(n)) if n > 1 else 0.0
    if code in ("all-reduce", "all-reduce-start"):
        return hlo.elements(op.shape)
    if code == "fusion" and "kind=kCustom" in op.attrs and called:
        # XLA prices a custom fusion holding a gather or scatter as that op alone.
        for inner in module.computations.get(called[0], []):
            if inner.opcode == "gather":
                return 0.0
            if inner.opcode == "scatter":
                return _op_flops(module, called[0], inner, flops)
    if code == "while":
        return hlo.trip_count(module, op) * sum(flops(c) for c in called)
    if code == "conditional":
        return max((flops(c) for c in called), default=0.0)
    if code in ("fusion", "call", "async-start"):
        return sum(flops(c) for c in called)
    return 0.0


def _flops_of(module: hlo.Module):
    """computation name → its FLOPs, loops multiplied (memoised per module)."""

    @functools.cache
    def flops(computation: str) -> float:
        return sum(_op_flops(module, computation, op, flops) for op in module.computations.get(computation, []))

    return flops


def _module_flops(module: hlo.Module) -> float:
    return _flops_of(module)(module.entry)


def hlo_flops(compiled) -> float:
    """FLOPs per device of a compiled program (or its HLO text), counted as XLA's cost analysis
    counts them but with every ``while`` body multiplied by its trip count."""
    return _module_flops(hlo.parse(hlo.text(compiled)))


# ---------------------------------------------------------------------------------------------
# Collectives


def _iota_groups(text: str) -> list[list[int]] | None:
    """``[G,S]<=[dims]`` or ``[G,S]<=[dims]T(perm)``: iota over dims, transposed, reshaped."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not m:
        return None
    shape, dims = hlo.ints(m.group(1)), hlo.ints(m.group(2))
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose(hlo.ints(m.group(3)))
    return ids.reshape(-1, shape[-1]).tolist()


def _mesh_groups(text: str) -> list[list[int]] | None:
    """``mesh['a'=4,'b'=2] {'b'}`` (optionally ``device_ids=([4,2]T(1,0))``): the devices that
    differ only along the listed axes form a group."""
    m = re.match(r"mesh\[([^\]]*)\](?:\s*,?\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", text)
    if not m:
        return None
    axes = re.findall(r"'?([\w.\-]+)'?\s*=\s*(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    n = math.prod(sizes)
    if m.group(2):
        order = _iota_groups(f"[{n}]<={m.group(2)}" if m.group(2).startswith("[") else "")
        ids = np.asarray(order if order is not None else hlo.ints(m.group(2))).reshape(sizes)
    else:
        ids = np.arange(n).reshape(sizes)
    listed = [names.index(a) for a in re.findall(r"'?([\w.\-]+)'?", m.group(3)) if a in names]
    rest = [i for i in range(len(names)) if i not in listed]
    return ids.transpose(rest + listed).reshape(-1, math.prod(sizes[i] for i in listed)).tolist()


def _groups(op: hlo.Op, num_devices: int) -> list[list[int]]:
    """The device groups (partition indices) of a collective."""
    pairs = re.search(r"source_target_pairs=(\{(?:\{[\d,\s]*\},?\s*)*\})", op.attrs)
    if pairs:
        return [hlo.ints(p) for p in re.findall(r"\{([\d,\s]*)\}", pairs.group(1)[1:-1])]
    m = re.search(r"replica_groups=", op.attrs)
    if not m:
        return [list(range(num_devices))]
    text = op.attrs[m.end() :]
    if text.startswith("{"):
        inner = text[: hlo.closing(text, 0)][1:-1]
        groups = [hlo.ints(g) for g in re.findall(r"\{([\d,\s]*)\}", inner)]
        return [g for g in groups if g] or [list(range(num_devices))]
    groups = _iota_groups(text) or _mesh_groups(text)
    if groups is None:
        raise ValueError(f"unknown replica_groups form in {op.name}: {text[:80]}")
    return groups


def _axes(groups: list[list[int]], mesh_shape: dict[str, int]) -> str:
    """The mesh axes along which the members of the groups differ, as "a" or "a,b"."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    total = math.prod(sizes)
    spanned = set()
    for group in groups:
        coords = [np.unravel_index(d % total, sizes) for d in group]
        for i, name in enumerate(names):
            if len({c[i] for c in coords}) > 1:
                spanned.add(name)
    return ",".join(n for n in names if n in spanned)


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS else None


@dataclasses.dataclass(frozen=True)
class _Found:
    kind: str
    bytes: int  # per device, one execution
    axis: str
    group_size: int
    executions: int  # trip counts of the enclosing loops multiplied


# Ops that move no data and compute nothing (buffer bookkeeping).
_FREE = frozenset(
    "parameter constant get-tuple-element tuple bitcast partition-id replica-id after-all opt-barrier".split()
)


def _schedule(module: hlo.Module) -> list[tuple[str, hlo.Op, int]]:
    """Every op the program runs as a unit — (computation, op, executions) — through control
    flow (while bodies and conditions times their trip counts, calls, conditional branches,
    async computations), not into fusions or reducers."""
    out = []

    def walk(computation: str, times: int) -> None:
        for op in module.computations.get(computation, []):
            if op.opcode in ("while", "call", "conditional", "async-start"):
                inner = times * hlo.trip_count(module, op) if op.opcode == "while" else times
                for c in hlo.called(op):
                    walk(c, inner)
            elif op.opcode not in _FREE and not op.opcode.endswith(("-done", "-update")):
                out.append((computation, op, times))

    walk(module.entry, 1)
    return out


def _found(module: hlo.Module, computation: str, op: hlo.Op, times: int, mesh_shape: dict[str, int]) -> _Found | None:
    kind = _kind(op.opcode)
    if not kind:
        return None
    size = sum(hlo.shape_bytes(module.operand_shape(computation, op, i)) for i in range(len(op.operands))) or hlo.shape_bytes(op.shape)
    groups = _groups(op, math.prod(mesh_shape.values()))
    n = max(len(g) for g in groups)
    if kind == "all-gather":
        size *= n  # the gathered buffer each device ends with
    return _Found(kind, size, _axes(groups, mesh_shape), n, times) if n > 1 else None


def _find(module: hlo.Module, mesh_shape: dict[str, int]) -> list[_Found]:
    found = (_found(module, c, op, times, mesh_shape) for c, op, times in _schedule(module))
    return [f for f in found if f is not None]


def _op_bytes(module: hlo.Module, computation: str, op: hlo.Op) -> int:
    """Bytes an op reads and writes in device memory: its operands and its result (a fusion's
    intermediates stay in registers and caches)."""
    return hlo.shape_bytes(op.shape) + sum(hlo.shape_bytes(module.operand_shape(computation, op, i)) for i in range(len(op.operands)))


@dataclasses.dataclass(frozen=True)
class _Memory:
    """How fast one device's ops move bytes (read + written) while every device is busy."""

    rate: float  # bytes/s (0: no memory term)
    cached_rate: float = 0.0  # bytes/s for an op whose bytes, on every device at once, fit in
    cache_bytes: int = 0  # this cache (0: none modelled)
    devices: int = 1

    def seconds(self, size: float) -> float:
        if self.cache_bytes and size * self.devices <= self.cache_bytes:
            return size / self.cached_rate
        return size / self.rate if self.rate else 0.0


def _roofline(module: hlo.Module, flop_rate: float, memory: _Memory) -> tuple[float, float, float, float]:
    """(seconds, flops, bytes, seconds of the bytes alone) of the program's non-collective ops:
    each op takes the longer of its FLOPs at `flop_rate` and its bytes at `memory`'s rate."""
    seconds = flops_total = bytes_total = memory_s = 0.0
    flops_of = _flops_of(module)
    for computation, op, times in _schedule(module):
        if _kind(op.opcode):
            continue
        flops = _op_flops(module, computation, op, flops_of)
        size = _op_bytes(module, computation, op)
        moving = memory.seconds(size)
        flops_total += times * flops
        bytes_total += times * size
        memory_s += times * moving
        seconds += times * max(flops / flop_rate, moving)
    return seconds, flops_total, bytes_total, memory_s


def _mesh_shape(mesh) -> dict[str, int]:
    return dict(mesh.shape) if not isinstance(mesh, dict) else dict(mesh)


def collectives(compiled, mesh) -> list[tuple[str, int, str]]:
    """(kind, bytes per device, mesh axis) of every collective in the compiled program (or its
    HLO text), bytes multiplied by the trip counts of the loops around it."""
    found = _find(hlo.parse(hlo.text(compiled)), _mesh_shape(mesh))
    return [(f.kind, f.bytes * f.executions, f.axis) for f in found]


# ---------------------------------------------------------------------------------------------
# The step


def host_cache_bytes() -> int:
    """This host's last-level CPU cache in bytes (Linux sysfs; 0 where it cannot be read)."""
    best = (0, 0)
    for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, (level, int(digits) * scale))
    return best[1]


def memory(topology, num_devices: int) -> _Memory:
    """How fast one device's ops move bytes (read + written) while all `num_devices` of the step
    are busy.

    An accelerator: its memory bandwidth (the datasheet's figure counts reads and writes).
    Simulated CPU devices (device links of kind ``memcpy``: their memory is the host's): the
    host's measured copy rate (``device_memory_bandwidth``: bytes copied per second), shared by
    the devices. A copy reads and writes each byte, so a streaming copy's traffic is twice that
    rate; an op whose bytes on every device at once fit in the host's last-level cache moves
    them at that traffic rate, a larger one at the copy rate alone (XLA:CPU's fused loops over
    DRAM-sized data — strided reads, transposes, reductions — reach about half a streaming
    copy's traffic). 0 where the topology states no bandwidth: no memory term then."""
    bandwidth = float(getattr(topology, "device_memory_bandwidth", 0.0) or 0.0)
    if getattr(topology.device_link, "kind", "") != "memcpy":
        return _Memory(bandwidth)
    share = bandwidth / max(num_devices, 1)
    return _Memory(share, 2 * share, host_cache_bytes(), max(num_devices, 1))


def predict(cfg, step, compiled, topology, feed_s: float = 0.0) -> StepTime:
    """Predicted time of one train step of `cfg` (`step`: its :class:`meshpar.parts.AbstractStep`,
    or anything with its ``mesh``; `compiled`: its compiled program or HLO text) on `topology`,
    with `feed_s` seconds to place one batch (see :mod:`meshpar.plan.feed_time`)."""
    module = hlo.parse(hlo.text(compiled))
    mesh_shape = _mesh_shape(step.mesh if hasattr(step, "mesh") else step)
    flop_rate = topology.peak(throughput.compute_dtype(cfg.model)) * topology.efficiency
    rates = memory(topology, math.prod(mesh_shape.values()))
    compute_s, op_flops, op_bytes, memory_s = _roofline(module, flop_rate, rates)
    merged: dict[tuple[str, str], list] = {}
    for f in _find(module, mesh_shape):
        entry = merged.setdefault((f.kind, f.axis), [0, 0.0])
        entry[0] += f.bytes * f.executions
        link = cost.axis_link(topology, mesh_shape, f.axis)
        entry[1] += cost.collective_seconds(f.kind, f.bytes, f.group_size, link, f.executions)
    parts = tuple(Collective(kind, b, axis, sec) for (kind, axis), (b, sec) in merged.items())
    collective_s = sum(c.seconds for c in parts)
    exposed = cost.exposed_feed_seconds(feed_s, compute_s, cfg.feed.prefetch)
    return StepTime(
        _module_flops(module), compute_s, parts, collective_s, feed_s, exposed, compute_s + collective_s + exposed,
        flops_s=op_flops / flop_rate, bytes=op_bytes, memory_s=memory_s,
    )  # fmt: skip


def to_json(t: StepTime) -> dict:
    """A StepTime as plain JSON data."""
    out = dataclasses.asdict(t)
    out["collectives"] = [dataclasses.asdict(c) for c in t.collectives]
    return json.loads(json.dumps(out))



"""Step time of a compiled train step on a topology: compute from its FLOPs and bytes, collectives from its HLO.

**FLOPs.** ``compiled.cost_analysis()`` counts a ``while`` body once whatever its trip count (a
layer scan of 4 and of 16 layers report the same FLOPs), and it gives only the module's total.
So the FLOPs are counted here from the optimised HLO text (``compiled.as_text()``), with XLA's
own rules (``HloCostAnalysis``): a dot is 2 × output elements × contracted elements, a
convolution 2 × output elements × kernel elements per output feature, an elementwise op one
FLOP per output element (transcendentals are not FLOPs), a reduce one application of its
reducer per input element it folds, an all-reduce one per element; fusions (Triton GEMM
fusions included: their dot and its fused prologue and epilogue), calls and async computations
count their bodies. A ``while`` counts its body and condition times its trip count
(``known_trip_count`` from its backend config, else the constant its condition compares the
induction variable against), nested loops multiplied through. Without loops the total equals
``cost_analysis()``'s on CPU (a test keeps it so). :func:`matmul_flops` is the part in matrix
products alone, the work a model's FLOP formula counts.

GPU library calls are custom-calls whose work XLA's text states only in their shapes and
``backend_config``: a cuBLAS GEMM (``__cublas$gemm``, ``__cublas$lt$matmul``, its ``$f8``
form) is a dot with the dimension numbers of its ``gemm_backend_config``; a cuDNN convolution
(``__cudnn$conv…``) is the forward convolution its window and ``dim_labels`` describe, which
each of its three passes costs; cuDNN fused attention (``__cudnn$fmha…``) is counted as
FlashAttention counts it: forward 2 × scores × (d_qk + d_v) (QKᵀ and PV; scores = batch ×
heads × q_len × kv_len), backward 2 × scores × (3·d_qk + 2·d_v) (QKᵀ recomputed, dP, dV, dQ,
dK: 2.5× the forward at equal head dims), halved under a causal mask (the kernel skips the tiles
above the diagonal) or kept to window / kv_len of it under a sliding window.

**Collectives.** Every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute in the HLO (sync, ``-start``, and the wrapped op of a generic
``async-start``/``-update``/``-done`` chain; the ``-update`` and ``-done`` halves are not
counted again), times the trip counts of the loops around it. Its bytes per device come
from its operands' shapes (all-gather: the gathered result), its devices from
``replica_groups`` (explicit ``{{0,1},...}``, iota ``[4,2]<=[8]``, or mesh-axes
``mesh[...] {...}`` form) or ``source_target_pairs``, mapped onto the mesh by partition index
(partition i is the i-th device of the mesh in row-major order), so the axis is the set of
mesh axes a group spans. It runs on the link of that axis (``Topology.axis_link``), priced by
:func:`meshpar.plan.cost.collective_seconds`: from the link's measured NCCL curve where its
topology file gives one (:mod:`meshpar.plan.time.kernels`), else as a ring (bytes × ring factor /
bandwidth + latency × steps).

**Compute.** Each op the program runs (a fusion, a library call, a copy; loop bodies once per
trip) is priced by the machine's components. On a GPU (a topology with ``kernels:``,
:mod:`meshpar.plan.time.kernels`): a GEMM by its shape (tiles in waves over the SMs, at the share of
the dtype's peak a large GEMM sustains), fused attention likewise, every other kernel by its
bytes at the achieved bandwidth (or its FLOPs on the CUDA cores), each at least its bytes, plus
the fixed cost every kernel pays. On ``cpu-sim``: the longer of its FLOPs at the measured matmul
rate and its bytes at the host's rates — a roofline per op. The bytes are what the op reads and
writes in device memory: of each operand, what it reads of it
— a fusion what its body reads of that parameter (a ``dynamic-slice``, ``slice`` or ``gather``
of it: that part, through bitcasts, reshapes, transposes and converts; a nested fusion: what
that one reads), so that a rolled layer loop reading one layer's slice of stacked weights per
trip moves that layer, not the stack — and of its result what it writes: an in-place
``dynamic-update-slice`` or ``scatter`` (a fusion's root, through tuples and bitcasts) writes
its update, neither reading nor rewriting the buffer it updates; a GPU library call's result
less the scratch workspace (a trailing ``s8``/``u8`` vector) it also returns. A bare slice or
update is priced the same way. The FLOP bound alone (``flops_s``) is what a plain FLOPs / peak
model gives; it undercounts every step whose ops are small or elementwise (optimizer updates,
norms, softmax, thin matmuls), which are bound by memory on GPUs and CPUs alike. Simulated CPU
devices share the host's memory and caches: each gets a share of the host's rates, faster
for ops whose data fits in the host's last-level cache (:func:`memory`). :func:`op_costs` lists
every op with its FLOPs and bytes.

**The schedule.** The ops run in the order of the scheduled text on two streams (:class:`_Pricer`):
compute one op after another; an async collective (``X-start`` … ``X-done``) from when it is
issued and the link is free, its ``-done`` waiting for it, so compute XLA placed between the
two hides it up to that compute; a synchronous collective holds both. A loop runs its body its
trip count times. The step is when both streams are done (``total_s``); ``hidden_s`` is the
collective time that overlapped compute.

**What the model takes from the backend.** The HLO read is the one compiled for the target: a
GPU's program from XLA's GPU compiler (deviceless on a host without one,
:mod:`meshpar.plan.gpu_target`), or XLA:CPU's where no GPU compiler is installed. A GPU program
is priced as it is: its GEMMs as Triton fusions (XLA's default) or cuBLAS calls
(``--xla_gpu_enable_triton_gemm=false``) count the same matrix FLOPs; its collectives are its
own (reduce-scatter + all-gather pairs, async forms); its fusions set the bytes. A CPU stand-in
prices the CPU's choices: for a gradient all-reduce that is the same bytes on the wire as a
GPU's reduce-scatter + all-gather pair (2(n−1)/n either way), so the totals agree even where
the op names differ, but its fusions (and so its bytes) are the CPU's. The program tells what
XLA chose; how long its kernels take comes from the component costs (a GEMM's tiles are
assumed 128 × 128 whatever Triton or cuBLAS picks; split-K is not modelled). XLA:CPU's
collectives are synchronous, so nothing hides there. The feed overlaps compute when
``feed.prefetch`` ≥ 1 (a background thread places the next
batch while the step runs): only the part of the feed longer than the compute is exposed; with
prefetch 0 the whole feed is.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re

import numpy as np

from meshpar.plan import cost, hlo
from meshpar.plan.time import kernels
from meshpar.step import throughput


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


# ---------------------------------------------------------------------------------------------
# FLOPs


def _module_flops(module: hlo.Module) -> float:
    return hlo.flops_of(module)(module.entry)


def hlo_flops(compiled) -> float:
    """FLOPs per device of a compiled program (or its HLO text), counted as XLA's cost analysis
    counts them but with every ``while`` body multiplied by its trip count, and GPU library
    calls (cuBLAS GEMMs, cuDNN attention and convolutions) from their shapes and configs."""
    return _module_flops(hlo.parse(hlo.text(compiled)))


def matmul_flops(compiled) -> float:
    """The part of :func:`hlo_flops` in matrix products (dots, GEMM and convolution calls, fused
    attention): what a model's FLOP formula (6·N per token…) counts, without the elementwise
    ops, norms and optimizer updates that XLA also counts."""
    module = hlo.parse(hlo.text(compiled))
    return hlo.flops_of(module, matmuls=True)(module.entry)


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
    return hlo.collective_kind(opcode)


@dataclasses.dataclass(frozen=True)
class _Found:
    kind: str
    bytes: int  # per device, one execution
    axis: str
    group_size: int
    executions: int  # trip counts of the enclosing loops multiplied


# Ops that move no data and compute nothing (buffer bookkeeping).
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id", "after-all",
    "opt-barrier",
})  # fmt: skip


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
    size = sum(
        hlo.shape_bytes(module.operand_shape(computation, op, i)) for i in range(len(op.operands))
    ) or hlo.shape_bytes(op.shape)
    groups = _groups(op, math.prod(mesh_shape.values()))
    n = max(len(g) for g in groups)
    if kind == "all-gather":
        size *= n  # the gathered buffer each device ends with
    return _Found(kind, size, _axes(groups, mesh_shape), n, times) if n > 1 else None


def _find(module: hlo.Module, mesh_shape: dict[str, int]) -> list[_Found]:
    found = (_found(module, c, op, times, mesh_shape) for c, op, times in _schedule(module))
    return [f for f in found if f is not None]


# Ops whose result holds exactly the elements of their operand (a fusion reads through them).
_VIEWS = frozenset({"bitcast", "reshape", "transpose", "copy", "convert"})
# Ops that read only part of their first operand: as many of its elements as their result has.
_PARTIAL = frozenset({"dynamic-slice", "slice", "gather"})
# Ops that update their first operand in place, writing only their update.
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": -1}  # opcode → the operand that is written (-1: last)


def _in_place(module: hlo.Module, computation: str) -> set[str]:
    """The in-place updates (dynamic-update-slice, scatter) a computation's root is made of,
    through tuples and bitcasts: the buffer they update is the result's, neither read nor
    rewritten whole."""
    out, todo = set(), [module.root(computation)]
    while todo:
        op = todo.pop()
        if op is None:
            continue
        if op.opcode in _IN_PLACE:
            out.add(op.name)
        elif op.opcode in ("tuple", "bitcast"):
            todo += [module.ops[computation].get(name) for name in op.operands]
    return out


def _read_elements(module: hlo.Module, computation: str, name: str, total: int, updated: set[str]) -> float:
    """Elements of the value `name` (of `total` elements) that its users in `computation` read:
    a slice, dynamic-slice or gather reads what it returns, an in-place update nothing of the
    buffer it updates, a nested fusion what its body reads of that parameter; bitcasts,
    reshapes, transposes, copies and converts pass the question on to their own users. Any
    other user reads all of it."""
    read = 0.0
    for user, i in module.users[computation].get(name, []):
        if user.opcode in _PARTIAL and i == 0:
            read += hlo.elements(user.shape, first=True)
        elif user.name in updated and i == 0:
            continue
        elif user.opcode in _VIEWS:
            read += _read_elements(module, computation, user.name, total, updated)
        elif user.opcode == "fusion" and hlo.called(user):
            read += _parameter_reads(module, hlo.called(user)[0]).get(i, total)
        else:
            return total
        if read >= total:
            return total
    return read


def _parameter_reads(module: hlo.Module, computation: str) -> dict[int, float]:
    """Parameter number → elements of it a fused computation reads (memoised per module)."""
    cache = module.memo.setdefault("parameter_reads", {})
    if computation not in cache:
        updated = _in_place(module, computation)
        cache[computation] = {
            number: _read_elements(module, computation, p.name, hlo.elements(p.shape), updated)
            for number, p in module.parameters(computation).items()
        }
    return cache[computation]


def _written(module: hlo.Module, computation: str, op: hlo.Op | None) -> float:
    """Bytes an op writes: an in-place update its update, a tuple its elements, a GPU library
    call its results less the scratch workspace (a trailing ``s8``/``u8`` vector) it returns."""
    if op is None:
        return 0.0
    if op.opcode in _IN_PLACE:
        written = _IN_PLACE[op.opcode] % len(op.operands)
        return hlo.shape_bytes(module.operand_shape(computation, op, written))
    if op.opcode in ("tuple", "bitcast"):
        return sum(_written(module, computation, module.ops[computation].get(n)) for n in set(op.operands))
    leaves = hlo.leaves(op.shape)
    if op.opcode == "custom-call" and len(leaves) > 1 and re.fullmatch(r"[su]8\[\d*\].*", leaves[-1]):
        leaves = leaves[:-1]
    return sum(hlo.shape_bytes(leaf) for leaf in leaves)


def _op_bytes(module: hlo.Module, computation: str, op: hlo.Op) -> float:
    """Bytes an op reads and writes in device memory: what it reads of each operand and what it
    writes (a fusion's intermediates stay in registers and caches). A fusion reads of each
    parameter what its body does (a dynamic-slice of a stacked weight: that slice, not the
    stack) and writes its root (an in-place dynamic-update-slice: the update alone); a bare
    slice or update is priced the same way."""
    op = hlo.unwrap(op)
    called = hlo.called(op)
    if op.opcode == "fusion" and called:
        reads = _parameter_reads(module, called[0])
        written = _written(module, called[0], module.root(called[0]))
    else:
        reads = {i: hlo.elements(module.operand_shape(computation, op, i)) for i in range(len(op.operands))}
        if op.opcode in _PARTIAL and reads:
            reads[0] = min(reads[0], hlo.elements(op.shape, first=True))
        elif op.opcode in _IN_PLACE and reads:
            reads[0] = 0
        written = _written(module, computation, op)
    seen, read = set(), 0.0
    for i, name in enumerate(op.operands):
        if name in seen:
            continue
        seen.add(name)
        shape = module.operand_shape(computation, op, i)
        leaves = hlo.arrays(shape)
        if len(leaves) == 1:
            read += reads.get(i, 0) * hlo.dtype_bytes(shape)
        else:  # a tuple operand: read whole
            read += hlo.shape_bytes(shape)
    return read + written


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


def _op_costs(module: hlo.Module) -> list[OpCost]:
    flops_of = hlo.flops_of(module)
    out = []
    for computation, op, times in _schedule(module):
        if _kind(op.opcode):
            continue
        kind = hlo.target(hlo.unwrap(op)) or hlo.fusion_kind(op)
        flops, size = hlo.op_flops(module, computation, op, flops_of), _op_bytes(module, computation, op)
        out.append(OpCost(computation, op.name, op.opcode, kind, times, flops, size))
    return out


def op_costs(compiled) -> list[OpCost]:
    """FLOPs and bytes of every non-collective op the compiled program (or its HLO text) runs."""
    return _op_costs(hlo.parse(hlo.text(compiled)))


def _roofline(module: hlo.Module, flop_rate: float, memory: _Memory) -> tuple[float, float, float, float]:
    """(seconds, flops, bytes, seconds of the bytes alone) of the program's non-collective ops:
    each op takes the longer of its FLOPs at `flop_rate` and its bytes at `memory`'s rate."""
    seconds = flops_total = bytes_total = memory_s = 0.0
    for op in _op_costs(module):
        moving = memory.seconds(op.bytes)
        flops_total += op.executions * op.flops
        bytes_total += op.executions * op.bytes
        memory_s += op.executions * moving
        seconds += op.executions * max(op.flops / flop_rate, moving)
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


# ---------------------------------------------------------------------------------------------
# The schedule: compute and collectives on their own streams


@dataclasses.dataclass
class _Span:
    """One run of a computation: its wall time on the two streams, and what it is made of."""

    seconds: float = 0.0  # until its last op (compute or collective) is done
    compute_s: float = 0.0  # its compute ops, one after another
    kernels: int = 0  # kernels launched (fusions, library calls, copies…)
    components: dict[str, float] = dataclasses.field(default_factory=dict)  # compute seconds by component

    def add(self, other: _Span, times: int = 1) -> None:
        self.compute_s += times * other.compute_s
        self.kernels += times * other.kernels
        for name, seconds in other.components.items():
            self.components[name] = self.components.get(name, 0.0) + times * seconds


class _Pricer:
    """Prices a parsed program on a machine: every op by `op_seconds`, every collective by
    `collective_seconds`, run as XLA scheduled them (see :meth:`run`)."""

    def __init__(self, module: hlo.Module, mesh_shape: dict[str, int], op_seconds, collective_seconds):
        self.module, self.mesh_shape = module, mesh_shape
        self.op_seconds, self.collective_seconds = op_seconds, collective_seconds
        self.memo: dict[str, _Span] = {}

    def run(self, computation: str) -> _Span:
        """One run of `computation` (memoised): its ops in the order of the scheduled text, on two
        streams. A compute op runs on the compute stream after the one before it. An async
        collective (``X-start`` … ``X-done``) starts when it is issued and the collective
        stream is free, and its ``-done`` waits for it: compute XLA placed between the two hides
        it, up to that compute. A synchronous collective waits for both streams and holds both.
        A loop, call or conditional runs its bodies (a loop: its trip count times) on the
        compute stream."""
        if computation in self.memo:
            return self.memo[computation]
        span, compute_t, link_t, pending = _Span(), 0.0, 0.0, {}
        for op in self.module.computations.get(computation, []):
            code = op.opcode
            if code in _FREE:
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
            kind = _kind(code)
            collective = self._collective_op(op)
            if kind or collective is not op:
                found = _found(self.module, computation, collective, 1, self.mesh_shape)
                seconds = self.collective_seconds(found) if found else 0.0
                begin = max(compute_t, link_t)
                link_t = begin + seconds
                if code.endswith("-start"):
                    pending[op.name] = link_t
                else:
                    compute_t = link_t
                continue
            if code in ("while", "call", "conditional", "async-start"):
                inner = _Span()
                runs = [self.run(c) for c in hlo.called(op)]
                if code == "conditional":
                    runs = [max(runs, key=lambda r: r.seconds)] if runs else []
                times = hlo.trip_count(self.module, op) if code == "while" else 1
                for r in runs:
                    inner.seconds += r.seconds
                    inner.add(r)
                compute_t += times * inner.seconds
                span.add(inner, times)
                continue
            seconds, launches, component = self.op_seconds(computation, op)
            compute_t += seconds
            span.compute_s += seconds
            span.kernels += launches
            span.components[component] = span.components.get(component, 0.0) + seconds
        span.seconds = max(compute_t, link_t, *pending.values())
        self.memo[computation] = span
        return span

    def _collective_op(self, op: hlo.Op) -> hlo.Op:
        """A generic ``async-start``'s wrapped collective (the op its called computation runs),
        else the op itself."""
        if op.opcode != "async-start":
            return op
        for c in hlo.called(op):
            for inner in self.module.computations.get(c, []):
                if _kind(inner.opcode):
                    return dataclasses.replace(inner, operands=op.operands)
        return op


def _gpu_op_seconds(module: hlo.Module, topology):
    """Seconds of one execution of a compute op on a GPU from the topology's kernel costs
    (:mod:`meshpar.plan.time.kernels`), and the kernels it launches."""
    costs, sms = topology.kernels, topology.gpu.sm_count
    flops_of = hlo.flops_of(module)
    bandwidth = topology.device_memory_bandwidth * costs.memory_fraction

    def seconds(computation: str, op: hlo.Op) -> tuple[float, int, str]:
        moving = _op_bytes(module, computation, op) / bandwidth
        inner = hlo.unwrap(op)
        name = hlo.target(inner)
        gemm = kernels.gemm(module, computation, op)
        if gemm is not None:
            peak = topology.peak(kernels.peak_dtype(gemm.dtype))
            work, component = kernels.gemm_seconds(gemm, peak, sms, costs), "gemm"
        elif name.startswith("__cudnn$fmha"):
            q = hlo.arrays(module.operand_shape(computation, inner, 0))
            peak = topology.peak(kernels.peak_dtype(q[0][0] if q else "bf16"))
            flops = hlo.op_flops(module, computation, op, flops_of)
            blocks = kernels.attention_blocks(module, computation, op)
            work, component = kernels.attention_seconds(flops, blocks, peak, sms, costs), "attention"
        elif name.startswith("__cudnn$conv"):
            flops = hlo.op_flops(module, computation, op, flops_of)
            work, component = flops / (topology.peak("bfloat16") * costs.gemm_fraction), "gemm"
        else:  # elementwise and reductions: CUDA cores
            work = hlo.op_flops(module, computation, op, flops_of) / topology.peak_flops.get("float32", 1.0)
            component = "memory-bound"
        if moving > work:
            component = "memory-bound"
        return costs.launch_s + max(work, moving), 1, component

    return seconds


def _roofline_op_seconds(module: hlo.Module, flop_rate: float, rates: _Memory):
    """Seconds of one execution of an op at the roofline of the machine's rates (cpu-sim: the
    host's measured matmul and copy rates; no per-kernel cost)."""
    flops_of = hlo.flops_of(module)

    def seconds(computation: str, op: hlo.Op) -> tuple[float, int, str]:
        flops = hlo.op_flops(module, computation, op, flops_of)
        moving = rates.seconds(_op_bytes(module, computation, op))
        return max(flops / flop_rate, moving), 1, "flop-bound" if flops / flop_rate >= moving else "memory-bound"

    return seconds


def basis(topology) -> str:
    """One line: what a step time predicted on `topology` rests on."""
    if topology.kernels is None:
        return (f"{topology.name}: each op at the roofline of {topology.source or 'its figures'}; collectives as rings "
                "of the measured all-reduce; run in program order")  # fmt: skip
    curve = topology.device_link.curve
    links = f"collectives from {curve.source}" if curve else "collectives as rings of the datasheet link"
    return (f"{topology.name}: kernels from {topology.kernels.source}; {links}; async collectives hidden behind "
            "the compute XLA scheduled beside them")  # fmt: skip


def predict(cfg, step, compiled, topology, feed_s: float = 0.0) -> StepTime:
    """Predicted time of one train step of `cfg` (`step`: its :class:`meshpar.step.parts.AbstractStep`,
    or anything with its ``mesh``; `compiled`: its compiled program or HLO text) on `topology`,
    with `feed_s` seconds to place one batch (see :mod:`meshpar.plan.time.feed_time`)."""
    module = hlo.parse(hlo.text(compiled))
    mesh_shape = _mesh_shape(step.mesh if hasattr(step, "mesh") else step)
    flop_rate = topology.peak(throughput.compute_dtype(cfg.model)) * topology.efficiency
    rates = memory(topology, math.prod(mesh_shape.values()))
    _, op_flops, op_bytes, memory_s = _roofline(module, flop_rate, rates)
    if topology.kernels is not None and topology.gpu is not None:
        op_seconds = _gpu_op_seconds(module, topology)
    else:
        op_seconds = _roofline_op_seconds(module, flop_rate, rates)

    def collective_seconds(f: _Found) -> float:
        return cost.collective_seconds(f.kind, f.bytes, f.group_size, cost.axis_link(topology, mesh_shape, f.axis))

    span = _Pricer(module, mesh_shape, op_seconds, collective_seconds).run(module.entry)
    merged: dict[tuple[str, str], list] = {}
    for f in _find(module, mesh_shape):
        entry = merged.setdefault((f.kind, f.axis), [0, 0.0])
        entry[0] += f.bytes * f.executions
        entry[1] += f.executions * collective_seconds(f)
    parts = tuple(Collective(kind, b, axis, sec) for (kind, axis), (b, sec) in merged.items())
    collective_s = sum(c.seconds for c in parts)
    routed = [c for c in parts if c.kind == "all-to-all"]
    hidden = max(span.compute_s + collective_s - span.seconds, 0.0)
    exposed = cost.exposed_feed_seconds(feed_s, span.compute_s, cfg.feed.prefetch)
    launch = topology.kernels.launch_s * span.kernels if topology.kernels is not None else 0.0
    return StepTime(
        _module_flops(module), span.compute_s, parts, collective_s, feed_s, exposed, span.seconds + exposed,
        flops_s=op_flops / flop_rate, bytes=op_bytes, memory_s=memory_s, hidden_s=hidden, kernels=span.kernels,
        launch_s=launch, basis=basis(topology), components=dict(sorted(span.components.items())),
        all_to_all_bytes=sum(c.bytes for c in routed), all_to_all_s=sum(c.seconds for c in routed),
    )  # fmt: skip


def to_json(t: StepTime) -> dict:
    """A StepTime as plain JSON data."""
    out = dataclasses.asdict(t)
    out["collectives"] = [dataclasses.asdict(c) for c in t.collectives]
    return json.loads(json.dumps(out))

"""What one GPU kernel of a compiled program costs: GEMMs by shape, fused attention, memory-bound
kernels, and the fixed cost every kernel pays; collectives by size and group from measured curves.

The step-time model (:mod:`meshpar.plan.time.timing`) prices each op of XLA:GPU's program with these
component costs. Their parameters belong to a device kind or a link kind — never to a model, a
layout or a measured row — and each is read from the topology file, where its source is cited
(``kernels:`` and ``device_link.allreduce_us``; see :func:`parse` and :func:`parse_curve`).
The spec: docs/time-model.md ("GPU kernel costs").
"""

from __future__ import annotations

import bisect
import dataclasses
import math

from meshpar.configuration.config import ConfigError
from meshpar.plan import hlo

KEY = "--topology"
# The dtypes of a dot's operands → the peak_tflops entry its tensor cores run at.
_PEAK_DTYPE = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f8e4m3fn": "float8", "f8e5m2": "float8",
               "f64": "float64", "s8": "int8"}  # fmt: skip
ATTENTION_BLOCK = 128  # query rows per block of a fused attention kernel (FlashAttention's, cuDNN's)


@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """One GPU kind's kernel costs (a topology's ``kernels:`` section)."""

    launch_s: float  # fixed cost of every kernel
    gemm_tile: tuple[int, int]  # output tile of one thread block
    gemm_fraction: float  # share of the dense tensor-core peak a large GEMM sustains
    attention_fraction: float  # share of it fused attention sustains
    memory_fraction: float  # share of the datasheet memory bandwidth a streaming kernel reaches
    source: str = ""  # one line: where the figures come from


def _number(spec: dict, key: str, where: str, upper: float | None = None) -> float:
    value = spec.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ConfigError(KEY, f"{where}.{key}: expected a positive number, got {value!r}")
    if upper is not None and value > upper:
        raise ConfigError(KEY, f"{where}.{key}: {value} is above {upper:g}")
    return float(value)


KERNEL_KEYS = ("launch_us", "gemm_tile", "gemm_fraction", "attention_fraction", "memory_fraction", "source")


def parse(spec, where: str) -> KernelCosts:
    """A topology file's ``kernels:`` mapping (every key of KERNEL_KEYS); a missing or malformed
    field is a one-line ConfigError naming it."""
    if not isinstance(spec, dict):
        raise ConfigError(KEY, f"{where}: expected a mapping with {', '.join(KERNEL_KEYS)}")
    unknown = sorted(set(spec) - set(KERNEL_KEYS))
    if unknown:
        raise ConfigError(KEY, f"{where}: unknown key {unknown[0]!r}")
    tile = spec.get("gemm_tile")
    if not (isinstance(tile, list) and len(tile) == 2 and all(isinstance(t, int) and t > 0 for t in tile)):
        raise ConfigError(KEY, f"{where}.gemm_tile: expected [rows, columns] of positive integers, got {tile!r}")
    return KernelCosts(
        launch_s=_number(spec, "launch_us", where) * 1e-6,
        gemm_tile=(tile[0], tile[1]),
        gemm_fraction=_number(spec, "gemm_fraction", where, 1.0),
        attention_fraction=_number(spec, "attention_fraction", where, 1.0),
        memory_fraction=_number(spec, "memory_fraction", where, 1.0),
        source=str(spec.get("source", "")),
    )


# ---------------------------------------------------------------------------------------------
# Collectives from a measured curve


@dataclasses.dataclass(frozen=True)
class Curve:
    """Measured all-reduce times: for each group size, seconds at each of `sizes` (bytes)."""

    sizes: tuple[float, ...]
    seconds: dict[int, tuple[float, ...]]
    source: str = ""

    def allreduce(self, nbytes: float, n: int) -> float:
        """Seconds of one all-reduce of `nbytes` per device over `n` devices."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        if n not in self.seconds:  # a group size not measured: the nearest measured one above, else below
            above = [m for m in self.seconds if m > n]
            n = min(above) if above else max(self.seconds)
        xs, ys = self.sizes, self.seconds[n]
        if nbytes >= xs[-1]:  # beyond the largest: at its bus bandwidth
            return ys[-1] * nbytes / xs[-1]
        i = max(bisect.bisect_right(xs, nbytes) - 1, 0)  # below the smallest: the line through the first two
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        return max(ys[i] + slope * (nbytes - xs[i]), 0.0)

    def seconds_of(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds of one collective of `kind` whose HLO buffer is `nbytes` per device (an
        all-gather's: the gathered result) over `n` devices (see docs/time-model.md)."""
        if kind == "all-reduce":
            return self.allreduce(nbytes, n)
        if kind == "collective-permute":
            return self.allreduce(nbytes, 2)
        return self.allreduce(nbytes / 2, n)


def parse_curve(spec, where: str) -> Curve:
    """A link's ``allreduce_us`` mapping: ``sizes_mib: [...]`` and, per group size, the times in
    µs at those sizes (increasing sizes, one positive time each)."""
    if not isinstance(spec, dict) or "sizes_mib" not in spec:
        raise ConfigError(KEY, f"{where}: expected a mapping with sizes_mib and a list of µs per group size")
    sizes = spec["sizes_mib"]
    ok = isinstance(sizes, list) and len(sizes) >= 2 and all(isinstance(s, (int, float)) and s > 0 for s in sizes)
    if not ok or sorted(sizes) != sizes or len(set(sizes)) != len(sizes):
        raise ConfigError(KEY, f"{where}.sizes_mib: expected two or more increasing positive sizes, got {sizes!r}")
    table = {}
    for key, times in spec.items():
        if key in ("sizes_mib", "source"):
            continue
        if not (isinstance(key, int) and key >= 2):
            raise ConfigError(KEY, f"{where}: {key!r} is not a group size (an integer >= 2)")
        if not (isinstance(times, list) and len(times) == len(sizes)
                and all(isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0 for t in times)):  # fmt: skip
            raise ConfigError(KEY, f"{where}.{key}: expected {len(sizes)} positive times in µs, one per size")
        table[key] = tuple(t * 1e-6 for t in times)
    if not table:
        raise ConfigError(KEY, f"{where}: no group size listed")
    return Curve(tuple(s * (1 << 20) for s in sizes), table, str(spec.get("source", "")))


# ---------------------------------------------------------------------------------------------
# One kernel


@dataclasses.dataclass(frozen=True)
class Gemm:
    """A matrix product's dims: ``batch`` products of ``[m, k] @ [k, n]``, operands in `dtype`."""

    batch: int
    m: int
    n: int
    k: int
    dtype: str  # HLO element type of the left operand ("bf16", "f32"…)


def _dot_in(module: hlo.Module, computation: str, seen: frozenset = frozenset()) -> tuple[str, hlo.Op] | None:
    """The first dot of a fused computation, through nested fusions: (its computation, the dot)."""
    for op in module.computations.get(computation, []):
        if op.opcode in ("dot", "scaled-dot"):
            return computation, op
    for op in module.computations.get(computation, []):
        if op.opcode == "fusion":
            for inner in hlo.called(op):
                if inner not in seen:
                    found = _dot_in(module, inner, seen | {computation})
                    if found:
                        return found
    return None


def _dims(lhs: tuple[int, ...], rhs: tuple[int, ...], numbers: dict[str, list[int]], dtype: str) -> Gemm:
    def pick(shape, side, key):
        return [shape[d] for d in numbers.get(f"{side}_{key}", []) if 0 <= d < len(shape)]

    batch = math.prod(pick(lhs, "lhs", "batch_dims"))
    k = math.prod(pick(lhs, "lhs", "contracting_dims"))
    lhs_skip = {*numbers.get("lhs_batch_dims", []), *numbers.get("lhs_contracting_dims", [])}
    rhs_skip = {*numbers.get("rhs_batch_dims", []), *numbers.get("rhs_contracting_dims", [])}
    rows = math.prod(size for i, size in enumerate(lhs) if i not in lhs_skip)
    columns = math.prod(size for i, size in enumerate(rhs) if i not in rhs_skip)
    return Gemm(batch, rows, columns, k, dtype)


def gemm(module: hlo.Module, computation: str, op: hlo.Op) -> Gemm | None:
    """The matrix product an op runs — a dot, a fusion holding one (Triton GEMM fusions), a
    cuBLAS call — or None."""
    op = hlo.unwrap(op)
    if op.opcode == "custom-call" and hlo.target(op).startswith("__cublas$"):
        config = hlo.backend_config(op).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
        numbers = {k.replace("_dimensions", "_dims"): [int(d) for d in v] for k, v in config.items()}
        where = computation
        dot = op
    else:
        if op.opcode == "fusion" and hlo.called(op):
            found = _dot_in(module, hlo.called(op)[0])
        elif op.opcode in ("dot", "scaled-dot"):
            found = (computation, op)
        else:
            found = None
        if not found:
            return None
        where, dot = found
        numbers = {key: hlo.ints(hlo.attr(dot, key)) for key in
                   ("lhs_batch_dims", "lhs_contracting_dims", "rhs_batch_dims", "rhs_contracting_dims")}  # fmt: skip
    lhs, rhs = (hlo.arrays(module.operand_shape(where, dot, i)) for i in (0, 1))
    if not lhs or not rhs:
        return None
    return _dims(lhs[0][1], rhs[0][1], numbers, lhs[0][0])


def _waves(tiles: float, sms: int) -> int:
    return max(math.ceil(tiles / sms), 1)


def gemm_seconds(g: Gemm, peak: float, sms: int, costs: KernelCosts) -> float:
    """Seconds of the arithmetic of a GEMM kernel (tile and wave quantization; no launch)."""
    # Tiles run in waves of one per SM, each tile of a wave costing a full one: NVIDIA, "Matrix
    # Multiplication Background User's Guide", "Dimension Quantization Effects".
    tm, tn = costs.gemm_tile
    tiles = g.batch * math.ceil(g.m / tm) * math.ceil(g.n / tn)
    per_sm = peak / sms * costs.gemm_fraction
    return _waves(tiles, sms) * 2.0 * tm * tn * g.k / per_sm


def attention_seconds(flops: float, blocks: int, peak: float, sms: int, costs: KernelCosts) -> float:
    """Seconds of the arithmetic of a fused attention kernel of `flops` in `blocks` blocks of
    query rows (wave quantization; no launch)."""
    blocks = max(blocks, 1)
    per_sm = peak / sms * costs.attention_fraction
    return _waves(blocks, sms) * (flops / blocks) / per_sm


def attention_blocks(module: hlo.Module, computation: str, op: hlo.Op) -> int:
    """Blocks of ATTENTION_BLOCK query rows a fused attention call runs: batch × heads × ⌈q_len /
    128⌉, from its query operand (``[batch, q_len, heads, head_dim]`` as jax lays it out)."""
    q = hlo.arrays(module.operand_shape(computation, hlo.unwrap(op), 0))
    if not q or len(q[0][1]) != 4:
        return 1
    b, s, h, _ = q[0][1]
    return b * h * math.ceil(s / ATTENTION_BLOCK)


def peak_dtype(element_type: str) -> str:
    """The ``peak_tflops`` entry an HLO element type's matmuls run at (f32: float32, which
    :meth:`meshpar.plan.topology.Topology.peak` maps to TF32 at JAX's default precision; every
    8-bit float: float8, the FP8 tensor cores' rate)."""
    return "float8" if element_type.startswith("f8") else _PEAK_DTYPE.get(element_type, "float32")

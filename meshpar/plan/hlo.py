"""The optimised HLO text of a compiled program, parsed: computations, instructions, shapes, loop trip counts.

What the step-time model (:mod:`meshpar.plan.time`) reads to count FLOPs, bytes and collectives. Only what those
need is parsed: each instruction's name, result shape, opcode, operands and attributes, which
instruction is each computation's root, and the JSON ``backend_config`` where an op's cost is
stated there (GPU GEMM and cuDNN custom-calls, fusion kinds). The text may carry
``metadata={...}`` and the ``FileNames``/``StackFrames`` blocks or not: both read the same.

Also here, as properties of one op of the text: the FLOPs it computes (XLA's cost-analysis
rules, and the work of GPU library calls from their shapes and configs). The rules are
implemented here; their spec, with the rest of the time model: docs/time-model.md ("FLOPs").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable

DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
    # XLA's 8-bit floats (xla_data.proto's F8E5M2, F8E4M3FN, F8E4M3B11FNUZ, F8E5M2FNUZ, F8E4M3FNUZ,
    # F8E4M3, F8E3M4, F8E8M0FNU) and its 4-bit one (F4E2M1FN), as the HLO printer names them
    "f8e5m2": 1, "f8e4m3fn": 1, "f8e4m3b11fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    shape: str  # as printed: "f32[8,128]{1,0}" or a tuple "(f32[2], s32[])"
    opcode: str
    operands: tuple[str, ...]  # operand instruction names
    attrs: str  # everything after the operand list
    args: str = ""  # the operand list as printed (a constant's literal)


def closing(text: str, start: int) -> int:
    """Index just past the bracket group opening at `start` ("(", "{" or "[")."""
    close = {"(": ")", "{": "}", "[": "]"}[text[start]]
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == text[start]:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_op(line: str) -> Op | None:
    line = _COMMENT.sub("", line).strip()
    if line.startswith("ROOT "):
        line = line[5:]
    name, sep, rest = line.partition(" = ")
    if not sep:
        return None
    if rest.startswith("("):
        end = closing(rest, 0)
    else:
        end = rest.find(" ")
        end = len(rest) if end < 0 else end
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.find("(")
    if paren < 0:
        return None
    opcode = rest[:paren]
    end = closing(rest, paren)
    args = rest[paren + 1 : end - 1]
    operands = tuple(m.lstrip("%") for m in re.findall(r"%[\w.\-]+", args))
    return Op(name.lstrip("%"), shape, opcode, operands, rest[end:], args)


@dataclasses.dataclass(eq=False)
class Module:
    computations: dict[str, list[Op]]
    entry: str
    roots: dict[str, str] = dataclasses.field(default_factory=dict)  # computation → its ROOT op's name
    memo: dict = dataclasses.field(default_factory=dict, repr=False)  # what readers derive from it, kept with it

    @functools.cached_property
    def shapes(self) -> dict[str, dict[str, str]]:
        """Per computation: instruction name → shape."""
        return {c: {op.name: op.shape for op in ops} for c, ops in self.computations.items()}

    @functools.cached_property
    def ops(self) -> dict[str, dict[str, Op]]:
        """Per computation: instruction name → instruction."""
        return {c: {op.name: op for op in ops} for c, ops in self.computations.items()}

    @functools.cached_property
    def users(self) -> dict[str, dict[str, list[tuple[Op, int]]]]:
        """Per computation: instruction name → (user, operand index) of every use of it."""
        out: dict[str, dict[str, list[tuple[Op, int]]]] = {}
        for c, ops in self.computations.items():
            uses = out[c] = {}
            for op in ops:
                for i, name in enumerate(op.operands):
                    uses.setdefault(name, []).append((op, i))
        return out

    def operand_shape(self, computation: str, op: Op, i: int) -> str:
        return self.shapes[computation].get(op.operands[i], "") if i < len(op.operands) else ""

    def root(self, computation: str) -> Op | None:
        """The computation's ROOT instruction (its last one where the text marks none)."""
        ops = self.computations.get(computation, [])
        name = self.roots.get(computation)
        return self.ops[computation].get(name) if name else (ops[-1] if ops else None)

    def parameters(self, computation: str) -> dict[int, Op]:
        """The computation's parameters by number."""
        return {int(op.args): op for op in self.computations.get(computation, []) if op.opcode == "parameter"}


def parse(text: str) -> Module:
    computations, roots, entry, current = {}, {}, None, None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
        elif line.strip() == "}":
            current = None
        else:
            op = _parse_op(line)
            if op is not None:
                computations[current].append(op)
                if line.lstrip().startswith("ROOT "):
                    roots[current] = op.name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations, entry, roots)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a printed shape (a tuple's leaves in order)."""
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def elements(shape: str, first: bool = False) -> int:
    """Elements of an array shape (of a tuple: all leaves, or with `first` the first leaf)."""
    found = arrays(shape)[:1] if first else arrays(shape)
    return sum(math.prod(d) for _, d in found)


def shape_bytes(shape: str) -> int:
    """Bytes of every array in a printed shape."""
    return int(sum(math.prod(d) * DTYPE_BYTES.get(t, 4) for t, d in arrays(shape)))


def leaves(shape: str) -> list[str]:
    """The top-level elements of a printed tuple shape (the shape itself if it is no tuple)."""
    shape = _COMMENT.sub("", shape).strip()
    if not shape.startswith("("):
        return [shape] if shape else []
    inner, out, depth, start = shape[1 : closing(shape, 0) - 1], [], 0, 0
    for i, c in enumerate(inner):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(inner[start:i].strip())
            start = i + 1
    tail = inner[start:].strip()
    return out + ([tail] if tail else [])


def dtype_bytes(shape: str) -> float:
    """Bytes of one element of an array shape (of a tuple: of its first leaf)."""
    found = arrays(shape)
    return DTYPE_BYTES.get(found[0][0], 4) if found else 0


def called(op: Op) -> list[str]:
    names = [m.group(2) for m in _CALLED.finditer(op.attrs)]
    branches = re.search(r"branch_computations=\{([^}]*)\}", op.attrs)
    if branches:
        names += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
    return names


def attr(op: Op, key: str) -> str | None:
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|[^,\s]+)", op.attrs)
    return m.group(1) if m else None


@functools.cache
def _backend_config(attrs: str) -> dict:
    m = re.search(r"\bbackend_config=", attrs)
    if not m:
        return {}
    rest = attrs[m.end() :]
    try:
        if rest.startswith('"'):  # older printers quote the JSON as a string
            rest = json.JSONDecoder().raw_decode(rest)[0]
        value = json.JSONDecoder().raw_decode(rest)[0]
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def backend_config(op: Op) -> dict:
    """An op's ``backend_config`` JSON as a dict ({} where it has none or it is not JSON)."""
    return _backend_config(op.attrs)


def target(op: Op) -> str:
    """A custom-call's ``custom_call_target`` ("" for any other op)."""
    m = re.search(r'custom_call_target="([^"]*)"', op.attrs) if op.opcode.startswith("custom-call") else None
    return m.group(1) if m else ""


def fusion_kind(op: Op) -> str:
    """A fusion's backend kind (``__triton_gemm``, ``__triton_nested_gemm_fusion``, ``__cudnn$fusion``,
    ``__custom_fusion``…; "" where the backend config names none)."""
    kind = backend_config(op).get("fusion_backend_config", {}).get("kind", "")
    return kind if isinstance(kind, str) else ""


def ints(text: str | None) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text or "")]


def trip_count(module: Module, op: Op) -> int:
    """Iterations of a while loop: XLA's ``known_trip_count``, else the bound its condition
    compares against (induction variable from 0, step 1), else 1."""
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', op.attrs) or re.search(
        r"known_trip_count=\{n=(\d+)", op.attrs
    )
    if m:
        return int(m.group(1))
    condition = re.search(r"\bcondition=%?([\w.\-]+)", op.attrs)
    ops = module.computations.get(condition.group(1), []) if condition else []
    constants = {o.name: int(o.args) for o in ops if o.opcode == "constant" and re.fullmatch(r"-?\d+", o.args)}
    for o in ops:  # the compare itself, or a fusion wrapping it (its bound is then an operand)
        inner = module.computations.get(called(o)[0], []) if o.opcode == "fusion" and called(o) else []
        if any(c.opcode == "compare" and "direction=LT" in c.attrs for c in [o, *inner]):
            bound = [constants[x] for x in o.operands if constants.get(x) is not None]
            if bound:
                return max(bound[0], 1)
    return 1


def text(compiled) -> str:
    """The optimised HLO text of a compiled program (or the text itself)."""
    return compiled if isinstance(compiled, str) else compiled.as_text()


# ---------------------------------------------------------------------------------------------
# What one op computes: XLA's FLOP rules, and the GPU library calls' work from their configs

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def collective_kind(opcode: str) -> str | None:
    """The collective an opcode runs (its ``-start`` half included), or None."""
    base = opcode.removesuffix("-start")
    return base if base in COLLECTIVES else None


# Opcodes XLA's cost analysis counts as one FLOP per output element.
_ELEMENTWISE = frozenset(
    "abs add and ceil clamp compare complex convert count-leading-zeros divide floor imag is-finite maximum minimum "
    "multiply negate not or popcnt real reduce-precision remainder round-nearest-afz round-nearest-even select "
    "shift-left shift-right-arithmetic shift-right-logical sign stochastic-convert subtract xor".split()
)


def _conv_flops(out_shape: str, kernel_shape: str, op: Op) -> float:
    """XLA's count for a convolution: 2 × output elements × kernel elements per output feature."""
    kernel = arrays(kernel_shape)
    labels = re.search(r"dim_labels=\w+_(\w+)->", op.attrs)
    if not kernel or not labels or "o" not in labels.group(1):
        return 0.0
    dims = kernel[0][1]
    per_output = math.prod(dims) / dims[labels.group(1).index("o")]
    groups = ints(attr(op, "batch_group_count")) or [1]
    return 2.0 * elements(out_shape, first=True) * per_output / groups[0]


def _gemm_flops(module: Module, computation: str, op: Op) -> float:
    """A cuBLAS GEMM custom-call: 2 × output elements × contracted elements, the contracting
    dims read from its ``gemm_backend_config`` (its result may be a tuple with a workspace)."""
    lhs = arrays(module.operand_shape(computation, op, 0))
    dims = lhs[0][1] if lhs else ()
    numbers = backend_config(op).get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [len(dims) - 1])]
    width = math.prod(dims[d] for d in contracting if 0 <= d < len(dims))
    return 2.0 * elements(op.shape, first=True) * width


def _free_dims(shape: tuple[int, ...], numbers: dict, side: str) -> int:
    """Elements of one side of a dot that are neither batch nor contracted (its rows or columns)."""
    skip = {int(d) for key in ("contracting", "batch") for d in numbers.get(f"{side}_{key}_dimensions", [])}
    return math.prod(n for i, n in enumerate(shape) if i not in skip)


def _attention_flops(module: Module, computation: str, op: Op) -> float:
    """A cuDNN fused attention custom-call (``__cudnn$fmha…``), the FlashAttention count.

    Forward: QKᵀ and PV, 2 × scores × (d_qk + d_v), scores = batch × heads × q_len × kv_len (the
    ``intermediate_tensor_shape`` of its config). Backward: five matmuls — QKᵀ again, dP = dO·Vᵀ,
    dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q — 2 × scores × (3·d_qk + 2·d_v), 2.5× the forward at equal
    head dims. A causal mask halves both (the kernel skips the tiles above the diagonal), a sliding
    window keeps window / kv_len of them. q, k, v are its first three operands, head dim last."""
    config = backend_config(op).get("cudnn_fmha_backend_config", {})
    q, k, v = (arrays(module.operand_shape(computation, op, i)) for i in range(3))
    if not (q and k and v):
        return 0.0
    q, k, v = q[0][1], k[0][1], v[0][1]
    d_qk, d_v = q[-1], v[-1]
    backward = "Backward" in target(op)
    # [batch, heads, q_len, kv_len] as jax states it; else kv_len is the one dim of k neither
    # batch nor contracted in the QKᵀ product (dP = dO·Vᵀ for the backward: V is laid out as K).
    dims = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    numbers = config.get("bmm2_grad_gemm2_dot_dimension_numbers" if backward else "bmm1_dot_dimension_numbers")
    if len(dims) == 4:
        kv_len, scores = dims[-1], math.prod(dims)
    else:
        kv_len = _free_dims(k, numbers, "rhs") if numbers else k[1] if len(k) == 4 else 0  # BTNH by default
        scores = math.prod(q) // d_qk * kv_len
    window = int(config.get("sliding_window_length", 0) or 0)
    share = 1.0
    if window > 0 and kv_len:
        share = min(window, kv_len) / kv_len
    elif "CAUSAL" in str(config.get("mask_type", "")):
        share = 0.5
    return 2.0 * scores * share * ((3 * d_qk + 2 * d_v) if backward else (d_qk + d_v))


def _custom_call_flops(module: Module, computation: str, op: Op) -> float:
    name = target(op)
    if name.startswith("__cublas$"):
        return _gemm_flops(module, computation, op)
    if name.startswith("__cudnn$fmha"):
        return _attention_flops(module, computation, op)
    if name.startswith("__cudnn$conv"):
        # Its window and dim_labels are the forward convolution's (input, kernel → output) in
        # all three passes, which each cost as much as it: the backward input pass takes
        # (d_output, kernel), the backward filter pass (input, d_output) and returns the kernel.
        first, second = (module.operand_shape(computation, op, i) for i in (0, 1))
        if name == "__cudnn$convBackwardInput":
            return _conv_flops(first, second, op)
        if name == "__cudnn$convBackwardFilter":
            return _conv_flops(second, leaves(op.shape)[0], op)
        return _conv_flops(op.shape, second, op)
    return 0.0


def unwrap(op: Op) -> Op:
    """The op an async ``X-start`` runs, as if it ran synchronously: the printer's short form of
    an ``async-start`` wrapping one op (``fusion-start``, ``custom-call-start``…) carries the
    wrapped op's attributes, its shape is ((operands), result, context); ``copy-start``'s is
    (result, operand, context). Collectives' own ``-start`` forms are returned as they are."""
    if not op.opcode.endswith("-start") or collective_kind(op.opcode) or op.opcode == "async-start":
        return op
    parts = leaves(op.shape)
    result = parts[0] if op.opcode == "copy-start" else parts[1] if len(parts) > 1 else op.shape
    return dataclasses.replace(op, opcode=op.opcode.removesuffix("-start"), shape=result)


def op_flops(module: Module, computation: str, op: Op, flops: Callable[[str], float]) -> float:
    """FLOPs of one execution of `op` (in `computation`) by XLA's rules (see
    docs/time-model.md), `flops` giving those of a called computation (see :func:`flops_of`)."""
    op = unwrap(op)
    code = op.opcode
    if code in _ELEMENTWISE:
        return elements(op.shape)
    if code in ("dot", "scaled-dot"):
        lhs = arrays(module.operand_shape(computation, op, 0))
        dims = lhs[0][1] if lhs else ()
        width = math.prod(dims[d] for d in ints(attr(op, "lhs_contracting_dims")) if d < len(dims))
        return 2.0 * elements(op.shape) * width
    if code == "convolution":
        return _conv_flops(op.shape, module.operand_shape(computation, op, 1), op)
    if code == "custom-call":
        return _custom_call_flops(module, computation, op)
    bodies = called(op)
    if code in ("reduce", "reduce-window", "map", "scatter", "sort", "select-and-scatter") and not bodies:
        return 0.0
    if code == "reduce":
        folded = elements(module.operand_shape(computation, op, 0)) - elements(op.shape, first=True)
        return folded * flops(bodies[0])
    if code == "reduce-window":
        window = re.search(r"size=([\dx]+)", op.attrs)
        size = math.prod(int(x) for x in window.group(1).split("x")) if window else 1
        return (size - 1) * elements(op.shape, first=True) * flops(bodies[0])
    if code == "map":
        return elements(op.shape) * flops(bodies[0])
    if code == "scatter":
        n = (len(op.operands) - 1) // 2
        return elements(module.operand_shape(computation, op, n + 1)) * flops(bodies[0])
    if code == "sort":
        n = elements(module.operand_shape(computation, op, 0))
        return n * math.ceil(math.log2(n)) if n > 1 else 0.0
    if code in ("all-reduce", "all-reduce-start"):
        return elements(op.shape)
    if code == "fusion" and "kind=kCustom" in op.attrs and bodies:
        # XLA prices a custom fusion holding a gather or scatter as that op alone (a GEMM
        # fusion's body, dot and all, is counted as any fusion's).
        inner = module.computations.get(bodies[0], [])
        if not any(o.opcode in ("dot", "scaled-dot", "custom-call") for o in inner):
            for o in inner:
                if o.opcode == "gather":
                    return 0.0
                if o.opcode == "scatter":
                    return op_flops(module, bodies[0], o, flops)
    if code == "while":
        return trip_count(module, op) * sum(flops(c) for c in bodies)
    if code == "conditional":
        return max((flops(c) for c in bodies), default=0.0)
    if code in ("fusion", "call", "async-start"):
        return sum(flops(c) for c in bodies)
    return 0.0


# Ops that are matrix products (the work a model's FLOP formula counts) and ops that hold others.
_MATMULS = frozenset({"dot", "scaled-dot", "convolution", "custom-call"})
_CONTAINERS = frozenset({"fusion", "call", "while", "conditional", "async-start"})


def flops_of(module: Module, matmuls: bool = False) -> Callable[[str], float]:
    """computation name → its FLOPs, loops multiplied (memoised per module); with `matmuls`,
    those of its matrix products alone (dots, GEMM and convolution calls, fused attention)."""

    @functools.cache
    def flops(computation: str) -> float:
        ops = module.computations.get(computation, [])
        if matmuls:
            ops = [op for op in ops if unwrap(op).opcode in _MATMULS | _CONTAINERS]
            ops = [op for op in ops if op.opcode != "fusion" or _has_matmul(module, op)]
        return sum(op_flops(module, computation, op, flops) for op in ops)

    return flops


def _has_matmul(module: Module, op: Op) -> bool:
    """Whether a fusion's body (nested fusions included) holds a matrix product."""
    for c in called(op):
        for inner in module.computations.get(c, []):
            if inner.opcode in _MATMULS or (inner.opcode == "fusion" and _has_matmul(module, inner)):
                return True
    return False

"""The optimised HLO text of a compiled program, parsed: computations, instructions, shapes, loop trip counts.

What :mod:`meshpar.plan.timing` reads to count FLOPs, bytes and collectives. Only what those
need is parsed: each instruction's name, result shape, opcode, operands and attributes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

DTYPE_BYTES = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "token": 0,
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


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Op]]
    entry: str

    @functools.cached_property
    def shapes(self) -> dict[str, dict[str, str]]:
        """Per computation: instruction name → shape."""
        return {c: {op.name: op.shape for op in ops} for c, ops in self.computations.items()}

    def operand_shape(self, computation: str, op: Op, i: int) -> str:
        return self.shapes[computation].get(op.operands[i], "") if i < len(op.operands) else ""


def parse(text: str) -> Module:
    computations, entry, current = {}, None, None
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
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations, entry)


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


def called(op: Op) -> list[str]:
    names = [m.group(2) for m in _CALLED.finditer(op.attrs)]
    branches = re.search(r"branch_computations=\{([^}]*)\}", op.attrs)
    if branches:
        names += [b.strip().lstrip("%") for b in branches.group(1).split(",")]
    return names


def attr(op: Op, key: str) -> str | None:
    m = re.search(rf"\b{key}=(\{{[^}}]*\}}|[^,\s]+)", op.attrs)
    return m.group(1) if m else None


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



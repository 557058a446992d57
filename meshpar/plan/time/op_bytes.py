"""What one op of a compiled program reads and writes in device memory: of each operand the part it
reads (a fusion: what its body reads of that parameter), and of its result what it writes (an
in-place update: the update alone).

The spec: docs/time-model.md.
"""

from __future__ import annotations

import re

from meshpar.plan import hlo

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


def op_bytes(module: hlo.Module, computation: str, op: hlo.Op) -> float:
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

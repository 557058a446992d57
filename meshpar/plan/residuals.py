"""The residuals XLA keeps for a backward pass, read from the program jax builds.

:func:`kept_residuals` walks the forward jaxpr of ``jax.vjp`` of a function (calls inlined,
layer loops followed into their bodies) and decides, value by value, which residuals XLA holds
in memory and which its fusion recomputes where the backward reads them;
:func:`backward_slices` reads the backward's own loops for what a layer loop that runs as a loop
writes out of its stacks. The rules, and the memory model they serve, are in
:mod:`meshpar.plan.memory`'s docstring.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from meshpar import jaxprs


def nbytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value XLA keeps for the backward pass: its bytes per copy, the copies (the iterations
    of the layer loop it is stacked over, 1 outside loops) and where it comes from."""

    nbytes: int
    copies: int
    label: str  # the checkpoint_name tag in quotes, else the primitive that makes it
    loop: bool = False  # handed out by a loop's body (one per iteration), even a loop of one iteration
    rolled: bool = False  # handed out by a loop that runs as a loop (scan_unroll below its length)
    sliced: bool = False  # rolled, and a matmul reads it: the backward slices it out of its stack
    at: int = 0  # where the forward makes it, in the step's program order (a loop's residuals: the loop's place)

    @property
    def total(self) -> int:
        return self.nbytes * self.copies


class _Graph:
    """One jaxpr with its calls inlined. Values are ``(instance, var)`` keys: a jitted function
    called twice has one jaxpr, so each inlined call gets an instance number of its own."""

    def __init__(self, jaxpr):
        self.producer = {}  # key -> (eqn, input keys, position in program order)
        self.alias = {}  # key -> the key of the same value (a call's outputs and its body's inputs)
        self.tags = {}  # key -> the checkpoint_name tag the model gave it
        self.inputs = {(0, v): i for i, v in enumerate(jaxpr.invars)}
        self._instances = 0
        self._inline(jaxpr, 0)
        self.operands = set()  # what matmuls read, and what a reduction over leading dims reads
        for eqn, args, _ in self.producer.values():
            if jaxprs.is_matmul(eqn):
                self.operands.update(self.canonical(a) for a in args if a is not None)
            elif jaxprs.is_mul(eqn) and None not in args:
                for a, other in ((args[0], args[1]), (args[1], args[0])):
                    if self._leading_broadcast(a):
                        self.operands.add(self.canonical(other))

    def _leading_broadcast(self, key) -> bool:
        """`key` is a value broadcast along leading dims only (a per-feature scale over batch rows):
        the gradient of what was broadcast is a reduction over those dims of the cotangent times
        the product's other operand, and XLA:CPU fuses reductions over the minor dim only, so
        that operand is read from memory."""
        key = self.canonical(key)
        grown = jaxprs.broadcast_grown(self.producer[key][0]) if key in self.producer else None
        rank = len(key[1].aval.shape)
        return bool(grown) and rank - 1 not in grown

    def _inline(self, jaxpr, inst: int) -> None:
        for eqn in jaxpr.eqns:
            args = [None if jaxprs.is_literal(v) else self.resolve((inst, v)) for v in eqn.invars]
            body = jaxprs.call_body(eqn)
            if body is not None:
                self._instances += 1
                sub = self._instances
                self.alias.update({(sub, v): a for v, a in zip(body.invars, args) if a is not None})
                self._inline(body, sub)
                for v, w in zip(eqn.outvars, body.outvars):
                    if not jaxprs.is_literal(w):
                        self.alias[(inst, v)] = self.resolve((sub, w))
                continue
            for v in eqn.outvars:
                self.producer[(inst, v)] = (eqn, args, len(self.producer))
            tag = jaxprs.tag_of(eqn)
            if tag is not None and args[0] is not None:
                self.tags[self.canonical(args[0])] = tag

    def resolve(self, key):
        while key in self.alias:
            key = self.alias[key]
        return key

    def canonical(self, key):
        """`key` with relabelling producers (:func:`meshpar.jaxprs.is_relabel`) looked through."""
        key = self.resolve(key)
        while key in self.producer and jaxprs.is_relabel(self.producer[key][0]):
            operand = self.producer[key][1][0]
            if operand is None:
                break
            key = self.resolve(operand)
        return key


class _Level:
    """The residuals one jaxpr (the step's forward, or a loop body) hands to the backward pass,
    and which of them XLA keeps (see the module docstring for the rule)."""

    def __init__(self, jaxpr, copies: int, on_input, out: list[Residual], in_loop: bool = False, at: int | None = None):
        self.graph, self.copies, self.on_input, self.out = _Graph(jaxpr), copies, on_input, out
        self.in_loop = in_loop  # a loop's body
        self.at = at  # a loop's body: the loop's place in the step's program order
        self.candidates: set = set()
        self.loops: dict[int, _Level] = {}  # a scan equation's id -> its body's level
        self.stacked: set = set()  # a loop's body: the values it hands out stacked (each once)
        self.kept: set = set()  # the candidates kept (after finish)
        self.parent: tuple | None = None  # a loop's body: (the caller's level, the loop's inputs, consts, carry, length)

    def add(self, key) -> None:
        """`key` is a residual: a candidate here, or handed to the loop body or the caller it comes from."""
        g = self.graph
        key = g.canonical(key)
        if key in g.inputs:
            self.on_input(g.inputs[key])
            return
        if key not in g.producer:  # a constant of the program
            return
        eqn, args, pos = g.producer[key]
        if jaxprs.is_scan(eqn):
            i = next(n for n, v in enumerate(eqn.outvars) if v is key[1])
            body, _, carry = jaxprs.scan_parts(eqn)
            if i >= carry:  # a per-iteration value, stacked over the loop
                loop = self._loop(eqn, args, pos)
                if jaxprs.is_rolled(eqn):  # a loop output: XLA writes every one into its stack
                    w = body.outvars[i]
                    value = loop.graph.canonical((0, w))
                    if value in loop.stacked:  # the same value handed out again: one stack
                        return
                    loop.stacked.add(value)
                    tag = loop.graph.tags.get(value)
                    label = f"'{tag}'" if tag else "loop output"
                    sliced = value in loop.graph.operands
                    self.out.append(Residual(nbytes(w.aval), loop.copies, label, loop=True, rolled=True,
                                             sliced=sliced, at=loop.at))
                else:  # unrolled: straight-line code, fused like any other
                    loop.add((0, body.outvars[i]))
                return
        self.candidates.add(key)

    def _place(self, pos: int) -> int:
        return pos if self.at is None else self.at

    def _loop(self, eqn, args, pos: int) -> _Level:
        if id(eqn) not in self.loops:
            (body, consts, carry), length = jaxprs.scan_parts(eqn), jaxprs.scan_length(eqn)
            carried: set[int] = set()

            def on_input(k: int) -> None:
                if consts <= k < consts + carry:  # the carry: one value per iteration, stacked
                    if k not in carried:
                        carried.add(k)
                        tag = self.loops[id(eqn)].graph.tags.get((0, body.invars[k]))
                        label = f"'{tag}'" if tag else "loop carry"
                        self.out.append(Residual(nbytes(body.invars[k].aval), self.copies * length, label, loop=True,
                                                 rolled=jaxprs.is_rolled(eqn), at=self._place(pos)))
                elif args[k] is not None:  # a constant or a stacked input: the caller's value
                    self.add(args[k])

            self.loops[id(eqn)] = _Level(body, self.copies * length, on_input, self.out, in_loop=True, at=self._place(pos))
            self.loops[id(eqn)].parent = (self, args, consts, carry, length)
        return self.loops[id(eqn)]

    def finish(self) -> None:
        """Decide, in program order, which candidates XLA keeps; loop bodies first."""
        for loop in self.loops.values():
            loop.finish()
        g, kept = self.graph, self.kept

        def sources(key, seen: dict) -> set:
            """The values, neither kept nor inputs, that cheap ops recompute `key` from."""
            if key is None:
                return set()
            key = g.canonical(key)
            if key in g.inputs or key in kept or key not in g.producer:
                return set()
            if key not in seen:
                eqn, args, _ = g.producer[key]
                seen[key] = set().union(*(sources(a, seen) for a in args)) if jaxprs.is_cheap(eqn) else {key}
            return seen[key]

        def keep(key) -> None:
            kept.add(key)
            label = f"'{g.tags[key]}'" if key in g.tags else jaxprs.op(g.producer[key][0])
            self.out.append(Residual(nbytes(key[1].aval), self.copies, label, loop=self.in_loop,
                                     at=self._place(g.producer[key][2])))

        for key in sorted(self.candidates, key=lambda k: g.producer[k][2]):
            if key in kept:
                continue
            eqn, args, _ = g.producer[key]
            if not jaxprs.is_cheap(eqn) or key in g.operands:
                keep(key)
                continue
            needed = set().union(*(sources(a, {}) for a in args))
            if sum(nbytes(k[1].aval) for k in needed) > nbytes(key[1].aval):
                keep(key)  # cheaper to keep than what it is made from
            else:  # fused into the backward and recomputed there, from `needed` (kept once)
                for k in sorted(needed, key=lambda k: g.producer[k][2]):
                    keep(k)


def _argument_copies(level: _Level, key) -> tuple[int, int] | None:
    """(flattened argument index, copies) when `key` is an argument of the traced function, or one
    layer's slice of one (a loop's stacked input or constant): the copies are the slices' number."""
    copies = 1
    while True:
        key = level.graph.canonical(key)
        if key not in level.graph.inputs:
            return None
        k = level.graph.inputs[key]
        if level.parent is None:
            return k, copies
        level, args, consts, carry, length = level.parent
        if consts <= k < consts + carry or args[k] is None:
            return None  # the carry: a value the loop makes
        copies *= length if k >= consts + carry else 1
        key = args[k]


def _widening_casts(level: _Level, nargs: int) -> int:
    """Bytes of the casts of the first `nargs` arguments (the parameters) to a wider dtype that
    the forward makes (every layer's, for a slice of a stacked argument) and does not keep as
    residuals, in this level and the loop bodies below it."""
    total = 0
    for key, (eqn, args, _) in level.graph.producer.items():
        if jaxprs.op(eqn) != "convert_element_type" or args[0] is None or key in level.kept | level.stacked:
            continue
        if key[1].aval.dtype.itemsize <= args[0][1].aval.dtype.itemsize:
            continue
        src = _argument_copies(level, args[0])
        if src is not None and src[0] < nargs:
            total += nbytes(key[1].aval) * src[1]
    return total + sum(_widening_casts(loop, nargs) for loop in level.loops.values())


def kept_residuals(fn, *args, read: set[int] | None = None, uses: dict | None = None, casts: list | None = None,
                   matmuls_at: dict | None = None) -> list[Residual]:  # fmt: skip
    """The residuals of ``jax.vjp(fn, *args)`` that XLA keeps for the backward pass (see the
    module docstring); `args` are abstract. Residuals that are the arguments themselves are left
    out; `read` (when given) receives their indices among the flattened `args`. `uses` (when
    given) receives, for each flattened argument the forward reads, ``(place, cotangent, bytes)``:
    the place in program order (:attr:`Residual.at`) of the last op that reads it (where the
    backward produces its gradient), the bytes of that op's largest output (the cotangent it is
    differentiated with; None for a loop: one iteration's residuals') and the argument's bytes.
    `casts` (when given) receives the bytes of the casts of the first argument's leaves (the
    parameters) to a wider dtype that are not kept as residuals (:func:`_widening_casts`).
    `matmuls_at` (when given) receives, for each place in program order that runs matmuls,
    ``(a loop, their equations)``: a matmul's own, or every matmul in a loop's body (a loop is
    one place)."""
    leaves, tree = jax.tree.flatten(args)
    closed, shapes = jax.make_jaxpr(
        lambda *xs: jax.vjp(lambda *ys: fn(*jax.tree.unflatten(tree, ys)), *xs), return_shape=True
    )(*leaves)
    jaxpr = closed.jaxpr
    n = len(jax.tree.leaves(shapes[1]))  # the vjp function's leaves: the residuals, last
    out: list[Residual] = []
    top = _Level(jaxpr, 1, read.add if read is not None else (lambda k: None), out)  # an argument: counted in its own category
    for v in jaxpr.outvars[len(jaxpr.outvars) - n :]:
        if not jaxprs.is_literal(v):
            top.add((0, v))
    top.finish()
    if casts is not None:
        casts.append(_widening_casts(top, len(jax.tree.leaves(args[0]))))
    if matmuls_at is not None:
        for eqn, _, pos in top.graph.producer.values():
            if jaxprs.is_matmul(eqn):
                matmuls_at[pos] = (False, [eqn])
            elif jaxprs.is_scan(eqn):
                body = jaxprs.scan_parts(eqn)[0]
                matmuls_at[pos] = (True, [e for j in jaxprs.nested(body) for e in j.eqns if jaxprs.is_matmul(e)])
    if uses is not None:
        g = top.graph
        for eqn, ins, pos in g.producer.values():
            loop = jaxprs.is_scan(eqn)  # its cotangents are one iteration's: its residuals' (None here)
            cot = None if loop else max((nbytes(v.aval) for v in eqn.outvars), default=0)
            for a in ins:
                k = g.canonical(a) if a is not None else None
                if k in g.inputs and not jaxprs.is_relabel(eqn) and pos >= uses.get(g.inputs[k], (-1,))[0]:
                    uses[g.inputs[k]] = (pos, cot, nbytes(k[1].aval))
    return out


def backward_slices(fn, *args) -> int:
    """Bytes one iteration of a backward layer loop that runs as a loop writes out of its
    residual stacks (the largest such loop's): the backward of ``jax.vjp(fn, *args)`` is traced,
    and a stacked residual its body reads (a per-iteration input made by a loop) is sliced out
    into a buffer of its own when a matmul reads it or more than one op does; a dynamic slice
    read by one elementwise op fuses into it. `args` are abstract."""
    leaves, tree = jax.tree.flatten(args)

    def backward(*xs):
        out, vjp = jax.vjp(lambda *ys: fn(*jax.tree.unflatten(tree, ys)), *xs)
        return vjp(jax.tree.map(jnp.ones_like, out))

    g = _Graph(jax.make_jaxpr(backward)(*leaves).jaxpr)
    most = 0
    for eqn, args_, _ in {id(v[0]): v for v in g.producer.values()}.values():
        if not jaxprs.is_scan(eqn) or not jaxprs.is_rolled(eqn):
            continue
        body, consts, carry = jaxprs.scan_parts(eqn)
        inner = _Graph(body)
        reads: dict = {}  # a stacked residual's key in the body -> (ops reading it, a matmul among them)
        for k in range(consts + carry, len(body.invars)):
            a = args_[k]
            src = g.canonical(a) if a is not None else None
            if src is not None and src in g.producer and jaxprs.is_scan(g.producer[src][0]):
                reads[inner.canonical((0, body.invars[k]))] = [0, False]
        for e, ins, _ in {id(v[0]): v for v in inner.producer.values()}.values():
            if jaxprs.is_relabel(e):
                continue
            for key in {inner.canonical(a) for a in ins if a is not None} & set(reads):
                reads[key][0] += 1
                reads[key][1] |= jaxprs.is_matmul(e)
        most = max(most, sum(nbytes(k[1].aval) for k, (n, mm) in reads.items() if mm or n > 1))
    return most


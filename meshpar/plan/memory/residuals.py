"""The residuals XLA keeps for a backward pass, read from the program jax builds.

:func:`kept_residuals` walks the forward jaxpr of ``jax.vjp`` of a function (calls inlined,
layer loops followed into their bodies) and decides, value by value, which residuals XLA holds
in memory and which its fusion recomputes where the backward reads them;
:func:`backward_slices` reads the backward's own loops for what a layer loop that runs as a loop
writes out of its stacks. The rules, and the memory model they serve, are in
:mod:`meshpar.plan.memory.analytic`'s docstring.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshpar import jaxprs

# XLA:GPU's fusion counts these cheap in float32 and float16 (each one hardware instruction, or
# nearly) and duplicates them into every consumer, where XLA:CPU keeps their outputs
GPU_CHEAP = frozenset({"exp", "div", "sqrt", "rsqrt"})


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
    cot: int = 0  # bytes of its cotangent, where the forward widens it (a cast to a wider dtype); else 0: nbytes

    @property
    def total(self) -> int:
        return self.nbytes * self.copies


class Use(NamedTuple):
    """Where the backward produces one argument's gradient (see :func:`kept_residuals`)."""

    at: int  # the place in program order of the last op that reads the argument
    cot: int | None  # bytes of that op's largest output (its cotangent); None for a loop
    nbytes: int  # the gradient's bytes as produced: the argument's, in the dtype the forward reads it in
    scattered: bool = False  # a gather reads it: its gradient is added into a zeroed buffer of its shape
    matmul: bool = False  # that op is a matmul: the gradient is its weight gradient
    # ... and its output has more than two dims: the weight gradient contracts the cotangent over several
    folded: bool = False
    # the values the forward reads it as (each ``use`` relabels and casts it anew): the backward
    # produces one cotangent for each, and reduces each (the transpose of its own sharding
    # constraint) before adding them
    parts: int = 1


class _Graph:
    """One jaxpr with its calls inlined. Values are ``(instance, var)`` keys: a jitted function
    called twice has one jaxpr, so each inlined call gets an instance number of its own."""

    def __init__(self, jaxpr):
        self.producer = {}  # key -> (eqn, input keys, position in program order)
        self.alias = {}  # key -> the key of the same value (a call's outputs and its body's inputs)
        self.tags = {}  # key -> the checkpoint_name tag the model gave it
        self.inputs = {(0, v): i for i, v in enumerate(jaxpr.invars)}
        self._instances = self._places = 0
        self.order: dict = {}
        self._inline(jaxpr, 0)
        self.operands = set()  # what matmuls read, and what a reduction over leading dims reads
        self.widened: dict = {}  # value -> its largest cast to a wider dtype (bytes)
        for key, (eqn, args, _) in self.producer.items():
            if jaxprs.op(eqn) == "convert_element_type" and args[0] is not None:
                src = self.canonical(args[0])
                self.widened[src] = max(self.widened.get(src, 0), nbytes(key[1].aval))
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
            self._places += 1  # one place per equation: every output of a loop is the loop's
            for v in eqn.outvars:
                self.producer[(inst, v)] = (eqn, args, self._places)
                self.order[(inst, v)] = len(self.order)  # program order, outputs apart
            tag = jaxprs.tag_of(eqn)
            if tag is not None and args[0] is not None:
                self.tags[self.canonical(args[0])] = tag

    def argument(self, key) -> tuple[int, object] | None:
        """(the argument's index, the dtype it is read in) when `key` is an argument, through
        relabellings and casts (``use``'s cast to the compute dtype); else None."""
        key, dtype = self.canonical(key), key[1].aval.dtype
        while key not in self.inputs and key in self.producer and self._cast(key):
            operand = self.producer[key][1][0]
            if operand is None:
                return None
            key = self.canonical(operand)
        return (self.inputs[key], dtype) if key in self.inputs else None

    def _cast(self, key) -> bool:
        return jaxprs.op(self.producer[key][0]) == "convert_element_type"

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

    def __init__(self, jaxpr, copies: int, on_input, out: list[Residual], in_loop: bool = False, at: int | None = None,
                 cheap: frozenset = frozenset(), looped: bool = False):  # fmt: skip
        self.graph, self.copies, self.on_input, self.out = _Graph(jaxpr), copies, on_input, out
        self.looped = looped  # every scan runs as a loop, even of one iteration (a pipeline's tick loop holds it)
        self.extra_cheap = cheap  # primitives also fused and recomputed where float32 or float16
        self.in_loop = in_loop  # a loop's body
        self.at = at  # a loop's body: the loop's place in the step's program order
        self.candidates: set = set()
        self.loops: dict[int, _Level] = {}  # a scan equation's id -> its body's level
        self.stacked: set = set()  # a loop's body: the values it hands out stacked (each once)
        self.kept: set = set()  # the candidates kept (after finish)
        self.parent: tuple | None = (
            None  # a loop's body: (the caller's level, the loop's inputs, consts, carry, length)
        )

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
                if jaxprs.is_rolled(eqn) or self.looped:  # a loop output: XLA writes every one into its stack
                    w = body.outvars[i]
                    value = loop.graph.canonical((0, w))
                    if value in loop.stacked:  # the same value handed out again: one stack
                        return
                    loop.stacked.add(value)
                    tag = loop.graph.tags.get(value)
                    label = f"'{tag}'" if tag else "loop output"
                    sliced = value in loop.graph.operands
                    self.out.append(
                        Residual(nbytes(w.aval), loop.copies, label, loop=True, rolled=True, sliced=sliced, at=loop.at)
                    )
                else:  # unrolled: straight-line code, fused like any other
                    loop.add((0, body.outvars[i]))
                return
        self.candidates.add(key)

    def cheap(self, eqn) -> bool:
        """XLA fuses `eqn` into its consumers and recomputes it there (see the module docstring)."""
        if jaxprs.is_cheap(eqn):
            return True
        narrow = all(v.aval.dtype in (jnp.float32, jnp.float16) for v in eqn.outvars)
        return jaxprs.op(eqn) in self.extra_cheap and narrow

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
                        self.out.append(
                            Residual(
                                nbytes(body.invars[k].aval),
                                self.copies * length,
                                label,
                                loop=True,
                                rolled=jaxprs.is_rolled(eqn) or self.looped,
                                at=self._place(pos),
                            )
                        )
                elif args[k] is not None:  # a constant or a stacked input: the caller's value
                    self.add(args[k])

            self.loops[id(eqn)] = _Level(body, self.copies * length, on_input, self.out, in_loop=True,
                                         at=self._place(pos), cheap=self.extra_cheap, looped=self.looped)  # fmt: skip
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
                seen[key] = set().union(*(sources(a, seen) for a in args)) if self.cheap(eqn) else {key}
            return seen[key]

        def keep(key) -> None:
            kept.add(key)
            label = f"'{g.tags[key]}'" if key in g.tags else jaxprs.op(g.producer[key][0])
            size = nbytes(key[1].aval)
            cot = g.widened.get(key, 0)  # its cotangent comes back in the wider dtype
            self.out.append(Residual(size, self.copies, label, loop=self.in_loop, at=self._place(g.producer[key][2]),
                                     cot=cot if cot > size else 0))  # fmt: skip

        for key in sorted(self.candidates, key=g.order.get):
            if key in kept:
                continue
            eqn, args, _ = g.producer[key]
            if not self.cheap(eqn) or key in g.operands:
                keep(key)
                continue
            needed = set().union(*(sources(a, {}) for a in args))
            if sum(nbytes(k[1].aval) for k in needed) > nbytes(key[1].aval):
                keep(key)  # cheaper to keep than what it is made from
            else:  # fused into the backward and recomputed there, from `needed` (kept once)
                for k in sorted(needed, key=g.order.get):
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


def _cast_dtypes(level: _Level) -> dict:
    """Argument index -> the dtype the forward computes with it where it casts it (the narrowest
    of its casts, in this level and the loop bodies below it: a stacked argument is cast one
    layer's slice at a time)."""
    out: dict = {}
    for key, (eqn, args, _) in level.graph.producer.items():
        if jaxprs.op(eqn) != "convert_element_type" or args[0] is None:
            continue
        src = _argument_copies(level, args[0])
        if src is not None:
            dtype = key[1].aval.dtype
            if src[0] not in out or dtype.itemsize < out[src[0]].itemsize:
                out[src[0]] = dtype
    for loop in level.loops.values():
        for k, dtype in _cast_dtypes(loop).items():
            if k not in out or dtype.itemsize < out[k].itemsize:
                out[k] = dtype
    return out


def kept_residuals(fn, *args, read: set[int] | None = None, uses: dict | None = None, casts: list | None = None,
                   matmuls_at: dict | None = None, dtypes: dict | None = None,
                   cheap: frozenset = frozenset(), looped: bool = False) -> list[Residual]:  # fmt: skip
    """The residuals of ``jax.vjp(fn, *args)`` that XLA keeps for the backward pass (see the
    module docstring); `args` are abstract. Residuals that are the arguments themselves are left
    out; `read` (when given) receives their indices among the flattened `args`. `uses` (when
    given) receives, for each flattened argument the forward reads, a :class:`Use`: the place in
    program order (:attr:`Residual.at`) of the last op that reads it (where the backward
    produces its gradient; relabellings and casts of an argument are the argument), the bytes
    of that op's largest output (the cotangent it is differentiated with; None for a loop: one
    iteration's residuals'), the argument's bytes in the dtype the forward reads it in, whether
    a gather reads it, whether that op is a matmul (of an output of more than two dims), and
    how many values the forward reads it as. `casts` (when given) receives the bytes of the
    casts of the first argument's leaves (the parameters) to a wider dtype that are not kept as
    residuals (:func:`_widening_casts`). `matmuls_at` (when given) receives, for each place in
    program order that runs matmuls, ``(a loop, their equations)``: a matmul's own, or every
    matmul in a loop's body (a loop is one place). `dtypes` (when given) receives the dtype each
    argument is cast to where the forward casts it (:func:`_cast_dtypes`). `cheap`: primitives
    also fused into their consumers where float32 or float16 (the target's: :data:`GPU_CHEAP`).
    `looped`: every scan counts as one that runs as a loop, a scan of one iteration too (a
    pipeline stage's layers inside the tick loop, :mod:`meshpar.plan.memory.stage_axis`)."""
    top = _forward_level(fn, args, read, cheap, looped)
    if casts is not None:
        casts.append(_widening_casts(top, len(jax.tree.leaves(args[0]))))
    if dtypes is not None:
        dtypes.update(_cast_dtypes(top))
    if matmuls_at is not None:
        matmuls_at.update(_matmuls_at(top))
    if uses is not None:
        uses.update(_uses(top, jax.tree.leaves(args)))
    return top.out


def _forward_level(fn, args, read: set[int] | None, cheap: frozenset, looped: bool) -> _Level:
    """The forward of ``jax.vjp(fn, *args)`` traced and its residuals decided (:class:`_Level`, finished)."""
    leaves, tree = jax.tree.flatten(args)
    closed, shapes = jax.make_jaxpr(
        lambda *xs: jax.vjp(lambda *ys: fn(*jax.tree.unflatten(tree, ys)), *xs), return_shape=True
    )(*leaves)
    jaxpr = closed.jaxpr
    n = len(jax.tree.leaves(shapes[1]))  # the vjp function's leaves: the residuals, last
    out: list[Residual] = []
    # an argument is counted in its own category
    top = _Level(jaxpr, 1, read.add if read is not None else (lambda k: None), out, cheap=cheap, looped=looped)
    for v in jaxpr.outvars[len(jaxpr.outvars) - n :]:
        if not jaxprs.is_literal(v):
            top.add((0, v))
    top.finish()
    return top


def _matmuls_at(top: _Level) -> dict:
    """Place in program order -> ``(a loop, its matmul equations)``, for each place that runs matmuls."""
    found = {}
    for eqn, _, pos in top.graph.producer.values():
        if jaxprs.is_matmul(eqn):
            found[pos] = (False, [eqn])
        elif jaxprs.is_scan(eqn):
            body = jaxprs.scan_parts(eqn)[0]
            found[pos] = (True, [e for j in jaxprs.nested(body) for e in j.eqns if jaxprs.is_matmul(e)])
    return found


def _uses(top: _Level, leaves: list) -> dict[int, Use]:
    """Flattened argument index -> its :class:`Use`, for each argument (of `leaves`) the forward reads."""
    g, found, reads = top.graph, {}, {}
    for key, (eqn, ins, pos) in g.producer.items():
        if jaxprs.is_relabel(eqn) or jaxprs.op(eqn) == "convert_element_type" and g.argument(key) is not None:
            continue  # the argument itself, relabelled or read in another dtype
        loop = jaxprs.is_scan(eqn)  # its cotangents are one iteration's: its residuals' (None here)
        cot = None if loop else max((nbytes(v.aval) for v in eqn.outvars), default=0)
        for j, a in enumerate(ins):
            arg = g.argument(a) if a is not None else None
            if arg is None:
                continue
            k, dtype = arg
            reads.setdefault(k, set()).add(g.resolve(a))
            size = math.prod(leaves[k].shape) * jnp.dtype(dtype).itemsize
            last = found.get(k, Use(-1, None, 0))
            scattered = last.scattered or (jaxprs.op(eqn) == "gather" and j == 0)
            if pos >= last.at:
                matmul = jaxprs.is_matmul(eqn)
                folded = matmul and len(eqn.outvars[0].aval.shape) > 2
                found[k] = Use(pos, cot, max(last.nbytes, size), scattered, matmul, folded)
            else:
                found[k] = last._replace(nbytes=max(last.nbytes, size), scattered=scattered)
    return {k: u._replace(parts=len(reads[k])) for k, u in found.items()}


def _fp8_gemm_operand(eqn, gpu: bool) -> bool:
    """`eqn` dequantizes an FP8 value (:mod:`meshpar.models.fp8`: a convert of an 8-bit float)
    that XLA:GPU's GEMM rewriter makes an FP8 GEMM's operand: read, like a matmul's, from a
    buffer of its own (the FP8 slice: ``dynamic-slice`` fusions of ``f8e4m3fn`` stacks feed the
    ``__cublas$lt$matmul$f8`` calls of the backward loop's body)."""
    return (
        gpu
        and jaxprs.op(eqn) == "convert_element_type"
        and jnp.dtype(eqn.invars[0].aval.dtype).itemsize == 1
        and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating)
    )


def backward_slices(fn, *args, gpu: bool = False) -> int:
    """Bytes one iteration of a backward layer loop that runs as a loop writes out of its
    residual stacks (the largest such loop's): the backward of ``jax.vjp(fn, *args)`` is traced,
    and a stacked residual its body reads (a per-iteration input made by a loop) is sliced out
    into a buffer of its own when a matmul reads it or more than one op does (on XLA:GPU, `gpu`,
    also an FP8 residual dequantized for an FP8 GEMM); a dynamic slice read by one elementwise
    op fuses into it. `args` are abstract."""
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
                reads[key][1] |= jaxprs.is_matmul(e) or _fp8_gemm_operand(e, gpu)
        most = max(most, sum(nbytes(k[1].aval) for k, (n, mm) in reads.items() if mm or n > 1))
    return most

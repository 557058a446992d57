"""Analytic per-device memory of a config's training run, by category, before anything exists.

Everything comes from the real abstract train state (``eval_shape``), its shardings and the
model's own code traced at per-device shapes; nothing is kept by hand for one model, and no
factor is fitted to a measurement. Per device (the most loaded one: the relay device in routed
feeding), in bytes:

* ``params`` (exact) — every parameter's shard under the layout with ``param_layout`` on top.
* ``grads`` (estimate) — one gradient per parameter, in the parameter dtype, placed like the
  parameter, when the update needs them together (clipping by their global norm, or a sum or
  re-placement over devices: XLA combines those collectives into one); otherwise the largest
  gradient at its activation-layout shard alone (each parameter is updated from its own gradient
  as the backward produces it, in the donated state's buffers, and the gradient dies there);
  with ``train.microbatches`` > 1 also the float32 running sum the accumulation keeps in the
  parameters' shardings.
* ``optimizer`` (exact) — every optimizer-state leaf's shard (moments placed like their
  parameters, counts and scalars whole), plus the step counter and the RNG key.
* ``activations`` (estimate) — the residuals of one microbatch that XLA keeps for the backward
  pass (:func:`saved_activations`). They are JAX's own residuals of the model's loss under the
  ``model.remat`` policy in use (``jax.vjp``'s forward jaxpr), traced at one device's shapes
  (every parameter at its shard in the activation layout, the batch at its per-device rows
  divided by ``train.microbatches`` and every other dim at the shard the model first places it
  in: the MLP's ``pixels`` under Mesh TensorFlow's mnist layout), each stacked over the layer
  loop it comes from (a stack of one layer is a loop of one iteration), filtered
  by what XLA must hold in memory (checked against XLA:CPU's buffer assignment):

  - a residual behind a relabelling op (reshape, squeeze, ``checkpoint_name``, ``stop_gradient``)
    is its operand,
    counted once;
  - kept: outputs of matmuls, reductions, gathers, transcendentals (tanh, exp, rsqrt, …: XLA
    does not duplicate them), random bits and loops; a value a matmul reads (an operand is
    written out before the matmul runs); a value multiplied by one broadcast along leading
    dims (a per-feature scale: its gradient is a reduction over the batch rows of that value,
    and XLA:CPU fuses reductions over the minor dim only); the carry of the layer loop;
  - otherwise, the output of a cheap elementwise or data-movement op (add, mul, select,
    broadcast, transpose, slice, concatenate, convert, …) is recomputed where the backward
    reads it (XLA fuses it there) from the values it is made of: those already kept and the
    arguments cost nothing more; any other (say a tanh output that two such residuals are
    made of) is kept instead, once, when it is no larger than the residual, else the
    residual itself is kept;
  - in a layer loop that runs as a loop (``scan_unroll`` below the depth: on CPU whenever
    ``remat`` is on, on accelerators by default), every residual the body hands out is kept:
    it leaves the body stacked, beyond fusion's reach (one stack per value, however often the
    body hands it out).

  Residuals that are the arguments (parameters, batch) are counted in their own categories.
  Each is labelled by the ``checkpoint_name`` tag the model gave it, where it has one.

  **Gathered parameters** (``param_layout``; :func:`_gathers`): a parameter stored on a smaller
  shard than compute uses (its shard in the activation layout) is gathered into a buffer of its
  own. A parameter the backward reads (a residual that is a parameter) keeps that gathered copy
  for it: the forward's copy as a residual, or under ``model.remat`` a second gather by the
  recomputed forward (XLA does not merge the two). Outside the layer loop XLA schedules these
  gathers, which read only arguments, at the step's start, so every pass's copies of those
  parameters are live at once, plus one more copy of the largest gathered along a dim after its
  leading one (gathered in a transposed layout, then copied back); with microbatches they leave
  the accumulation loop and stay live through it. Inside the layer loop each layer's copy is
  gathered in its iteration (a residual of every layer under ``remat: none``). When the layer
  loop runs as a loop, the stacked parameters are gathered along a dim after ``layers``: XLA
  copies each whole stack, at its stored shard, into the transposed layout once, outside the
  loops (live through the backward), and under ``model.remat`` the backward's iteration holds
  that layer's gathered copies (``Gathers.loop``, in the backward phase). When it is unrolled,
  under ``model.remat`` and with microbatches: ``Gathers.layers`` (the backward phase, below).
* ``workspace`` (estimate) — what the step's peak holds beyond gradients and activations. The
  step's working set is the largest of three phases, not a sum of categories:

  - gather (``param_layout`` only): every gathered copy of the parameters outside the layer
    loop and the transposed-layout copy (above), at the step's start;
  - backward (:func:`_backward_walk`): the most held at once walking the forward's program order
    in reverse, as the backward runs: the residuals die in reverse order (each after the op
    that reads it) while the gradients are produced (each at its parameter's last use in the
    forward). At each kept residual: every residual made up to it, plus its cotangent (a
    cotangent has its value's shape; it exists while the op that saved the residual is
    differentiated); at each parameter's last use: the residuals made before it plus that op's
    output as cotangent (a loop's: its largest per-iteration residual, its stacks still live).
    Gradients held together (see ``grads``; those of gathered parameters outside the layer loop
    at their compute shard, until reduced) count from where each is produced on; one at a time,
    each only where it is produced, with what applying it holds (the update below) when there
    are no microbatches (with them it is added to the running sum, held throughout). Plus under
    ``model.remat`` one layer's recomputed residuals (what ``remat: none`` keeps per layer-loop
    iteration less what the policy keeps per iteration). In a layer loop that runs as a loop,
    the backward's iteration reads its residuals as slices of their stacks: one a matmul reads,
    or more than one op reads, is written out (a dynamic slice fuses into one elementwise
    consumer only), so one iteration's such slices are held besides the stacks, counted on the
    traced backward loop's body (:func:`backward_slices`; under ``model.remat`` the body also
    recomputes, and the residuals a matmul reads are counted instead: ``Residual.sliced``);
  - update: the gradients as the backward produces them (each parameter at its shard in the
    activation layout), plus a second, reduced copy of every gradient the devices must sum (a
    parameter not split over every mesh axis the batch is split on: data parallel's
    all-reduce) or re-place (``param_layout``: reduce-scattered to its own shard; XLA:CPU has
    no reduce-scatter and all-reduces the whole gradient before slicing it, so outside the
    layer loop the copy there is the compute shard), plus with microbatches the float32
    running sum; when the gradients are not needed together (see ``grads``), the largest
    gradient alone, plus the running sum, plus what one leaf's update holds beyond its gradient
    and its state (:func:`_update_copies`, traced from the optimizer's own update at one leaf's
    shape: each function of the gradient alone that both the update and the gradient-norm metric
    compute, AdamW's square of the gradient, which XLA computes once and writes out for the
    reduction and the update's fusion to read; the largest leaf's). Held together, the reduced
    copies free the unreduced gradients' room before the updates run, and nothing is added.

  With microbatches the backward phase also holds the batch's microbatch-major copy (the
  accumulation loop's input: splitting rows i, i + k, … into microbatch i is a transpose, which
  XLA writes out, at the shard the model places the batch in), and both the backward and the update phase also hold every gathered copy of
  the parameters outside the layer loop (above). The backward phase also holds, with
  microbatches: the loop body's slice of its microbatch of each batch leaf the backward reads
  (a residual that is the batch: a matmul reads it, so the dynamic slice is written out); every
  cast of a parameter to a wider dtype (a bfloat16 parameter computed in float32) that is not
  a residual, every layer's (it reads only arguments, so XLA hoists it out of the accumulation
  loop, at its compute shard, live through the loop); and under ``model.remat`` with the layer
  loop unrolled, every layer's gathered copy of its parameters (``param_layout``: the forward's
  gathers, hoisted out of the loop likewise) plus one layer's copies of those the backward reads
  (gathered again behind remat's barrier, in the backward's iteration). ``workspace`` = the largest phase −
  gradients − activations: negative where the residuals die before the last gradients are
  produced (grads + activations is then more than is ever live at once).
* ``inputs`` (exact) — this device's slice of the batch the step is given.
* ``queued_inputs`` (exact) — the other batches resident on the device, outside the step:
  ``feed.prefetch`` placed ahead, and one more under the lagged loop (a dispatched step's batch
  stays alive while the next is placed; see :mod:`meshpar.loop`).
* ``relay_inputs`` (routed only, exact) — the relay also holds the whole process batch it
  received and, while placing, every other slice cut from it
  (:func:`meshpar.plan.feed_time.relay_bytes`).

``Breakdown.total`` is the sum of the categories: params + optimizer + the inputs (exact) plus
the step's working set (grads + activations + workspace, the estimate).

**Host offload** (the ``offload`` section; what lives where: :func:`meshpar.plan.offload_plan.placement`)
moves bytes from these device categories to ``Breakdown.host``, per device, in pinned host memory:

* ``host["optimizer"]`` (exact) — with ``offload.optimizer``, every optimizer-state leaf's shard;
  the device keeps the step counter and the RNG key. The update brings the state to the device:
  the update phase holds, beyond what it held before, the state of the parameter whose state
  is largest (AdamW: two moments) — an estimate and a lower bound, for XLA fetching it leaf by
  leaf before each leaf's update (all at once needs all of it); a GPU's ``memory_stats()``
  peak in the device check settles it.
* ``host["params"]`` (exact), ``host["grads"]`` (estimate) — with ``offload.params``, every
  parameter's shard, and its gradient (the gradient of a host array is a host array: each
  layer's goes back in the backward pass). The device holds (estimates) one layer's slice of
  the stacked ``layers`` weights and its gradient, the weights outside the layers, the float32
  microbatch sum; under ``remat: none`` every layer's fetched weights, kept as residuals
  (``activations``); the update phase adds the largest parameter and its gradient (as above).
* ``host["activations"]`` (exact, given the names) — with ``offload.activations``, the values
  each layer tags with the offloaded names (:data:`meshpar.plan.offload_plan.OFFLOADED_NAMES`),
  one microbatch, every layer. Everything else in the layer is recomputed, so the device's
  ``activations`` (estimate) are what ``model.remat: full`` keeps (the layer inputs the loop
  carries: offloading a carry does nothing, so ``layer_in`` counts on both sides), and the
  backward phase holds one layer's recomputed and fetched residuals, as under remat.

Out of scope (:func:`out_of_scope` names the reason, and no figure stands for these): on
XLA:CPU, bfloat16 compute (it computes bfloat16 matmuls in float32 and keeps float32 copies of
their operands) and host offload (memory kinds are ignored inside the step); dropout (XLA keeps
the 32-bit random bits behind each mask); a sequence split (XLA's partitioner gathers keys and
values over ``length``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import aot, jaxprs, parts, trainer
from meshpar import layout as layout_lib
from meshpar.config import Config
from meshpar.models import MODELS
from meshpar.plan import cost, offload_plan, programs, shapes

CATEGORIES = ("params", "grads", "optimizer", "activations", "workspace", "inputs", "queued_inputs", "relay_inputs")
EXACT = frozenset({"params", "optimizer", "inputs", "queued_inputs", "relay_inputs"})
HOST_EXACT = frozenset({"params", "optimizer", "activations"})  # host offload's column (see above)

@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Per-device bytes on the most loaded device, by category (see the module docstring)."""

    categories: dict[str, int]  # in CATEGORIES order; relay_inputs only in routed feeding
    exact: frozenset[str]  # the categories computed exactly; the others are estimates
    # Per-device bytes in pinned host memory (host offload), by category; empty without offload.
    host: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        """Device bytes: the sum of the categories (host bytes are not in it)."""
        return sum(self.categories.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


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


def _nbytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


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
                    self.out.append(Residual(_nbytes(w.aval), loop.copies, label, loop=True, rolled=True,
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
                        self.out.append(Residual(_nbytes(body.invars[k].aval), self.copies * length, label, loop=True,
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
            self.out.append(Residual(_nbytes(key[1].aval), self.copies, label, loop=self.in_loop,
                                     at=self._place(g.producer[key][2])))

        for key in sorted(self.candidates, key=lambda k: g.producer[k][2]):
            if key in kept:
                continue
            eqn, args, _ = g.producer[key]
            if not jaxprs.is_cheap(eqn) or key in g.operands:
                keep(key)
                continue
            needed = set().union(*(sources(a, {}) for a in args))
            if sum(_nbytes(k[1].aval) for k in needed) > _nbytes(key[1].aval):
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
            total += _nbytes(key[1].aval) * src[1]
    return total + sum(_widening_casts(loop, nargs) for loop in level.loops.values())


def kept_residuals(fn, *args, read: set[int] | None = None, uses: dict | None = None, casts: list | None = None) -> list[Residual]:
    """The residuals of ``jax.vjp(fn, *args)`` that XLA keeps for the backward pass (see the
    module docstring); `args` are abstract. Residuals that are the arguments themselves are left
    out; `read` (when given) receives their indices among the flattened `args`. `uses` (when
    given) receives, for each flattened argument the forward reads, ``(place, cotangent, bytes)``:
    the place in program order (:attr:`Residual.at`) of the last op that reads it (where the
    backward produces its gradient), the bytes of that op's largest output (the cotangent it is
    differentiated with; None for a loop: one iteration's residuals') and the argument's bytes.
    `casts` (when given) receives the bytes of the casts of the first argument's leaves (the
    parameters) to a wider dtype that are not kept as residuals (:func:`_widening_casts`)."""
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
    if uses is not None:
        g = top.graph
        for eqn, ins, pos in g.producer.values():
            loop = jaxprs.is_scan(eqn)  # its cotangents are one iteration's: its residuals' (None here)
            cot = None if loop else max((_nbytes(v.aval) for v in eqn.outvars), default=0)
            for a in ins:
                k = g.canonical(a) if a is not None else None
                if k in g.inputs and not jaxprs.is_relabel(eqn) and pos >= uses.get(g.inputs[k], (-1,))[0]:
                    uses[g.inputs[k]] = (pos, cot, _nbytes(k[1].aval))
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
        most = max(most, sum(_nbytes(k[1].aval) for k, (n, mm) in reads.items() if mm or n > 1))
    return most


def saved_activations(
    cfg: Config, step: parts.AbstractStep, remat: str | None = None, read: set[int] | None = None,
    uses: dict | None = None, slices: list | None = None, casts: list | None = None,
) -> list[Residual]:
    """What one device keeps for the backward pass of one microbatch (:func:`kept_residuals` of
    the model's loss at per-device shapes, no layout active). `remat`: trace the model under this
    ``model.remat`` instead of the config's. `read` (when given) receives the indices of the
    parameter leaves the backward pass reads (residuals that are parameters); `uses`, where each
    leaf's gradient is produced (:func:`kept_residuals`; the parameters first, then the batch);
    `slices`, where the layer loop runs as a loop, what one backward iteration writes out of the
    residual stacks (:func:`backward_slices`); `casts`, the parameters' widening casts that are not
    residuals (:func:`kept_residuals`)."""
    state, batch, _ = step.args
    params = shapes.local_params(state.params, step.layout, step.mesh)
    graphdef = step.plan.graphdef
    offloads = getattr(getattr(cfg, "offload", None), "activations", "none") != "none"  # the step's own policy differs
    if remat is not None and (remat != getattr(cfg.model, "remat", remat) or offloads):
        spec = {k: (tuple(b.shape[1:]), b.dtype) for k, b in batch.items()}
        build = functools.partial(MODELS[cfg.model.name].build, dataclasses.replace(cfg.model, remat=remat), spec)
        graphdef, _ = trainer.abstract_model(build)

    def loss(params, batch):
        batch = jax.tree.map(jax.lax.stop_gradient, batch)  # the step differentiates the params only
        rngs = nnx.Rngs(dropout=jax.random.key(0))
        return nnx.merge(graphdef, params).loss(batch, rngs=rngs)[0]

    kept = kept_residuals(loss, params, shapes.device_batch(cfg, step), read=read, uses=uses, casts=casts)
    if slices is not None and any(r.rolled for r in kept):
        slices.append(backward_slices(loss, params, shapes.device_batch(cfg, step)))
    return kept


def out_of_scope(cfg: Config, platform: str) -> str | None:
    """Why the model gives no figure for `cfg` compiled for `platform` (``jax.default_backend()``
    names: ``cpu``, ``gpu``, ``tpu``), in one line; None when the config is in its scope."""
    model = cfg.model
    if platform == "cpu" and getattr(model, "compute_dtype", "float32") == "bfloat16":
        return "bfloat16 compute on XLA:CPU (it computes bfloat16 matmuls in float32 and keeps float32 copies)"
    if getattr(model, "dropout", 0.0) > 0.0:
        return "dropout (XLA keeps the 32-bit random bits behind each mask)"
    axes = {name for name, size in cfg.mesh if size != 1}
    if any(dim == "length" for dim, _ in layout_lib.on_mesh(cfg.layout, axes)):
        # XLA's partitioner gathers keys and values over the split and reshards the dense
        # projections' batch·length rows: the per-device program is not one device's slice
        return "a sequence split (layout puts length on a mesh axis: XLA gathers attention's keys and values)"
    offload = getattr(cfg, "offload", None)
    moved = any(getattr(offload, k, False) for k in ("optimizer", "params"))
    if platform == "cpu" and (moved or getattr(offload, "activations", "none") != "none"):
        return "host offload on XLA:CPU (it ignores memory kinds inside the step: nothing moves to or from the host)"
    return None


def _loop_iteration(residuals: list[Residual]) -> int:
    """Bytes of one iteration of the layer loop: the per-iteration residuals of the largest loop
    (a stack of one layer is a loop of one iteration: its residuals are that iteration's)."""
    loops: dict[int, int] = {}
    for r in residuals:
        if r.loop:
            loops[r.copies] = loops.get(r.copies, 0) + r.nbytes
    return max(loops.values(), default=0)


def _backward_walk(kept: list[Residual], uses: dict, nparams: int, together: int | None, apply: dict) -> int:
    """The most the backward pass holds of residuals, cotangents and gradients at once, walking
    the forward's program order in reverse (see the module docstring): at each kept residual the
    residuals made up to there and its cotangent; at each parameter's last use (where its
    gradient is produced) the residuals made before it and that op's cotangent. `together`:
    the gradients' bytes when they are all held to the end (each held from its production on,
    in proportion to its traced bytes), None when each is applied as it is produced (then
    `apply`: parameter leaf -> what applying its gradient holds, the gradient included)."""
    made: dict[int, int] = {}  # place -> bytes of the residuals made there
    cots: dict[int, int] = {}
    for r in kept:
        made[r.at] = made.get(r.at, 0) + r.total
        cots[r.at] = max(cots.get(r.at, 0), r.nbytes)
    grads = {i: u for i, u in uses.items() if i < nparams}
    scale = together / max(sum(u[2] for u in grads.values()), 1) if together is not None else 0.0
    places = sorted(set(made) | {u[0] for u in grads.values()}, reverse=True)
    before = sum(made.values())  # residuals made before the place being walked
    produced, peak = 0, together or 0
    for p in places:
        here = made.get(p, 0)
        before -= here
        born = [i for i, u in grads.items() if u[0] == p]
        produced += sum(grads[i][2] for i in born)
        held = produced * scale
        if here:  # its residuals read: their cotangent live, and every residual made before
            peak = max(peak, before + here + cots[p] + held)
        for i in born:  # the gradient produced: the op's cotangent (a loop's: its largest residual's, its stacks live)
            _, cot, own = grads[i]
            live = before + (here if cot is None else 0) + (cots.get(p, 0) if cot is None else cot)
            peak = max(peak, live + (held if together is not None else apply.get(i, own)))
    return int(peak)


def _unary_of_first(fn, *avals) -> set:
    """The elementwise ops `fn` applies to its first argument alone (a square in either spelling
    is one op: XLA lowers both to the same multiply)."""
    jaxpr = jax.make_jaxpr(fn)(*avals).jaxpr
    g, found = jaxpr.invars[0], set()
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not jaxprs.is_literal(v)]
        if not jaxprs.is_cheap(eqn) and jaxprs.op(eqn) not in ("sqrt", "exp", "log", "abs") or ins != [g] * len(ins) or not ins:
            continue
        name, y = jaxprs.op(eqn), eqn.params.get("y")
        if name == "square" or (name == "integer_pow" and y == 2) or (name == "mul" and len(ins) == 2):
            found.add("square")
        elif not (name == "integer_pow" and y == 1):
            found.add((name, str(sorted(eqn.params.items()))))
    return found


@functools.cache
def _update_copies(tx, shape: tuple, dtype) -> int:
    """Leaf-sized values one leaf's update holds beyond its gradient and its state: each function
    of the gradient alone that both the optimizer's update and the gradient-norm metric compute
    (AdamW's square of the gradient): XLA computes it once, and a reduction and the update's
    fusion both read it, so it is written out. Traced at one leaf's shape."""
    import optax

    leaf = jax.ShapeDtypeStruct(shape, dtype)
    state = jax.eval_shape(tx.init, leaf)
    update = _unary_of_first(lambda g, p, s: optax.apply_updates(p, tx.update(g, s, p)[0]), leaf, leaf, state)
    return len(update & _unary_of_first(optax.tree.norm, leaf))


def _update_extra(cfg: Config, step: parts.AbstractStep, uses: dict) -> dict:
    """Parameter leaf -> the bytes its update holds beyond its gradient (:func:`_update_copies`),
    at the shape the backward produces the gradient in."""
    tx = step.tx or trainer.make_optimizer(cfg.optimizer, max(cfg.train.steps, 1))  # the schedule does not matter here
    leaves = jax.tree.leaves(shapes.local_params(step.args[0].params, step.layout, step.mesh))
    return {i: _update_copies(tx, tuple(a.shape), a.dtype) * _nbytes(a) for i, a in enumerate(leaves)}


def _update_phase(cfg: Config, step: parts.AbstractStep) -> int:
    """Bytes the update phase holds beyond the state (see the module docstring): every gradient
    at its activation-layout shard, and a reduced copy where the devices must sum or re-place it."""
    plan, (_, batch, _) = step.plan, step.args
    batch_axes = set()
    for b in batch.values():
        batch_axes |= set(jax.tree.leaves(tuple(b.sharding.spec)[:1]))
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    total = 0
    for var, act, own in zip(variables, shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                             jax.tree.leaves(plan.shardings.params)):  # fmt: skip
        a, dims = var.get_value(), var.get_metadata().get("dims") or ()
        computed = math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize
        placed = math.prod(own.shard_shape(a.shape)) * a.dtype.itemsize
        summed = not batch_axes <= set(jax.tree.leaves(tuple(act.spec)))
        if own.spec != act.spec and _cpu(step) and computed > placed and not (dims and dims[0] == "layers"):
            placed = computed  # XLA:CPU has no reduce-scatter: it all-reduces the whole gradient, then slices
        total += computed + (placed if summed or own.spec != act.spec else 0)
    return total


def _cpu(step: parts.AbstractStep) -> bool:
    return step.mesh.devices.flat[0].platform == "cpu"


@dataclasses.dataclass(frozen=True)
class Gathers:
    """What gathering the parameters that ``param_layout`` stores split but compute uses whole
    costs one device, in bytes (see the module docstring)."""

    kept: int  # the gathered copies the backward reads, held for it (a residual, or re-gathered under remat)
    copies: int  # every pass's copies of the parameters outside the layer loop
    rest: int  # those of `copies` not in `kept`
    relayout: int  # the largest one gathered along a later dim, once more (its transposed layout)
    grads: int  # the backward's gradients beyond their stored shards (outside the layer loop)
    # a layer loop that runs as a loop: its stacked parameters' transposed-layout copy (hoisted out
    # of the loops: every layer at its stored shard), and under remat one layer's gathered copies
    loop: int = 0
    # a layer loop unrolled, under remat: every layer's forward copy (it reads only arguments) and
    # one layer's copies the backward gathers again (behind remat's barrier, in its iteration)
    layers: int = 0


def _gathers(cfg: Config, step: parts.AbstractStep, read: set[int], rolled: bool = False) -> Gathers:
    """The gathered copies of the parameters stored smaller than compute uses them (``param_layout``),
    from their shardings; `read`: the parameter leaves the backward reads (:func:`saved_activations`);
    `rolled`: the layer loop runs as a loop."""
    plan = step.plan
    remat = getattr(cfg.model, "remat", "none") != "none"
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    kept = forward = again = relayout = grads = outside = loop = layers = 0
    for i, (var, act, own) in enumerate(zip(variables, shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                                            jax.tree.leaves(plan.shardings.params))):  # fmt: skip
        a, dims = var.get_value(), var.get_metadata().get("dims") or ()
        used, stored = (math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for s in (act, own))
        if used <= stored:
            continue  # not gathered
        if dims and dims[0] == "layers":  # gathered one layer at a time inside the layer loop
            kept += used if i in read and not remat else 0  # each layer's copy a residual
            if rolled:  # gathered along a dim after `layers`: the whole stack relaid out once, then per layer
                loop += stored + (used // a.shape[0] if remat else 0)
            elif remat:
                layers += used + (used // a.shape[0] if i in read else 0)
            continue
        forward += used
        grads += used - stored
        if i in read:
            kept, outside = kept + used, outside + used
            again += used if remat else 0  # the recomputed forward gathers it again
        # gathered along a dim after the leading one: XLA gathers it in a transposed layout, then copies it back
        shard = own.shard_shape(a.shape)
        lead = next((d for d, n in enumerate(a.shape) if n > 1), 0)
        if any(s != n for d, (s, n) in enumerate(zip(shard, act.shard_shape(a.shape))) if d > lead):
            relayout = max(relayout, used)
    return Gathers(kept=kept, copies=forward + again, rest=forward + again - outside, relayout=relayout, grads=grads, loop=loop, layers=layers)


def _gradients_together(cfg: Config, step: parts.AbstractStep) -> int | None:
    """None when something needs every gradient at once: clipping by their global norm, or a sum
    over devices (XLA combines the gradients' all-reduces into one) or a re-placement
    (``param_layout``'s reduce-scatter); else the largest gradient (at its activation-layout
    shard), the most the update holds: it updates each parameter from its own gradient as the
    backward produces it, in the donated state's buffers, and the gradient dies there."""
    plan, (_, batch, _) = step.plan, step.args
    if getattr(cfg.optimizer, "grad_clip_norm", 0.0) > 0:
        return None
    batch_axes = set()
    for b in batch.values():
        batch_axes |= set(jax.tree.leaves(tuple(b.sharding.spec)[:1]))
    largest = 0
    for a, act, own in zip(jax.tree.leaves(plan.abstract.params), shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                           jax.tree.leaves(plan.shardings.params)):  # fmt: skip
        if not batch_axes <= set(jax.tree.leaves(tuple(act.spec))) or own.spec != act.spec:
            return None
        largest = max(largest, math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize)
    return largest


def analytic(cfg: Config, step: parts.AbstractStep | None = None) -> Breakdown:
    """The config's per-device memory by category (nothing allocated, nothing compiled)."""
    step = step or parts.abstract_step(cfg)
    plan, (_, batch, _) = step.plan, step.args
    params = aot.shard_bytes(plan.abstract.params, plan.shardings.params)
    running_sum = 0
    if cfg.train.microbatches > 1:  # the float32 running sum, in the parameters' shardings
        f32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), plan.abstract.params)
        running_sum = aot.shard_bytes(f32, plan.shardings.params)
    grads = params + running_sum
    rest = (plan.abstract.opt_state, plan.abstract.step, plan.abstract.rng)
    optimizer = aot.shard_bytes(rest, (plan.shardings.opt_state, plan.shardings.step, plan.shardings.rng))
    place, host, fetched = offload_plan.placement(cfg, plan), {}, 0
    exact = EXACT
    if place.optimizer:  # the state lives on the host; the update fetches it (module docstring)
        host["optimizer"] = aot.shard_bytes(plan.abstract.opt_state, plan.shardings.opt_state)
        optimizer -= host["optimizer"]
        fetched += offload_plan.largest_moments(plan)
    if place.params:  # one layer's weights (and its gradient) on the device at a time
        w = offload_plan.weights(plan, step.layout, step.mesh)
        host["params"], host["grads"] = params, params
        grads, params = running_sum + w.layer, w.layer + w.other
        fetched += 2 * offload_plan.largest_param(plan)  # a parameter and its gradient
        exact = exact - {"params"}
    remat = getattr(cfg.model, "remat", "none")
    if place.activations != "none":  # the named residuals on the host, the rest recomputed
        prof, remat = offload_plan.profile(cfg, step), "full"
        host["activations"] = prof.named_bytes(offload_plan.OFFLOADED_NAMES[place.activations]) * prof.layers
    read: set[int] = set()  # the parameters the backward reads
    uses: dict = {}  # where the backward produces each gradient
    slices: list[int] = []  # a layer loop run as a loop: one backward iteration's slices of the stacks
    casts: list[int] = []  # the parameters' widening casts that are not residuals
    kept = saved_activations(cfg, step, remat if place.activations != "none" else None, read=read, uses=uses,
                             slices=slices if remat == "none" else None, casts=casts)
    gathered = _gathers(cfg, step, read, any(r.rolled for r in kept))  # param_layout: stored split, used whole
    activations = sum(r.total for r in kept) + gathered.kept
    if place.params and remat == "none":  # every layer's fetched weights kept for the backward
        activations += (offload_plan.profile(cfg, step).layers - 1) * w.layer_compute
    transient = _loop_iteration([r for r in kept if r.sliced])  # one iteration's slices a matmul reads
    if slices and remat == "none":  # nothing recomputed: one backward iteration's slices of the stacks, traced
        transient = slices[0]
    if remat != "none":  # one layer's recomputed residuals, live during its backward
        transient += max(_loop_iteration(saved_activations(cfg, step, "none")) - _loop_iteration(kept), 0)
    one_at_a_time = None if place.params else _gradients_together(cfg, step)
    if one_at_a_time is None:
        update = _update_phase(cfg, step) + running_sum + fetched
    else:  # each gradient applied as it is produced: one at a time (and the running sum)
        grads = running_sum + one_at_a_time
        update = grads + fetched
    extra = _update_extra(cfg, step, uses)  # what each leaf's update holds beyond its gradient
    if cfg.train.microbatches == 1:  # applied where the backward produces it, else after the accumulation
        apply = {i: u[2] + extra.get(i, 0) for i, u in uses.items()}
    else:
        apply = {}
    if one_at_a_time is not None:  # held together, the reduced copies' room is freed before the updates run
        update += max(extra.values(), default=0)
    together = None if one_at_a_time is not None else grads - running_sum + gathered.grads
    walk = _backward_walk(kept, uses, len(jax.tree.leaves(plan.abstract.params)), together, apply)
    backward = walk + activations - sum(r.total for r in kept) + running_sum + transient + gathered.loop
    if cfg.train.microbatches > 1:  # the batch in microbatch-major order: a transposed copy, the loop's input
        backward += cfg.train.microbatches * sum(_nbytes(b) for b in jax.tree.leaves(shapes.device_batch(cfg, step)))
    if cfg.train.microbatches > 1:  # the gathers and casts leave the accumulation loop: every copy held through it
        backward += gathered.rest + gathered.layers + sum(casts)
        update += gathered.copies
        nparams = len(jax.tree.leaves(plan.abstract.params))  # the body's own microbatch of what the backward reads
        backward += sum(_nbytes(b) for j, b in enumerate(jax.tree.leaves(shapes.device_batch(cfg, step))) if nparams + j in read)
    one_batch = aot.shard_bytes(batch)
    categories = {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "workspace": max(backward, update, gathered.copies + gathered.relayout) - grads - activations,
        "inputs": one_batch, "queued_inputs": one_batch * cost.resident_batches(cfg),
    }  # fmt: skip
    if cfg.feed.mode == "routed":
        categories["relay_inputs"] = programs.relay_bytes(cfg, batch)
    return Breakdown(categories, exact, host)

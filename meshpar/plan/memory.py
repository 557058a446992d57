"""Analytic per-device memory of a config's training run, by category, before anything exists.

Everything comes from the real abstract train state (``eval_shape``), its shardings and the
model's own code traced at per-device shapes; nothing is kept by hand for one model, and no
factor is fitted to a measurement. Per device (the most loaded one: the relay device in routed
feeding), in bytes:

* ``params`` (exact) — every parameter's shard under the layout with ``param_layout`` on top.
* ``grads`` (estimate) — one gradient per parameter, in the parameter dtype, placed like the
  parameter; with ``train.microbatches`` > 1 also the float32 running sum the accumulation keeps
  in the parameters' shardings.
* ``optimizer`` (exact) — every optimizer-state leaf's shard (moments placed like their
  parameters, counts and scalars whole), plus the step counter and the RNG key.
* ``activations`` (estimate) — the residuals of one microbatch that XLA keeps for the backward
  pass (:func:`saved_activations`). They are JAX's own residuals of the model's loss under the
  ``model.remat`` policy in use (``jax.vjp``'s forward jaxpr), traced at one device's shapes
  (every parameter at its shard in the activation layout, the batch at its per-device rows
  divided by ``train.microbatches``), each stacked over the layer loop it comes from, filtered
  by what XLA must hold in memory (checked against XLA:CPU's buffer assignment):

  - a residual behind a relabelling op (reshape, squeeze, ``checkpoint_name``) is its operand,
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
    it leaves the body stacked, beyond fusion's reach.

  Residuals that are the arguments (parameters, batch) are counted in their own categories.
  Each is labelled by the ``checkpoint_name`` tag the model gave it, where it has one.
* ``workspace`` (estimate) — what the step's peak holds beyond gradients and activations. The
  step's working set is the larger of two phases, not a sum of categories:

  - backward: activations + gradients + the cotangent of the largest kept residual (a
    cotangent has its value's shape; it exists while the op that saved the residual is
    differentiated), and under ``model.remat`` one layer's recomputed residuals (what
    ``remat: none`` keeps per layer-loop iteration less what the policy keeps per iteration);
  - update: the gradients as the backward produces them (each parameter at its shard in the
    activation layout), plus a second, reduced copy of every gradient the devices must sum (a
    parameter not split over every mesh axis the batch is split on: data parallel's
    all-reduce) or re-place (``param_layout``: reduce-scattered to its own shard), plus with
    microbatches the float32 running sum.

  ``workspace`` = the larger phase − gradients − activations (never negative: the backward
  phase holds both).
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

Not modelled, so the estimate runs low there: XLA:CPU computes bfloat16 matmuls in float32 and
keeps float32 copies of their operands; with dropout it keeps the 32-bit random bits behind
each mask; around a loop that runs as a loop, its temp allocation exceeds the largest set of
buffers live at once (packing long-lived stacks beside short-lived temporaries).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Literal

from meshpar import aot, trainer
from meshpar import layout as layout_lib
from meshpar.config import Config
from meshpar.models import MODELS
from meshpar.plan import offload_plan, programs

CATEGORIES = ("params", "grads", "optimizer", "activations", "workspace", "inputs", "queued_inputs", "relay_inputs")
EXACT = frozenset({"params", "optimizer", "inputs", "queued_inputs", "relay_inputs"})
HOST_EXACT = frozenset({"params", "optimizer", "activations"})  # host offload's column (see above)

# Primitives that only relabel their operand's bytes (bitcasts in XLA): a residual behind one is its operand.
_BITCAST = frozenset({
    "reshape", "squeeze", "expand_dims", "name", "reduce_precision", "sharding_constraint", "copy", "copy_p",
    "pvary", "mesh_cast",
})  # fmt: skip
# Cheap elementwise and data-movement primitives: XLA fuses them into their consumers and
# recomputes them there from their operands rather than keeping their outputs.
_CHEAP = frozenset({
    "add", "add_any", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "select_n", "clamp", "square",
    "integer_pow", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor", "floor", "ceil", "round",
    "is_finite", "rem", "nextafter", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "convert_element_type", "iota", "broadcast_in_dim", "transpose", "slice", "split", "concatenate", "pad", "rev",
    "stop_gradient", "random_wrap", "random_unwrap", "random_seed", "one_minus_square",
})  # fmt: skip
# Ops that read their operands from memory: an operand is written out before they run.
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
# Call-like primitives and the parameter holding their body, inlined when it maps inputs and outputs one to one.
_CALLS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
}  # fmt: skip


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

    @property
    def total(self) -> int:
        return self.nbytes * self.copies


def _nbytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


def _act_shardings(params: nnx.State, layout: layout_lib.Layout, mesh) -> list:
    """Every parameter's sharding in the activation `layout` (where compute uses it), in leaf order."""
    out = []
    for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        dims = v.get_metadata().get("dims")
        out.append(layout.sharding(mesh, (None,) * v.get_value().ndim if dims is None else dims))
    return out


def _local_params(params: nnx.State, layout: layout_lib.Layout, mesh) -> nnx.State:
    """Every parameter at its shard shape in the activation `layout` (where compute uses it)."""

    def one(v):
        dims = v.get_metadata().get("dims")
        a = v.get_value()
        shape = a.shape if dims is None else layout.sharding(mesh, dims).shard_shape(a.shape)
        return v.replace(jax.ShapeDtypeStruct(shape, a.dtype))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _body(eqn):
    """The jaxpr inside a call-like equation, when it maps the call's inputs and outputs one to one."""
    param = _CALLS.get(eqn.primitive.name)
    inner = eqn.params.get(param) if param else None
    inner = getattr(inner, "jaxpr", inner)
    if inner is not None and len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
        return inner
    return None


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
            if eqn.primitive.name in _MATMULS:
                self.operands.update(self.canonical(a) for a in args if a is not None)
            elif eqn.primitive.name == "mul" and None not in args:
                for a, other in ((args[0], args[1]), (args[1], args[0])):
                    if self._leading_broadcast(a):
                        self.operands.add(self.canonical(other))

    def _leading_broadcast(self, key) -> bool:
        """`key` is a value broadcast along leading dims only (a per-feature scale over batch rows):
        the gradient of what was broadcast is a reduction over those dims of the cotangent times
        the product's other operand, and XLA:CPU fuses reductions over the minor dim only, so
        that operand is read from memory."""
        key = self.canonical(key)
        if key not in self.producer or self.producer[key][0].primitive.name != "broadcast_in_dim":
            return False
        eqn, args, _ = self.producer[key]
        out, dims = eqn.outvars[0].aval.shape, eqn.params["broadcast_dimensions"]
        src = eqn.invars[0].aval.shape
        grown = [d for d in range(len(out)) if d not in dims or (src[dims.index(d)] == 1 and out[d] > 1)]
        return bool(grown) and len(out) - 1 not in grown

    def _inline(self, jaxpr, inst: int) -> None:
        for eqn in jaxpr.eqns:
            args = [None if isinstance(v, Literal) else self.resolve((inst, v)) for v in eqn.invars]
            body = _body(eqn)
            if body is not None:
                self._instances += 1
                sub = self._instances
                self.alias.update({(sub, v): a for v, a in zip(body.invars, args) if a is not None})
                self._inline(body, sub)
                for v, w in zip(eqn.outvars, body.outvars):
                    if not isinstance(w, Literal):
                        self.alias[(inst, v)] = self.resolve((sub, w))
                continue
            for v in eqn.outvars:
                self.producer[(inst, v)] = (eqn, args, len(self.producer))
            if eqn.primitive.name == "name" and args[0] is not None:
                self.tags[self.canonical(args[0])] = eqn.params["name"]

    def resolve(self, key):
        while key in self.alias:
            key = self.alias[key]
        return key

    def canonical(self, key):
        """`key` with relabelling producers (:data:`_BITCAST`) looked through."""
        key = self.resolve(key)
        while key in self.producer and self.producer[key][0].primitive.name in _BITCAST:
            operand = self.producer[key][1][0]
            if operand is None:
                break
            key = self.resolve(operand)
        return key


def _scan_parts(eqn) -> tuple:
    """A scan equation's body jaxpr, number of constants and number of carried values."""
    p = eqn.params
    body = getattr(p["jaxpr"], "jaxpr", p["jaxpr"])
    if "num_consts" in p:  # jax 0.10
        return body, p["num_consts"], p["num_carry"]
    consts, carry, _ = (list(g) for g in p["ft_in"].update(list(range(len(eqn.invars)))).unpack())  # jax 0.12
    return body, len(consts), len(carry)


def _rolled(eqn) -> bool:
    """The scan runs as a loop (not unrolled into straight-line code): what it hands to the
    backward pass leaves the loop body as stacked outputs, which fusion cannot reach into."""
    unroll, length = eqn.params.get("unroll", 1), eqn.params["length"]
    return unroll is not True and int(unroll) < length


class _Level:
    """The residuals one jaxpr (the step's forward, or a loop body) hands to the backward pass,
    and which of them XLA keeps (see the module docstring for the rule)."""

    def __init__(self, jaxpr, copies: int, on_input, out: list[Residual]):
        self.graph, self.copies, self.on_input, self.out = _Graph(jaxpr), copies, on_input, out
        self.candidates: set = set()
        self.loops: dict[int, _Level] = {}  # a scan equation's id -> its body's level

    def add(self, key) -> None:
        """`key` is a residual: a candidate here, or handed to the loop body or the caller it comes from."""
        g = self.graph
        key = g.canonical(key)
        if key in g.inputs:
            self.on_input(g.inputs[key])
            return
        if key not in g.producer:  # a constant of the program
            return
        eqn, args, _ = g.producer[key]
        if eqn.primitive.name == "scan":
            i = next(n for n, v in enumerate(eqn.outvars) if v is key[1])
            body, _, carry = _scan_parts(eqn)
            if i >= carry:  # a per-iteration value, stacked over the loop
                loop = self._loop(eqn, args)
                if _rolled(eqn):  # a loop output: XLA writes every one into its stack
                    w = body.outvars[i]
                    tag = loop.graph.tags.get(loop.graph.canonical((0, w)))
                    label = f"'{tag}'" if tag else "loop output"
                    self.out.append(Residual(_nbytes(w.aval), loop.copies, label))
                else:  # unrolled: straight-line code, fused like any other
                    loop.add((0, body.outvars[i]))
                return
        self.candidates.add(key)

    def _loop(self, eqn, args) -> _Level:
        if id(eqn) not in self.loops:
            (body, consts, carry), length = _scan_parts(eqn), eqn.params["length"]
            carried: set[int] = set()

            def on_input(k: int) -> None:
                if consts <= k < consts + carry:  # the carry: one value per iteration, stacked
                    if k not in carried:
                        carried.add(k)
                        tag = self.loops[id(eqn)].graph.tags.get((0, body.invars[k]))
                        label = f"'{tag}'" if tag else "loop carry"
                        self.out.append(Residual(_nbytes(body.invars[k].aval), self.copies * length, label))
                elif args[k] is not None:  # a constant or a stacked input: the caller's value
                    self.add(args[k])

            self.loops[id(eqn)] = _Level(body, self.copies * length, on_input, self.out)
        return self.loops[id(eqn)]

    def finish(self) -> None:
        """Decide, in program order, which candidates XLA keeps; loop bodies first."""
        for loop in self.loops.values():
            loop.finish()
        g, kept = self.graph, set()

        def sources(key, seen: dict) -> set:
            """The values, neither kept nor inputs, that cheap ops recompute `key` from."""
            if key is None:
                return set()
            key = g.canonical(key)
            if key in g.inputs or key in kept or key not in g.producer:
                return set()
            if key not in seen:
                eqn, args, _ = g.producer[key]
                seen[key] = set().union(*(sources(a, seen) for a in args)) if eqn.primitive.name in _CHEAP else {key}
            return seen[key]

        def keep(key) -> None:
            kept.add(key)
            label = f"'{g.tags[key]}'" if key in g.tags else g.producer[key][0].primitive.name
            self.out.append(Residual(_nbytes(key[1].aval), self.copies, label))

        for key in sorted(self.candidates, key=lambda k: g.producer[k][2]):
            if key in kept:
                continue
            eqn, args, _ = g.producer[key]
            if eqn.primitive.name not in _CHEAP or key in g.operands:
                keep(key)
                continue
            needed = set().union(*(sources(a, {}) for a in args))
            if sum(_nbytes(k[1].aval) for k in needed) > _nbytes(key[1].aval):
                keep(key)  # cheaper to keep than what it is made from
            else:  # fused into the backward and recomputed there, from `needed` (kept once)
                for k in sorted(needed, key=lambda k: g.producer[k][2]):
                    keep(k)


def kept_residuals(fn, *args) -> list[Residual]:
    """The residuals of ``jax.vjp(fn, *args)`` that XLA keeps for the backward pass (see the
    module docstring); `args` are abstract. Residuals that are the arguments themselves are left out."""
    leaves, tree = jax.tree.flatten(args)
    closed, shapes = jax.make_jaxpr(
        lambda *xs: jax.vjp(lambda *ys: fn(*jax.tree.unflatten(tree, ys)), *xs), return_shape=True
    )(*leaves)
    jaxpr = closed.jaxpr
    n = len(jax.tree.leaves(shapes[1]))  # the vjp function's leaves: the residuals, last
    out: list[Residual] = []
    top = _Level(jaxpr, 1, lambda k: None, out)  # an argument: counted in its own category
    for v in jaxpr.outvars[len(jaxpr.outvars) - n :]:
        if not isinstance(v, Literal):
            top.add((0, v))
    top.finish()
    return out


def _local_batch(cfg: Config, batch: dict) -> dict:
    """One device's rows of one microbatch of `batch`."""
    local = {}
    for name, b in batch.items():
        rows, *rest = b.sharding.shard_shape(b.shape)
        local[name] = jax.ShapeDtypeStruct((max(rows // cfg.train.microbatches, 1), *rest), b.dtype)
    return local


def saved_activations(cfg: Config, step: aot.AbstractStep, remat: str | None = None) -> list[Residual]:
    """What one device keeps for the backward pass of one microbatch (:func:`kept_residuals` of
    the model's loss at per-device shapes, no layout active). `remat`: trace the model under this
    ``model.remat`` instead of the config's."""
    state, batch, _ = step.args
    params = _local_params(state.params, step.layout, step.mesh)
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

    try:
        return kept_residuals(loss, params, _local_batch(cfg, batch))
    except TypeError:
        # A layout that splits a dim the data brings in (the MLP's `pixels`, split the way Mesh
        # TensorFlow's mnist splits its images) has no per-device trace: the model meets that dim
        # whole, from the batch, before it constrains it, against parameters already split along
        # it (a shape mismatch). Traced with whole parameters instead: the activations the
        # layout splits along the model's dims are then over-estimated, never missed.
        return kept_residuals(loss, state.params, _local_batch(cfg, batch))


def _loop_iteration(residuals: list[Residual]) -> int:
    """Bytes of one iteration of the layer loop: the per-iteration residuals of the largest loop."""
    loops: dict[int, int] = {}
    for r in residuals:
        if r.copies > 1:
            loops[r.copies] = loops.get(r.copies, 0) + r.nbytes
    return max(loops.values(), default=0)


def _update_phase(cfg: Config, step: aot.AbstractStep) -> int:
    """Bytes the update phase holds beyond the state (see the module docstring): every gradient
    at its activation-layout shard, and a reduced copy where the devices must sum or re-place it."""
    plan, (_, batch, _) = step.plan, step.args
    batch_axes = set()
    for b in batch.values():
        batch_axes |= set(jax.tree.leaves(tuple(b.sharding.spec)[:1]))
    leaves = jax.tree.leaves(plan.abstract.params)
    total = 0
    for a, act, own in zip(leaves, _act_shardings(plan.abstract.params, step.layout, step.mesh),
                           jax.tree.leaves(plan.shardings.params)):  # fmt: skip
        computed = math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize
        placed = math.prod(own.shard_shape(a.shape)) * a.dtype.itemsize
        summed = not batch_axes <= set(jax.tree.leaves(tuple(act.spec)))
        total += computed + (placed if summed or own.spec != act.spec else 0)
    return total


def analytic(cfg: Config, step: aot.AbstractStep | None = None) -> Breakdown:
    """The config's per-device memory by category (nothing allocated, nothing compiled)."""
    step = step or aot.abstract_step(cfg)
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
    kept = saved_activations(cfg, step, remat if place.activations != "none" else None)
    activations = sum(r.total for r in kept)
    if place.params and remat == "none":  # every layer's fetched weights kept for the backward
        activations += (offload_plan.profile(cfg, step).layers - 1) * w.layer_compute
    transient = max((r.nbytes for r in kept), default=0)  # the largest residual's cotangent
    if remat != "none":  # one layer's recomputed residuals, live during its backward
        transient += max(_loop_iteration(saved_activations(cfg, step, "none")) - _loop_iteration(kept), 0)
    backward = activations + grads + transient
    update = _update_phase(cfg, step) + running_sum + fetched
    one_batch = aot.shard_bytes(batch)
    lagged = 0 if cfg.train.sync_every_step else 1
    categories = {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "workspace": max(backward, update) - grads - activations,
        "inputs": one_batch, "queued_inputs": one_batch * (cfg.feed.prefetch + lagged),
    }  # fmt: skip
    if cfg.feed.mode == "routed":
        categories["relay_inputs"] = programs.relay_bytes(cfg, batch)
    return Breakdown(categories, exact, host)

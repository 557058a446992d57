"""The gradients in the memory model: where the backward leaves each one, how the devices reduce
it, and what the update holds beside it.

The rules (checked against XLA's buffer assignment on XLA:CPU and XLA:GPU) are stated in
:mod:`meshpar.plan.memory.analytic`'s docstring; this module computes them from the train state, its
shardings and the traced step (:func:`meshpar.plan.memory.residuals.kept_residuals`'s ``uses``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import jaxprs
from meshpar.plan import shapes
from meshpar.plan.memory import residuals
from meshpar.step import parts, trainer


def _unary_of_first(fn, *avals) -> set:
    """The elementwise ops `fn` applies to its first argument alone (a square in either spelling
    is one op: XLA lowers both to the same multiply)."""
    jaxpr = jax.make_jaxpr(fn)(*avals).jaxpr
    g, found = jaxpr.invars[0], set()
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not jaxprs.is_literal(v)]
        if (
            not jaxprs.is_cheap(eqn)
            and jaxprs.op(eqn) not in ("sqrt", "exp", "log", "abs")
            or ins != [g] * len(ins)
            or not ins
        ):
            continue
        name, y = jaxprs.op(eqn), eqn.params.get("y")
        if name == "square" or (name == "integer_pow" and y == 2) or (name == "mul" and len(ins) == 2):
            found.add("square")
        elif not (name == "integer_pow" and y == 1):
            found.add((name, str(sorted(eqn.params.items()))))
    return found


@functools.cache
def update_copies(tx, shape: tuple, dtype) -> int:
    """Leaf-sized values one leaf's update holds beyond its gradient and its state: each function
    of the gradient alone that both the optimizer's update and the gradient-norm metric compute
    (AdamW's square of the gradient): XLA computes it once, and a reduction and the update's
    fusion both read it, so it is written out. Traced at one leaf's shape."""
    import optax

    leaf = jax.ShapeDtypeStruct(shape, dtype)
    state = jax.eval_shape(tx.init, leaf)
    update = _unary_of_first(lambda g, p, s: optax.apply_updates(p, tx.update(g, s, p)[0]), leaf, leaf, state)
    return len(update & _unary_of_first(optax.tree.norm, leaf))


def update_extra(step: parts.AbstractStep, uses: dict) -> dict:
    """Parameter leaf -> the bytes its update holds beyond its gradient (:func:`update_copies`),
    at the shape the backward produces the gradient in."""
    cfg = step.cfg
    tx = step.tx or trainer.make_optimizer(cfg.optimizer, max(cfg.train.steps, 1))  # the schedule does not matter here
    leaves = jax.tree.leaves(shapes.local_params(step.args[0].params, step.layout, step.mesh))
    return {i: update_copies(tx, tuple(a.shape), a.dtype) * residuals.nbytes(a) for i, a in enumerate(leaves)}


# XLA's default for how large the gradients' all-reduces combined into one may grow (its
# AllReduceCombiner; XLA:GPU's ``xla_gpu_all_reduce_combine_threshold_bytes``): a gradient this
# large is all-reduced alone
COMBINE_THRESHOLD = 30 * 1024 * 1024 + 7


def stacked(var) -> bool:
    dims = var.get_metadata().get("dims") or ()
    return bool(dims) and dims[0] == "layers"


def held(step: parts.AbstractStep, uses: dict, rolled: bool) -> dict[int, int]:
    """Parameter leaf -> the bytes its gradient holds from where the backward produces it until
    the update, when every gradient is held to the end (see ``grads`` in :mod:`meshpar.plan.memory.analytic`):
    a stacked parameter's of a layer loop that runs as a loop (`rolled`), its stack at the
    stored shard (each layer's reduced in its iteration, into the stack); any other whole at its
    compute shard until it is reduced (``param_layout`` gathers it whole; without one the two
    shards are one), in the dtype the forward reads the parameter in (the compute dtype where
    ``use`` casts it)."""
    plan, out = step.plan, {}
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for i, (var, act, own) in enumerate(zip(variables, shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                                            jax.tree.leaves(plan.shardings.params))):  # fmt: skip
        a = var.get_value()
        placed = math.prod(own.shard_shape(a.shape)) * a.dtype.itemsize
        computed = math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize
        u = uses.get(i)
        if rolled and stacked(var):
            out[i] = placed
        elif u is not None and (own.spec == act.spec or computed > placed):
            out[i] = u.nbytes
        else:
            out[i] = placed
    return out


def accumulated(step: parts.AbstractStep, uses: dict, rolled: bool) -> set[int]:
    """The parameter leaves whose gradients are accumulated into buffers XLA zeroes before the
    backward begins, so held from its first step: where the layer loop runs as a loop, every
    stacked one (each layer's gradient written into a zeroed stack, the backward loop's output),
    and one a gather reads (its gradient is added into a zeroed table: the embedding). XLA:CPU's
    schedule zeroes the table at the step's start; XLA:GPU's only where the table's gradient is
    reduce-scattered (``param_layout`` re-places it, and it is produced in a narrower dtype than
    the parameter's, so the gradient norm reads the reduced shards, not the whole sum), and
    otherwise where the gather's gradient is added into it, at the backward's end."""
    plan = step.plan
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    gpu = shapes.platform(step) == "gpu"
    out = set()
    for i, (var, act, own) in enumerate(zip(variables, shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                                            jax.tree.leaves(plan.shardings.params))):  # fmt: skip
        u = uses.get(i)
        if u is None:
            continue
        if rolled and stacked(var):
            out.add(i)
        elif u.scattered:
            a = var.get_value()
            computed = math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize
            scattered = computed > math.prod(own.shard_shape(a.shape)) * a.dtype.itemsize and u.nbytes < computed
            if not gpu or scattered:
                out.add(i)
    return out


def update_phase(step: parts.AbstractStep, uses: dict, rolled: bool = False,
                  threshold: int = COMBINE_THRESHOLD, dtypes: dict | None = None,
                  local: frozenset = frozenset()) -> tuple[int, int]:  # fmt: skip
    """Bytes the update phase holds beyond the state (see :mod:`meshpar.plan.memory.analytic`): every
    gradient as the backward produces it (at its activation-layout shard, in the dtype the
    forward reads the parameter in), and a reduced copy where the devices must sum or re-place
    it — but a stacked (``layers``) parameter of a layer loop that runs as a loop has its stack
    alone, at its stored shard (each layer's gradient is reduced in its iteration, into the
    stack); on XLA:GPU a gradient reduced alone (re-placed: a reduce-scatter, or an all-reduce
    in place; summed and at least `threshold`, too large to combine) has no second copy beyond
    its stored shard; a gradient in several parts (:class:`meshpar.plan.memory.residuals.Use`) has
    each reduced. On XLA:GPU with microbatches, the float32 running sum in the parameters'
    shardings (each microbatch's gradient re-placed inside the accumulation loop: a
    reduce-scatter there), and a summed copy of it where the devices must sum it (the combined
    all-reduce's output). Also returns what one iteration of the backward layer loop holds of
    its layer's gradients: each at its compute shard, and its reduced copy (:func:`_reduced`);
    `dtypes`: parameter leaf -> the dtype the forward casts it to (the layer's gradient's).
    `local`: the batch axes gradient accumulation sums over on each device, reducing the running
    sum once, in place, after the last microbatch (:func:`meshpar.step.trainer.reduced_once`): no
    gradient is summed over them during the step, and no summed copy is held."""
    cfg = step.cfg
    plan, (_, batch, _) = step.plan, step.args
    batch_axes = set()
    for b in batch.values():
        batch_axes |= set(jax.tree.leaves(tuple(b.sharding.spec)[:1]))
    batch_axes -= set(local)
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    gpu = shapes.platform(step) == "gpu"
    total, iteration, running = 0, 0, cfg.train.microbatches > 1 and gpu
    dtypes = dtypes or {}
    for i, (var, act, own) in enumerate(zip(variables, shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                                            jax.tree.leaves(plan.shardings.params))):  # fmt: skip
        a = var.get_value()
        placed = math.prod(own.shard_shape(a.shape)) * a.dtype.itemsize
        own_dtype = math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize
        computed = uses[i].nbytes if i in uses else own_dtype
        parts = uses[i].parts if i in uses else 1  # each reduced on its own (a tied embedding's two)
        summed = not batch_axes <= set(jax.tree.leaves(tuple(act.spec)))
        if running:  # the running sum, and its all-reduced copy
            total += math.prod(own.shard_shape(a.shape)) * 4 * (2 if summed and own.spec == act.spec else 1)  # float32
            continue
        if rolled and stacked(var):  # reduced layer by layer in the backward loop, into its stack
            total += placed
            layer = own_dtype // a.shape[0] * jnp.dtype(dtypes.get(i, a.dtype)).itemsize // a.dtype.itemsize
            regathered = own.spec != act.spec and own_dtype > placed
            if summed or own.spec != act.spec:
                iteration += _reduced(gpu, layer, placed // a.shape[0], regathered, own.spec == act.spec, threshold)
            else:
                iteration += layer
            continue
        regathered = own.spec != act.spec and own_dtype > placed
        if summed or own.spec != act.spec:
            total += _reduced(gpu, computed, placed, regathered, own.spec == act.spec, threshold) * parts
        else:
            total += computed * parts
    return total, iteration


def _reduced(gpu: bool, computed: int, placed: int, regathered: bool, same: bool, threshold: int) -> int:
    """Bytes a gradient of `computed` bytes (at its compute shard; `placed` at its stored shard;
    `same`: the two shards are one) holds while the devices sum or re-place it: XLA:CPU has no
    reduce-scatter and reduces into new buffers, and XLA:GPU combines the smaller gradients'
    all-reduces into one (a concatenation) before any could become a reduce-scatter: each
    reduces the whole gradient (a second copy at its compute shard; `regathered`: one
    ``param_layout`` stores smaller than compute gathers it), then slices; on XLA:GPU one
    reduced alone (re-placed: a reduce-scatter, or an all-reduce in place; summed and at least
    `threshold`, too large to combine) has no second whole copy."""
    if gpu and (regathered or computed >= threshold):
        return computed + (placed if regathered else 0)
    return computed + (computed if regathered or same else placed)


def one_at_a_time(step: parts.AbstractStep) -> int | None:
    """None when something needs every gradient at once: clipping by their global norm, or a sum
    over devices (XLA combines the gradients' all-reduces into one) or a re-placement
    (``param_layout``'s reduce-scatter); else the largest gradient (at its activation-layout
    shard), the most the update holds: it updates each parameter from its own gradient as the
    backward produces it, in the donated state's buffers, and the gradient dies there."""
    cfg = step.cfg
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

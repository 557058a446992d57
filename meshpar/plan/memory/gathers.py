"""The gathered copies of the parameters ``param_layout`` stores on a smaller shard than compute
uses them: what gathering them costs one device, in the memory model's phases (the rules, checked
against XLA's buffer assignment, are in :mod:`meshpar.plan.memory.analytic`'s docstring).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar.plan import shapes
from meshpar.step import parts


@dataclasses.dataclass(frozen=True)
class Gathers:
    """What gathering the parameters that ``param_layout`` stores split but compute uses whole
    costs one device, in bytes (see :mod:`meshpar.plan.memory.analytic`); and the layer loop's own
    copies of its weights that are no gathers (each layer's slice of a stack, written out)."""

    # the gathered copies the backward reads, held for it (a residual, or re-gathered under remat);
    # an unrolled layer loop's slices of the stacks the backward reads, every layer's
    kept: int
    copies: int  # every pass's copies of the parameters outside the layer loop
    rest: int  # those of `copies` not in `kept`
    relayout: int  # the largest one gathered along a later dim, once more (its transposed layout)
    grads: int  # the backward's gradients beyond their stored shards (outside the layer loop)
    # a layer loop that runs as a loop: its stacked parameters' transposed-layout copy (hoisted out
    # of the loops: every layer at its stored shard), and under remat one layer's gathered copies
    # or its slices of the stacks (the backward's iteration's: `iteration`)
    loop: int = 0
    iteration: int = 0
    kept_by: dict = dataclasses.field(default_factory=dict)  # `kept`, by parameter leaf
    # a layer loop unrolled, under remat: every layer's forward copy (it reads only arguments) and
    # one layer's copies the backward gathers again (behind remat's barrier, in its iteration)
    layers: int = 0


def gathers(step: parts.AbstractStep, read: set[int], rolled: bool = False,
             dtypes: dict | None = None) -> Gathers:  # fmt: skip
    """The gathered copies of the parameters stored smaller than compute uses them
    (``param_layout``), from their shardings, and an unrolled layer loop's slices of its stacks;
    `read`: the parameter leaves the backward reads (:func:`meshpar.plan.memory.trace.saved_activations`);
    `rolled`: the layer loop runs as a loop; `dtypes`: parameter leaf -> the dtype the forward
    casts it to (``use`` casts where the parameter is stored, so it is gathered in that dtype)."""
    cfg = step.cfg
    dtypes = dtypes or {}
    plan, gpu = step.plan, shapes.platform(step) == "gpu"
    remat = step.traits.remat_on
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    kept = forward = again = relayout = grads = outside = loop = iteration = layers = 0
    kept_by: dict = {}
    for i, (var, act, own) in enumerate(zip(variables, shapes.act_shardings(plan.abstract.params, step.layout, step.mesh),
                                            jax.tree.leaves(plan.shardings.params))):  # fmt: skip
        a, dims = var.get_value(), var.get_metadata().get("dims") or ()
        used, stored = (math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize for s in (act, own))
        if used <= stored:
            if rolled and remat and dims and dims[0] == "layers":
                iteration += used // a.shape[0]  # the iteration's matmuls read its layer's slice, written out
            elif not rolled and not remat and dims and dims[0] == "layers" and a.shape[0] > 1 and i in read:
                # unrolled: every layer's slice of the stack is written out for the matmuls that
                # read it (one layer's is the stack itself), and held until the backward's read it again
                kept, kept_by[i] = kept + used, used
            continue  # not gathered
        # the cast's bytes: what is gathered (a residual that is the parameter itself is not cast)
        width = jnp.dtype(dtypes.get(i, a.dtype)).itemsize
        cast, stored_cast = used * width // a.dtype.itemsize, stored * width // a.dtype.itemsize
        if dims and dims[0] == "layers":  # gathered one layer at a time inside the layer loop
            if i in read and not remat:  # each layer's copy a residual
                kept, kept_by[i] = kept + used, used
            if rolled:  # gathered along a dim after `layers`: the whole stack relaid out once, then per layer
                # (XLA:GPU only where the gathered dim is not already a layer's leading one)
                shards = zip(own.shard_shape(a.shape), act.shard_shape(a.shape))
                split = [d for d, (s, n) in enumerate(shards) if s != n]
                loop += stored if not gpu or any(d > 1 for d in split) else 0
                iteration += cast // a.shape[0] if remat else 0
            elif remat:
                layers += cast + (cast // a.shape[0] if i in read else 0)
            continue
        used, stored = cast, stored_cast
        forward += used
        grads += used - stored
        if i in read:
            kept, outside, kept_by[i] = kept + used, outside + used, used
            again += used if remat else 0  # the recomputed forward gathers it again
        # gathered along a dim after the leading one: XLA gathers it in a transposed layout, then copies it back
        shard = own.shard_shape(a.shape)
        lead = next((d for d, n in enumerate(a.shape) if n > 1), 0)
        if any(s != n for d, (s, n) in enumerate(zip(shard, act.shard_shape(a.shape))) if d > lead):
            relayout = max(relayout, stored if gpu else used)
    if gpu and cfg.train.microbatches == 1:  # gathered where each pass uses it: one pass's copies at a time
        return Gathers(kept=kept, copies=forward, rest=forward - outside, relayout=relayout, grads=grads, loop=loop,
                       iteration=iteration, layers=layers, kept_by=kept_by)  # fmt: skip
    return Gathers(kept=kept, copies=forward + again, rest=forward + again - outside, relayout=relayout, grads=grads,
                   loop=loop, iteration=iteration, layers=layers, kept_by=kept_by)  # fmt: skip

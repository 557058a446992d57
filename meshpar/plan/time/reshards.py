"""The all-to-alls a layout implies, read from the model's traced program before anything is
compiled: a mixture of experts' routed tokens (:mod:`meshpar.models.moe`), placed first by the
batch's rule and then by the experts', cross the mesh where a mesh axis splits one dim of a
tensor before and another after.

The step's gradient (``jax.grad`` of the loss under the config's ``model.remat``, so the
backward's transposed constraints and a remat policy's recomputed forward are in it) is traced
at global shapes with the step's layout active. Two sharding constraints in a row on one value
(through relabellings and casts) are one re-placement; for each mesh axis of more than one
device: split along dim i before and dim j ≠ i after, an all-to-all over it (each device sends
its shard of the operand, split by destination); split before and not after, an all-gather;
not split before, a slice (nothing moves). One re-placement's all-to-all axes run as one
all-to-all (the axes joined, as :func:`meshpar.plan.time.replica_groups.axes` names a collective's), its bytes
per device those of the operand's shard: what XLA's partitioner emits and what
:func:`meshpar.plan.time.timing.predict` reads back from the compiled program
(``scripts/bench_moe.py`` checks one against the other). Loop bodies count their trip counts.
"""

from __future__ import annotations

import math

import jax

from meshpar import jaxprs
from meshpar.plan.memory import trace
from meshpar.sharding import layout as layout_lib
from meshpar.step import parts

# Ops between two constraints that change neither a value's elements nor its placement.
_THROUGH = frozenset({"convert_element_type", "copy", "copy_p", "checkpoint_name", "name", "optimization_barrier"})


def _axes_of(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def moved(src, dst, shape: tuple[int, ...], itemsize: int) -> tuple[str, int] | None:
    """The all-to-all of re-placing a value of global `shape` from NamedSharding `src` to `dst`:
    (its mesh axes, joined by commas in the mesh's order, and its bytes per device), or None."""
    sizes = dict(src.mesh.shape)
    before = {a: i for i, e in enumerate(src.spec) for a in _axes_of(e)}
    after = {a: i for i, e in enumerate(dst.spec) for a in _axes_of(e)}
    axes = [a for a in sizes if sizes[a] > 1 and a in before and a in after and before[a] != after[a]]
    if not axes:
        return None
    shard = src.shard_shape(shape)
    return ",".join(axes), math.prod(shard) * itemsize


def all_to_alls(step: parts.AbstractStep) -> dict[str, int]:
    """Mesh axes (``"a"`` or ``"a,b"``) → bytes per device per step of the all-to-alls the
    step's layout implies (see the module docstring); empty where it implies none."""
    loss, _ = trace.local_loss(step)
    state, batch, _ = step.args
    with layout_lib.activate(step.layout, step.mesh):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(state.params, batch)
    placed: dict = {}  # var -> the sharding its value was last constrained to
    out: dict[str, int] = {}
    for eqn, copies, _ in jaxprs.walk(jaxpr):
        if len(eqn.invars) != 1 or len(eqn.outvars) != 1 or jaxprs.is_literal(eqn.invars[0]):
            continue
        source = placed.get(eqn.invars[0])
        sharding = jaxprs.constraint(eqn)
        if sharding is None:
            if source is not None and (jaxprs.op(eqn) in _THROUGH or jaxprs.is_relabel(eqn)):
                if tuple(eqn.outvars[0].aval.shape) == tuple(eqn.invars[0].aval.shape):
                    placed[eqn.outvars[0]] = source
            continue
        placed[eqn.outvars[0]] = sharding
        if source is not None:
            aval = eqn.invars[0].aval
            found = moved(source, sharding, tuple(aval.shape), aval.dtype.itemsize)
            if found is not None:
                out[found[0]] = out.get(found[0], 0) + found[1] * copies
    return out

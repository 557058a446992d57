"""One device's shapes of a config's step: every parameter at its shard in the compute layout,
and the batch at one device's rows of one microbatch, each dim where the model places it. The
memory model (:mod:`meshpar.plan.memory.analytic`) and the offload plan (:mod:`meshpar.plan.out_of_core.offload_plan`)
trace the model at these shapes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

from meshpar import jaxprs
from meshpar.configuration.config import Config
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import tracing
from meshpar.step import parts


def platform(step: parts.AbstractStep) -> str:
    """The platform the step is compiled for (``cpu``, ``gpu``, ``tpu``): its mesh's devices'."""
    return step.mesh.devices.flat[0].platform


@contextlib.contextmanager
def on_target(step: parts.AbstractStep, local: bool = False) -> Iterator[None]:
    """Within this block a model traced at one device's shapes makes the choices it makes for the
    step's target (:func:`meshpar.sharding.layout.platform`: the layer loop's form, the attention kernel),
    not this host's: one device of the step's mesh is active, under a layout that splits
    nothing, so every constraint is a relabelling and the shapes stay one device's. `local`:
    the model is traced at one device's shapes (:func:`local_params`, :func:`device_batch`),
    and the trace says how many ways the step's layout splits each dim
    (:attr:`meshpar.sharding.tracing.Trace.splits`), for the model code that moves a tensor
    from one split to another."""
    one = jax.sharding.Mesh(np.asarray(step.mesh.devices.flat[:1]), ("device",))
    splits = {dim: step.layout.axis_size(dim) for dim, _ in step.layout.rules} if local else None
    with tracing.using(splits=splits), layout_lib.activate(layout_lib.Layout.create("", {"device": 1}), one):
        yield


def act_shardings(params: nnx.State, layout: layout_lib.Layout, mesh) -> list:
    """Every parameter's sharding in the activation `layout` (where compute uses it), in leaf order."""
    out = []
    for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        dims = v.get_metadata().get("dims")
        out.append(layout.sharding(mesh, (None,) * v.get_value().ndim if dims is None else dims))
    return out


def local_params(params: nnx.State, layout: layout_lib.Layout, mesh) -> nnx.State:
    """Every parameter at its shard shape in the activation `layout` (where compute uses it)."""

    def one(v):
        dims = v.get_metadata().get("dims")
        a = v.get_value()
        shape = a.shape if dims is None else layout.sharding(mesh, dims).shard_shape(a.shape)
        return v.replace(jax.ShapeDtypeStruct(shape, a.dtype))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def placed_shapes(graphdef, params, batch: dict, layout: layout_lib.Layout, mesh) -> list[tuple[int, ...]]:
    """One device's shard of each batch leaf (in leaf order) where the model places it: the model meets a batch leaf whole along dims the data brings in unsplit (the MLP's
    ``pixels``, the Transformer's ``length`` cut from its token windows) and constrains it there,
    so one device computes on the constrained shard. Read from the loss traced at global shapes
    with the layout active, following each leaf through the relabellings, casts and slices
    before its constraints (a slice keeps what it cut off: the window's extra token)."""

    def loss(params, batch):
        return nnx.merge(graphdef, params).loss(batch, rngs=nnx.Rngs(dropout=jax.random.key(0)))[0]

    leaves = jax.tree.leaves(batch)
    with layout_lib.activate(layout, mesh):
        jaxpr = jax.make_jaxpr(loss)(params, batch).jaxpr
    local = [list(b.shape) for b in leaves]
    # var -> (leaf index, extent cut off each dim by slices on the way)
    derived = {v: (i, (0,) * len(b.shape)) for i, (v, b) in enumerate(zip(jaxpr.invars[-len(leaves) :], leaves))}
    for eqn in jaxpr.eqns:
        sources = [derived[v] for v in eqn.invars if not jaxprs.is_literal(v) and v in derived]
        if len(sources) != 1 or len(eqn.outvars) != 1 or len(eqn.outvars[0].aval.shape) != len(local[sources[0][0]]):
            continue
        (i, cut), out = sources[0], eqn.outvars[0].aval.shape
        bounds, sharding = jaxprs.slice_bounds(eqn), jaxprs.constraint(eqn)
        if bounds is not None:
            cut = tuple(c + (d - (hi - lo)) for c, d, lo, hi in zip(cut, eqn.invars[0].aval.shape, *bounds))
        elif not (jaxprs.is_relabel(eqn) or jaxprs.is_cheap(eqn)) or tuple(eqn.invars[0].aval.shape) != tuple(out):
            continue
        if sharding is not None:
            shard = sharding.shard_shape(tuple(out))
            local[i] = [min(n, s + c) for n, s, c in zip(local[i], shard, cut)]
        derived[eqn.outvars[0]] = (i, cut)
    return [tuple(loc) for loc in local]


def local_batch(cfg: Config, batch: dict, placed: list[tuple[int, ...]] | None = None) -> dict:
    """One device's rows of one microbatch of `batch`; with `placed` (:func:`placed_shapes`),
    every dim at the shard the model places it in."""
    leaves, tree = jax.tree.flatten(batch)
    local = []
    for n, b in enumerate(leaves):
        shape = b.sharding.shard_shape(b.shape)
        if placed is not None:
            shape = tuple(min(s, p) for s, p in zip(shape, placed[n]))
        rows, *rest = shape
        local.append(jax.ShapeDtypeStruct((max(rows // cfg.train.microbatches, 1), *rest), b.dtype))
    return jax.tree.unflatten(tree, local)


def device_batch(step: parts.AbstractStep) -> dict:
    """One device's shard of one microbatch, every dim as the model places it (see :func:`placed_shapes`)."""
    cfg = step.cfg
    _, batch, _ = step.args  # the parameters without their placement: offloaded ones are no different here
    return local_batch(
        cfg, batch, placed_shapes(step.plan.graphdef, step.plan.abstract.params, batch, step.layout, step.mesh)
    )

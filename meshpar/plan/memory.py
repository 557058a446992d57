"""Analytic per-device memory of a config's training run, by category, before anything exists.

Everything comes from the real abstract train state (``eval_shape``), its shardings and the
model's own code traced at per-device shapes; nothing is kept by hand for one model. Per device
(the most loaded one: the relay device in routed feeding), in bytes:

* ``params`` (exact) — every parameter's shard under the layout with ``param_layout`` on top.
* ``grads`` (estimate) — one gradient per parameter, in the parameter dtype, placed like the
  parameter; with ``train.microbatches`` > 1 also the float32 running sum the accumulation keeps
  in the parameters' shardings. XLA may hold gradients in the activation layout instead (FSDP:
  the gathered layout) or fuse them into the update, so this is what a plain step keeps.
* ``optimizer`` (exact) — every optimizer-state leaf's shard (moments placed like their
  parameters, counts and scalars whole), plus the step counter and the RNG key.
* ``activations`` (estimate) — what the backward pass reads: the residuals JAX saves when the
  model's loss is differentiated under the ``model.remat`` policy in use
  (``saved_residuals``), traced at one device's shapes: every parameter at its shard in the
  activation layout (where :func:`meshpar.layout.use` places it for compute), the batch at its
  per-device rows divided by ``train.microbatches`` (one microbatch is live at a time).
  Residuals that are the arguments themselves (parameters, batch) are counted in their own
  categories. The trace covers every layer at once (inside the layer scan, stacked over
  ``layers``), in the dtypes the model computes in. XLA's workspace (temporaries of one op,
  collectives' buffers) is not in it.
* ``inputs`` (exact) — this device's slice of one batch times the batches resident on it:
  ``feed.prefetch`` + 1, and one more under the lagged loop (a dispatched step's batch stays
  alive while the next is placed; see :mod:`meshpar.loop`).
* ``relay_inputs`` (routed only, exact) — the relay also holds the whole process batch it
  received and, while placing, every slice cut from it: 2x the process batch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # no public equivalent in jax 0.10 / 0.12

from meshpar import aot
from meshpar import layout as layout_lib
from meshpar.config import Config

CATEGORIES = ("params", "grads", "optimizer", "activations", "inputs", "relay_inputs")
EXACT = frozenset({"params", "optimizer", "inputs", "relay_inputs"})


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Per-device bytes on the most loaded device, by category (see the module docstring)."""

    categories: dict[str, int]  # in CATEGORIES order; relay_inputs only in routed feeding
    exact: frozenset[str]  # the categories computed exactly; the others are estimates

    @property
    def total(self) -> int:
        return sum(self.categories.values())


def _shard_bytes(abstract, shardings) -> int:
    """Bytes one device holds of every leaf of `abstract`, each by its sharding's shard shape."""
    total = 0
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
    return total


def _local_params(params: nnx.State, layout: layout_lib.Layout, mesh) -> nnx.State:
    """Every parameter at its shard shape in the activation `layout` (where compute uses it)."""

    def one(v):
        dims = v.get_metadata().get("dims")
        a = v.get_value()
        shape = a.shape if dims is None else layout.sharding(mesh, dims).shard_shape(a.shape)
        return v.replace(jax.ShapeDtypeStruct(shape, a.dtype))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def saved_activations(cfg: Config, step: aot.AbstractStep) -> list[tuple[jax.ShapeDtypeStruct, str]]:
    """The residuals one device keeps for the backward pass of one microbatch: ``(aval,
    where it comes from)`` for each, as JAX reports them for the model's loss under its remat
    policy, traced at per-device shapes with no layout active (see the module docstring)."""
    state, batch, _ = step.args
    params = _local_params(state.params, step.layout, step.mesh)
    k = cfg.train.microbatches
    local = {}
    for name, b in batch.items():
        rows, *rest = b.sharding.shard_shape(b.shape)
        local[name] = jax.ShapeDtypeStruct((max(rows // k, 1), *rest), b.dtype)
    graphdef = step.plan.graphdef

    def loss(params, batch):
        batch = jax.tree.map(jax.lax.stop_gradient, batch)  # the step differentiates the params only
        rngs = nnx.Rngs(dropout=jax.random.key(0))
        return nnx.merge(graphdef, params).loss(batch, rngs=rngs)[0]

    return saved_residuals(loss, params, local)


def analytic(cfg: Config, step: aot.AbstractStep | None = None) -> Breakdown:
    """The config's per-device memory by category (nothing allocated, nothing compiled)."""
    step = step or aot.abstract_step(cfg)
    plan, (_, batch, _) = step.plan, step.args
    params = _shard_bytes(plan.abstract.params, plan.shardings.params)
    grads = params
    if cfg.train.microbatches > 1:  # the float32 running sum, in the parameters' shardings
        f32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), plan.abstract.params)
        grads += _shard_bytes(f32, plan.shardings.params)
    rest = (plan.abstract.opt_state, plan.abstract.step, plan.abstract.rng)
    optimizer = _shard_bytes(rest, (plan.shardings.opt_state, plan.shardings.step, plan.shardings.rng))
    activations = sum(
        math.prod(a.shape) * a.dtype.itemsize
        for a, where in saved_activations(cfg, step)
        if not where.startswith("from the argument")
    )
    one_batch = _shard_bytes(batch, {k: b.sharding for k, b in batch.items()})
    lagged = 0 if cfg.train.sync_every_step else 1
    categories = {
        "params": params, "grads": grads, "optimizer": optimizer, "activations": activations,
        "inputs": one_batch * (cfg.feed.prefetch + 1 + lagged),
    }  # fmt: skip
    if cfg.feed.mode == "routed":
        process_batch = sum(math.prod(b.shape) * b.dtype.itemsize for b in batch.values())
        categories["relay_inputs"] = 2 * process_batch // cfg.distributed.num_processes
    return Breakdown(categories, EXACT)

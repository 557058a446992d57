"""The layout search's analytic estimate of a step's time per device, by term, from the memory
plan and the traced model (nothing compiled): what ranks the options before the best are
compiled.

Each term is in :mod:`meshpar.plan.search.layouts`'s docstring (**Ranked analytically**).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from meshpar import jaxprs
from meshpar.plan import cost, shapes
from meshpar.plan.memory import analytic as memory
from meshpar.plan.memory import stage_axis as stages
from meshpar.plan.memory import trace, train_state
from meshpar.plan.out_of_core import offload_cost, offload_plan, unified
from meshpar.plan.search import options as options_lib
from meshpar.plan.search.candidates import MODEL_AXIS
from meshpar.plan.time import memory_rates, reshards
from meshpar.step import parts, trainer


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The analytic step time per device, by term (see :mod:`meshpar.plan.search.layouts`)."""

    flops: float
    compute_s: float
    memory_s: float
    gradient_s: float
    activation_s: float
    feed_s: float
    exposed_feed_s: float
    pipeline_s: float = 0.0  # a stage axis: its permutes and the outputs' sum (meshpar.plan.memory.stage_axis)
    experts_s: float = 0.0  # a mixture of experts: its routed tokens' all-to-alls (meshpar.plan.time.reshards)
    paging_s: float = 0.0  # unified memory: what its page faults stall (meshpar.plan.out_of_core.unified)
    kernels: float = 0.0  # kernels one device launches per step, at least (see pass_kernels)
    launch_s: float = 0.0  # their fixed cost: kernels × the topology's launch_us

    @property
    def collective_s(self) -> float:
        return self.gradient_s + self.activation_s + self.pipeline_s + self.experts_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.memory_s + self.collective_s + self.exposed_feed_s + self.paging_s + self.launch_s


def pass_kernels(step: parts.AbstractStep) -> int:
    """The kernels one microbatch's forward and backward pass launches at least: the matmuls and
    reductions of the model's own training jaxpr (``jax.grad`` of its loss under its
    ``model.remat`` policy, the recomputed forward included; loop bodies × their trip counts),
    traced for the target (its layer-loop form and attention kernel). XLA:GPU emits each matmul
    as its own kernel (a library call or a GEMM fusion) and each reduction as the root of a
    fusion of its own; the elementwise work fuses into them and is not counted, so this is a
    lower bound on the compiled program's kernels (:attr:`meshpar.plan.time.schedule.Span.kernels`).
    Counted at the global shapes: the count does not depend on the layout (splitting a matmul
    leaves one per device; a stage axis's share of the layers is the estimate's to take)."""
    loss, _ = trace.local_loss(step)
    state, batch, _ = step.args
    with shapes.on_target(step):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(state.params, batch)
    return sum(copies for eqn, copies, _ in jaxprs.walk(jaxpr) if jaxprs.is_matmul(eqn) or jaxprs.is_reduction(eqn))


def _axes_of(spec) -> set[str]:
    return {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}


def gradient_traffic(step: parts.AbstractStep, batch_axes: tuple[str, ...], compute_itemsize: int) -> dict:
    """(kind, axes) → bytes per device of the gradient sync: all-reduce over the batch axes a
    parameter is not split on; under FSDP two all-gathers (compute dtype) and a reduce-scatter."""
    sizes = dict(step.mesh.shape)
    batch = [a for a in batch_axes if sizes[a] > 1]
    params = jax.tree.leaves(step.plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    out: dict[tuple[str, tuple[str, ...]], float] = {}
    for var, own in zip(params, jax.tree.leaves(step.plan.shardings.params)):
        a = var.get_value()
        dims = var.get_metadata().get("dims") or (None,) * a.ndim
        act = step.layout.sharding(step.mesh, dims)
        elements = math.prod(act.shard_shape(a.shape))
        act_axes, own_axes = _axes_of(act.spec), _axes_of(own.spec)
        gathered = tuple(x for x in step.mesh.axis_names if x in own_axes - act_axes and sizes[x] > 1)
        if gathered:
            out[("all-gather", gathered)] = out.get(("all-gather", gathered), 0) + 2 * elements * compute_itemsize
            out[("reduce-scatter", gathered)] = out.get(("reduce-scatter", gathered), 0) + elements * a.dtype.itemsize
        summed = tuple(x for x in batch if x not in act_axes and x not in gathered)
        if summed:
            share = elements // math.prod(sizes[x] for x in gathered) * a.dtype.itemsize
            out[("all-reduce", summed)] = out.get(("all-reduce", summed), 0) + share
    return out


def estimate(
    step: parts.AbstractStep,
    option: options_lib.Option,
    breakdown: memory.Breakdown,
    topo,
    dims,
    kernels: int = 0,
) -> Estimate:
    """The analytic step time of the built `step` (the search's `option`, with memory
    `breakdown`) on `topo`; `kernels`: those one microbatch's pass launches (:func:`pass_kernels`;
    0: not counted)."""
    cfg, sizes = step.cfg, option.sizes
    spec, family = step.element_spec, step.family
    batch_ways = math.prod(sizes[a] for a in option.batch)
    model_ways = sizes.get(MODEL_AXIS, 1) if option.model else 1
    model, dtype = step.traits, step.traits.compute_dtype
    # Without the family's FLOPs no compute term (said once: meshpar.models.missing).
    per_example = family.flops_per_example(cfg.model, spec) if family.flops_per_example is not None else 0.0
    sched = step.plan.schedule  # a stage axis: a share of the layers, stretched by the bubble
    scale = stages.compute_scale(sched, stages.layer_share(family, cfg.model, spec))
    flops = per_example * cfg.train.batch_size / (batch_ways * model_ways) * scale
    flops *= trace.recompute(step).factor  # the backward's recomputed forward, as the policy traces
    compute_s = flops / (topo.peak(dtype) * topo.efficiency)
    # gradient accumulation (no stage axis): k passes over one microbatch's residuals each; the
    # gradients summed over the batch axes no weight is split on are reduced once per step
    # (meshpar.step.trainer.reduced_once), FSDP's gathers and reduce-scatters run in every pass
    k = cfg.train.microbatches if sched is None else 1
    once = set(trainer.reduced_once(step.layout, step.mesh, step.plan.shardings.params)) if k > 1 else set()
    memory_s = _memory_seconds(step, breakdown, k, topo, sizes)
    itemsize = jax.numpy.dtype(dtype).itemsize
    gradient_s = sum(
        (1 if kind == "all-reduce" and set(axes) <= once else k)
        * cost.collective_seconds(kind, nbytes, math.prod(sizes[a] for a in axes), cost.axis_link(topo, sizes, axes))
        for (kind, axes), nbytes in gradient_traffic(step, option.batch, itemsize).items()
    )
    activation_s = 0.0
    if model_ways > 1 and family.activation_all_reduces is not None:
        rows = cfg.train.batch_size // batch_ways // k  # one microbatch's: k times as many, each 1/k the size
        count, elements = family.activation_all_reduces(cfg.model, spec, rows, dims)
        link = topo.axis_link(sizes, MODEL_AXIS)
        activation_s = cost.collective_seconds("all-reduce", elements * itemsize, model_ways, link, count * k) * scale
    pipeline_s = _pipeline_seconds(step, batch_ways, itemsize, topo, sizes) if sched is not None else 0.0
    experts_s = _experts_seconds(step, topo, sizes) if model.experts else 0.0
    # every pass launches its kernels again: k passes of accumulation; a pipeline's M microbatches
    # spread over its ticks like its FLOPs (a stage runs its share of the layers per tick)
    launches = kernels * (sched.microbatches * scale if sched is not None else k)
    launch_s = launches * topo.kernels.launch_s if topo.kernels is not None else 0.0
    feed_s = cost.feed_seconds(cfg, topo)
    exposed = cost.exposed_feed_seconds(feed_s, compute_s + memory_s, cfg.feed.prefetch)
    return Estimate(flops, compute_s, memory_s, gradient_s, activation_s, feed_s, exposed, pipeline_s,
                    experts_s=experts_s, kernels=launches, launch_s=launch_s)  # fmt: skip


def _memory_seconds(step: parts.AbstractStep, breakdown: memory.Breakdown, k: int, topo, sizes) -> float:
    """Seconds of the bytes a step moves in device memory: the state read and written by the
    update, the saved activations written and read with their cotangents in each of `k` passes,
    and the float32 running sum read and written by each microbatch after the first."""
    c = breakdown.categories
    summed = 2 * train_state.running_sum_bytes(step.plan) * (k - 1)  # each further microbatch reads and writes the sum
    moved = 2 * (c["params"] + c["grads"] + c["optimizer"]) + 4 * c["activations"] * k + summed
    return memory_rates.memory(topo, math.prod(sizes.values())).seconds(moved)


def _pipeline_seconds(step: parts.AbstractStep, batch_ways: int, itemsize: int, topo, sizes) -> float:
    """Seconds of a stage axis's permutes and its outputs' all-reduce, on the stage axis's link."""
    cfg = step.cfg
    sched, family = step.plan.schedule, step.family
    width = step.traits.width  # the stack's [batch, length, embed] activations
    rows, length = cfg.train.batch_size // batch_ways, family.tokens_per_example(cfg.model, step.element_spec)
    traffic = stages.traffic(sched, rows, length, width, itemsize)
    return traffic.seconds(sched.stages, topo.axis_link(sizes, sched.axis))


def _experts_seconds(step: parts.AbstractStep, topo, sizes) -> float:
    """Seconds of a mixture of experts' routed tokens' all-to-alls, as the traced program
    implies them, each on its axes' link."""
    out = 0.0
    for axes, nbytes in reshards.all_to_alls(step).items():
        ways = math.prod(sizes[a] for a in axes.split(","))
        out += cost.collective_seconds("all-to-all", nbytes, ways, topo.axis_link(sizes, axes))
    return out


def paging(step: parts.AbstractStep, breakdown: memory.Breakdown, topo, cap: cost.Capacity) -> float:
    """Seconds unified memory's page faults add to `cfg`'s step on `topo` (:func:`meshpar.plan.out_of_core.offload_cost.paging`)."""
    cfg = step.cfg
    w = offload_plan.weights(step.plan, step.layout, step.mesh)
    layers = step.traits.stack_layers or 1
    blocks = unified.blocks(breakdown.categories, layers, w.layer, breakdown.residual_split, cfg.train.microbatches)
    return offload_cost.paging(blocks, breakdown.total, cap, topo, step.mesh.size)[1]

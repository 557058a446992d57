"""A stage axis in the planner (``layers:<axis>``, :mod:`meshpar.sharding.stages`): what a pipeline
costs per device in memory and in time, each formula once. The memory model
(:mod:`meshpar.plan.memory.analytic`), the layout search's estimate (:mod:`meshpar.plan.search.layouts`) and the
pre-flight's candidates (:mod:`meshpar.plan.search.candidates`) call these.

Notation: S stages, M microbatches (``train.microbatches``), R groups of layers per stage
(``pipeline.repeats``; 1 for GPipe), T = R·M + S − 1 ticks, L layers, B the batch rows one
device of a stage holds (the global batch over the batch axes), ``x`` the bytes of the layer
stack's input for those B rows ([batch, length, embed] in the compute dtype).

The spec: docs/planning.md ("Stage axes", "The formulas").
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar import jaxprs
from meshpar.plan import cost
from meshpar.sharding import stages as pipeline


def bubble_factor(sched: pipeline.Schedule) -> float:
    """How much longer a stage's share of the layers takes in the pipeline than alone: T / (R·M)."""
    return sched.ticks / (sched.repeats * sched.microbatches)


def compute_factor(sched: pipeline.Schedule) -> float:
    """The share of the layer stack's compute (for the batch rows of one device of a stage, at
    the other axes' split) one device spends its time on: 1/S of the layers, stretched by the bubble."""
    return bubble_factor(sched) / sched.stages


# ---------------------------------------------------------------------------------------------
# Memory


def carry_bytes(kept) -> int:
    """Bytes of one microbatch's input to the layer stack on one device (the layer loop's carry:
    tagged ``layer_in``, else a loop carry), read from residuals traced with the loop rolled."""
    carries = [r.nbytes for r in kept if r.loop and r.label in ("'layer_in'", "loop carry")]
    return max(carries, default=0)


def tick_residuals(kept, sched: pipeline.Schedule, weights: int = 0) -> int:
    """The residual stacks of the tick loop (see docs/planning.md, "The formulas"): `kept`, the residuals of
    one microbatch traced with the layer loop rolled at one device's shapes (the stage's L/S
    layers), those of the layer loop T/R times.

    Under ``model.remat: none`` the rolled layer loop hands each layer's weights (cast to the
    compute dtype, a matmul reads them) to its backward as a per-layer slice, so `kept` holds
    the stage's weights once (`weights`: their bytes on one device, as the layers use them).
    Under GPipe the stage's weights are the same at every tick, and the tick loop keeps them
    once, outside it: they are not a per-tick residual. Under the circular schedule the group
    changes from tick to tick and each tick keeps its group's copy (T × a group's weights, which
    is T/R × the stage's: counted with the rest of the stack). Under a remat policy the body
    hands out only what the policy saves: no weights (`weights` 0)."""
    stack = sum(r.total for r in kept if r.loop)
    if sched.repeats == 1:
        stack = max(stack - weights, 0)
    return stack * sched.ticks // sched.repeats


def tick_slice(kept, sched: pipeline.Schedule) -> int:
    """One tick's slice of the residual stacks: its group's residuals of one microbatch, which the
    backward tick copies out of the stacks for the group's backward (L/(S·R) layers' worth)."""
    return sum(r.total for r in kept if r.loop) // sched.repeats


def stack_weights(plan, itemsize: int) -> int:
    """Bytes one device holds of the layer stack's weights (every parameter whose first dim is
    ``layers``), at `itemsize` bytes per element (the dtype the layers compute in)."""
    total = 0
    for (_, var), (_, sharding) in zip(
        nnx.to_flat_state(plan.abstract.params), nnx.to_flat_state(plan.shardings.params)
    ):
        dims = var.get_metadata().get("dims") or ()
        if dims and dims[0] == "layers":
            total += math.prod(sharding.get_value().shard_shape(var.get_value().shape)) * itemsize
    return total


def stack_gradients(plan, act_shardings: list, sched: pipeline.Schedule) -> tuple[int, int]:
    """(the tick loop's gradient accumulators, one tick's gradient stacks): bytes on one device of
    the gradients of the layer stack's parameters, in the parameters' dtype — the accumulators
    at each parameter's stored shard (the stage's L/S layers; the backward tick loop's carry,
    zeroed before it and summed into every tick), one tick's at its compute shard
    (`act_shardings`, leaf order) for the tick's group of L/(S·R) layers (the group's backward
    layer loop writes each layer's gradient into a stack of its own, its output, added into the
    accumulators after the tick)."""
    held = tick = 0
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for var, act, own in zip(variables, act_shardings, jax.tree.leaves(plan.shardings.params)):
        dims = var.get_metadata().get("dims") or ()
        if dims and dims[0] == "layers":
            a = var.get_value()
            held += math.prod(own.shard_shape(a.shape)) * a.dtype.itemsize
            tick += math.prod(act.shard_shape(a.shape)) * a.dtype.itemsize // sched.repeats
    return held, tick


def widened_matmuls(jaxpr) -> dict[int, int]:
    """Bytes of a matmul's output → bytes of its widest cast to a wider float dtype, where the
    forward casts it after relabellings and cheap ops with scalar operands (the head's logits:
    a matmul in the compute dtype, scaled, cast to float32 for the loss). The backward brings
    the cotangent back in the wider dtype (the cast's transpose and the scale fuse into the
    loss's backward): a residual the backward walk holds beside its cotangent at that size.
    Read from `jaxpr` (the forward's, calls followed, loops' bodies too)."""
    out: dict[int, int] = {}
    for j in jaxprs.nested(jaxpr):
        producer = {v: e for e in j.eqns for v in e.outvars}
        for e in j.eqns:
            if jaxprs.op(e) != "convert_element_type" or jaxprs.is_literal(e.invars[0]):
                continue
            src, dst = e.invars[0].aval, e.outvars[0].aval
            if not (jnp.issubdtype(src.dtype, jnp.floating) and dst.dtype.itemsize > src.dtype.itemsize):
                continue
            v = e.invars[0]
            while v in producer and not jaxprs.is_matmul(producer[v]):
                p = producer[v]
                arrays = [a for a in p.invars if not jaxprs.is_literal(a) and a.aval.shape]
                elementwise = len(arrays) == 1 and arrays[0].aval.shape == v.aval.shape  # beside scalars only
                if not (elementwise and (jaxprs.is_relabel(p) or jaxprs.is_cheap(p))):
                    break
                v = arrays[0]
            if v in producer and jaxprs.is_matmul(producer[v]):
                size = jaxprs.nbytes(v)
                out[size] = max(out.get(size, 0), math.prod(dst.shape) * dst.dtype.itemsize)
    return out


def buffers(kept, sched: pipeline.Schedule, in_loop: bool) -> int:
    """The pipeline's buffers of the stack's input size for the whole batch (x, see the module
    docstring) beside the residuals, in the backward: the cotangent of the stack's input the
    backward tick loop accumulates (zeroed before the head's backward), and in the tick loop
    (`in_loop`) the cotangent of the collected outputs it reads a microbatch of per tick; the
    circular schedule's loop buffer's (R > 1)."""
    x = carry_bytes(kept) * sched.microbatches
    return x * (1 + in_loop + (sched.repeats > 1))


# ---------------------------------------------------------------------------------------------
# XLA:CPU's program (the step compiled for this host's devices, as the search and a CPU run
# plan it): the accounting checked against XLA:CPU's compiled steps (scripts/validate_memory.py)


def cpu_activations(kept, sched: pipeline.Schedule, weights: int = 0) -> int:
    """A stage's saved activations (see docs/planning.md, "The formulas"): `kept`, the residuals of one
    microbatch traced with the layer loop rolled at one device's shapes (the stage's L/S layers).

    The rolled layer loop hands each layer's weights to its backward as a per-layer slice, so
    `kept` holds the stage's weights once (`weights`: their bytes on one device, as the layers
    use them). Under GPipe the stage's weights are the same at every tick, and the tick loop
    keeps them once, outside it: they are not a per-tick residual. Under the circular schedule
    the group changes from tick to tick and each tick keeps its group's copy (T × a group's
    weights, which is T/R × the stage's: counted with the rest of the stack)."""
    stack = sum(r.total for r in kept if r.loop) - (weights if sched.repeats == 1 else 0)
    rest = sum(r.total for r in kept if not r.loop)
    return stack * sched.ticks // sched.repeats + rest * sched.microbatches


def cpu_buffers(kept, sched: pipeline.Schedule, recomputed: int = 0) -> int:
    """The pipeline's buffers beside the residuals (see docs/planning.md, "The formulas"): the collected
    outputs and the input's cotangent, the loop buffer under repeats, and `recomputed`, one
    layer's residuals of one microbatch recomputed under remat (times the group's layers)."""
    x = carry_bytes(kept) * sched.microbatches
    group = 0
    if recomputed:
        group = recomputed * max(_len_group(kept, sched), 1)
    return x * (2 + (sched.repeats > 1)) + group


def _len_group(kept, sched: pipeline.Schedule) -> int:
    """Layers in one group (L/(S·R)), from the traced stack's copies (L/S layers)."""
    copies = max((r.copies for r in kept if r.loop), default=0)
    return copies // sched.repeats


# ---------------------------------------------------------------------------------------------
# Time


@dataclasses.dataclass(frozen=True)
class Traffic:
    """The pipeline's collectives per step over the stage axis, per device."""

    permute_bytes: float  # one tick's hand-over: one microbatch's stack output
    permutes: int  # 2·T: forward, and the transposes backward
    reduce_bytes: float  # the outputs' sum over the stages, once

    def seconds(self, stages: int, link) -> float:
        return cost.collective_seconds("collective-permute", self.permute_bytes, stages, link, self.permutes) + (
            cost.collective_seconds("all-reduce", self.reduce_bytes, stages, link)
        )


def traffic(sched: pipeline.Schedule, rows: int, length: int, embed: int, itemsize: int) -> Traffic:
    """The collectives of `sched` for `rows` batch rows per device of a stage, each
    ``[rows, length, embed]`` in `itemsize`-byte elements (see docs/planning.md, "The formulas")."""
    x = rows * length * embed * itemsize
    return Traffic(x / sched.microbatches, 2 * sched.ticks, x)


def layer_share(family, model_cfg, element_spec) -> float:
    """The share of one example's training FLOPs in the layer stack (the family's
    ``layer_flops`` over its ``flops_per_example``); 1 when the family gives no split."""
    if family.layer_flops is None or family.flops_per_example is None:
        return 1.0
    total = family.flops_per_example(model_cfg, element_spec)
    return min(sum(family.layer_flops(model_cfg, element_spec)) / total, 1.0) if total else 1.0


def compute_scale(sched: pipeline.Schedule | None, share: float) -> float:
    """Per-device compute of a step with `sched`, as a multiple of the step's compute split over
    the other axes alone: the layers' `share` × 1/S × T/(R·M), the rest whole on every stage."""
    if sched is None:
        return 1.0
    return share * compute_factor(sched) + (1 - share)


def stage_sizes(n_layers: int | None, devices: int) -> list[int]:
    """Stage counts a search may try on `devices`: every divisor > 1 of both `n_layers` and the
    devices (no layer stack: none)."""
    if not n_layers:
        return []
    return [s for s in range(2, devices + 1) if devices % s == 0 and n_layers % s == 0]

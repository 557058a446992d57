"""The memory plan of a step with a stage axis (``layers:<axis>``): the layer stack runs as a
pipeline of ticks (:mod:`meshpar.sharding.stages`).

:func:`categories` gives such a step's categories as :mod:`meshpar.plan.memory.analytic` counts
them (docs/memory-model.md, "A stage axis"): on XLA:GPU the most the step holds at once, in the
better of XLA's two orders; on XLA:CPU its own accounting (:func:`cpu_categories`). The stage
axis's own figures (tick residuals, stage buffers, stacked gradients) are
:mod:`meshpar.plan.memory.stage_axis`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from meshpar.plan import shapes
from meshpar.plan.memory import backward as backward_phase
from meshpar.plan.memory import gradients, residuals, trace, train_state
from meshpar.plan.memory import stage_axis as stages
from meshpar.plan.time import gemm
from meshpar.step import parts


def cpu_categories(step: parts.AbstractStep, sched, state: train_state.State) -> dict[str, int]:
    """The categories of a step whose layer stack runs as the pipeline `sched` (the module
    docstring of :mod:`meshpar.plan.memory.stage_axis`): params and optimizer state as the layout places
    them (the stack's divided over the stages), one gradient per parameter and no running sum
    (the microbatches are the pipeline's), a stage's residuals over the ticks, and the
    pipeline's buffers as workspace: the accounting of XLA:CPU's program (:func:`categories` on a GPU)."""
    kept = trace.saved_activations(step, rolled=True)
    recomputed = 0
    if step.traits.remat_on:  # the backward tick recomputes its group
        full = [r for r in trace.saved_activations(step, "none", rolled=True) if r.loop]
        recomputed = sum(r.nbytes for r in full)  # one layer of one microbatch
    itemsize = jnp.dtype(step.traits.compute_dtype).itemsize
    return train_state.categories(
        step, params=state.params, grads=state.params, optimizer=state.optimizer,
        activations=stages.cpu_activations(kept, sched, stages.stack_weights(step.plan, itemsize)),
        workspace=stages.cpu_buffers(kept, sched, recomputed),
    )  # fmt: skip


@dataclasses.dataclass
class _Staged:
    """A pipelined step traced (:func:`_staged`): the layers outside the stack on the whole batch,
    the stack's on one microbatch (a tick's), and what the backward walk reads of them."""

    whole: parts.AbstractStep  # the step traced with no microbatches: the layers outside the stack see the whole batch
    outside: list[residuals.Residual]  # the residuals outside the stack (their widened cotangents set)
    kept: list[residuals.Residual]  # one microbatch's residuals: a tick's
    loop_at: int  # the stack's place in the forward's program order
    uses: dict  # where the backward produces each gradient
    matmuls_at: dict  # place -> the matmuls there, the stack's at one microbatch's shapes
    dtypes: dict  # the parameters the forward casts, to the dtype it computes with them in


def _staged(step: parts.AbstractStep) -> _Staged:
    """The traces of a pipelined step (see :class:`_Staged`), each layer loop traced as a loop."""
    cfg = step.cfg
    # the layers outside the stack run on the whole batch: the same step traced with no microbatches
    whole = dataclasses.replace(
        step, cfg=dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=1))
    )
    uses: dict = {}
    matmuls_at: dict = {}
    dtypes: dict = {}
    outer = trace.saved_activations(whole, uses=uses, matmuls_at=matmuls_at, dtypes=dtypes, rolled=True)
    tick_at: dict = {}
    kept = trace.saved_activations(step, rolled=True, matmuls_at=tick_at)  # one microbatch: a tick's
    loop_at = min((r.at for r in outer if r.loop), default=0)
    loss, local = trace.local_loss(whole, rolled=True)
    with shapes.on_target(
        step, local=True
    ):  # the logits cast to float32 for the loss: their cotangent comes back in it
        widened = stages.widened_matmuls(jax.make_jaxpr(loss)(local, shapes.device_batch(whole)).jaxpr)
    outside = [dataclasses.replace(r, cot=widened[r.nbytes]) if r.label == "dot_general" and not r.cot
               and widened.get(r.nbytes, 0) > r.nbytes else r for r in outer if not r.loop]  # fmt: skip
    at = {p: v for p, v in matmuls_at.items() if p != loop_at}  # the layer loop's matmuls at a tick's shapes
    at.update((loop_at, v) for v in tick_at.values() if v[0])
    return _Staged(whole, outside, kept, loop_at, uses, at, dtypes)


def _tick(step: parts.AbstractStep, sched, kept: list, tick_grads: int, partial: int) -> int:
    """What one backward tick holds beyond the stacks it walks over: its layers' gradients, one
    layer's residual slices (and under remat its recomputed residuals beyond those kept), the
    pipeline's buffers, and the matmul scratch at the stack's place (`partial`)."""
    transient = stages.tick_slice(kept, sched)
    if step.traits.remat_on:  # the tick's backward recomputes one layer at a time
        one = backward_phase.loop_iteration(trace.saved_activations(step, "none", unrolled=True))
        transient += max(one - backward_phase.loop_iteration(kept), 0)
    return tick_grads + transient + stages.buffers(kept, sched, True) + partial


def categories(step: parts.AbstractStep, sched, state: train_state.State) -> dict[str, int]:
    """The categories of a step whose layer stack runs as the pipeline `sched` (the module
    docstring of :mod:`meshpar.plan.memory.stage_axis`): params and optimizer state as the layout places
    them (the stack's divided over the stages), one gradient per parameter and no running sum
    (the microbatches are the pipeline's), and the most the step holds of the rest at once: the
    backward outside the stack (walked as any step's, the tick loop's residual stacks held
    through it), the backward tick loop, or the update — in the better of XLA's two orders."""

    if shapes.platform(step) != "gpu":  # XLA:CPU's program: its own accounting, checked against XLA:CPU
        return cpu_categories(step, sched, state)
    plan, traced = step.plan, _staged(step)
    itemsize = jnp.dtype(step.traits.compute_dtype).itemsize
    remat_on = step.traits.remat_on
    weights = 0 if remat_on else stages.stack_weights(plan, itemsize)  # a remat policy keeps no weights
    stack = stages.tick_residuals(traced.kept, sched, weights)
    act = shapes.act_shardings(plan.abstract.params, step.layout, step.mesh)
    accumulators, tick_grads = stages.stack_gradients(plan, act, sched)
    workspace, partials = gemm.matmul_scratch(step, traced.matmuls_at)
    for r in traced.outside:  # a widened cotangent dies before the backward's matmuls there read its narrowed copy
        if r.cot and r.at in partials and r.at != traced.loop_at:
            partials[r.at] = max(partials[r.at] - r.cot, 0)
    tick = _tick(step, sched, traced.kept, tick_grads, partials.get(traced.loop_at, 0))
    peak = _pipeline_peak(step, sched, traced, stack, accumulators, tick, partials)
    update, _ = gradients.update_phase(traced.whole, traced.uses, True, gradients.COMBINE_THRESHOLD, traced.dtypes)
    working = max(min(peak(True), peak(False)) + workspace, update)
    activations = stack + sum(r.total for r in traced.outside)
    return train_state.categories(
        step, params=state.params, grads=state.params, optimizer=state.optimizer, activations=activations,
        workspace=working - state.params - activations,
    )  # fmt: skip


def _pipeline_peak(step: parts.AbstractStep, sched, traced: _Staged, stack: int, accumulators: int, tick: int,
                   partials: dict) -> Callable[[bool], int]:  # fmt: skip
    """The most a pipelined step on a GPU holds in its backward, but the matmul workspace, as a
    function of XLA's order: the head's backward (walked over the tick loop's `stack`, one
    residual at the stack's place) or the tick loop's (`tick` on top of the stacks), the larger."""
    variables = jax.tree.leaves(step.plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    uses, loop_at, outside = traced.uses, traced.loop_at, traced.outside
    stacked = {i for i, v in enumerate(variables) if gradients.stacked(v)}
    held = gradients.held(step, uses, True)
    # the tick loop's stacks, one residual at its place: every place after it (the head) walks over them
    ticks = residuals.Residual(max(stack // sched.ticks, 1), sched.ticks, "ticks", loop=True, rolled=True, at=loop_at)
    before = sum(r.total for r in outside if r.at < loop_at)  # made before the stack, held through its backward

    def peak(early_zeros: bool) -> int:
        """The head's backward or the tick loop's, the larger, in one of XLA's orders: the
        accumulators and the embedding table's gradient zeroed at the step's start and the head's
        weight gradients run where the backward reaches them (`early_zeros`), or zeroed where
        the backward needs them and those weight gradients run after the tick loop (their
        cotangents held through it)."""
        accumulated = gradients.accumulated(step, uses, True) - stacked
        if early_zeros:
            accumulated |= stacked | {i for i, u in uses.items() if u.scattered and i < len(variables)}
        early = sum(held.get(i, 0) for i in accumulated)
        shares = {i: (uses[i].parts if i in uses else 1) - (i in accumulated) for i in held}
        together = {i: b * shares[i] for i, b in held.items() if shares[i]}  # a stacked one's: from the tick loop on
        late = set()
        if not early_zeros:
            late = {i for i, u in uses.items() if u.matmul and u.at > loop_at and i < len(variables)} - stacked
        head = backward_phase.walk([*outside, ticks], uses, len(variables), together, {}, partials, early,
                                   False, {}, {}, late)  # fmt: skip
        after = sum(b for i, b in together.items() if i not in late and i in uses and uses[i].at > loop_at)
        waiting = sum(uses[i].cot or 0 for i in late)
        loop = before + stack + early + after + waiting + (0 if early_zeros else accumulators) + tick
        return max(head + stages.buffers(traced.kept, sched, False), loop)

    return peak

"""The working set of a step without a stage axis: its backward and update phases, and what
gradient accumulation adds to them.

Each function reads one microbatch's traced residuals (:class:`meshpar.plan.memory.trace.Traced`),
the train state's bytes (:class:`meshpar.plan.memory.train_state.State`) and the gathered
parameters (:mod:`meshpar.plan.memory.gathers`); :func:`meshpar.plan.memory.analytic.analytic`
takes the largest phase. What each phase holds, and why, is in
:mod:`meshpar.plan.memory.analytic`'s docstring (``workspace``).
"""

from __future__ import annotations

import math

import jax
from flax import nnx

from meshpar.plan import shapes
from meshpar.plan.memory import backward as backward_phase
from meshpar.plan.memory import gathers, gradients, residuals, trace, train_state
from meshpar.plan.time import gemm
from meshpar.step import parts, trainer


def transient(step: parts.AbstractStep, traced: trace.Traced, remat: str) -> int:
    """What one backward iteration of the layer loop holds beside the residuals: the slices of
    the stacks a matmul reads (traced, where nothing is recomputed), and under `remat` one
    layer's recomputed residuals, live during its backward."""
    transient = backward_phase.loop_iteration([r for r in traced.kept if r.sliced])
    if traced.slices and remat == "none":  # nothing recomputed: one backward iteration's slices of the stacks, traced
        transient = traced.slices[0]
    if remat != "none":
        recomputed = backward_phase.loop_iteration(trace.saved_activations(step, "none", unrolled=True))
        transient += max(recomputed - backward_phase.loop_iteration(traced.kept), 0)
    return transient


def update(step: parts.AbstractStep, state: train_state.State, traced: trace.Traced, extra: dict,
           compiler_options: dict | None) -> tuple[int, int, int, int | None]:  # fmt: skip
    """(the update phase's bytes, the gradients', one backward layer-loop iteration's gradients
    reduced into their stacks, :func:`meshpar.plan.memory.gradients.one_at_a_time`'s largest gradient
    or None when the update needs every gradient at once)."""
    cfg = step.cfg
    place, grads, iteration = state.place, state.grads, 0
    one_at_a_time = None if place.params else gradients.one_at_a_time(step)
    if one_at_a_time is None:
        # on XLA:GPU the update phase holds the running sum in its place (see gradients.update_phase)
        held = 0 if shapes.platform(step) == "gpu" else state.running_sum
        options = compiler_options or {}
        threshold = options.get("xla_gpu_all_reduce_combine_threshold_bytes", gradients.COMBINE_THRESHOLD)
        local = frozenset()
        if cfg.train.microbatches > 1 and not place.params:  # the accumulation sums these axes locally
            local = frozenset(trainer.reduced_once(step.layout, step.mesh, step.plan.shardings.params))
        update, iteration = gradients.update_phase(step, traced.uses, traced.rolled, int(threshold),
                                                   traced.dtypes, local)  # fmt: skip
        update += held + state.fetched
    else:  # each gradient applied as it is produced: one at a time (and the running sum)
        grads = state.running_sum + one_at_a_time
        # held together, the reduced copies' room is freed before the updates run
        update = grads + state.fetched + max(extra.values(), default=0)
    return update, grads, iteration, one_at_a_time


def held_gradients(step: parts.AbstractStep, state: train_state.State, traced: trace.Traced,
                   grads: int, gathered: gathers.Gathers, extra: dict,
                   together: bool) -> tuple[dict, int, dict | None]:  # fmt: skip
    """How the backward walk holds the gradients: (parameter leaf -> the bytes its update applies
    where the backward produces it, the bytes held from the backward's first step, parameter leaf
    -> the bytes each gradient holds to the update, or None when each is applied as produced).
    `together`: the update needs every gradient at once."""
    cfg = step.cfg
    plan, uses, rolled = step.plan, traced.uses, traced.rolled
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    accumulated = gradients.accumulated(step, uses, rolled)  # held from the backward's first step
    held_grads = gradients.held(step, uses, rolled)
    if state.place.params:  # one layer's gradient on the device at a time: the held bytes shared out as traced
        traced_bytes = sum(u.nbytes for i, u in uses.items() if i < len(variables))
        share = grads - state.running_sum + gathered.grads
        held_grads = {i: u.nbytes * share // max(traced_bytes, 1) for i, u in uses.items()}
    if cfg.train.microbatches == 1:  # applied where the backward produces it, else after the accumulation
        apply = {i: (u.parts - (i in accumulated)) * u.nbytes + extra.get(i, 0) for i, u in uses.items()}
    else:
        apply = {}
    early = sum(held_grads.get(i, 0) for i in accumulated)
    held = None
    if together:  # each part of a gradient held (a tied embedding's: the gather's and the matmul's)
        shares = {i: (uses[i].parts if i in uses else 1) - (i in accumulated) for i in held_grads}
        held = {i: b * shares[i] for i, b in held_grads.items() if shares[i]}
    if cfg.train.microbatches > 1 and shapes.platform(step) == "gpu":
        # each gradient is added to the running sum as it is produced, in place (the matmul's
        # accumulating epilogue); one re-placed to a smaller shard exists whole until reduce-scattered
        # the backward layer loop writes every stacked parameter's gradient into a stack of its own,
        # all live until the loop ends (its outputs), and only then added to the running sum
        # (re-placed ones reduce-scattered layer by layer into stacks at their own shard)
        own = jax.tree.leaves(plan.shardings.params)
        act = shapes.act_shardings(plan.abstract.params, step.layout, step.mesh)
        stacks = {i: math.prod(own[i].shard_shape(v.get_value().shape)) * v.get_value().dtype.itemsize
                  for i, v in enumerate(variables) if rolled and gradients.stacked(v)}  # fmt: skip
        stacked = sum(stacks.values())
        replaced = {i for i in range(len(own)) if own[i].spec != act[i].spec}
        held, early = None, 0
        apply = {i: stacked if i in stacks else u.nbytes if i in replaced else 0 for i, u in uses.items()}
    return apply, early, held


def backward(step: parts.AbstractStep, traced: trace.Traced, gathered: gathers.Gathers, during: int,
             held: tuple[dict, int, dict | None], compiler_options: dict | None) -> int:  # fmt: skip
    """The backward walk's peak over the residuals (:func:`meshpar.plan.memory.backward.walk`), with the
    matmul workspace and, where no layer loop is walked over, one iteration's extras: `during`,
    what one backward iteration of the layer loop holds beyond its residuals; `held`, how the
    gradients are held (:func:`held_gradients`)."""
    platform, kept, uses = shapes.platform(step), traced.kept, traced.uses
    apply, early, together = held
    nvars = len(jax.tree.leaves(step.plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    workspace, partials = (
        gemm.matmul_scratch(step, traced.matmuls_at, compiler_options) if platform == "gpu" else (0, {})
    )
    # the backward iteration's extras where the walk reaches the loop (anywhere, without one)
    loops = {r.at: during for r in kept if r.loop}
    weights: dict = {}  # the weights the backward reads from copies of their own (gathered, or sliced), by place
    for i, b in gathered.kept_by.items():
        weights[uses[i].at] = weights.get(uses[i].at, 0) + b
    late = set()
    if platform == "gpu" and traced.rolled:  # weight gradients of matmuls after the layer loop, run after its backward
        late = {i for i, u in uses.items() if i < nvars and u.matmul and u.at > min(loops, default=u.at)}
    walk = backward_phase.walk(kept, uses, nvars, together, apply, partials, early, platform == "cpu", loops, weights,
                               late)  # fmt: skip
    return walk + workspace + (0 if loops else during)


def accumulation(step: parts.AbstractStep, traced: trace.Traced, gathered: gathers.Gathers) -> tuple[int, int]:
    """(backward, update): the bytes gradient accumulation (``train.microbatches`` > 1) adds to each phase."""
    cfg = step.cfg
    if cfg.train.microbatches == 1:
        return 0, 0
    batch = jax.tree.leaves(shapes.device_batch(step))
    # the batch in microbatch-major order: a transposed copy, the loop's input
    backward, update = cfg.train.microbatches * sum(residuals.nbytes(b) for b in batch), 0
    # the gathers and casts leave the accumulation loop: every copy held through it
    if shapes.platform(step) == "gpu":  # XLA:GPU gathers inside the accumulation loop, once per microbatch
        backward += gathered.layers + sum(traced.casts)
    else:
        backward += gathered.rest + gathered.layers + sum(traced.casts)
        update += gathered.copies
    nparams = len(jax.tree.leaves(step.plan.abstract.params))  # the body's own microbatch of what the backward reads
    backward += sum(residuals.nbytes(b) for j, b in enumerate(batch) if nparams + j in traced.read)
    return backward, update


def residual_split(kept: list[residuals.Residual]) -> tuple[int, int, int]:
    """The residuals' bytes made before the layer loop, by it and after it
    (:attr:`meshpar.plan.memory.analytic.Breakdown.residual_split`)."""
    loop_at = min((r.at for r in kept if r.loop), default=None)
    before = sum(r.total for r in kept if not r.loop and loop_at is not None and r.at < loop_at)
    looped = sum(r.total for r in kept if r.loop)
    return before, looped, sum(r.total for r in kept) - before - looped

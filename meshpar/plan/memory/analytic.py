"""Analytic per-device memory of a config's training run, by category, before anything exists.

The categories come from the real abstract train state (``eval_shape``), its shardings and the
model's own code traced at per-device shapes — ``params``, ``optimizer`` and the inputs exact,
``grads``, ``activations`` and ``workspace`` estimates (the step's working set as the largest of
its phases) — with host offload's bytes apart (``Breakdown.host``). What the model does not
cover is named by :func:`out_of_scope` instead of a figure. The spec: docs/memory-model.md.
"""

from __future__ import annotations

import dataclasses

import jax

from meshpar import models
from meshpar.configuration.config import Config
from meshpar.models import remat as remat_lib
from meshpar.plan.memory import gathers, gradients, phases, pipelined, trace, train_state
from meshpar.plan.out_of_core import offload_plan
from meshpar.sharding import layout as layout_lib
from meshpar.step import parts

CATEGORIES = ("params", "grads", "optimizer", "activations", "workspace", "inputs", "queued_inputs", "relay_inputs")
HOST_EXACT = frozenset({"params", "optimizer", "activations"})  # host offload's column (see above)


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Per-device bytes on the most loaded device, by category (see docs/memory-model.md)."""

    categories: dict[str, int]  # in CATEGORIES order; relay_inputs only in routed feeding
    exact: frozenset[str]  # the categories computed exactly; the others are estimates
    # Per-device bytes in pinned host memory (host offload), by category; empty without offload.
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    # The traced residuals' bytes made before the layer loop, by it (all layers) and after it:
    # where the step makes its activations (meshpar.plan.out_of_core.unified); (0, 0, 0) untraced.
    residual_split: tuple[int, int, int] = (0, 0, 0)

    @property
    def total(self) -> int:
        """Device bytes: the sum of the categories (host bytes are not in it)."""
        return sum(self.categories.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def out_of_scope(cfg: Config, platform: str) -> str | None:
    """Why the model gives no figure for `cfg` compiled for `platform` (``jax.default_backend()``
    names: ``cpu``, ``gpu``, ``tpu``), in one line; None when the config is in its scope."""
    model = models.traits(cfg.model)
    if platform == "cpu" and model.compute_dtype == "bfloat16":
        return "bfloat16 compute on XLA:CPU (it computes bfloat16 matmuls in float32 and keeps float32 copies)"
    if model.dropout > 0.0:
        return "dropout (XLA keeps the 32-bit random bits behind each mask)"
    if model.experts and getattr(cfg.model, "moe_dispatch", "capacity") == "dropless":
        # Traced as jax lowers ragged_dot (meshpar.models.moe._ragged_dot: one masked copy of the
        # rows per expert), dropless dispatch with every expert whole on every device is modelled
        # (validate_memory's rows). Split weights are not: each device gathers its group's tokens,
        # rolls them (copies of every row) and reduces the outputs, or gathers d_ff or embed at the
        # region's edge (meshpar.models.moe._dropless_split): moe_tiny dropless, every other layer,
        # on its own layout 20.5% under XLA:CPU's total (validate_memory.py --ci --beyond-scope).
        weights = ("experts", "d_ff", "embed")
        split = [d for rules in (cfg.layout, cfg.param_layout) for d, _ in layout_lib.on_mesh(rules, {n for n, s in cfg.mesh if s != 1})
                 if d in weights]  # fmt: skip
        if split:
            return (f"dropless mixture-of-experts dispatch with the expert weights split by {', '.join(sorted(set(split)))} "
                    "(the gathered, rolled rows are not modelled)")  # fmt: skip
    if model.experts and model.remat not in (None, "none"):
        # the recomputed dispatch and expert MLPs of a layer's backward keep copies of the expert
        # hidden [groups, experts, capacity, d_ff] (XLA:CPU's transposes for its dots) that the
        # working set does not count: moe_tiny with remat full 25.9% under XLA:CPU's total
        # (validate_memory.py --ci --beyond-scope)
        return f"a mixture of experts under model.remat {model.remat} (the recomputed expert MLPs' copies are not modelled)"
    axes = {name for name, size in cfg.mesh if size != 1}
    if model.experts and any(dim == "layers" for dim, _ in layout_lib.on_mesh(cfg.layout, axes)):
        # the pipeline's accounting (meshpar.plan.memory.stage_axis) counts a stage's dense layers'
        # residuals per tick; the dispatch maps and routed tokens each tick keeps are not in it:
        # moe_tiny on data:2,stage:2,expert:2 18.6% under XLA:CPU's total (validate_memory.py --ci --beyond-scope)
        return "a mixture of experts under a stage axis (the pipeline's accounting leaves out the dispatch buffers)"
    if any(dim == "length" for dim, _ in layout_lib.on_mesh(cfg.layout, axes)):
        # context-parallel attention (meshpar.models.context_parallel) gathers or passes keys and
        # values over the split, and the partitioner reshards the dense projections' batch·length
        # rows: the per-device program is not one device's slice
        return "a sequence split (layout puts length on a mesh axis: attention gathers or passes keys and values)"
    offload = getattr(cfg, "offload", None)
    moved = any(getattr(offload, k, False) for k in ("optimizer", "params"))
    # host offload: of the state, of activations, or a remat policy's (model.remat minimal_offloaded, ...)
    offloaded = moved or getattr(offload, "activations", "none") != "none" or bool(remat_lib.offloaded(model.remat))
    if platform == "cpu" and offloaded:
        return "host offload on XLA:CPU (it ignores memory kinds inside the step: nothing moves to or from the host)"
    if platform == "gpu" and jax.default_backend() != "gpu" and offloaded:
        # a GPU target on a host without one is compile-only: its devices have no memories to place arrays in
        return ("host offload on a GPU compiled deviceless (compile-only devices have no pinned_host memory: "
                "the step is compiled with everything on the device)")  # fmt: skip
    return None


def analytic(step: parts.AbstractStep, compiler_options: dict | None = None) -> Breakdown:
    """The built step's per-device memory by category (nothing allocated; the step is not compiled —
    for a GPU, each distinct matmul is, alone, to read what XLA:GPU's lowering of it holds:
    :func:`meshpar.plan.time.gemm.matmul_scratch`). `compiler_options`: those the step will be compiled with
    (``Lowered.compile``'s; on a GPU the matmuls' lowering follows them); default the step's own XLA
    flags (:attr:`meshpar.step.parts.AbstractStep.compiler_options`)."""
    compiler_options = step.compiler_options if compiler_options is None else compiler_options
    state = train_state.state_bytes(step)
    if step.plan.schedule is not None:  # a stage axis: the pipeline's own accounting (meshpar.plan.memory.stage_axis)
        return Breakdown(pipelined.categories(step, step.plan.schedule, state), state.exact, state.host)
    place, remat = state.place, step.traits.remat or "none"
    # the named residuals on the host (offload.activations', or an offloading remat policy's),
    # the rest recomputed
    offloading = place.activations != "none" or bool(remat_lib.offloaded(remat))
    if offloading:
        own = place.activations == "none"
        names = remat_lib.offloaded(remat) if own else step.family.kept_activations(place.activations)
        prof, remat = offload_plan.profile(step), "full"
        state.host["activations"] = prof.named_bytes(names) * prof.layers
    traced = trace.traced(step, remat if offloading else None, slices=remat == "none")
    kept = traced.kept
    gathered = gathers.gathers(step, traced.read, traced.rolled, traced.dtypes)  # param_layout: stored split
    activations = sum(r.total for r in kept) + gathered.kept
    if place.params and remat == "none":  # every layer's fetched weights kept for the backward
        activations += (offload_plan.profile(step).layers - 1) * state.weights.layer_compute
    extra = gradients.update_extra(step, traced.uses)  # what each leaf's update holds beyond its gradient
    update, grads, iteration, one_at_a_time = phases.update(step, state, traced, extra, compiler_options)
    held = phases.held_gradients(step, state, traced, grads, gathered, extra, together=one_at_a_time is None)
    # one backward iteration of the layer loop: its recomputed residuals and gathered weights
    # while it runs, or at its end, once those have died, its layer's gradients being reduced
    during = max(phases.transient(step, traced, remat) + gathered.iteration, iteration)
    backward = phases.backward(step, traced, gathered, during, held, compiler_options)
    backward += activations - sum(r.total for r in kept) - gathered.kept + state.running_sum + gathered.loop
    more_backward, more_update = phases.accumulation(step, traced, gathered)
    backward, update = backward + more_backward, update + more_update
    categories = train_state.categories(
        step, params=state.params, grads=grads, optimizer=state.optimizer, activations=activations,
        workspace=max(backward, update, gathered.copies + gathered.relayout) - grads - activations,
    )  # fmt: skip
    return Breakdown(categories, state.exact, state.host, phases.residual_split(kept))

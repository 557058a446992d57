"""One device's residuals for the backward pass: the model's loss traced at per-device shapes.

:func:`saved_activations` is what the memory plan (:mod:`meshpar.plan.memory.analytic`) counts as
``activations``, and what the rest of its phases are walked over; which residuals XLA keeps,
and why, is in that module's docstring. :func:`local_loss` is the loss at one device's shapes
that the trace reads, also read by the search's kernel count and the reshard model.
:func:`recompute` is what a remat policy runs again, read from the same trace: the search's
estimate and the out-of-core model price it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from meshpar import jaxprs, models
from meshpar.plan import shapes
from meshpar.plan.memory import residuals
from meshpar.step import parts, trainer


def local_loss(step: parts.AbstractStep, remat: str | None = None, unrolled: bool = False, rolled: bool = False):
    """The model's loss as a function of the parameters and the batch, and the parameters at one
    device's shapes (see :func:`saved_activations` for `remat` and `unrolled`)."""
    cfg = step.cfg
    state, batch, _ = step.args
    params = shapes.local_params(state.params, step.layout, step.mesh)
    graphdef = step.plan.graphdef
    offloads = getattr(getattr(cfg, "offload", None), "activations", "none") != "none"  # the step's own policy differs
    model, own = cfg.model, step.traits  # the loop's form set where the family names a field for it
    if unrolled and own.stack_layers is not None:
        model = models.with_settings(model, scan_unroll=own.stack_layers)
    if rolled:
        model = models.with_settings(model, scan_unroll=1)
    if remat is not None and (remat != (own.remat or remat) or offloads) or model is not cfg.model:
        spec = {k: (tuple(b.shape[1:]), b.dtype) for k, b in batch.items()}
        model = models.with_settings(model, remat=remat) if remat is not None else model
        build = functools.partial(step.family.build, model, spec)
        graphdef, _ = trainer.abstract_model(build)

    def loss(params, batch):
        batch = jax.tree.map(jax.lax.stop_gradient, batch)  # the step differentiates the params only
        rngs = nnx.Rngs(dropout=jax.random.key(0))
        return nnx.merge(graphdef, params).loss(batch, rngs=rngs)[0]

    return loss, params


def saved_activations(
    step: parts.AbstractStep,
    remat: str | None = None,
    read: set[int] | None = None,
    uses: dict | None = None,
    slices: list | None = None,
    casts: list | None = None,
    unrolled: bool = False,
    matmuls_at: dict | None = None,
    dtypes: dict | None = None,
    rolled: bool = False,
) -> list[residuals.Residual]:
    """What one device keeps for the backward pass of one microbatch
    (:func:`meshpar.plan.memory.residuals.kept_residuals` of the model's loss at per-device shapes, no
    layout active). `remat`: trace the model under this ``model.remat`` instead of the config's.
    `read` (when given) receives the indices of the parameter leaves the backward pass reads
    (residuals that are parameters); `uses`, where each leaf's gradient is produced (the
    parameters first, then the batch); `slices`, where the layer loop runs as a loop, what one
    backward iteration writes out of the residual stacks
    (:func:`meshpar.plan.memory.residuals.backward_slices`); `casts`, the parameters' widening casts
    that are not residuals. `unrolled`: trace the layer loop as straight-line code (every layer
    in one iteration), as the backward recomputes one layer under remat, within fusion's reach.
    `matmuls_at`: the matmuls each place in the forward's program order runs; `dtypes`, the dtype
    the forward casts each parameter leaf to, where it does (:func:`meshpar.plan.memory.residuals.kept_residuals`).
    `rolled`: trace the layer loop as a loop (every residual its body hands out kept, one layer's
    loop too), as a pipeline stage's layers run inside the tick loop (:mod:`meshpar.plan.memory.stage_axis`)."""
    loss, params = local_loss(step, remat, unrolled, rolled)
    local = shapes.device_batch(step)
    with shapes.on_target(step, local=True):  # the layer loop's form and the attention kernel the target's
        cheap = residuals.GPU_CHEAP if shapes.platform(step) == "gpu" else frozenset()
        kept = residuals.kept_residuals(loss, params, local, read=read, uses=uses, casts=casts, matmuls_at=matmuls_at,
                                        dtypes=dtypes, cheap=cheap, looped=rolled)  # fmt: skip
        if slices is not None and any(r.rolled for r in kept):
            slices.append(residuals.backward_slices(loss, params, local, gpu=shapes.platform(step) == "gpu"))
    return kept


@dataclasses.dataclass
class Traced:
    """One microbatch's residuals (:func:`saved_activations`) and what the trace gives beside them."""

    kept: list[residuals.Residual]
    read: set[int] = dataclasses.field(default_factory=set)  # the parameters the backward reads
    uses: dict = dataclasses.field(default_factory=dict)  # where the backward produces each gradient
    slices: list[int] = dataclasses.field(default_factory=list)  # a rolled loop: one backward iteration's slices
    casts: list[int] = dataclasses.field(default_factory=list)  # the parameters' widening casts that are not residuals
    matmuls_at: dict = dataclasses.field(default_factory=dict)  # place -> the matmuls there (XLA:GPU's scratch)
    dtypes: dict = dataclasses.field(default_factory=dict)  # the parameters the forward casts, to their dtype

    @property
    def rolled(self) -> bool:
        """The layer loop runs as a loop."""
        return any(r.rolled for r in self.kept)


def traced(step: parts.AbstractStep, remat: str | None, slices: bool) -> Traced:
    """The residuals of `step` under `remat` (None: the config's own), with the trace's other
    figures; `slices`: the backward iteration's slices of a rolled loop's stacks too."""
    out = Traced([])
    out.kept = saved_activations(step, remat, read=out.read, uses=out.uses, slices=out.slices if slices else None,
                                 casts=out.casts, matmuls_at=out.matmuls_at, dtypes=out.dtypes)  # fmt: skip
    return out


@dataclasses.dataclass(frozen=True)
class Recompute:
    """The matmul FLOPs of one device's gradient of one microbatch, under the step's remat policy
    and under none: what the policy's backward runs again, derived from the policy itself."""

    flops: float  # jax.grad of the loss under the step's model.remat
    without: float  # the same under remat none

    @property
    def again(self) -> float:
        """FLOPs the backward runs again (the recomputed forward's matmuls)."""
        return max(self.flops - self.without, 0.0)

    @property
    def factor(self) -> float:
        """The step's matmul work over the same without remat (1: nothing recomputed)."""
        return self.flops / self.without if self.without else 1.0


def _grad_flops(step: parts.AbstractStep, remat: str | None) -> float:
    loss, params = local_loss(step, remat)
    with shapes.on_target(step, local=True):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(params, shapes.device_batch(step))
    return sum(jaxprs.matmul_flops(eqn)[0] * copies for eqn, copies, _ in jaxprs.walk(jaxpr))


def recompute(step: parts.AbstractStep) -> Recompute:
    """What `step`'s ``model.remat`` policy runs again (:class:`Recompute`): its gradient traced
    under the policy and under none; without a policy nothing, untraced."""
    if not step.traits.remat_on:
        return Recompute(0.0, 0.0)
    return Recompute(_grad_flops(step, None), _grad_flops(step, "none"))

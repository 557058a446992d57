"""A stage axis in the planner (``layers:<axis>``, :mod:`meshpar.pipeline`): what a pipeline
costs per device in memory and in time, each formula once. The memory model
(:mod:`meshpar.plan.memory`), the layout search's estimate (:mod:`meshpar.plan.search`) and the
pre-flight's candidates (:mod:`meshpar.plan.candidates`) call these.

Notation: S stages, M microbatches (``train.microbatches``), R groups of layers per stage
(``pipeline.repeats``; 1 for GPipe), T = R·M + S − 1 ticks, L layers, B the batch rows one
device of a stage holds (the global batch over the batch axes), ``x`` the bytes of the layer
stack's input for those B rows ([batch, length, embed] in the compute dtype).

**Memory** (per device, :func:`activations`, :func:`buffers`). Each stage holds the stack's
parameters, gradients and optimizer state of its L/S layers: the ``layers`` dim of every stacked
parameter is split over the stage axis, so the exact, layout-driven categories divide by S
already (nothing here). The forward is one ``lax.scan`` over T ticks that runs as a loop: every
residual its body (one group of L/(S·R) layers on one microbatch of B/M rows) hands to the
backward leaves it stacked over the ticks, beyond fusion's reach — so a stage keeps

    activations = T / R × (every residual of its L/S layers for one microbatch, as a rolled loop keeps them)
                + M × (the residuals outside the stack for one microbatch: embedding, head)

— the first term is (R·M + S − 1) / (R·M) × the activations of L/S layers for all B rows (the
bubble's ticks keep residuals too: idle stages compute on zeros); the second, the layers outside
the pipeline, run on every stage for the whole batch. The per-microbatch residuals are traced
as the memory model traces any step (:func:`meshpar.plan.memory.saved_activations`), the layer
loop rolled. There is no gradient accumulation: with a stage axis ``train.microbatches`` are
the pipeline's, and no float32 running sum is held. The pipeline's own buffers (workspace):
the stack's output collected over the ticks (x), the cotangent of the stack's input the
backward scan accumulates (x), the circular schedule's loop buffer (x, R > 1), and under
``model.remat`` the backward tick's recomputed residuals of its group for one microbatch.

**Time** (:func:`compute_factor`, :func:`traffic`). A device runs one group per tick
for T ticks: its busy time is the layer compute of L/S layers for B rows stretched by the
bubble, ``T / (R·M)``, i.e.

    layer compute per device = (layer FLOPs of the batch) / (S × split ways) × T / (R·M),

while the work outside the stack (embedding, head) is computed on every stage for the whole
batch (replicated over the stage axis). Each tick every stage sends its output, x / M bytes, to
the next stage with a ``collective-permute`` over the stage axis, forward and (its transpose)
backward: 2·T permutes per step, each ``x / M / bandwidth + latency`` on the link the stage
axis's neighbours use (:func:`meshpar.plan.cost.collective_seconds`); the outputs are summed
over the stage axis once (an all-reduce of x; its transpose in the backward is free). The
HLO-based model (:mod:`meshpar.plan.timing`) needs nothing of this: the compiled program's
tick loop, its trip count and its permutes carry it; these are the search's analytic terms.
"""

from __future__ import annotations

import dataclasses
import math

from flax import nnx

from meshpar import pipeline
from meshpar.plan import cost


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


def activations(kept, sched: pipeline.Schedule, weights: int = 0) -> int:
    """A stage's saved activations (see the module docstring): `kept`, the residuals of one
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


def stack_weights(plan, itemsize: int) -> int:
    """Bytes one device holds of the layer stack's weights (every parameter whose first dim is
    ``layers``), at `itemsize` bytes per element (the dtype the layers compute in)."""
    total = 0
    for (_, var), (_, sharding) in zip(nnx.to_flat_state(plan.abstract.params), nnx.to_flat_state(plan.shardings.params)):
        dims = var.get_metadata().get("dims") or ()
        if dims and dims[0] == "layers":
            total += math.prod(sharding.get_value().shard_shape(var.get_value().shape)) * itemsize
    return total


def buffers(kept, sched: pipeline.Schedule, recomputed: int = 0) -> int:
    """The pipeline's buffers beside the residuals (see the module docstring): the collected
    outputs and the input's cotangent, the loop buffer under repeats, and `recomputed`, one
    layer's residuals of one microbatch recomputed under remat (times the group's layers)."""
    x = carry_bytes(kept) * sched.microbatches
    group = 0
    if recomputed:
        group = recomputed * max(len_group(kept, sched), 1)
    return x * (2 + (sched.repeats > 1)) + group


def len_group(kept, sched: pipeline.Schedule) -> int:
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
    ``[rows, length, embed]`` in `itemsize`-byte elements (see the module docstring)."""
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


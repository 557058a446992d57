"""The exactly known part of the memory plan: the train state's bytes per device, where host
offload puts them (device or pinned host memory), and the batches'.

Each figure is read from the abstract train state and its shardings (:mod:`meshpar.step.parts`);
what each category holds is in :mod:`meshpar.plan.memory.analytic`'s docstring.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshpar.plan import cost, programs
from meshpar.plan.out_of_core import offload_plan
from meshpar.step import aot, parts

EXACT = frozenset({"params", "optimizer", "inputs", "queued_inputs", "relay_inputs"})


def categories(step: parts.AbstractStep, **working) -> dict[str, int]:
    """The categories in order: `working` (params, grads, optimizer, activations, workspace) and the batches."""
    cfg = step.cfg
    one_batch = aot.shard_bytes(step.args[1])
    out = {**working, "inputs": one_batch, "queued_inputs": one_batch * cost.resident_batches(cfg)}
    if cfg.feed.mode == "routed":
        out["relay_inputs"] = programs.relay_bytes(cfg, step.args[1])
    return out


@dataclasses.dataclass
class State:
    """The train state's bytes per device where the offload placement puts them (:func:`state_bytes`)."""

    params: int  # on the device (parameter offload: one layer's and those outside the layers)
    grads: int  # the gradients, and the running sum with microbatches
    running_sum: int  # gradient accumulation's float32 sum (0 without microbatches)
    optimizer: int  # on the device, with the step counter and the RNG key
    host: dict[str, int]  # in pinned host memory, by category
    fetched: int  # what the update fetches from the host beside the device's state
    exact: frozenset[str]  # the categories computed exactly
    place: offload_plan.Placement
    weights: offload_plan.Weights | None  # parameter offload's per-layer weights (else None)


def state_bytes(step: parts.AbstractStep) -> State:
    """The parameters, gradients and optimizer state of `step`'s plan, on the device and (host
    offload) in host memory: exact from the shardings, but parameter offload's device share."""
    cfg = step.cfg
    plan = step.plan
    params = aot.shard_bytes(plan.abstract.params, plan.shardings.params)
    running_sum = running_sum_bytes(plan) if cfg.train.microbatches > 1 else 0
    grads = params + running_sum
    rest = (plan.abstract.opt_state, plan.abstract.step, plan.abstract.rng)
    optimizer = aot.shard_bytes(rest, (plan.shardings.opt_state, plan.shardings.step, plan.shardings.rng))
    place, host, fetched, w = offload_plan.placement(cfg, plan), {}, 0, None
    exact = EXACT
    if place.optimizer:  # the state lives on the host; the update fetches it (see meshpar.plan.memory.analytic)
        host["optimizer"] = aot.shard_bytes(plan.abstract.opt_state, plan.shardings.opt_state)
        optimizer -= host["optimizer"]
        fetched += offload_plan.largest_moments(plan)
    if place.params:  # one layer's weights (and its gradient) on the device at a time
        w = offload_plan.weights(plan, step.layout, step.mesh)
        host["params"], host["grads"] = params, params
        grads, params = running_sum + w.layer, w.layer + w.other
        fetched += 2 * offload_plan.largest_param(plan)  # a parameter and its gradient
        exact = exact - {"params"}
    return State(params, grads, running_sum, optimizer, host, fetched, exact, place, w)


def running_sum_bytes(plan) -> int:
    """Bytes per device of gradient accumulation's float32 running sum, in the parameters' shardings."""
    f32 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), plan.abstract.params)
    return aot.shard_bytes(f32, plan.shardings.params)

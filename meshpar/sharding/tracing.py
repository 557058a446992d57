"""The one context a model is traced in: what model code follows without being passed it.

Model code names logical dims only and is the same for every layout, so what a trace depends
on — the layout rules and the mesh they resolve onto, whether the parameters live in pinned host
memory, the pipeline schedule of the layer stack, which values each layer keeps for its backward
pass, and the set collecting the dims the model places — travels beside the call, in one
:class:`Trace` (flax's ``logical_axis_rules`` context is the model: one object, not a variable
per setting). A step sets it once around the function it traces::

    with tracing.using(Trace(layout=layout, mesh=mesh, schedule=schedule)):
        loss = model.loss(batch)

and the library reads it where a choice is made: :func:`meshpar.sharding.layout.constrain` and
:func:`meshpar.sharding.layout.use` (placement), :func:`meshpar.models.layers.run_layers` (the stages),
:func:`meshpar.models.remat.checkpointed` (what a layer keeps).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class Trace:
    """What a traced model follows; the defaults change nothing (no layout: no placement)."""

    # Typed Any: meshpar.sharding.layout and meshpar.sharding.stages read the trace, so this module cannot
    # import them for their classes.
    layout: Any = None  # meshpar.sharding.layout.Layout: the rules activations and parameters are placed by
    mesh: Mesh | None = None  # the mesh `layout` resolves onto (a compile target's, for AOT)
    params_on_host: bool = False  # parameters given to the model live in pinned host memory
    schedule: Any = None  # meshpar.sharding.stages.Schedule: the layer stack's pipeline (None: in sequence)
    # (names, memory): every layer keeps exactly the values tagged `names` for its backward
    # pass, in `memory` ("pinned_host": offloaded; "device": saved), in place of model.remat.
    keep: tuple[tuple[str, ...], str] | None = None
    seen: set[str] | None = None  # collects every dim the model places (None: not collected)
    # A trace at one device's shapes (the planner's memory model): how many ways the step's
    # layout splits each logical dim, which the traced shapes are already divided by. Model
    # code that moves a tensor from one split to another (the routed tokens of
    # meshpar.models.moe, from the batch's axes to the experts') reads it for its per-device shape.
    splits: Mapping[str, int] | None = None


_CURRENT: contextvars.ContextVar[Trace] = contextvars.ContextVar("meshpar_trace", default=Trace())


def current() -> Trace:
    """The trace of the enclosing :func:`using` block (outside any: nothing set)."""
    return _CURRENT.get()


@contextlib.contextmanager
def using(trace: Trace | None = None, **changes) -> Iterator[Trace]:
    """Within this block models are traced under `trace` (default: the enclosing one) with
    `changes` (fields of :class:`Trace`) applied; yields the trace in force."""
    new = dataclasses.replace(_CURRENT.get() if trace is None else trace, **changes)
    token = _CURRENT.set(new)
    try:
        yield new
    finally:
        _CURRENT.reset(token)

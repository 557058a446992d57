"""Pipeline parallelism over a stage axis: ``layers:<axis>`` in the layout.

A layout rule ``layers:stage`` splits a model's layer stack into stages over the mesh axis
``stage``, and the layers run as a pipeline (:func:`run`): the batch is cut into
``train.microbatches`` microbatches, each stage runs its layers on one microbatch per tick and
hands the result to the next stage with a ``ppermute`` over the stage axis. The other mesh axes
are left to XLA's partitioner inside the stage function (``jax.shard_map`` over the stage axis
alone), so the model code is the same for every layout: it calls
:func:`meshpar.models.layers.run_layers`, which runs the stack here when a schedule is active
(:func:`active`). Two schedules (``pipeline.schedule``, after MaxText's): ``gpipe`` and
``circular`` (:class:`Schedule`). An op with its own partitioning rule runs fully manual inside
a stage (:func:`manual`).

Layers are *stored* in the order each stage's slice of the ``layers`` dim needs
(:func:`stored_order`); checkpoints always hold the canonical order, and :class:`Reorder`
converts a state at the run's edges. What runs, the schedules, the memory and the checks:
docs/pipeline.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from meshpar.sharding import layout as layout_lib
from meshpar.sharding import tracing


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline: `stages` stages over mesh axis `axis`, `microbatches` per step, `kind` ``gpipe``
    or ``circular`` with `repeats` groups of layers per stage (1 for gpipe)."""

    axis: str
    stages: int
    microbatches: int
    kind: str = "gpipe"
    repeats: int = 1

    @property
    def ticks(self) -> int:
        """Ticks of the forward pass: every stage runs one microbatch through one group per tick."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The schedule's idle share per stage: ``(S − 1) / (R·M + S − 1)`` (computed, not measured)."""
        return (self.stages - 1) / self.ticks


def stage_axis(layout: layout_lib.Layout) -> str | None:
    """The mesh axis the layout splits ``layers`` over (a one-axis rule), or None."""
    axes = layout.axis("layers")
    return axes if isinstance(axes, str) else None


def schedule_for(layout: layout_lib.Layout, kind: str, repeats: int, microbatches: int) -> Schedule | None:
    """The pipeline a layout runs (``pipeline.schedule``, ``pipeline.repeats``,
    ``train.microbatches``), or None when it splits no layers over a mesh axis."""
    axis = stage_axis(layout)
    if axis is None:
        return None
    return Schedule(axis, layout.axis_size("layers"), microbatches, kind, repeats if kind == "circular" else 1)


def problem(sched: Schedule, n_layers: int | None, key: str) -> tuple[str, str] | None:
    """(config key, what is wrong) when `sched` cannot run a stack of `n_layers` layers (None:
    the model has no layer stack), else None. `n_layers` and `key`, the config key that sets it,
    are the model family's (:class:`meshpar.models.Traits`: ``stack_layers``)."""
    if n_layers is None:
        return "layout", f"layers:{sched.axis} pipelines a layer stack, and this model has none (drop the rule)"
    groups = sched.stages * sched.repeats
    if n_layers % groups:
        split = (
            f"{sched.stages} stages × {sched.repeats} repeats" if sched.kind == "circular" else f"{sched.stages} stages"
        )
        return key, f"{n_layers} layers do not split evenly into {split} (mesh axis '{sched.axis}')"
    if sched.kind == "circular" and sched.microbatches < sched.stages:
        return "train.microbatches", (
            f"{sched.microbatches} is fewer than the {sched.stages} stages over '{sched.axis}': the circular schedule "
            f"needs at least as many microbatches as stages"
        )
    return None


def bubble_note(sched: Schedule) -> str | None:
    """One line for a GPipe schedule with fewer microbatches than stages (it runs, idly)."""
    if sched.kind == "gpipe" and sched.microbatches < sched.stages:
        return (
            f"train.microbatches {sched.microbatches} < {sched.stages} pipeline stages: each stage idles "
            f"{sched.bubble:.0%} of the step (bubble (S-1)/(M+S-1)); use at least {sched.stages} microbatches"
        )
    return None


def active() -> Schedule | None:
    """The schedule :func:`meshpar.models.layers.run_layers` follows in the enclosing trace
    (:class:`meshpar.sharding.tracing.Trace`'s ``schedule``; None: layers run in sequence)."""
    return tracing.current().schedule


# ---------------------------------------------------------------------------------------------
# Microbatches


def split_microbatches(x: jax.Array, k: int) -> jax.Array:
    """``[batch, ...]`` → ``[k, batch / k, ...]``, microbatch i holding rows i, i + k, i + 2k, ….

    Every device's contiguous block of rows splits into k strided microbatches of its own, so
    each microbatch takes rows from every device and no row moves between devices (the batch
    dim's blocks stay where they are: ``[batch / k, k]`` has the same blocks on its first dim).
    """
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:])  # [batch / k, k, ...]
    return layout_lib.constrain(jnp.moveaxis(x, 1, 0), (None, "batch") + (None,) * (x.ndim - 2))


def merge_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of :func:`split_microbatches`: ``[k, batch / k, ...]`` → ``[batch, ...]``."""
    k = x.shape[0]
    x = jnp.moveaxis(x, 0, 1)  # [batch / k, k, ...]
    return x.reshape(x.shape[0] * k, *x.shape[2:])


# ---------------------------------------------------------------------------------------------
# The pipelined stack

# `run_stage(weights, x, key)`: one group's layers (weights each ``[K, ...]``) on ``x``, in order;
# with statistics (`aux`), ``(x, values)``, each value stacked ``[K, ...]`` over the group's layers.
RunStage = Callable[[dict[str, jax.Array], jax.Array, "jax.Array | None"], "jax.Array | tuple[jax.Array, dict]"]


def run(
    sched: Schedule,
    run_stage: RunStage,
    stacked: dict[str, jax.Array],
    x: jax.Array,
    key: jax.Array | None,
    aux: bool = False,
    maxed: tuple[str, ...] = (),
):
    """The layer stack `stacked` (each ``[layers, ...]`` in stored order, :func:`stored_order`)
    on ``x [batch, ...]`` as the pipeline `sched`; returns the last layer's output, ``x``'s shape,
    and with `aux` also each layer's values (``run_stage``'s statistics), each ``[layers, ...]``
    in canonical layer order, averaged over the microbatches.

    Inside ``jax.shard_map`` over the stage axis (every other mesh axis left to the partitioner,
    so the layout's data, model and FSDP splits hold inside a stage as outside), stage s keeps
    its slice of the stack and, per tick, runs one microbatch through one group of it
    (:class:`_Stage`); a ``psum`` over the stage axis gives every stage the result. The entries
    of `stacked` named in `maxed` reach each tick as that tick's copy (:func:`fan_out_max`), so
    that their gradients over the ticks combine by max, not by sum.
    """
    mesh = layout_lib.active_mesh()
    if mesh is None:
        raise ValueError("a pipeline runs under an active layout (meshpar.sharding.layout.activate)")
    axis = sched.axis
    micro = split_microbatches(x, sched.microbatches)  # [M, batch / M, ...]
    n_layers = next(iter(stacked.values())).shape[0]
    keys = () if key is None else (key,)  # dropout's key, replicated
    in_specs = ({name: PartitionSpec(axis) for name in stacked}, PartitionSpec(), *(PartitionSpec() for _ in keys))
    out, values = jax.shard_map(
        lambda w, micro, *k: _run_stages(sched, run_stage, w, micro, k[0] if k else None, aux, n_layers, maxed),
        mesh=mesh, in_specs=in_specs, out_specs=(PartitionSpec(), PartitionSpec()), axis_names={axis}, check_vma=True,
    )(stacked, micro, *keys)  # fmt: skip
    return (merge_microbatches(out), values) if aux else merge_microbatches(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_out_max(v: jax.Array, n: int) -> jax.Array:
    """`v` repeated `n` times along a new leading dim, whose gradient is the max of the `n`
    copies' gradients (a broadcast's is their sum): for a value the backward pass writes, not
    adds to, such as an FP8 amax history (:class:`meshpar.models.fp8.History`)."""
    return jnp.broadcast_to(v, (n, *v.shape))


fan_out_max.defvjp(lambda v, n: (fan_out_max(v, n), None), lambda n, _, g: (jnp.max(g, axis=0),))


def _run_stages(sched: Schedule, run_stage: RunStage, w: dict, micro: jax.Array, key, aux: bool, n_layers: int,
                maxed: tuple[str, ...] = ()):  # fmt: skip
    """Inside the stage axis's ``shard_map``: every tick of the schedule on this stage (one
    ``lax.scan``), then the last stage's outputs and every stage's statistics, by ``psum``."""
    S, R = sched.stages, sched.repeats
    K = n_layers // (S * R)  # layers per group
    index = jax.lax.axis_index(sched.axis)
    weights = {name: v.reshape(R, K, *v.shape[1:]) for name, v in w.items()}  # this stage's [R, K, ...]
    stage = _Stage(sched, run_stage, weights, micro, key, aux, index)
    zeros = stage.varying(jnp.zeros_like(micro))  # [M, batch / M, ...]
    sums = {}
    if aux:  # each value's sums over the microbatches, per group of this stage: [R, K, ...]
        shapes = jax.eval_shape(run_stage, stage.group(0), zeros[0], key)[1]
        sums = jax.tree.map(lambda v: stage.varying(jnp.zeros((R, *v.shape), v.dtype)), shapes)
    init = (zeros[0], zeros, zeros if R > 1 else zeros[:0], sums)
    per_tick = {name: fan_out_max(weights[name], sched.ticks) for name in maxed}  # each [T, R, K, ...]
    (_, outputs, _, sums), _ = jax.lax.scan(stage.tick, init, (jnp.arange(sched.ticks), per_tick))
    out = jax.lax.psum(jnp.where(stage.index == S - 1, outputs, 0), sched.axis)
    return out, jax.tree.map(lambda total: stage.canonical(total, n_layers), sums)


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One stage of the pipeline, inside the stage axis's ``shard_map``: per tick it takes a
    microbatch in (stage 0: a fresh one, or one re-entering under the circular schedule; every
    other stage: its predecessor's output), runs it through one group of its layers, and a
    ``ppermute`` hands the result to the next stage (stage S−1's to stage 0). The last stage
    collects each microbatch's output after its last group.

    Statistics are collected alike: a stage adds its group's values to its sums on the ticks it
    works (never in the bubble, where it runs on zeros), places its sums where its groups sit in
    the canonical order (:meth:`canonical`), and a ``psum`` over the stage axis gathers every
    stage's. Divided by M, a value that is a mean over its microbatch's tokens is the batch's
    mean: the microbatches hold equally many tokens."""

    sched: Schedule
    run_stage: RunStage
    weights: dict[str, jax.Array]  # this stage's groups of layers, each [R, K, ...]
    micro: jax.Array  # [M, batch / M, ...]
    key: jax.Array | None
    aux: bool
    index: jax.Array  # s: this stage's place on the stage axis

    def varying(self, v: jax.Array) -> jax.Array:
        return jax.lax.pcast(v, self.sched.axis, to="varying")

    def group(self, r) -> dict[str, jax.Array]:
        return {name: jax.lax.dynamic_index_in_dim(v, r, keepdims=False) for name, v in self.weights.items()}

    def entering(self, state: jax.Array, loop: jax.Array, t) -> tuple[jax.Array, jax.Array]:
        """(What stage 0 takes in at tick `t`, the circular schedule's microbatches between passes)."""
        S, M = self.sched.stages, self.sched.microbatches
        if self.sched.repeats == 1:
            return self.varying(jax.lax.dynamic_index_in_dim(self.micro, jnp.clip(t, 0, M - 1), keepdims=False)), loop
        # What stage 0 received now is stage S−1's output of tick t − 1: microbatch (t − S) mod M
        # after a group short of its last, kept until it re-enters.
        back = jnp.maximum(t - S, 0) % M
        kept = jnp.where(t >= S, state, jax.lax.dynamic_index_in_dim(loop, back, keepdims=False))
        loop = jax.lax.dynamic_update_index_in_dim(loop, kept, back, 0)
        fresh = jax.lax.dynamic_index_in_dim(self.micro, jnp.minimum(t, M - 1), keepdims=False)
        again = jax.lax.dynamic_index_in_dim(loop, t % M, keepdims=False)
        return jnp.where(t < M, self.varying(fresh), again), loop

    def tick(self, carry, xs):
        """One tick of the ``lax.scan``: `carry` is (the input from the previous stage, the
        collected outputs ``[M, ...]``, the re-entering microbatches, the statistics' sums); `xs`
        the tick's number and its own copies of the maxed weights (:func:`_run_stages`)."""
        t, own = xs
        if own:
            return dataclasses.replace(self, weights={**self.weights, **own}).tick(carry, (t, {}))
        state, outputs, loop, sums = carry
        S, M, R, s = self.sched.stages, self.sched.microbatches, self.sched.repeats, self.index
        first, loop = self.entering(state, loop, t)
        h = jnp.where(s == 0, first, state)
        i = t - s  # this stage's work item: microbatch i mod M of group i // M (idle outside 0 .. R·M − 1)
        m, r = jnp.clip(i, 0, R * M - 1) % M, jnp.clip(i // M, 0, R - 1)
        k = None if self.key is None else jax.random.fold_in(jax.random.fold_in(self.key, m), r * S + s)
        if R == 1:  # one group: the stage's whole slice, the same at every tick
            out = self.run_stage({name: v[0] for name, v in self.weights.items()}, h, k)
        else:
            # The group changes from tick to tick: the backward pass keeps each tick's copy of
            # its weights (T copies of a group's), the circular schedule's price.
            out = self.run_stage(self.group(r), h, k)
        if self.aux:
            out, values = out
            busy = (i >= 0) & (i < R * M)

            def add(total, v):  # total [R, K, ...] += v [K, ...] at group r, on a working tick
                at = jax.lax.dynamic_index_in_dim(total, r, keepdims=False)
                return jax.lax.dynamic_update_index_in_dim(total, at + jnp.where(busy, v, 0), r, 0)

            sums = jax.tree.map(add, sums, values)
        done = (s == S - 1) & (i >= (R - 1) * M) & (i < R * M)
        slot = jax.lax.dynamic_index_in_dim(outputs, m, keepdims=False)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, jnp.where(done, out, slot), m, 0)
        state = jax.lax.ppermute(out, self.sched.axis, [(j, (j + 1) % S) for j in range(S)])
        return (state, outputs, loop, sums), None

    def canonical(self, total: jax.Array, n_layers: int) -> jax.Array:
        """This stage's sums ``[R, K, ...]`` placed among every stage's in canonical layer order
        (group r of stage s is canonical block r·S + s: ``[R, S, K, ...]`` is that order), gathered
        over the stage axis and divided by the microbatches: ``[layers, ...]``."""
        S = self.sched.stages
        every = self.varying(jnp.zeros((self.sched.repeats, S, *total.shape[1:]), total.dtype))
        every = jax.lax.dynamic_update_index_in_dim(every, total[:, None], self.index, 1)
        return jax.lax.psum(every.reshape(n_layers, *total.shape[2:]), self.sched.axis) / self.sched.microbatches


# ---------------------------------------------------------------------------------------------
# Fully manual ops inside a stage

Dims = tuple[str | None, ...]


def _manual_layout(spare: str, dims: tuple[Dims, ...]) -> tuple[layout_lib.Layout, jax.sharding.AbstractMesh] | None:
    """Inside a stage: the active layout with every mesh axis the stage leaves to the
    partitioner that no dim of `dims` is split over added to `spare`'s split, and the stage's
    (abstract) mesh. None outside a stage or without an active layout."""
    abstract = jax.sharding.get_abstract_mesh()
    manual_axes = frozenset(abstract.manual_axes)
    layout = layout_lib.active_layout()  # the one the stage's activations follow
    if not manual_axes or layout is None:
        return None
    named = {a for d in dims for entry in layout.spec(d) for a in layout_lib.mesh_axes(entry)}
    extra = tuple(a for a in abstract.axis_names if a not in manual_axes and a not in named)
    if extra:
        axes = (*layout_lib.mesh_axes(layout.axis(spare)), *extra)
        rules = (*((d, a) for d, a in layout.rules if d != spare), (spare, axes[0] if len(axes) == 1 else axes))
        layout = dataclasses.replace(layout, rules=rules)
    return layout, abstract


def manual_problem(shapes: tuple[tuple[int, ...], ...], in_dims: tuple[Dims, ...], spare: str) -> str | None:
    """Why :func:`manual` cannot split arguments of `shapes` (None when it can, or outside a stage)."""
    found = _manual_layout(spare, in_dims)
    if found is None:
        return None
    try:
        for shape, dims in zip(shapes, in_dims):
            found[0].check_shape(dims, shape)
    except layout_lib.LayoutError as e:
        return str(e)
    return None


def manual(f: Callable, in_dims: tuple[Dims, ...], out_dims: Dims, spare: str) -> Callable:
    """`f` made fully manual inside a pipeline stage: a nested ``jax.shard_map`` over every mesh
    axis the stage leaves to the partitioner, each argument split by the active layout's rule
    for its logical dims (`in_dims`, one tuple per argument; `out_dims`, the result's), so `f`
    runs on one device's block. Outside a stage (no manual mesh axis) or without an active
    layout, `f` itself.

    An op with its own partitioning rule (``custom_partitioning``, as jax's cuDNN fused
    attention has) cannot be partitioned in a partially manual region: the partitioner hands
    the rule a ``GSPMDSharding`` where it reads a ``NamedSharding``'s spec. Fully manual, the op
    is never partitioned. A dim named None is whole on every device (the partitioner gathers it
    at the edge where the layout splits it). A mesh axis the layout splits none of the dims
    over is added to the split of dim `spare` (which every argument and the result have), so
    the op does its share of the work, not a copy of all of it; :func:`manual_problem` says
    when `spare` does not divide.

    The gradient is written out (a ``custom_vjp``): the forward region runs `f`'s own forward
    pass and returns its residuals, one block per device; the backward region runs `f`'s own
    backward pass on them. jax's autodiff of a nested region gets the residuals' specs wrong
    (jax 0.10 to 0.12): it names the stage's manual axis in them, which the lowering rejects.
    For the same reason `f`'s forward pass must hold no constant that the loop around it would
    hoist out as a residual of the region (jax makes a literal meeting a per-device value
    per-device too); cuDNN's call, one primitive each way, holds none.
    """
    found = _manual_layout(spare, (*in_dims, out_dims))
    if found is None:
        return f
    layout, abstract = found
    free = frozenset(abstract.axis_names) - frozenset(abstract.manual_axes)
    in_specs, out_spec = tuple(layout.spec(d) for d in in_dims), layout.spec(out_dims)
    # A residual of any shape: each device's own, stacked along a new leading dim.
    blocks = PartitionSpec(tuple(a for a in abstract.axis_names if a in free))

    def region(body, in_specs, out_specs):
        return jax.shard_map(body, mesh=abstract, in_specs=in_specs, out_specs=out_specs, axis_names=free)

    pullback_tree = []  # the structure of f's backward pass, from the forward region's trace

    def forward(*args):
        out, pullback = jax.vjp(f, *args)
        leaves, tree = jax.tree.flatten(pullback)
        pullback_tree[:] = [tree]
        return out, [x[None] for x in leaves]

    def backward(residuals, g):
        return jax.tree.unflatten(pullback_tree[0], [x[0] for x in residuals])(g)

    @jax.custom_vjp
    def call(*args):
        return region(f, in_specs, out_spec)(*args)

    def call_fwd(*args):
        return region(forward, in_specs, (out_spec, blocks))(*args)

    def call_bwd(residuals, g):
        return region(backward, (blocks, out_spec), in_specs)(residuals, g)

    call.defvjp(call_fwd, call_bwd)
    return call


# ---------------------------------------------------------------------------------------------
# Stored order of the layer stack


def stored_order(n_layers: int, sched: Schedule | None) -> np.ndarray:
    """The canonical layer held at each position of the stored ``layers`` dim: stage s's slice
    holds its groups r = 0 .. R−1, group r being canonical block ``r·S + s`` of ``L / (S·R)``
    layers. The identity unless the schedule is circular with repeats > 1. A LayoutError where
    `n_layers` does not split into S·R groups (a stack shorter than the model's layers, as an MoE
    model's experts are, one per ``moe_every`` layers)."""
    if sched is None or sched.repeats == 1:
        return np.arange(n_layers)
    S, R = sched.stages, sched.repeats
    if n_layers % (S * R):
        raise layout_lib.LayoutError(
            f"a stack of {n_layers} along dim 'layers' does not split into {S} stages × {R} repeats over mesh axis "
            f"'{sched.axis}' (circular schedule)"
        )
    K = n_layers // (S * R)
    return np.arange(n_layers).reshape(R, S, K).transpose(1, 0, 2).reshape(-1)


def _has_layers(x) -> bool:
    if not isinstance(x, nnx.Variable):
        return False
    dims = x.get_metadata().get("dims") or ()
    return bool(dims) and dims[0] == "layers"


@dataclasses.dataclass(frozen=True)
class Reorder:
    """Moves a tree of variables with dims (parameters, optimizer state, a train state) between
    the canonical layer order checkpoints hold and the order `sched` stores (:func:`stored_order`):
    every variable whose first dim is ``layers`` is taken along it. Traceable; `identity` when the
    orders agree (no schedule, gpipe, or one repeat), and then it returns the tree as it is."""

    sched: Schedule | None = None

    @property
    def identity(self) -> bool:
        return self.sched is None or self.sched.repeats == 1

    def to_stored(self, tree):
        """Canonical → stored."""
        return self._take(tree, lambda n: stored_order(n, self.sched))

    def to_canonical(self, tree):
        """Stored → canonical."""
        return self._take(tree, lambda n: np.argsort(stored_order(n, self.sched)))

    def _take(self, tree, index: Callable[[int], np.ndarray]):
        if self.identity:
            return tree

        def one(x):
            if _has_layers(x):
                v = x.get_value()
                return x.replace(jnp.take(v, index(v.shape[0]), axis=0))
            return x

        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

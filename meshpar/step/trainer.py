"""Train state, sharded initialisation, and the jitted train / eval steps.

Initialisation never materialises a parameter whole on one device: the model is first built
abstractly (``nnx.eval_shape``), each parameter's logical dims become a ``NamedSharding``
through the layout, and the real init runs under ``jit`` with those ``out_shardings``, so XLA
computes every shard on the device that owns it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshpar import models
from meshpar.configuration.config import OptimizerConfig
from meshpar.models import fp8 as fp8_lib
from meshpar.processes import stop as stop_lib
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import offload as offload_lib
from meshpar.sharding import stages as pipeline
from meshpar.sharding import tracing
from meshpar.sharding.tracing import Trace


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: steps taken
    params: nnx.State  # nnx.Param variables, each carrying its logical `dims`
    opt_state: optax.OptState
    rng: jax.Array  # uint32[2] raw key data: dropout etc. (raw so checkpoints stay plain arrays)


def make_optimizer(cfg: OptimizerConfig, decay_steps: int) -> optax.GradientTransformation:
    """The optax optimizer; a cosine schedule reaches 0 at `decay_steps` (warmup included)."""
    if cfg.schedule == "cosine":
        decay = optax.cosine_decay_schedule(cfg.learning_rate, max(decay_steps - cfg.warmup_steps, 1))
    else:
        decay = optax.constant_schedule(cfg.learning_rate)
    lr = optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps), decay], [cfg.warmup_steps]
    )
    opt = {
        "adam": lambda: optax.adam(lr, b1=cfg.b1, b2=cfg.b2),
        "adamw": lambda: optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
        "lion": lambda: optax.lion(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
        "sgd": lambda: optax.sgd(lr, momentum=cfg.b1 or None),
    }[cfg.name]()
    if cfg.grad_clip_norm > 0:
        opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), opt)
    return opt


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def by_kind(param_fn: Callable, history_fn: Callable, *trees: Any) -> Any:
    """`trees` (params, their gradients, shardings: one structure) mapped leaf by leaf with
    `history_fn` where the leaf is an FP8 amax history (:class:`meshpar.models.fp8.History`,
    whose "gradient" is its next value: kept by max, never summed or averaged), else `param_fn`."""

    def one(v, *rest):
        if not _is_var(v):
            return param_fn(v, *rest)
        fn = history_fn if isinstance(v, fp8_lib.History) else param_fn
        return v.replace(fn(v.get_value(), *(r.get_value() if _is_var(r) else r for r in rest)))

    return jax.tree.map(one, *trees, is_leaf=_is_var)


def tree_shardings(tree: Any, layout: layout_lib.Layout, mesh: Mesh) -> Any:
    """Sharding for every leaf: a variable by its logical ``dims``, anything else replicated.

    Works on params and on optimizer state alike, since optax's moments keep the parameters'
    variables (and so their dims).
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(x):
        if _is_var(x):
            dims = x.get_metadata().get("dims")
            return x.replace(replicated if dims is None else layout.sharding(mesh, dims))
        return replicated

    return jax.tree.map(one, tree, is_leaf=_is_var)


def check_params(abstract_params: nnx.State, layout: layout_lib.Layout) -> None:
    """Every parameter's split dims divide evenly (raises LayoutError naming the parameter)."""
    for path, var in nnx.to_flat_state(abstract_params):
        dims = var.get_metadata().get("dims")
        if dims is not None:
            name = "/".join(str(p) for p in path)
            layout.check_shape(dims, var.get_value().shape, what=f"parameter {name} {tuple(dims)}")


def param_dim_names(params: nnx.State) -> frozenset[str]:
    """The logical dims of every parameter in `params` (abstract or not)."""
    return frozenset(
        d for _, var in nnx.to_flat_state(params) for d in (var.get_metadata().get("dims") or ()) if d is not None
    )


def abstract_model(build: Callable[[nnx.Rngs], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and parameter shapes, without allocating anything."""
    return nnx.split(nnx.eval_shape(lambda: build(nnx.Rngs(0))))


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """The train state before any of it exists: structure, shapes and shardings."""

    graphdef: nnx.GraphDef
    abstract: TrainState  # ShapeDtypeStructs
    shardings: TrainState  # NamedShardings
    init: Callable[[], TrainState]
    # Every logical dim the model's tensors have, its parameters' and the activations' it
    # constrains (filled by meshpar.step.parts.plan_model): what layout rules can apply to.
    dims: frozenset[str] = frozenset()
    # The pipeline the layout runs (a stage axis), or None; its layer order is the one `init`
    # stores (meshpar.sharding.stages.Reorder: checkpoints hold the canonical one).
    schedule: pipeline.Schedule | None = None

    @property
    def reorder(self) -> pipeline.Reorder:
        return pipeline.Reorder(self.schedule)

    def stored(self, state: TrainState) -> TrainState:
        """A state in the canonical layer order (restored from a checkpoint), in the order this
        plan stores; donated. The identity without a circular schedule."""
        return state if self.reorder.identity else self._to_stored(state)

    def canonical(self, state: TrainState) -> TrainState:
        """This plan's state in the canonical layer order, for a checkpoint (a new state; the
        identity without a circular schedule)."""
        return state if self.reorder.identity else self._to_canonical(state)

    @functools.cached_property
    def _to_stored(self) -> Callable[[TrainState], TrainState]:
        return jax.jit(self.reorder.to_stored, out_shardings=self.shardings, donate_argnums=0)

    @functools.cached_property
    def _to_canonical(self) -> Callable[[TrainState], TrainState]:  # compiled once, used at every save
        return jax.jit(self.reorder.to_canonical, out_shardings=self.shardings)

    def materialize(self, layout: layout_lib.Layout, mesh: Mesh) -> TrainState:
        """Run the initialisers under jit, each shard computed on the device that owns it."""
        with layout_lib.activate(layout, mesh):
            return jax.jit(self.init, out_shardings=self.shardings)()


def plan_state(
    build: Callable[[nnx.Rngs], nnx.Module],
    tx: optax.GradientTransformation,
    seed: int,
    layout: layout_lib.Layout,
    mesh: Mesh,
    schedule: pipeline.Schedule | None = None,
) -> StatePlan:
    """The state's plan; `schedule`: the layout's pipeline, whose layer order `init` stores
    (the canonical init, reordered: the same weights as without a pipeline)."""

    def init() -> TrainState:
        params_rng, state_rng = jax.random.split(jax.random.key(seed))
        _, params = nnx.split(build(nnx.Rngs(params=params_rng)))
        params = pipeline.Reorder(schedule).to_stored(params)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            rng=jax.random.key_data(state_rng),
        )

    graphdef, _ = abstract_model(build)
    abstract = jax.eval_shape(init)
    return StatePlan(graphdef, abstract, tree_shardings(abstract, layout, mesh), init, schedule=schedule)


def check_activations(
    plan: StatePlan, layout: layout_lib.Layout, mesh: Mesh, batch: Mapping[str, jax.ShapeDtypeStruct]
) -> frozenset[str]:
    """Trace the model's loss abstractly under the layout: every activation constraint is
    resolved (and raises LayoutError if the layout cannot place it) before anything runs.
    Returns the dims the model placed while traced (its activations' and parameters')."""

    def loss(params, batch):
        return nnx.merge(plan.graphdef, params).loss(batch, rngs=None)

    with tracing.using(Trace(layout=layout, mesh=mesh, schedule=plan.schedule, seen=set())) as trace:
        jax.eval_shape(loss, plan.abstract.params, dict(batch))
    return frozenset(trace.seen)


def init_state(
    build: Callable[[nnx.Rngs], nnx.Module],
    tx: optax.GradientTransformation,
    seed: int,
    layout: layout_lib.Layout,
    mesh: Mesh,
) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """Initialise the train state directly in its shardings. Returns (graphdef, state, shardings)."""
    plan = plan_state(build, tx, seed, layout, mesh)
    return plan.graphdef, plan.materialize(layout, mesh), plan.shardings


def _grad_fn(graphdef: nnx.GraphDef):
    """``grad_fn(params, batch, key) -> ((loss, aux), grads)`` of the model `graphdef` describes,
    with `key` its dropout key."""

    def grad_fn(params, batch, key):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            return model.loss(batch, rngs=nnx.Rngs(dropout=key))

        return jax.value_and_grad(loss_fn, has_aux=True)(params)

    return grad_fn


def _update(tx: optax.GradientTransformation, state: TrainState, grads, state_shardings: TrainState):
    """(grads, params, opt_state) after the optimizer's update. It runs on the devices: offloaded
    state (and the gradient of offloaded parameters, which jax keeps in their memory) is brought
    there; the output shardings write it back. Without offload the fetches are no-ops."""
    grads = offload_lib.fetch(grads, state_shardings.params)
    params = offload_lib.fetch(state.params, state_shardings.params)
    opt_state = offload_lib.fetch(state.opt_state, state_shardings.opt_state)
    histories = grads  # FP8 amax histories' next values: written over the old, not an update
    grads = by_kind(lambda g: g, jnp.zeros_like, grads)  # so out of the optimizer, its clipping and the norm
    updates, opt_state = tx.update(grads, opt_state, params)
    params = by_kind(lambda p, h: p, lambda p, h: h.astype(p.dtype), optax.apply_updates(params, updates), histories)
    return grads, params, opt_state


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    layout: layout_lib.Layout,
    mesh: Mesh,
    state_shardings: TrainState,
    batch_shardings: Mapping[str, NamedSharding],
    microbatches: int = 1,
    activations: str = "none",
    activations_memory: str = offload_lib.HOST,
    activation_names: Sequence[str] | None = None,
    schedule: pipeline.Schedule | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[[TrainState, dict, jax.Array], tuple[TrainState, dict]]:
    """``step(state, batch, stop) -> (state, metrics)``, jitted with explicit shardings; state
    is donated. `stop` holds one int32 per device (see :mod:`meshpar.processes.stop`); ``metrics["stop"]``
    is its maximum, the same on every process. With `microbatches` k > 1 the batch's gradients
    are accumulated over k microbatches (see :func:`accumulate`) before the one update.

    Host offload (:mod:`meshpar.sharding.offload`) follows `state_shardings`: parameters or optimizer
    state whose shardings are in pinned host memory are brought to the devices where they are
    used, and written back through the output shardings. `activations` (``offload.activations``)
    keeps its named values of every layer in `activations_memory` in place of ``model.remat``
    (``device``: the same names saved on the devices, the reference offload is compared with);
    `activation_names`: those names (:meth:`meshpar.models.Family.kept_activations`; default the
    built-in families'). `schedule`: the layout's pipeline (:mod:`meshpar.sharding.stages`); its
    microbatches are the pipeline's, and the gradients of the whole batch come from one pass.
    `compiler_options`: XLA's flags for every compile of it, ahead of time or at its first call."""
    params_on_host = offload_lib.any_on_host(state_shardings.params)
    keep = models.ACTIVATION_NAMES[activations] if activation_names is None else tuple(activation_names)
    kept = (keep, activations_memory) if keep else None
    trace = Trace(layout=layout, mesh=mesh, params_on_host=params_on_host, schedule=schedule, keep=kept)
    # jax cannot move host arrays in a partially manual region ("Unhandled OpSharding type"):
    # with offloaded parameters each microbatch's gradients are reduced as it is accumulated
    local = () if params_on_host or schedule is not None else reduced_once(layout, mesh, state_shardings.params)

    grad_fn = _grad_fn(graphdef)

    def step(state: TrainState, batch: dict, stop: jax.Array) -> tuple[TrainState, dict]:
        rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))
        with tracing.using(trace):
            if microbatches == 1 or schedule is not None:
                (loss, aux), grads = grad_fn(state.params, batch, step_rng)
            elif local:
                (loss, aux), grads = accumulate_locally(
                    grad_fn, state.params, batch, step_rng, microbatches, state_shardings.params, layout, mesh, local
                )
            else:
                param_shardings = state_shardings.params
                (loss, aux), grads = accumulate(grad_fn, state.params, batch, step_rng, microbatches, param_shardings)
            grads, params, opt_state = _update(tx, state, grads, state_shardings)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "stop": jnp.max(stop), **aux}
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(rng))
        return new, metrics

    replicated, flags = NamedSharding(mesh, PartitionSpec()), stop_lib.flag_sharding(mesh)
    ins, outs = (state_shardings, dict(batch_shardings), flags), (state_shardings, replicated)
    options = dict(compiler_options or {})
    return jax.jit(step, in_shardings=ins, out_shardings=outs, donate_argnums=0, compiler_options=options)


def accumulate(grad_fn, params: nnx.State, batch: dict, key: jax.Array, k: int, param_shardings: nnx.State,
               reduce: bool = True):  # fmt: skip
    """``grad_fn(params, batch, key) -> ((loss, aux), grads)`` over k microbatches of `batch`, in
    a ``lax.scan``: gradients summed in float32 (kept in the parameters' shardings), then the
    means of gradients, losses and metrics — the full batch's, as the microbatches are equal
    (``reduce=False``: the float32 sums instead of the gradients' means).
    Parameters in host memory (offload) give host gradients: each is brought to the devices
    before it is added, and the sum stays there."""
    micro = {name: pipeline.split_microbatches(x, k) for name, x in batch.items()}
    own_shardings, param_shardings = param_shardings, offload_lib.on_device(param_shardings)
    zeros = jax.tree.map(
        lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s), params, param_shardings
    )

    def body(total, xs):
        i, mb = xs
        (loss, aux), grads = grad_fn(params, mb, jax.random.fold_in(key, i))
        grads = offload_lib.fetch(grads, own_shardings)

        def add(t, g, s):  # the running sum, in float32, kept in the parameter's sharding
            return jax.lax.with_sharding_constraint(t + g.astype(jnp.float32), s)

        def most(t, h, s):  # an FP8 history: the microbatches' max, element by element
            return jax.lax.with_sharding_constraint(jnp.maximum(t, h.astype(jnp.float32)), s)

        total = by_kind(add, most, total, grads, param_shardings)
        return total, (loss, aux)

    total, (losses, aux) = jax.lax.scan(body, zeros, (jnp.arange(k), micro))
    if not reduce:  # the float32 sums, for the caller to reduce (accumulate_locally)
        return (losses.mean(), jax.tree.map(lambda a: a.mean(), aux)), total
    grads = by_kind(lambda t, p: (t / k).astype(p.dtype), lambda t, p: t.astype(p.dtype), total, params)
    return (losses.mean(), jax.tree.map(lambda a: a.mean(), aux)), grads


def reduced_once(layout: layout_lib.Layout, mesh: Mesh, param_shardings: Any) -> tuple[str, ...]:
    """The mesh axes over which gradient accumulation sums each device's gradients locally and
    reduces them once per step (:func:`accumulate_locally`): the leading axes of the batch's rule,
    of more than one device, that no parameter, no ``param_layout`` rule and no other dim is split
    over (there each device computes whole weights' gradients for its own rows). Empty where
    the first batch axis splits something else too (FSDP over it: each microbatch's gradient is
    reduce-scattered to the shard the device keeps, as before)."""
    batch = layout.axis("batch")
    if batch is None:
        return ()
    taken = {a for d, axes in (*layout.rules, *layout.param_rules) if d != "batch" for a in layout_lib.mesh_axes(axes)}
    taken |= {a for s in jax.tree.leaves(param_shardings) for entry in s.spec for a in layout_lib.mesh_axes(entry)}
    out = []
    for a in layout_lib.mesh_axes(batch):
        if a in taken:
            break
        out.append(a)
    sizes = dict(mesh.shape)
    return tuple(a for a in out if sizes[a] > 1)


def accumulate_locally(grad_fn, params: nnx.State, batch: dict, key: jax.Array, k: int, param_shardings: nnx.State,
                       layout: layout_lib.Layout, mesh: Mesh, axes: tuple[str, ...]):  # fmt: skip
    """:func:`accumulate`, with each device summing the gradients of its own rows over the k
    microbatches and the devices reducing the sum once, at the end: one all-reduce over `axes`
    (:func:`reduced_once`) per step instead of one per microbatch, as data-parallel trainers
    accumulate (PyTorch DDP's ``no_sync``; Megatron reduces after the last microbatch).

    A ``jax.shard_map`` manual over `axes` (every other axis left to the partitioner, the model
    traced under :meth:`meshpar.sharding.layout.Layout.without` them): each device runs the accumulation
    on its block of the batch, its microbatches the rows :func:`meshpar.sharding.stages.split_microbatches`
    gives it in the whole-batch form. The model's loss is a mean over rows, and every device
    holds as many, so the mean of the devices' losses and gradients is the batch's — the same
    training to float reassociation. Dropout draws each device's bits from the microbatch's key
    folded with the device's index along `axes` (the masks differ from the whole-batch program's,
    not their distribution)."""
    n = math.prod(dict(mesh.shape)[a] for a in axes)
    split = PartitionSpec(axes[0] if len(axes) == 1 else axes)
    local_layout = layout.without(axes)

    def body(params, batch, key):
        key = jax.random.fold_in(key, jax.lax.axis_index(axes))
        abstract = jax.sharding.get_abstract_mesh()
        shardings = jax.tree.map(lambda s: NamedSharding(abstract, s.spec), param_shardings)
        with layout_lib.activate(local_layout, mesh):
            (loss, aux), grads = accumulate(grad_fn, params, batch, key, k, shardings, reduce=False)
        total = by_kind(lambda g: jax.lax.psum(g, axes), lambda h: jax.lax.pmax(h, axes), grads)  # once
        grads = by_kind(lambda t, p: (t / (k * n)).astype(p.dtype), lambda t, p: t.astype(p.dtype), total, params)
        return (jax.lax.pmean(loss, axes), jax.tree.map(lambda a: jax.lax.pmean(a, axes), aux)), grads

    batch_specs = {name: split for name in batch}
    return jax.shard_map(
        body, mesh=mesh, in_specs=(PartitionSpec(), batch_specs, PartitionSpec()), out_specs=PartitionSpec(),
        axis_names=set(axes), check_vma=False,
    )(params, batch, key)  # fmt: skip


def make_eval_step(
    graphdef: nnx.GraphDef,
    layout: layout_lib.Layout,
    mesh: Mesh,
    param_shardings: nnx.State,
    batch_shardings: Mapping[str, NamedSharding],
    schedule: pipeline.Schedule | None = None,
    compiler_options: Mapping[str, Any] | None = None,
) -> Callable[[nnx.State, dict], dict]:
    """``eval_step(params, batch) -> metrics`` (loss and the model's own metrics), no dropout;
    through the pipeline `schedule` when there is one; compiled with `compiler_options` as the
    train step is."""

    params_on_host = offload_lib.any_on_host(param_shardings)

    def step(params: nnx.State, batch: dict) -> dict:
        # Offloaded weights fetched where used.
        with tracing.using(Trace(layout=layout, mesh=mesh, params_on_host=params_on_host, schedule=schedule)):
            loss, aux = nnx.merge(graphdef, params).loss(batch, rngs=None)
        return {"loss": loss, **aux}

    replicated = NamedSharding(mesh, PartitionSpec())
    ins, options = (param_shardings, dict(batch_shardings)), dict(compiler_options or {})
    return jax.jit(step, in_shardings=ins, out_shardings=replicated, compiler_options=options)

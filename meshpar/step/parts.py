"""A config's parts: devices → mesh → layout → element spec → state plan → jitted train step.

One builder for everything that needs them: :mod:`meshpar.run.experiment` runs them (with real
inputs and state), :mod:`meshpar.step.aot` compiles them, the planner (:mod:`meshpar.plan`) reads
them. Nothing here allocates: the state is its plan (shapes and shardings, from
``eval_shape``), the batch and the stop flags are ``ShapeDtypeStruct``s with the shardings a
run gives them, so what :func:`abstract_step` lowers is exactly the program a run calls.

The devices are this host's (the config's mesh, built as a run builds it: simulated CPU devices
requested, other processes joined) or any given list — a compile target's, or a mesh built
already (:func:`abstract_step`'s ``mesh``).

Every check that needs no data runs here and fails as one line: the mesh (``mesh``), the batch
against it (``train.batch_size``), the layout and ``param_layout`` against every parameter and
activation, the model's own checks (``model``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Sequence

import jax
import optax

from meshpar import models
from meshpar.backend import compile_cache, xla_flags
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config, ConfigError
from meshpar.processes import joining, stop
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.sharding import offload as offload_lib
from meshpar.sharding import stages as pipeline
from meshpar.step import inputs as inputs_lib
from meshpar.step import trainer


@contextlib.contextmanager
def config_key(key: str, *errors: type[Exception]):
    """Report `errors` raised inside the block as a ConfigError on `key`."""
    try:
        yield
    except errors as e:
        raise ConfigError(key, str(e)) from None


def horizon(cfg: Config) -> int:
    """The learning-rate schedule's steps for a run that starts fresh."""
    return cfg.optimizer.decay_steps or cfg.train.steps


def make_mesh(cfg: Config, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
    """The config's mesh: over `devices` when given (a compile target's, or a subset of this
    host's), else over this host's, as a run builds it — simulated CPU devices where there is
    no accelerator, the other processes joined.

    In a multi-process run, :func:`meshpar.processes.joining.join` also starts the backend, so that
    joining and gathering every process's devices fit in ``distributed.initialization_timeout``
    (a process that cannot is ended with one line: jax's own wait would end in a C++ abort).
    """
    if devices is not None:
        with config_key("mesh", mesh_lib.MeshError):
            return mesh_lib.build_mesh(cfg.mesh, devices)
    processes = cfg.distributed.num_processes
    with config_key("mesh", mesh_lib.MeshError):
        total = mesh_lib.cpu_device_count(cfg.mesh)
    if total % processes == 0:
        try:
            mesh_lib.request_cpu_devices(total // processes)  # this process's share (all of them when alone)
        except RuntimeError:
            pass  # backend already started (e.g. in-process tests); build_mesh reports a shortfall
    # else: on accelerators the share does not matter; on CPU build_mesh names the shortfall
    if processes > 1:
        joining.join(cfg.distributed, cfg.checkpoint_dir)  # before any other JAX call: it starts the backend
    with config_key("mesh", mesh_lib.MeshError):
        return mesh_lib.build_mesh(cfg.mesh)


def make_layout(cfg: Config, mesh: jax.sharding.Mesh) -> layout_lib.Layout:
    """The config's layout (with ``param_layout`` on top) on `mesh`, once the batch is known to
    divide over it (a -1 batch axis has its size now)."""
    shape = dict(mesh.shape)
    if shape != dict(cfg.mesh):  # a -1 axis has its size now: the config's own checks skipped it
        config_lib.check_batch_size(cfg, shape)
        config_lib.check_pipeline(cfg, shape)
        config_lib.check_context_parallel(cfg, shape)
    return layout_for(cfg, shape)


def layout_for(cfg: Config, axis_sizes: dict[str, int]) -> layout_lib.Layout:
    """The config's layout (with ``param_layout`` on top) on a mesh of `axis_sizes`, with the
    rules the model family derives from them (e.g. Llama's ``kv_heads`` following ``heads``)."""
    derive = models.family(cfg.model.name).layout_rules
    rules = derive(cfg.model, layout_lib.on_mesh(cfg.layout, axis_sizes), axis_sizes)
    params = derive(cfg.model, layout_lib.on_mesh(cfg.param_layout, axis_sizes), axis_sizes)
    return layout_lib.Layout.create(rules, axis_sizes, params=params)


def source_element_spec(cfg: Config) -> dict:
    """The train source's per-example ``(shape, dtype)`` by field (the source is opened)."""
    source = inputs_lib.make_source(cfg.data, "train", cfg.train.seed, cfg.checkpoint.init_from)
    if source is None:
        raise ConfigError("data", "has no train examples")
    return dict(source.element_spec)


def abstract_batch(cfg: Config, element_spec: dict, shardings: dict | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """The global train batch as shapes (with `shardings`, where given)."""
    return {
        k: jax.ShapeDtypeStruct((cfg.train.batch_size, *shape), dtype, sharding=shardings and shardings[k])
        for k, (shape, dtype) in element_spec.items()
    }


def check_param_layout(cfg: Config, mesh: jax.sharding.Mesh, param_dims: frozenset[str]) -> None:
    """A ``param_layout`` none of whose rules splits a parameter (its dims are no parameter's,
    or its axes not the mesh's) is a ConfigError: the FSDP it asks for would silently not happen."""
    if cfg.param_layout and not layout_lib.applies(cfg.param_layout, mesh.axis_names, param_dims):
        why = layout_lib.unused(cfg.param_layout, mesh.axis_names, param_dims, "this model's parameters have no dim")
        raise ConfigError(
            "param_layout",
            f"none of its rules applies to a parameter, so it would split nothing ({why}; "
            f"the parameters' dims: {', '.join(sorted(param_dims))})",
        )


def plan_model(
    cfg: Config,
    family: models.Family,
    mesh: jax.sharding.Mesh,
    layout: layout_lib.Layout,
    element_spec: dict,
    decay_steps: int,
) -> tuple[optax.GradientTransformation, trainer.StatePlan]:
    """The optimizer and the train state's plan (shapes, shardings), every parameter and
    activation checked against the layout; nothing allocated. Parameters and optimizer state
    are placed by `layout` with ``param_layout`` on top, in pinned host memory where the
    ``offload`` section says so; activations by `layout`."""
    build_model = functools.partial(family.build, cfg.model, element_spec)
    tx = trainer.make_optimizer(cfg.optimizer, decay_steps)
    params_layout = layout.overlay(cfg.param_layout)
    with config_key("model", ValueError):  # the model's own checks (e.g. length beyond max_length)
        _, abstract_params = trainer.abstract_model(build_model)
    check_param_layout(cfg, mesh, trainer.param_dim_names(abstract_params))
    with config_key("param_layout" if cfg.param_layout else "layout", layout_lib.LayoutError):
        trainer.check_params(abstract_params, params_layout)  # before any sharding is made of them
        plan = trainer.plan_state(build_model, tx, cfg.train.seed, params_layout, mesh, schedule(cfg, layout))
    off = cfg.offload
    plan = dataclasses.replace(plan, shardings=offload_lib.place_state(plan.shardings, off.optimizer, off.params))
    with config_key("layout", layout_lib.LayoutError):
        dims = trainer.check_activations(plan, layout, mesh, abstract_batch(cfg, element_spec))
    return tx, dataclasses.replace(plan, dims=dims | trainer.param_dim_names(abstract_params))


def schedule(cfg: Config, layout: layout_lib.Layout) -> pipeline.Schedule | None:
    """The pipeline the layout runs (a ``layers:<axis>`` rule), by the ``pipeline`` section and
    ``train.microbatches``; None without a stage axis."""
    return pipeline.schedule_for(layout, cfg.pipeline.schedule, cfg.pipeline.repeats, cfg.train.microbatches)


def unused_rules(step: AbstractStep) -> list[str]:
    """One line for ``layout`` and one for ``param_layout`` (only where there is something to
    say) naming their rules that cannot apply: dims the model's tensors (the parameters', for
    ``param_layout``) do not have, mesh axes the mesh does not have. Not an error: Mesh
    TensorFlow's shared rule strings name dims a model may lack, and it ignores them too."""
    cfg, plan = step.cfg, step.plan
    param_dims = trainer.param_dim_names(plan.abstract.params)
    sets = (
        ("layout", cfg.layout, plan.dims, "this model has no dim"),
        ("param_layout", cfg.param_layout, param_dims, "this model's parameters have no dim"),
    )
    lines = []
    for key, rules, dims, no_dim in sets:
        why = layout_lib.unused(rules, step.mesh.axis_names, dims, no_dim)
        if why:
            lines.append(f"{key}: unused rules ({why})")
    return lines


def say_unused_rules(step: AbstractStep) -> None:
    """Print :func:`unused_rules` on stderr (from the first process only), and the bubble a
    GPipe schedule with fewer microbatches than stages costs (:func:`meshpar.sharding.stages.bubble_note`)."""
    if jax.process_index() == 0:
        note = step.schedule and pipeline.bubble_note(step.schedule)
        for line in [*unused_rules(step), *([note] if note else [])]:
            print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class AbstractStep:
    """A config built once into what every later stage needs: the config itself, its model
    family and traits, the mesh, the layout on it, the state plan (with the pipeline schedule),
    the optimizer, the jitted train and eval steps and the abstract arguments the train step is
    lowered with. Nothing in it is allocated. The run, the pre-flight and the planner all take
    this object; none of them builds it again."""

    cfg: Config
    family: models.Family
    traits: models.Traits
    mesh: jax.sharding.Mesh
    layout: layout_lib.Layout
    plan: trainer.StatePlan
    step: object  # jitted (state, batch, stop) -> (state, metrics)
    eval_step: object  # jitted (params, batch) -> metrics
    args: tuple  # (state, batch, stop) as ShapeDtypeStructs with shardings
    element_spec: dict  # the train data's, per example
    tx: optax.GradientTransformation

    @property
    def schedule(self) -> pipeline.Schedule | None:
        """The pipeline the layout runs (a stage axis), or None."""
        return self.plan.schedule

    @property
    def batch_shardings(self) -> dict:
        return {k: b.sharding for k, b in self.args[1].items()}

    def lower(self) -> jax.stages.Lowered:
        return self.step.lower(*self.args)

    @property
    def compiler_options(self) -> dict:
        """The XLA flags every program of this step is compiled with (:func:`compiler_options`)."""
        return compiler_options(self.cfg, self.mesh)

    def compile(self) -> jax.stages.Compiled:
        """The train step compiled for the step's devices with its XLA flags: what the run executes."""
        return xla_flags.compile(self.lower(), self.compiler_options)

    def with_optimizer(self, tx: optax.GradientTransformation) -> AbstractStep:
        """The same parts with the train step built for another optimizer (a resumed run's
        schedule horizon)."""
        step = train_step(self.cfg, self.family, self.mesh, self.layout, self.plan, tx, self.batch_shardings)
        return dataclasses.replace(self, step=step, tx=tx)


def compiler_options(cfg: Config, mesh: jax.sharding.Mesh) -> dict:
    """The XLA flags the config's programs are compiled with on `mesh`'s devices: ``xla.flags``
    over the GPU defaults where the devices are GPUs, and what a model with FP8 dots needs there
    (:func:`meshpar.backend.xla_flags.options`)."""
    fp8 = bool(models.traits(cfg.model).fp8)
    return xla_flags.options(cfg.xla.flags, cfg.xla.gpu_defaults, mesh.devices.flat[0].platform, fp8)


def train_step(cfg: Config, family: models.Family, mesh, layout, plan: trainer.StatePlan, tx, batch_shardings: dict):
    """The jitted train step of these parts (:func:`meshpar.step.trainer.make_train_step`), with
    the config's XLA flags for whichever compile of it comes first (ahead of time, or its first call)."""
    return trainer.make_train_step(
        plan.graphdef, tx, layout, mesh, plan.shardings, batch_shardings, cfg.train.microbatches,
        cfg.offload.activations, activation_names=family.kept_activations(cfg.offload.activations),
        schedule=plan.schedule, compiler_options=compiler_options(cfg, mesh),
    )  # fmt: skip


def assemble(
    cfg: Config,
    mesh: jax.sharding.Mesh,
    layout: layout_lib.Layout,
    element_spec: dict,
    batch_shardings: dict,
    decay_steps: int,
) -> AbstractStep:
    """The state plan, the optimizer and the jitted train step on a mesh and layout built
    already, with the batch's shardings (a run's, or :func:`meshpar.step.inputs.batch_shardings`)."""
    family = models.family(cfg.model.name)
    tx, plan = plan_model(cfg, family, mesh, layout, element_spec, decay_steps)
    step = train_step(cfg, family, mesh, layout, plan, tx, batch_shardings)
    evaluate = trainer.make_eval_step(
        plan.graphdef, layout, mesh, plan.shardings.params, batch_shardings, plan.schedule, compiler_options(cfg, mesh)
    )
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), plan.abstract, plan.shardings)
    flags = jax.ShapeDtypeStruct((mesh.size,), jax.numpy.int32, sharding=stop.flag_sharding(mesh))
    batch = abstract_batch(cfg, element_spec, batch_shardings)
    return AbstractStep(
        cfg, family, models.traits(cfg.model), mesh, layout, plan, step, evaluate, (state, batch, flags),
        dict(element_spec), tx,
    )  # fmt: skip


def abstract_step(
    cfg: Config,
    mesh: jax.sharding.Mesh | None = None,
    element_spec: dict | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> AbstractStep:
    """The config's parts without data batches, state or checkpoints. `mesh`: one built already
    (the config's own is built when None, over `devices` when given, else this host's);
    `element_spec`: the train data's, when known (the source is not opened then)."""
    if mesh is None:
        compile_cache.configure(cfg.compile_cache)  # as a run would: a rerun's compile is cached
        mesh = make_mesh(cfg, devices)
    layout = make_layout(cfg, mesh)
    inputs_lib.check_vocab(cfg)  # as a run checks it, before the source is opened
    spec = element_spec if element_spec is not None else source_element_spec(cfg)
    batch_shardings = inputs_lib.batch_shardings(spec, layout, mesh)
    return assemble(cfg, mesh, layout, spec, batch_shardings, horizon(cfg))

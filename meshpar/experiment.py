"""An experiment built from its config: devices → mesh → layout → inputs → sharded state → steps.

Everything that can be checked without running is checked here, before the first step — every
parameter and activation against the layout (abstractly), the data against the model, the
memory each device needs against what it has (:mod:`meshpar.plan.preflight`), the run's
folders, and a checkpoint to resume against the config — and reported as one-line errors
(:mod:`meshpar.errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import jax
import optax

from input_pipeline.errors import DataError
from meshpar import compile_cache, distributed, rundir, throughput, trainer
from meshpar import config as config_lib
from meshpar import inputs as inputs_lib
from meshpar import layout as layout_lib
from meshpar import mesh as mesh_lib
from meshpar import offload as offload_lib
from meshpar import resume as resume_lib
from meshpar.checkpoint import Checkpointer
from meshpar.config import Config, ConfigError
from meshpar.models import MODELS


@dataclasses.dataclass
class Experiment:
    """Everything built from a config, ready to step."""

    cfg: Config
    mesh: jax.sharding.Mesh
    layout: layout_lib.Layout
    inputs: inputs_lib.Inputs
    state: trainer.TrainState
    train_step: object  # (state, batch, stop flags) -> (state, metrics); state donated
    eval_step: object  # (params, batch) -> metrics
    flops_per_example: float  # model FLOPs of one training example (forward + backward)
    tokens_per_example: int
    peak_tflops: float  # per device, for MFU, for the arithmetic the model runs
    peak_source: str
    checkpointer: Checkpointer | None = None
    record: dict = dataclasses.field(default_factory=dict)  # what each checkpoint records about the run
    resumed_from: int | None = None  # the checkpoint step the state came from


def _compiled_step(compiled: jax.stages.Compiled, jitted) -> object:
    """An ahead-of-time `compiled` program as the run's step: called with the same arguments as
    `jitted` (same shardings and donation), never compiling again; it keeps the jitted
    function's name (``jit_<name>`` is its program's name in profiles)."""

    def step(*args):
        return compiled(*args)

    step.__name__ = step.__qualname__ = jitted.__name__
    step.compiled = compiled
    return step


@contextlib.contextmanager
def _config_key(key: str, *errors: type[Exception]):
    """Report `errors` raised inside the block as a ConfigError on `key`."""
    try:
        yield
    except errors as e:
        raise ConfigError(key, str(e)) from None


def make_mesh(cfg: Config) -> jax.sharding.Mesh:
    """Simulated CPU devices where there is no accelerator, the other processes joined, the mesh.

    In a multi-process run, :func:`meshpar.distributed.join` also starts the backend, so that
    joining and gathering every process's devices fit in ``distributed.initialization_timeout``
    (a process that cannot is ended with one line: jax's own wait would end in a C++ abort).
    """
    processes = cfg.distributed.num_processes
    with _config_key("mesh", mesh_lib.MeshError):
        total = mesh_lib.cpu_device_count(cfg.mesh)
    if total % processes == 0:
        try:
            mesh_lib.request_cpu_devices(total // processes)  # this process's share (all of them when alone)
        except RuntimeError:
            pass  # backend already started (e.g. in-process tests); build_mesh reports a shortfall
    # else: on accelerators the share does not matter; on CPU build_mesh names the shortfall
    if processes > 1:
        distributed.join(cfg.distributed, cfg.checkpoint_dir)  # before any other JAX call: it starts the backend
    with _config_key("mesh", mesh_lib.MeshError):
        return mesh_lib.build_mesh(cfg.mesh)


def _check_data(cfg: Config, family, inputs: inputs_lib.Inputs) -> None:
    problem = family.check_data(inputs.element_spec)
    if problem:
        raise DataError(f"{cfg.data.source} data for model {cfg.model.name}: {problem}")
    num_classes = getattr(inputs.train.source, "num_classes", None)
    if num_classes is not None and getattr(cfg.model, "num_classes", num_classes) != num_classes:
        raise ConfigError("model.num_classes", f"{cfg.model.num_classes} but the data has {num_classes} classes")


def abstract_batch(cfg: Config, element_spec: dict, shardings: dict | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """The global train batch as shapes (with `shardings`, where given)."""
    return {
        k: jax.ShapeDtypeStruct((cfg.train.batch_size, *shape), dtype, sharding=shardings and shardings[k])
        for k, (shape, dtype) in element_spec.items()
    }


def plan_model(
    cfg: Config, mesh: jax.sharding.Mesh, layout: layout_lib.Layout, element_spec: dict, decay_steps: int
) -> tuple[optax.GradientTransformation, trainer.StatePlan]:
    """The optimizer and the train state's plan (shapes, shardings), every parameter and
    activation checked against the layout; nothing allocated. Parameters and optimizer state
    are placed by `layout` with ``param_layout`` on top, in pinned host memory where the
    ``offload`` section says so; activations by `layout`."""
    family = MODELS[cfg.model.name]
    build_model = functools.partial(family.build, cfg.model, element_spec)
    tx = trainer.make_optimizer(cfg.optimizer, decay_steps)
    params_layout = layout.overlay(cfg.param_layout)
    with _config_key("model", ValueError):  # the model's own checks (e.g. length beyond max_length)
        _, abstract_params = trainer.abstract_model(build_model)
    check_param_layout(cfg, mesh, trainer.param_dim_names(abstract_params))
    with _config_key("param_layout" if cfg.param_layout else "layout", layout_lib.LayoutError):
        trainer.check_params(abstract_params, params_layout)  # before any sharding is made of them
        plan = trainer.plan_state(build_model, tx, cfg.train.seed, params_layout, mesh)
    off = cfg.offload
    plan = dataclasses.replace(plan, shardings=offload_lib.place_state(plan.shardings, off.optimizer, off.params))
    with _config_key("layout", layout_lib.LayoutError):
        dims = trainer.check_activations(plan, layout, mesh, abstract_batch(cfg, element_spec))
    return tx, dataclasses.replace(plan, dims=dims | trainer.param_dim_names(abstract_params))


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


def unused_rules(cfg: Config, mesh: jax.sharding.Mesh, plan: trainer.StatePlan) -> list[str]:
    """One line for ``layout`` and one for ``param_layout`` (only where there is something to
    say) naming their rules that cannot apply: dims the model's tensors (the parameters', for
    ``param_layout``) do not have, mesh axes the mesh does not have. Not an error: Mesh
    TensorFlow's shared rule strings name dims a model may lack, and it ignores them too."""
    param_dims = trainer.param_dim_names(plan.abstract.params)
    sets = (
        ("layout", cfg.layout, plan.dims, "this model has no dim"),
        ("param_layout", cfg.param_layout, param_dims, "this model's parameters have no dim"),
    )
    lines = []
    for key, rules, dims, no_dim in sets:
        why = layout_lib.unused(rules, mesh.axis_names, dims, no_dim)
        if why:
            lines.append(f"{key}: unused rules ({why})")
    return lines


def say_unused_rules(cfg: Config, mesh: jax.sharding.Mesh, plan: trainer.StatePlan) -> None:
    """Print :func:`unused_rules` on stderr (from the first process only)."""
    if jax.process_index() == 0:
        for line in unused_rules(cfg, mesh, plan):
            print(line, file=sys.stderr, flush=True)


def build(cfg: Config) -> Experiment:
    """Devices → mesh → layout → inputs → the state's plan → the memory pre-flight → sharded
    state (fresh, or from a checkpoint) → jitted steps.

    With ``plan.check`` (the default) nothing is allocated until the plan is known to fit
    (:mod:`meshpar.plan.preflight`): the analytic check first, before the run's folders are
    made, then the train step compiled ahead of time, which the run then calls instead of
    compiling it again. Resuming a run whose schedule horizon differs from this config's
    (``--resume train.steps=<more>``) builds the step for the restored horizon: that one
    compiles at its first call."""
    compile_cache.configure(cfg.compile_cache)  # before the first compilation
    mesh = make_mesh(cfg)
    config_lib.check_batch_size(cfg, dict(mesh.shape))  # a -1 batch axis has its size now
    layout = layout_lib.Layout.create(cfg.layout, dict(mesh.shape), params=cfg.param_layout)
    inputs = inputs_lib.build(cfg, mesh, layout)
    family = MODELS[cfg.model.name]
    _check_data(cfg, family, inputs)
    record = resume_lib.record(cfg, inputs)
    # The schedule's horizon does not change the optimizer state's structure: the state is
    # planned with this run's horizon, and the step is built with the restored run's.
    tx, plan = plan_model(cfg, mesh, layout, inputs.element_spec, record["decay_steps"])
    say_unused_rules(cfg, mesh, plan)
    shardings, microbatches, activations = plan.shardings, cfg.train.microbatches, cfg.offload.activations
    train_step = trainer.make_train_step(
        plan.graphdef, tx, layout, mesh, shardings, inputs.shardings, microbatches, activations
    )
    compiled = {}  # program name -> compiled by the pre-flight (meshpar.plan.programs)
    if cfg.plan.check:
        from meshpar import aot  # here: aot imports this module
        from meshpar.plan import preflight

        step = aot.from_parts(cfg, mesh, layout, plan, train_step, inputs.shardings, inputs.element_spec)
        breakdown, capacity = preflight.check_analytic(cfg, step, inputs.element_spec)
    rundir.check_paths(cfg)  # folders that cannot be created fail here, before any state exists
    if cfg.plan.check:
        compiled = preflight.check_compiled(cfg, step, inputs.element_spec, breakdown, capacity)
    checkpointer = rundir.open_checkpoints(cfg)
    resumed = checkpointer and resume_lib.restore(cfg, checkpointer, plan, record)
    if resumed:
        horizon = record["decay_steps"]
        state, record = resumed.state, resumed.record
        if record["decay_steps"] != horizon:
            tx = trainer.make_optimizer(cfg.optimizer, record["decay_steps"])
            train_step = trainer.make_train_step(
                plan.graphdef, tx, layout, mesh, shardings, inputs.shardings, microbatches, activations
            )
            # The pre-flight's step (only there with plan.check) was compiled for the other horizon.
            compiled.pop("train step", None)
    else:
        state = plan.materialize(layout, mesh)
    eval_step = trainer.make_eval_step(plan.graphdef, layout, mesh, plan.shardings.params, inputs.shardings)
    if "train step" in compiled:
        train_step = _compiled_step(compiled["train step"], train_step)
    if "eval step" in compiled:
        eval_step = _compiled_step(compiled["eval step"], eval_step)
    if checkpointer is not None:
        checkpointer.digest_program = compiled.get("checkpoint digest")
    peak, peak_source = throughput.peak_tflops(mesh, cfg.hardware.peak_tflops, throughput.compute_dtype(cfg.model))
    flops = family.flops_per_example(cfg.model, inputs.element_spec)
    tokens = family.tokens_per_example(cfg.model, inputs.element_spec)
    return Experiment(
        cfg, mesh, layout, inputs, state, train_step, eval_step, flops, tokens, peak, peak_source,
        checkpointer, record, resumed.step if resumed else None,
    )

"""An experiment built from its config: devices → mesh → layout → inputs → the built step → its
programs, compiled once and judged by the pre-flight → sharded state.

Everything that can be checked without running is checked here, before the first step — every
parameter and activation against the layout (abstractly), the data against the model, the
memory each device needs against what it has (:mod:`meshpar.plan.preflight`), the run's
folders, and a checkpoint to resume against the config — and reported as one-line errors
(:mod:`meshpar.configuration.errors`).
"""

from __future__ import annotations

import dataclasses

import jax

from input_pipeline.errors import DataError
from meshpar import models
from meshpar.backend import compile_cache, unified_memory
from meshpar.checkpoints import rundir
from meshpar.checkpoints.checkpoint import Checkpointer, Codec
from meshpar.configuration.config import Config, ConfigError
from meshpar.plan import fp8_check, preflight
from meshpar.run import init_from
from meshpar.run import resume as resume_lib
from meshpar.step import inputs as inputs_lib
from meshpar.step import parts, programs, throughput, trainer


@dataclasses.dataclass
class Experiment:
    """Everything built from a config, ready to step."""

    step: parts.AbstractStep  # the config built once: mesh, layout, state plan, jitted steps
    inputs: inputs_lib.Inputs
    state: trainer.TrainState
    train_step: object  # (state, batch, stop flags) -> (state, metrics); state donated
    eval_step: object  # (params, batch) -> metrics
    # Model FLOPs of one training example (forward + backward); None when the family gives none.
    flops_per_example: float | None
    tokens_per_example: int
    peak_tflops: float  # per device, for MFU, for the arithmetic the model runs
    peak_source: str
    checkpointer: Checkpointer | None = None
    record: dict = dataclasses.field(default_factory=dict)  # what each checkpoint records about the run
    resumed_from: int | None = None  # the checkpoint step the state came from
    # The step's, for the loop to read: set from `step`, never given.
    cfg: Config = dataclasses.field(init=False)
    mesh: jax.sharding.Mesh = dataclasses.field(init=False)
    layout: object = dataclasses.field(init=False)

    def __post_init__(self):
        self.cfg, self.mesh, self.layout = self.step.cfg, self.step.mesh, self.step.layout


def _as_step(compiled: jax.stages.Compiled, jitted) -> object:
    """An ahead-of-time `compiled` program as the run's step: called with the same arguments as
    `jitted` (same shardings and donation), never compiling again; it keeps the jitted
    function's name (``jit_<name>`` is its program's name in profiles)."""

    def step(*args):
        return compiled(*args)

    step.__name__ = step.__qualname__ = jitted.__name__
    step.compiled = compiled
    return step


def _check_data(cfg: Config, inputs: inputs_lib.Inputs) -> None:
    """The data against the model, before the model is traced on it."""
    problem = models.family(cfg.model.name).check_data(inputs.element_spec)
    if problem:
        raise DataError(f"{cfg.data.source} data for model {cfg.model.name}: {problem}")
    num_classes, model = getattr(inputs.train.source, "num_classes", None), models.traits(cfg.model)
    if num_classes is not None and model.num_classes not in (None, num_classes):
        raise ConfigError(model.key("num_classes"), f"{model.num_classes} but the data has {num_classes} classes")


def built(cfg: Config, mesh: jax.sharding.Mesh) -> tuple[parts.AbstractStep, inputs_lib.Inputs, dict]:
    """The config built once on `mesh`: (the step, the run's inputs, the record its checkpoints
    keep)."""
    layout = parts.make_layout(cfg, mesh)
    inputs = inputs_lib.build(cfg, mesh, layout)
    _check_data(cfg, inputs)
    record = resume_lib.record(cfg, inputs)
    # The schedule's horizon does not change the optimizer state's structure: the state is
    # planned with this run's horizon, and the step is built with the restored run's.
    step = parts.assemble(cfg, mesh, layout, inputs.element_spec, inputs.shardings, record["decay_steps"])
    parts.say_unused_rules(step)
    return step, inputs, record


def _judged(step: parts.AbstractStep) -> programs.Programs | None:
    """The run's programs, compiled once and judged by the pre-flight before anything is
    allocated (``plan.check``, the default): the analytic model first, before the run's folders
    are made, then XLA's figures for the compiled programs. Without ``plan.check``: None, and
    the run's jitted steps compile at their first call."""
    cfg = step.cfg
    fp8_check.refuse_device(cfg, step.mesh.devices.flat[0])  # FP8 dots on a GPU without FP8: one line
    verdict = preflight.check_analytic(step) if cfg.plan.check else None
    rundir.check_paths(cfg)  # folders that cannot be created fail here, before any state exists
    if verdict is None:
        return None
    compiled = programs.compile_all(step)
    preflight.check_compiled(step, compiled, verdict)
    return compiled


def build(cfg: Config) -> Experiment:
    """Devices → mesh → layout → inputs → the built step → its programs, judged by the memory
    pre-flight (:func:`_judged`) → sharded state (fresh: random, or checkpoint.init_from's
    weights; or from a checkpoint). Resuming a run whose schedule horizon differs from this
    config's (``--resume train.steps=<more>``) builds the train step for the restored horizon:
    that one compiles at its first call. With ``offload.unified_memory`` the variables it needs
    are set before jax's backend starts, and checked once it has
    (:mod:`meshpar.backend.unified_memory`)."""
    env = unified_memory.set_up(cfg.offload)  # before jax's backend starts (make_mesh starts it)
    compile_cache.configure(cfg.compile_cache)  # before the first compilation
    mesh = parts.make_mesh(cfg)
    if env is not None:
        unified_memory.check(env, mesh)  # the variables took effect on this process's devices
    step, inputs, record = built(cfg, mesh)
    plan = step.plan
    origin = init_from.open_source(cfg, plan.abstract.params)  # checked before anything is allocated
    compiled = _judged(step)
    # Checkpoints hold a pipeline's layers in the canonical order: the codec converts both ways.
    checkpointer = rundir.open_checkpoints(cfg, Codec.of_plan(plan, compiled and compiled.digest))
    resumed = checkpointer and resume_lib.restore(cfg, checkpointer, plan, record)
    train_step = _as_step(compiled.train, step.step) if compiled else step.step
    eval_step = _as_step(compiled.eval, step.eval_step) if compiled and compiled.eval else step.eval_step
    if resumed:
        horizon = record["decay_steps"]
        state, record = resumed.state, resumed.record
        if record["decay_steps"] != horizon:
            step = step.with_optimizer(trainer.make_optimizer(cfg.optimizer, record["decay_steps"]))
            train_step = step.step  # the compiled one has the other horizon: this one compiles at its first call
    elif origin is not None:  # a fresh run from checkpoint.init_from's parameters
        state = init_from.initial_state(cfg, origin, plan, step.tx)
    else:
        state = plan.materialize(step.layout, step.mesh)
    peak, peak_source = throughput.peak_tflops(step.mesh, cfg.hardware.peak_tflops, step.traits.compute_dtype)
    flops = step.family.flops_per_example and step.family.flops_per_example(cfg.model, inputs.element_spec)
    tokens = step.family.tokens_per_example(cfg.model, inputs.element_spec)
    return Experiment(
        step, inputs, state, train_step, eval_step, flops, tokens, peak, peak_source,
        checkpointer, record, resumed.step if resumed else None,
    )  # fmt: skip

"""The programs a run executes, compiled once, ahead of time, from its built step: the train
step, the eval step (when the run evaluates) and the checkpoint digest (when it saves).

Each is compiled with the config's XLA flags (:mod:`meshpar.backend.xla_flags`). The run calls
them instead of compiling again; the planner reads their memory and costs
(:mod:`meshpar.plan.programs`, :mod:`meshpar.plan.preflight`) and never compiles them itself.
"""

from __future__ import annotations

import dataclasses

import jax

from meshpar.backend import xla_flags
from meshpar.checkpoints import integrity, rundir
from meshpar.configuration import errors
from meshpar.configuration.config import Config
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import parts


def runs_eval(cfg: Config) -> bool:
    """Whether the run evaluates (``train.eval_every`` > 0)."""
    return cfg.train.eval_every > 0


@dataclasses.dataclass(frozen=True)
class Programs:
    """A run's compiled programs; `eval` and `digest` are None where the run has none."""

    train: jax.stages.Compiled  # (state, batch, stop flags) -> (state, metrics); state donated
    eval: jax.stages.Compiled | None = None  # (params, batch) -> metrics
    digest: jax.stages.Compiled | None = None  # (state leaves) -> digests, before each save

    def named(self) -> list[tuple[str, jax.stages.Compiled]]:
        """The programs by the name a plan reports them under, the train step first."""
        names = (("train step", self.train), ("eval step", self.eval), ("checkpoint digest", self.digest))
        return [(name, compiled) for name, compiled in names if compiled is not None]


def _compile(lowered_by, what: str, step: parts.AbstractStep) -> jax.stages.Compiled:
    """`lowered_by()` compiled with the step's XLA flags (:attr:`meshpar.step.parts.AbstractStep.compiler_options`);
    the compiler's own failure as one line (a CompileError naming the devices), not its traceback."""
    try:
        return xla_flags.compile(lowered_by(), step.compiler_options)
    except jax.errors.JaxRuntimeError as e:
        first = str(e).splitlines()[0].split(", metadata=")[0]
        where = f"{step.mesh.size} {step.mesh.devices.flat[0].platform} devices ({mesh_lib.describe(step.mesh)})"
        raise errors.CompileError(f"XLA cannot compile the {what} for {where}: {first}") from None


def compile_train(step: parts.AbstractStep) -> jax.stages.Compiled:
    """The train step of `step`, compiled on its abstract arguments (nothing allocated)."""
    return _compile(step.lower, "train step", step)


def compile_all(step: parts.AbstractStep) -> Programs:
    """Every program the step's run executes, compiled once."""
    state, batch, _ = step.args
    cfg = step.cfg
    evaluate = (
        _compile(lambda: step.eval_step.lower(state.params, batch), "eval step", step) if runs_eval(cfg) else None
    )
    leaves = jax.tree.leaves(state)
    digest = (
        _compile(lambda: integrity.digest_program(leaves), "checkpoint digest", step)
        if rundir.uses_checkpoints(cfg)
        else None
    )
    return Programs(compile_train(step), evaluate, digest)

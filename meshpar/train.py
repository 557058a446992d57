"""``python -m meshpar.train --config experiments/x.yaml [--resume] [section.key=value ...]``

Exit status: 0 on success; 2 on a config, data or checkpoint mistake, with one line
``config error: <key>: <what is wrong>`` (``data error: ...``, ``checkpoint error: ...``) on
stderr; 1 when training cannot go on (``training error: step N: ...``); 128 + the signal
number after SIGINT/SIGTERM, once the state is checkpointed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import signal
import sys
import threading
import time

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from input_pipeline.errors import DataError
from meshpar import config as config_lib
from meshpar import inputs as inputs_lib
from meshpar import layout as layout_lib
from meshpar import mesh as mesh_lib
from meshpar import throughput, trainer
from meshpar.checkpoint import Checkpointer, CheckpointError
from meshpar.config import Config, ConfigError
from meshpar.memory import PeakTracker
from meshpar.metrics import MetricsWriter, RunStats, write_summary
from meshpar.models import MODELS


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. a non-finite loss); the message names the step."""


@dataclasses.dataclass
class Experiment:
    """Everything built from a config, ready to step."""

    cfg: Config
    mesh: jax.sharding.Mesh
    layout: layout_lib.Layout
    inputs: inputs_lib.Inputs
    state: trainer.TrainState
    train_step: object
    eval_step: object
    flops_per_example: float  # model FLOPs of one training example (forward + backward)
    tokens_per_example: int
    peak_tflops: float  # per device, for MFU
    peak_source: str
    checkpointer: Checkpointer | None = None


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived; the state was checkpointed at `step` and the run stopped."""

    def __init__(self, signum: int, step: int, saved: bool):
        super().__init__(f"{signal.Signals(signum).name} at step {step}")
        self.signum, self.step, self.saved = signum, step, saved


class _StopSignals:
    """Turns the first SIGINT/SIGTERM into a flag the loop checks after each step (a second
    one acts as usual), so a stop never lands in the middle of a step or a save."""

    def __enter__(self):
        self.signum = None
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        signal.signal(signum, self._previous[signum])
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def position(cfg: Config, next_batch: int) -> dict:
    """The input pipeline's position: batch `next_batch` comes next (batches are a pure function
    of seed and index, so this is all a resumed run needs, plus what must not change)."""
    return {"next_batch": next_batch, "seed": cfg.train.seed, "batch_size": cfg.train.batch_size}


def _restore(cfg: Config, checkpointer: Checkpointer, plan: trainer.StatePlan) -> trainer.TrainState | None:
    if cfg.checkpoint.resume != "auto" or not checkpointer.steps():
        return None
    state, saved, step = checkpointer.restore(plan.abstract, plan.shardings)
    for key, name in (("seed", "train.seed"), ("batch_size", "train.batch_size")):
        if saved.get(key) != position(cfg, step)[key]:
            raise ConfigError(name, f"{position(cfg, step)[key]} but the checkpoint at step {step} was saved with {saved.get(key)}")
    if saved["next_batch"] != step:
        raise CheckpointError(f"checkpoint at step {step} records input position {saved['next_batch']}")
    return state


@contextlib.contextmanager
def _config_key(key: str, *errors: type[Exception]):
    """Report `errors` raised inside the block as a ConfigError on `key`."""
    try:
        yield
    except errors as e:
        raise ConfigError(key, str(e)) from None


def _make_mesh(cfg: Config) -> jax.sharding.Mesh:
    processes = cfg.distributed.num_processes
    total = mesh_lib.cpu_device_count(cfg.mesh)
    if total % processes:
        raise ConfigError("distributed.num_processes", f"{processes} processes cannot split the mesh's {total} devices evenly")
    try:
        mesh_lib.request_cpu_devices(total // processes)  # this process's share (all of them when alone)
    except RuntimeError:
        pass  # backend already started (e.g. in-process tests); build_mesh reports a shortfall
    if processes > 1:
        mesh_lib.join_processes(cfg.distributed.coordinator, processes, cfg.distributed.process_id)
    with _config_key("mesh", mesh_lib.MeshError):
        return mesh_lib.build_mesh(cfg.mesh)


def _check_data(cfg: Config, family, inputs: inputs_lib.Inputs) -> None:
    problem = family.check_data(inputs.element_spec)
    if problem:
        raise DataError(f"{cfg.data.source} data for model {cfg.model.name}: {problem}")
    num_classes = getattr(inputs.train.source, "num_classes", None)
    if num_classes is not None and getattr(cfg.model, "num_classes", num_classes) != num_classes:
        raise ConfigError("model.num_classes", f"{cfg.model.num_classes} but the data has {num_classes} classes")


def build(cfg: Config) -> Experiment:
    """Devices → mesh → layout → inputs → sharded state → jitted steps.

    Everything that can be checked without running is checked first — every parameter and
    every activation against the layout, abstractly — and reported as ConfigError/DataError.
    """
    mesh = _make_mesh(cfg)
    layout = layout_lib.Layout.create(cfg.layout, dict(mesh.shape))
    inputs = inputs_lib.build(cfg, mesh, layout)
    family = MODELS[cfg.model.name]
    _check_data(cfg, family, inputs)
    build_model = functools.partial(family.build, cfg.model, inputs.element_spec)
    tx = trainer.make_optimizer(cfg.optimizer, cfg.train.steps)
    with _config_key("model", ValueError):  # the model's own checks (e.g. length beyond max_length)
        plan = trainer.plan_state(build_model, tx, cfg.train.seed, layout, mesh)
    batch = {k: jax.ShapeDtypeStruct((cfg.train.batch_size, *shape), dtype) for k, (shape, dtype) in inputs.element_spec.items()}
    with _config_key("layout", layout_lib.LayoutError):
        trainer.check_params(plan.abstract.params, layout)
        trainer.check_activations(plan, layout, mesh, batch)
    checkpointer = None
    if cfg.checkpoint.every or cfg.checkpoint.resume == "auto":
        checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.checkpoint.every, cfg.checkpoint.keep)
    state = (checkpointer and _restore(cfg, checkpointer, plan)) or plan.materialize(layout, mesh)
    train_step = trainer.make_train_step(plan.graphdef, tx, layout, mesh, plan.shardings, inputs.shardings)
    eval_step = trainer.make_eval_step(plan.graphdef, layout, mesh, plan.shardings.params, inputs.shardings)
    peak, peak_source = throughput.peak_tflops(mesh, cfg.hardware.peak_tflops)
    flops = family.flops_per_example(cfg.model, inputs.element_spec)
    tokens = family.tokens_per_example(cfg.model, inputs.element_spec)
    return Experiment(cfg, mesh, layout, inputs, state, train_step, eval_step, flops, tokens, peak, peak_source, checkpointer)


def rates(exp: Experiment, step_time_s: float) -> dict[str, float]:
    """examples/s, tokens/s, model TFLOP/s per device and MFU for one step of `step_time_s`."""
    batch = exp.cfg.train.batch_size
    out = throughput.rates(exp.flops_per_example, exp.tokens_per_example, batch, step_time_s, exp.mesh.size, exp.peak_tflops)
    return {"examples_per_s": batch / step_time_s, **out}


def evaluate(exp: Experiment, state: trainer.TrainState) -> dict[str, float]:
    """Mean eval metrics over the first ``train.eval_batches`` batches of the eval split."""
    rows = []
    for i in range(min(exp.cfg.train.eval_batches, exp.inputs.eval.batches_per_epoch)):
        batch, _ = exp.inputs.feeder.place(exp.inputs.eval.batch(i))
        rows.append(jax.device_get(exp.eval_step(state.params, batch)))
    return {f"eval_{k}": float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("loss {task.fields[loss]:.4f}  {task.fields[eps]:,.0f} ex/s  {task.fields[extra]}"),
        TimeRemainingColumn(),
        disable=not enabled,
    )


def train(exp: Experiment) -> dict:
    """The train loop. Returns the summary (also written to ``<workdir>/summary.json``)."""
    cfg, inputs, state, ckpt = exp.cfg, exp.inputs, exp.state, exp.checkpointer
    start = int(state.step)
    if start >= cfg.train.steps:  # resumed a finished run: leave its outputs as they are
        if ckpt:
            ckpt.close()
        return {"steps": cfg.train.steps, "already_at_step": start}
    lead = jax.process_index() == 0  # one process writes the run's outputs and shows progress
    writer, stats = MetricsWriter(cfg.workdir, start, enabled=lead), RunStats()
    memory = PeakTracker(exp.mesh.local_devices, inputs.feeder.live_bytes)
    losses, last_eval, placement = [], {}, None
    try:
        with _progress(cfg.train.progress and lead) as progress, inputs.batches(start, cfg.train.steps) as batches, _StopSignals() as stop:
            task = progress.add_task("train", total=cfg.train.steps, completed=start, loss=float("nan"), eps=0.0, extra="")
            last = time.perf_counter()
            for fed in batches:
                state, metrics = exp.train_step(state, fed.arrays)
                loss = float(metrics["loss"])  # waits for the step: step times are real, not dispatch times
                now, done, placement = time.perf_counter(), fed.step + 1, fed.info
                _check_finite(loss, float(metrics["grad_norm"]), done, ckpt)
                stats.add(now - last, fed.wait_s, placement.seconds)
                memory.sample()  # the feeder's own arrays only: cheap enough for every step
                losses.append(loss)
                if ckpt:
                    ckpt.maybe_save(state, position(cfg, done), force=done == cfg.train.steps)
                evaluated = bool(cfg.train.eval_every and inputs.eval) and (done % cfg.train.eval_every == 0 or done == cfg.train.steps)
                if evaluated:
                    last_eval = evaluate(exp, state)
                if evaluated or done % cfg.train.log_every == 0 or done == cfg.train.steps:
                    row = {"loss": loss, **stats.window(), **_scalars(metrics), **(last_eval if evaluated else {})}
                    row.update(rates(exp, row["step_time_s"]))
                    writer.write(done, row)
                    progress.update(task, loss=loss, eps=row["examples_per_s"], extra=_eval_text(last_eval))
                progress.update(task, completed=done)
                if stop.signum is not None:
                    if ckpt:  # a no-op when this step was just saved
                        ckpt.maybe_save(state, position(cfg, done), force=True)
                    raise Interrupted(stop.signum, done, saved=ckpt is not None)
                last = time.perf_counter()
    finally:
        writer.close()
        if ckpt:
            ckpt.close()  # waits for the last async save to commit
    exp.state = state
    summary = _summary(exp, losses, last_eval, stats, placement, memory)
    if lead:
        write_summary(cfg.workdir, summary)
        stats.write(cfg.workdir)
    return summary


def _check_finite(loss: float, grad_norm: float, step: int, ckpt: Checkpointer | None) -> None:
    """Stop on a non-finite loss or gradient; that state is never saved, so the newest
    checkpoint stays the last good one."""
    if not (np.isfinite(loss) and np.isfinite(grad_norm)):
        if ckpt:
            ckpt.wait()  # the previous step's save may still be committing
        kept = ckpt.steps() if ckpt else []
        where = f"; last good checkpoint: step {kept[-1]}" if kept else ""
        raise TrainingError(f"step {step}: loss is {loss}, gradient norm is {grad_norm}{where}")


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(metrics).items() if k != "loss"}


def _eval_text(last_eval: dict) -> str:
    return f"eval {last_eval['eval_loss']:.4f}" if last_eval else ""


def _summary(exp: Experiment, losses, last_eval, stats: RunStats, placement, memory: PeakTracker) -> dict:
    cfg, timing = exp.cfg, stats.summary()
    return {
        "steps": cfg.train.steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        **{f"final_{k}": v for k, v in last_eval.items()},
        **timing,
        **(rates(exp, timing["median_step_time_s"]) if timing else {}),
        "model_flops_per_example": exp.flops_per_example,
        "tokens_per_example": exp.tokens_per_example,
        "peak_tflops_per_device": exp.peak_tflops,
        "peak_tflops_source": exp.peak_source,
        "feed_mode": cfg.feed.mode,
        "prefetch": cfg.feed.prefetch,
        "relay_device": exp.inputs.feeder.relay.id,
        "relay_input_bytes": placement.relay_bytes if placement else None,
        "batch_input_bytes": placement.total_bytes if placement else None,
        "host_buffer_aliased": placement.aliased if placement else None,
        "input_memory": memory.report(),
        "mesh": mesh_lib.describe(exp.mesh),
        "layout": str(exp.layout),
        "devices": [str(d) for d in exp.mesh.devices.flat],
        "config": config_lib.to_dict(cfg),
    }


# What the CLI reports in one line instead of a traceback: exception → (prefix, exit status).
FAILURES: dict[type[Exception], tuple[str, int]] = {
    ConfigError: ("config error", 2),
    DataError: ("data error", 2),
    CheckpointError: ("checkpoint error", 2),
    TrainingError: ("training error", 1),
}


def run(cfg: Config) -> dict:
    return train(build(cfg))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshpar.train", description="Train a model on a device mesh.")
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. experiments/quickstart.yaml")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint (checkpoint.resume=auto)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)
    overrides = [*args.overrides, *(["checkpoint.resume=auto"] if args.resume else [])]
    try:
        summary = run(config_lib.load(args.config, overrides))
    except tuple(FAILURES) as e:
        prefix, status = next(v for cls, v in FAILURES.items() if isinstance(e, cls))
        print(f"{prefix}: {e}", file=sys.stderr)
        return status
    except Interrupted as e:
        saved = f"; checkpoint saved at step {e.step}" if e.saved else " (checkpointing is off: nothing saved)"
        print(f"stopped by {e}{saved}", file=sys.stderr)
        return 128 + e.signum
    if "already_at_step" in summary:
        print(f"nothing to train: the checkpoint is at step {summary['already_at_step']} of {summary['steps']}")
        return 0
    print(
        f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} → {summary['final_loss']:.4f}, "
        f"{summary['examples_per_s']:,.0f} examples/s, {summary['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {summary['mfu']:.1%}, feed={summary['feed_mode']}, mesh {summary['mesh']}, "
        f"workdir {summary['config']['workdir']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

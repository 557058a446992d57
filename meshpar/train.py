"""``python -m meshpar.train --config experiments/x.yaml [section.key=value ...]``

Exit status: 0 on success; 2 on a config or data mistake, with one line
``config error: <key>: <what is wrong>`` (or ``data error: ...``) on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from input_pipeline.errors import DataError
from meshpar import config as config_lib
from meshpar import inputs as inputs_lib
from meshpar import layout as layout_lib
from meshpar import mesh as mesh_lib
from meshpar import trainer
from meshpar.config import Config, ConfigError
from meshpar.metrics import MetricsWriter, write_summary
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


def build(cfg: Config) -> Experiment:
    """Devices → mesh → layout → inputs → sharded state → jitted steps. Config mistakes raise ConfigError."""
    try:
        mesh_lib.request_cpu_devices(mesh_lib.cpu_device_count(cfg.mesh))
    except RuntimeError:
        pass  # backend already started (e.g. in-process tests); build_mesh reports a shortfall
    try:
        mesh = mesh_lib.build_mesh(cfg.mesh)
    except mesh_lib.MeshError as e:
        raise ConfigError("mesh", str(e)) from None
    layout = layout_lib.Layout.create(cfg.layout, dict(mesh.shape))
    inputs = inputs_lib.build(cfg, mesh, layout)
    family = MODELS[cfg.model.name]
    num_classes = getattr(inputs.train.source, "num_classes", None)
    if num_classes is not None and getattr(cfg.model, "num_classes", num_classes) != num_classes:
        raise ConfigError("model.num_classes", f"{cfg.model.num_classes} but the data has {num_classes} classes")
    build_model = functools.partial(family.build, cfg.model, inputs.element_spec)
    _, abstract_params = trainer.abstract_model(build_model)
    try:
        trainer.check_params(abstract_params, layout)
    except layout_lib.LayoutError as e:
        raise ConfigError("layout", str(e)) from None
    tx = trainer.make_optimizer(cfg.optimizer, cfg.train.steps)
    graphdef, state, shardings = trainer.init_state(build_model, tx, cfg.train.seed, layout, mesh)
    train_step = trainer.make_train_step(graphdef, tx, layout, mesh, shardings, inputs.shardings)
    eval_step = trainer.make_eval_step(graphdef, layout, mesh, shardings.params, inputs.shardings)
    return Experiment(cfg, mesh, layout, inputs, state, train_step, eval_step)


def evaluate(exp: Experiment, state: trainer.TrainState) -> dict[str, float]:
    """Mean eval metrics over the first ``train.eval_batches`` batches of the eval split."""
    rows = []
    for i in range(min(exp.cfg.train.eval_batches, exp.inputs.eval.batches_per_epoch)):
        batch = exp.inputs.feeder.place(exp.inputs.eval.batch(i))
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
    cfg, inputs = exp.cfg, exp.inputs
    state, batch_size = exp.state, cfg.train.batch_size
    writer = MetricsWriter(cfg.workdir)
    step_times, feed_times, losses, window, last_eval = [], [], [], [], {}
    with _progress(cfg.train.progress) as progress:
        task = progress.add_task("train", total=cfg.train.steps, loss=float("nan"), eps=0.0, extra="")
        for step in range(int(state.step), cfg.train.steps):
            start = time.perf_counter()
            batch = inputs.feeder.place(inputs.train.batch(step))
            fed = time.perf_counter()
            state, metrics = exp.train_step(state, batch)
            loss = float(metrics["loss"])  # waits for the step: step times are real, not dispatch times
            end = time.perf_counter()
            if not np.isfinite(loss):
                raise TrainingError(f"step {step + 1}: loss is {loss}")
            step_times.append(end - start)
            feed_times.append(fed - start)
            losses.append(loss)
            window.append((end - start, fed - start))
            done = step + 1
            if cfg.train.eval_every and inputs.eval and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
                last_eval = evaluate(exp, state)
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                step_s = statistics.fmean(t for t, _ in window)
                row = {
                    "loss": loss,
                    "step_time_s": step_s,
                    "feed_time_s": statistics.fmean(f for _, f in window),
                    "place_time_s": inputs.feeder.last.seconds,
                    "examples_per_s": batch_size / step_s,
                    **{k: float(v) for k, v in jax.device_get(metrics).items() if k != "loss"},
                    **last_eval,
                }
                writer.write(done, row)
                window.clear()
                extra = f"eval {last_eval['eval_loss']:.4f}" if last_eval else ""
                progress.update(task, loss=loss, eps=row["examples_per_s"], extra=extra)
            progress.update(task, completed=done)
    writer.close()
    steady = step_times[1:] or step_times  # the first step includes compilation
    summary = {
        "steps": cfg.train.steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        **{f"final_{k}": v for k, v in last_eval.items()},
        "mean_step_time_s": statistics.fmean(steady) if steady else None,
        "median_step_time_s": statistics.median(steady) if steady else None,
        "first_step_time_s": step_times[0] if step_times else None,
        "median_feed_time_s": statistics.median(feed_times[1:] or feed_times) if feed_times else None,
        "examples_per_s": batch_size / statistics.median(steady) if steady else None,
        "feed_mode": cfg.feed.mode,
        "relay_input_bytes": inputs.feeder.last.relay_bytes,
        "batch_input_bytes": inputs.feeder.last.total_bytes,
        "mesh": mesh_lib.describe(exp.mesh),
        "layout": str(exp.layout),
        "devices": [str(d) for d in exp.mesh.devices.flat],
        "config": config_lib.to_dict(cfg),
    }
    write_summary(cfg.workdir, summary)
    exp.state = state
    return summary


def run(cfg: Config) -> dict:
    return train(build(cfg))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshpar.train", description="Train a model on a device mesh.")
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. experiments/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_args(argv)
    try:
        summary = run(config_lib.load(args.config, args.overrides))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except DataError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"training error: {e}", file=sys.stderr)
        return 1
    print(
        f"done: {summary['steps']} steps, loss {summary['first_loss']:.4f} → {summary['final_loss']:.4f}, "
        f"{summary['examples_per_s']:,.0f} examples/s, feed={summary['feed_mode']}, mesh {summary['mesh']}, "
        f"workdir {summary['config']['workdir']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

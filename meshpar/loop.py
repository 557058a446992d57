"""The train loop: steps, and between them logging, eval, checkpoints and stopping, as calls.

Two clocks, never mixed: ``step_time_s`` is one step from dispatch until its loss is on the
host (device compute plus dispatch and one scalar fetch; no input wait, eval, checkpoint or
logging), and ``wall_time_per_step_s`` is the whole loop's wall time divided by its steps.
Throughput (examples/s, tokens/s, TFLOP/s, MFU) comes from wall time; the same figures from
step time carry a ``step_`` prefix.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshpar import config as config_lib
from meshpar import mesh as mesh_lib
from meshpar import throughput
from meshpar.checkpoint import Checkpointer
from meshpar.errors import OutputError, TrainingError
from meshpar.experiment import Experiment
from meshpar.metrics import MetricsWriter, RunStats, write_summary
from meshpar.resume import position
from meshpar.stop import Interrupted, StopSignals


def rates(exp: Experiment, seconds_per_step: float, prefix: str = "") -> dict[str, float]:
    """examples/s, tokens/s, model TFLOP/s per device and MFU at `seconds_per_step`."""
    batch = exp.cfg.train.batch_size
    out = throughput.rates(exp.flops_per_example, exp.tokens_per_example, batch, seconds_per_step, exp.mesh.size, exp.peak_tflops)
    return {f"{prefix}{k}": v for k, v in {"examples_per_s": batch / seconds_per_step, **out}.items()}


def evaluate(exp: Experiment, state) -> dict[str, float]:
    """Mean eval metrics over the first ``train.eval_batches`` batches of the eval split, placed
    through the eval feeder (never the train one, whose prefetch thread may be placing)."""
    rows = []
    for i in range(min(exp.cfg.train.eval_batches, exp.inputs.eval.batches_per_epoch)):
        batch, _ = exp.inputs.eval_feeder.place(exp.inputs.eval.batch(i))
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


def _last_saved(ckpt: Checkpointer | None) -> str:
    if ckpt is None:
        return "checkpointing is off"
    return f"last checkpoint saved: step {ckpt.last_saved}" if ckpt.last_saved is not None else "no checkpoint saved"


def train(exp: Experiment) -> dict:
    """The train loop. Returns the summary (also written to ``<workdir>/summary.json``)."""
    cfg, inputs, state, ckpt = exp.cfg, exp.inputs, exp.state, exp.checkpointer
    start = int(state.step)
    if start >= cfg.train.steps:  # resumed a finished run: leave its outputs as they are
        if ckpt:
            ckpt.close()
        return {"steps": cfg.train.steps, "already_at_step": start}
    lead = jax.process_index() == 0  # one process writes the run's outputs and shows progress
    stats, losses, last_eval, placement = RunStats(), [], {}, None
    writer = None
    try:
        writer = MetricsWriter(cfg.workdir, start, enabled=lead)
        with _progress(cfg.train.progress and lead) as progress, inputs.batches(start, cfg.train.steps) as batches, StopSignals(exp.mesh) as stop:
            task = progress.add_task("train", total=cfg.train.steps, completed=start, loss=float("nan"), eps=0.0, extra="")
            stats.start()
            for fed in batches:
                dispatched = time.perf_counter()
                state, metrics = exp.train_step(state, fed.arrays, stop.flags())
                loss = float(metrics["loss"])  # waits for the step: step times are real, not dispatch times
                done, placement = fed.step + 1, fed.info
                stats.add(time.perf_counter() - dispatched, fed.wait_s, placement.seconds)
                del fed  # the batch is released before the next is placed (feed.prefetch + 1 live at most)
                _check_finite(loss, float(metrics["grad_norm"]), done, ckpt)
                losses.append(loss)
                stopping = int(metrics["stop"])  # the same on every process (see meshpar.stop)
                if ckpt:
                    ckpt.maybe_save(state, position(done), exp.record, force=done == cfg.train.steps or bool(stopping))
                evaluated = bool(cfg.train.eval_every and inputs.eval) and (done % cfg.train.eval_every == 0 or done == cfg.train.steps)
                if evaluated:
                    last_eval = evaluate(exp, state)
                if evaluated or done % cfg.train.log_every == 0 or done == cfg.train.steps:
                    window = stats.window()
                    row = {"loss": loss, **window, **_scalars(metrics), **(last_eval if evaluated else {})}
                    row.update(rates(exp, window["wall_time_per_step_s"]))
                    row.update(rates(exp, window["step_time_s"], prefix="step_"))
                    writer.write(done, row)
                    progress.update(task, loss=loss, eps=row["examples_per_s"], extra=_eval_text(last_eval))
                progress.update(task, completed=done)
                if stopping:
                    if ckpt:
                        ckpt.wait()  # the stop line says the step is saved: it must be committed
                    raise Interrupted(stopping, done, saved=ckpt is not None)
            stats.stop()
    except OutputError as e:
        raise OutputError(f"{e}; {_last_saved(ckpt)}") from None
    finally:
        try:
            if writer is not None:
                writer.close()
        finally:
            if ckpt:
                ckpt.close()  # waits for the last async save to commit
    exp.state = state
    summary = _summary(exp, losses, last_eval, stats, placement)
    if lead:
        try:
            write_summary(cfg.workdir, summary)
            stats.write(cfg.workdir)
        except OutputError as e:
            raise OutputError(f"{e}; {_last_saved(ckpt)}") from None
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
    return {k: float(v) for k, v in jax.device_get(metrics).items() if k not in ("loss", "stop")}


def _eval_text(last_eval: dict) -> str:
    return f"eval {last_eval['eval_loss']:.4f}" if last_eval else ""


def _summary(exp: Experiment, losses, last_eval, stats: RunStats, placement) -> dict:
    cfg, timing = exp.cfg, stats.summary()
    feeder = exp.inputs.feeder
    return {
        "steps": cfg.train.steps,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        **{f"final_{k}": v for k, v in last_eval.items()},
        **timing,
        **(rates(exp, timing["wall_time_per_step_s"]) if timing else {}),
        **(rates(exp, timing["median_step_time_s"], prefix="step_") if timing else {}),
        "model_flops_per_example": exp.flops_per_example,
        "tokens_per_example": exp.tokens_per_example,
        "peak_tflops_per_device": exp.peak_tflops,
        "peak_tflops_source": exp.peak_source,
        "feed_mode": cfg.feed.mode,
        "prefetch": cfg.feed.prefetch,
        "relay_device": feeder.relay.id,
        "relay_input_bytes": placement.relay_bytes if placement else None,
        "batch_input_bytes": placement.total_bytes if placement else None,
        "host_buffer_aliased": placement.aliased if placement else None,
        "input_memory": feeder.memory_report(),
        "mesh": mesh_lib.describe(exp.mesh),
        "layout": str(exp.layout),
        "devices": [str(d) for d in exp.mesh.devices.flat],
        "resumed_from": exp.resumed_from,
        "decay_steps": exp.record.get("decay_steps"),
        "config": config_lib.to_dict(cfg),
    }

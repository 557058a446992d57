"""The train loop: steps, and between them logging, eval, checkpoints and stopping, as calls.

No per-step host sync: a step's results are fetched one step late (the loop dispatches step
n+1, then waits for step n's), so the devices never wait on the host; the loop syncs right
after dispatching a step only where its state is needed before the next step takes it over
(checkpoint and eval steps, the last step, a stop, the edges of a ``train.profile`` trace).
``train.sync_every_step: true`` syncs every step, with the same results bit for bit. Stopping
on a signal, the NaN guard, the notices said before the first step, the batches in device
memory and the two clocks (``step_time_s`` vs ``wall_time_per_step_s``): docs/running.md,
"The loop: no per-step sync".
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from meshpar import sources
from meshpar.checkpoints.checkpoint import Checkpointer, CheckpointError
from meshpar.configuration import config as config_lib
from meshpar.configuration.errors import DataError, OutputError, TrainingError
from meshpar.processes.stop import Interrupted, StopSignals
from meshpar.run.experiment import Experiment
from meshpar.run.metrics import MetricsWriter, RunStats, write_summary
from meshpar.run.profiler import StepTrace
from meshpar.run.resume import position
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import throughput


def rates(exp: Experiment, seconds_per_step: float, prefix: str = "") -> dict[str, float]:
    """examples/s, tokens/s, model TFLOP/s per device and MFU at `seconds_per_step`."""
    batch = exp.cfg.train.batch_size
    out = throughput.rates(
        exp.flops_per_example, exp.tokens_per_example, batch, seconds_per_step, exp.mesh.size, exp.peak_tflops
    )
    return {f"{prefix}{k}": v for k, v in {"examples_per_s": batch / seconds_per_step, **out}.items()}


def evaluate(exp: Experiment, state) -> dict[str, float]:
    """Mean eval metrics over the first ``train.eval_batches`` batches of the eval split, placed
    through the eval feeder (never the train one, whose prefetch thread may be placing)."""
    rows = []
    for i in range(min(exp.cfg.train.eval_batches, exp.inputs.eval.batches_per_epoch)):
        batch, _ = exp.inputs.eval_feeder.place(exp.inputs.eval.batch(i))
        rows.append(jax.device_get(exp.eval_step(state.params, batch)))
    return {f"eval_{k}": float(np.mean([r[k] for r in rows])) for k in rows[0]}


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}..{last}"


def notices(exp: Experiment, start: int) -> list[str]:
    """One line for each setting that cannot take effect as written in this run, which starts
    after step `start`: what is done instead."""
    train, lines = exp.cfg.train, []
    profile = train.profile
    if profile.steps:  # config.check refuses a window that starts past train.steps
        first, last = profile.start, profile.start + profile.steps - 1
        traced = max(first, start + 1), min(last, train.steps)
        if traced != (first, last):
            why = [f"this run resumes at step {start + 1}"] if start + 1 > first else []
            why += [f"the run ends at step {train.steps} (train.steps)"] if train.steps < last else []
            done = f"tracing {_steps(*traced)}" if traced[0] <= traced[1] else "nothing is traced"
            lines.append(f"profile: train.profile asks for {_steps(first, last)} but {' and '.join(why)}: {done}")
    evaluation = exp.inputs.eval
    if train.eval_every and evaluation is None:
        key = sources.of(exp.cfg.data).eval_key  # the setting that, zero or empty, leaves no eval split
        why = f" (data.{key} is {getattr(exp.cfg.data, key)!r})" if key else ""
        lines.append(f"eval: train.eval_every is {train.eval_every} but there is no eval split{why}: no eval")
    elif train.eval_every and train.eval_batches > evaluation.batches_per_epoch:
        held, examples = evaluation.batches_per_epoch, len(evaluation.source)
        batches = f"{held} batch{'es' if held > 1 else ''} of {train.batch_size} ({examples} examples)"
        asked = f"train.eval_batches is {train.eval_batches}"
        lines.append(f"eval: {asked} but the eval split holds {batches}: evaluating on {held}")
    return lines


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


def _committed(ckpt: Checkpointer | None) -> str:
    """:func:`_last_saved` once the save in flight, if any, has committed (the line a stopped
    run ends with must name the checkpoint a resume will start from)."""
    if ckpt is not None:
        try:
            ckpt.wait()
        except CheckpointError as e:
            return f"{_last_saved(ckpt)} (the save in flight failed: {e})"
    return _last_saved(ckpt)


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose results are not on the host yet."""

    step: int  # its number (the run's first step is 1)
    metrics: dict  # device arrays
    dispatched: float  # perf_counter at dispatch
    wait_s: float  # how long the loop waited for its batch
    placement: Any  # what placing its batch cost (input_pipeline.feeding.Placement)


def train(exp: Experiment) -> dict:
    """The train loop. Returns the summary (also written to ``<workdir>/summary.json``)."""
    cfg, inputs, state, ckpt = exp.cfg, exp.inputs, exp.state, exp.checkpointer
    start = int(state.step)
    if start >= cfg.train.steps:  # resumed a finished run: leave its outputs as they are
        if ckpt:
            ckpt.close()
        return {"steps": cfg.train.steps, "already_at_step": start}
    lead = jax.process_index() == 0  # one process writes the run's outputs and shows progress
    if lead:
        for line in notices(exp, start):
            print(line, file=sys.stderr)
    book = None
    try:
        book = _Book(exp, start, lead)
        with (
            book.progress,
            inputs.batches(start, cfg.train.steps) as batches,
            StopSignals(exp.mesh) as stop,
            book.trace,
        ):
            book.stats.start()
            pending = None  # the step dispatched before, its results not fetched yet
            for fed in batches:
                step = fed.step + 1
                book.trace.before(step, state)
                dispatched = time.perf_counter()
                state, metrics = exp.train_step(state, fed.arrays, stop.flags())
                current = _InFlight(step, metrics, dispatched, fed.wait_s, fed.info)
                del fed, metrics  # the batch is released before the next is placed
                stopping = (
                    book.finish(pending) if pending is not None else 0
                )  # the previous step's results, while this one runs
                if stopping or book.syncs(step):  # `state` is this step's until the next dispatch
                    pending, stopping = None, book.finish(current, state, stopping)
                    if stopping:
                        if ckpt:
                            ckpt.wait()  # the stop line says the step is saved: it must be committed
                        raise Interrupted(stopping, step, saved=ckpt is not None)
                else:
                    pending = current
            book.stats.stop()
    except (OutputError, DataError) as e:  # e.g. a corrupt shard, a data worker killed by the OS
        raise type(e)(f"{e}; {_committed(ckpt)}") from None
    finally:
        try:
            if book is not None:
                book.writer.close()
        finally:
            if ckpt:
                ckpt.close()  # waits for the last async save to commit
    exp.state = state
    summary = _summary(exp, book.losses, book.last_eval, book.stats, book.placement)
    if lead:
        try:
            write_summary(cfg.workdir, summary)
            book.stats.write(cfg.workdir)
        except OutputError as e:
            raise OutputError(f"{e}; {_last_saved(ckpt)}") from None
    return summary


class _Book:
    """What the loop does with a step's results once they are on the host."""

    def __init__(self, exp: Experiment, start: int, lead: bool):
        cfg = exp.cfg
        self.exp, self.ckpt, self.train = exp, exp.checkpointer, cfg.train
        self.stats, self.losses, self.last_eval, self.placement = RunStats(), [], {}, None
        self.trace = StepTrace(cfg.train.profile, cfg.workdir)
        self.show = cfg.train.progress and lead
        self.progress = _progress(self.show)
        self.task = self.progress.add_task(
            "train", total=cfg.train.steps, completed=start, loss=float("nan"), eps=0.0, extra=""
        )
        self.writer = MetricsWriter(cfg.workdir, start, enabled=lead)

    def evals(self, step: int) -> bool:
        every = self.train.eval_every
        return bool(every and self.exp.inputs.eval) and (step % every == 0 or step == self.train.steps)

    def syncs(self, step: int) -> bool:
        """Whether the loop waits for `step` right after dispatching it (its state is needed)."""
        ckpt = self.ckpt
        return (
            self.train.sync_every_step
            or step == self.train.steps
            or (ckpt is not None and ckpt.every > 0 and step % ckpt.every == 0)
            or self.evals(step)
            or self.trace.syncs(step)
        )

    def finish(self, done: _InFlight, state=None, stopping: int = 0) -> int:
        """Fetch `done`'s results, check them, and log; with `state` (a sync step: the state it
        returned, not yet donated) also save and evaluate, and save anyway when `stopping`.
        Returns the stop signal number the step carried (0 = go on), or `stopping`."""
        metrics = done.metrics
        loss, grad_norm, flag = jax.device_get((metrics["loss"], metrics["grad_norm"], metrics["stop"]))
        self.stats.add(done.dispatched, time.perf_counter(), done.wait_s, done.placement.seconds)
        self.trace.after(done.step, state)
        step, loss, grad_norm = done.step, float(loss), float(grad_norm)
        _check_finite(loss, grad_norm, step, self.ckpt)
        self.losses.append(loss)
        self.placement = done.placement
        stopping = max(stopping, int(flag))  # the same on every process (see meshpar.processes.stop)
        evaluated = False
        if state is not None:
            if self.ckpt:
                last = step == self.train.steps
                self.ckpt.maybe_save(state, position(step), self.exp.record, force=last or bool(stopping))
            evaluated = self.evals(step)
            if evaluated:
                self.last_eval = evaluate(self.exp, state)
        if (
            evaluated
            or step % self.train.log_every == 0
            or step == self.train.steps
            or (state is not None and stopping)
        ):
            window = self.stats.window()
            row = {"loss": loss, **window, **_scalars(metrics), **(self.last_eval if evaluated else {})}
            row.update(rates(self.exp, window["wall_time_per_step_s"]))
            row.update(rates(self.exp, window["step_time_s"], prefix="step_"))
            self.writer.write(step, row)
            if self.show:
                self.progress.update(self.task, loss=loss, eps=row["examples_per_s"], extra=_eval_text(self.last_eval))
        if self.show:
            self.progress.update(self.task, completed=step)
        return stopping


def _check_finite(loss: float, grad_norm: float, step: int, ckpt: Checkpointer | None) -> None:
    """Stop on a non-finite loss or gradient; that state is never saved, so the newest
    checkpoint stays the last good one."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        if ckpt:
            ckpt.wait()  # the previous step's save may still be committing
        kept = ckpt.steps() if ckpt else []
        where = f"; last good checkpoint: step {kept[-1]}" if kept else ""
        raise TrainingError(f"step {step}: loss is {loss}, gradient norm is {grad_norm}{where}")


def _scalars(metrics: dict) -> dict[str, float]:
    """The step's metrics for its row, fetched only for rows (the loss comes first, from the
    caller; no stop flag)."""
    return {
        k: float(v) for k, v in jax.device_get({k: v for k, v in metrics.items() if k not in ("loss", "stop")}).items()
    }


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

"""Run outputs: ``metrics.jsonl`` (one object per logged step), TensorBoard events, ``summary.json``."""

from __future__ import annotations

import contextlib
import json
import pathlib
import statistics
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from meshpar.configuration.errors import OutputError


class MetricsWriter:
    """Appends one JSON line per logged step and mirrors the scalars to TensorBoard under ``tb/``.

    A write that fails (a full disk, a file in the way) raises :class:`OutputError` naming the path.
    """

    def __init__(self, workdir: str | pathlib.Path, start_step: int = 0, enabled: bool = True):
        """A run starting at `start_step` (a resumed one) keeps the rows up to that step and
        drops later ones, which a killed run wrote after its last checkpoint (TensorBoard is
        told to purge its events after that step too); a fresh run (step 0) starts the file
        anew. Disabled (processes other than the first of a multi-process run), it writes nothing."""
        try:
            from tensorboardX import SummaryWriter  # protobuf-only event writer; no TensorFlow
            from tensorboardX.proto.summary_pb2 import Summary
            from tensorboardX.summary import scalar
        except ImportError:  # a bare accelerator image: the JSON outputs are the record, TB is a mirror
            SummaryWriter = Summary = scalar = None

        self.enabled = enabled
        if not enabled:
            return
        self.workdir = pathlib.Path(workdir)
        path = self.workdir / "metrics.jsonl"
        with _writing(path):
            self.workdir.mkdir(parents=True, exist_ok=True)
            kept = [r for r in read_jsonl(path) if r["step"] <= start_step] if start_step and path.exists() else []
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self._jsonl = open(path, "a")
        self._summary, self._scalar = Summary, scalar
        self._tb = None
        if SummaryWriter is None:
            print("tensorboard: skipped: tensorboardX is not installed (metrics.jsonl and summary.json are written)")
            return
        with _writing(self.workdir / "tb"):
            self._tb = SummaryWriter(str(self.workdir / "tb"), purge_step=start_step + 1 if start_step else None)

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
        with _writing(self.workdir / "metrics.jsonl"):
            self._jsonl.write(json.dumps(row) + "\n")
            self._jsonl.flush()
        if self._tb is None:
            return
        with _writing(self.workdir / "tb"):
            # One event per row, all its scalars in it (one add_scalar each costs ~0.3 ms).
            scalars = [
                v
                for k, x in row.items()
                if k != "step" and isinstance(x, (int, float))
                for v in self._scalar(k, x).value
            ]
            self._tb.file_writer.add_summary(self._summary(value=scalars), int(step))

    def close(self) -> None:
        if not self.enabled:
            return
        with _writing(self.workdir / "metrics.jsonl"):
            self._jsonl.close()
        if self._tb is not None:
            with _writing(self.workdir / "tb"):
                self._tb.close()


@contextlib.contextmanager
def _writing(path: pathlib.Path):
    """Report an OSError raised while writing `path` as one line."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None


def write_summary(workdir: str | pathlib.Path, summary: Mapping[str, Any]) -> None:
    path = pathlib.Path(workdir) / "summary.json"
    with _writing(path):
        path.write_text(json.dumps({k: _plain(v) for k, v in summary.items()}, indent=2) + "\n")


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def _plain(value: Any) -> Any:
    """numpy / jax scalars → Python numbers, so rows serialise exactly."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


class RunStats:
    """Per-step timings of a run: windows for metrics.jsonl, medians for summary.json.

    Per step: ``step_time_s``, from when the step could start until its results (loss,
    gradient norm) are on the host. It could start at its dispatch, or — the devices run one
    step at a time — when the previous step's results reached the host, whichever is later;
    nor before the last logged row's window closed (below). With results fetched a step late
    (:mod:`meshpar.run.loop`), the host dispatches the next step and waits for its batch inside
    this stretch while the devices compute, so on a device-bound run it is the step's device
    time plus one scalar fetch, and on a host-bound run (the devices finish before the host
    asks) it is the host's time per step. It leaves out eval, checkpoints and logging done
    while no step ran. ``wait_s``, how long the loop waited for the step's batch (input
    stall); ``place_s``, how long placing that batch on the devices took (in the background
    when prefetching). And the loop's wall clock: ``wall_time_per_step_s`` is the wall time of
    a stretch of the loop — everything it did, eval, checkpoints and logging included —
    divided by its steps. Step times never overlap and each lies inside its window, so a
    window's mean step time is at most its wall time per step. The first step includes
    compilation and is left out of the summary.
    """

    def __init__(self):
        self.rows: list[tuple[float, float, float]] = []
        self._window_start, self._window_mark = 0, 0.0
        self._floor = 0.0  # no step's time starts before this
        self._started = self._first_done = self._stopped = None

    def start(self) -> None:
        self._started = self._window_mark = self._floor = time.perf_counter()

    def add(self, dispatched: float, fetched: float, wait_s: float, place_s: float) -> None:
        """A step dispatched at `dispatched` whose results reached the host at `fetched`
        (``time.perf_counter`` values)."""
        self.rows.append((fetched - max(dispatched, self._floor), wait_s, place_s))
        self._floor = fetched
        if len(self.rows) == 1:
            self._first_done = fetched

    def stop(self) -> None:
        self._stopped = time.perf_counter()

    def window(self) -> dict[str, float]:
        """Means over the steps since the previous call; wall time since the previous call."""
        now = time.perf_counter()
        rows, self._window_start = self.rows[self._window_start :], len(self.rows)
        wall, self._window_mark = (now - self._window_mark) / len(rows), now
        self._floor = now  # the next window's steps lie inside it
        step, wait, place = (statistics.fmean(col) for col in zip(*rows))
        return {"step_time_s": step, "wall_time_per_step_s": wall, "feed_time_s": wait, "place_time_s": place}

    def write(self, workdir: str | pathlib.Path) -> None:
        """Every step's timings, as columns, to ``<workdir>/step_times.json``."""
        columns = dict(zip(("step_time_s", "wait_s", "place_s"), (list(c) for c in zip(*self.rows))))
        path = pathlib.Path(workdir) / "step_times.json"
        with _writing(path):
            path.write_text(json.dumps(columns) + "\n")

    def summary(self) -> dict[str, float | None]:
        if not self.rows:
            return {}
        steady = self.rows[1:] or self.rows
        step, wait, place = (list(col) for col in zip(*steady))
        end = self._stopped or time.perf_counter()
        if len(self.rows) > 1:  # from the first step's end: no compilation
            wall = (end - self._first_done) / (len(self.rows) - 1)
        else:
            wall = end - self._started
        return {
            "first_step_time_s": self.rows[0][0],
            "mean_step_time_s": statistics.fmean(step),
            "median_step_time_s": statistics.median(step),
            "wall_time_per_step_s": wall,
            "loop_wall_time_s": end - self._started,
            "median_feed_time_s": statistics.median(wait),
            "median_place_time_s": statistics.median(place),
            "p90_place_time_s": float(np.percentile(place, 90)),
            "stall_fraction": sum(wait) / (wall * len(steady)),
        }

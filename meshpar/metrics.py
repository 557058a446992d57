"""Run outputs: ``metrics.jsonl`` (one object per logged step), TensorBoard events, ``summary.json``."""

from __future__ import annotations

import json
import pathlib
import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np


class MetricsWriter:
    """Appends one JSON line per logged step and mirrors the scalars to TensorBoard under ``tb/``."""

    def __init__(self, workdir: str | pathlib.Path, start_step: int = 0, enabled: bool = True):
        """A run starting at `start_step` (a resumed one) keeps the rows up to that step and
        drops later ones, which a killed run wrote after its last checkpoint; a fresh run
        (step 0) starts the file anew. Disabled (processes other than the first of a
        multi-process run), it writes nothing."""
        from tensorboardX import SummaryWriter  # protobuf-only event writer; no TensorFlow

        self.enabled = enabled
        if not enabled:
            return
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "metrics.jsonl"
        kept = [r for r in read_jsonl(path) if r["step"] <= start_step] if start_step and path.exists() else []
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._jsonl = open(path, "a")
        self._tb = SummaryWriter(str(self.workdir / "tb"))

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, int(step))

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        self._tb.close()


def write_summary(workdir: str | pathlib.Path, summary: Mapping[str, Any]) -> None:
    path = pathlib.Path(workdir) / "summary.json"
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

    ``step_time_s`` is the wall time between consecutive step completions (so it includes any
    wait for input); ``wait_s`` is how long the step waited for its batch (input stall);
    ``place_s`` is how long placing that batch on the devices took (in the background when
    prefetching). The first step includes compilation and is left out of the summary.
    """

    def __init__(self):
        self.rows: list[tuple[float, float, float]] = []
        self._window_start = 0

    def add(self, step_time_s: float, wait_s: float, place_s: float) -> None:
        self.rows.append((step_time_s, wait_s, place_s))

    def window(self) -> dict[str, float]:
        """Means over the steps since the previous call."""
        rows, self._window_start = self.rows[self._window_start :], len(self.rows)
        step, wait, place = (statistics.fmean(col) for col in zip(*rows))
        return {"step_time_s": step, "feed_time_s": wait, "place_time_s": place}

    def write(self, workdir: str | pathlib.Path) -> None:
        """Every step's timings, as columns, to ``<workdir>/step_times.json``."""
        columns = dict(zip(("step_time_s", "wait_s", "place_s"), (list(c) for c in zip(*self.rows))))
        (pathlib.Path(workdir) / "step_times.json").write_text(json.dumps(columns) + "\n")

    def summary(self) -> dict[str, float | None]:
        if not self.rows:
            return {}
        steady = self.rows[1:] or self.rows
        step, wait, place = (list(col) for col in zip(*steady))
        return {
            "first_step_time_s": self.rows[0][0],
            "mean_step_time_s": statistics.fmean(step),
            "median_step_time_s": statistics.median(step),
            "median_feed_time_s": statistics.median(wait),
            "median_place_time_s": statistics.median(place),
            "p90_place_time_s": float(np.percentile(place, 90)),
            "stall_fraction": sum(wait) / sum(step),
        }

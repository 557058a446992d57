"""Run outputs: ``metrics.jsonl`` (one object per logged step), TensorBoard events, ``summary.json``."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping
from typing import Any


class MetricsWriter:
    """Appends one JSON line per logged step and mirrors the scalars to TensorBoard under ``tb/``."""

    def __init__(self, workdir: str | pathlib.Path):
        from tensorboardX import SummaryWriter  # protobuf-only event writer; no TensorFlow

        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.workdir / "metrics.jsonl", "a")
        self._tb = SummaryWriter(str(self.workdir / "tb"))

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(key, value, int(step))

    def close(self) -> None:
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

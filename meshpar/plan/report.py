"""A config's per-device memory plan: the analytic model next to XLA's figures for the compiled
train step, against the device capacity, as a rich table and as JSON.

XLA's ``memory_analysis()`` of the step reports four figures per device; how they map onto the
analytic categories:

- argument = train state + one batch (+ the stop flags): exact, the arrays the step is given;
- temp = gradients + activations saved for the backward pass + XLA's workspace: an estimate
  (the workspace is XLA's own, and XLA may reuse or fuse away buffers);
- output = the new state and the metrics; alias = the state donated back into its own buffers;
- total = argument + output + temp − alias, the step's peak (on CPU ``peak_memory_in_bytes``
  leaves temp out, so it is not used).
"""

from __future__ import annotations

import dataclasses
import importlib.util

from meshpar import aot
from meshpar import mesh as mesh_lib
from meshpar.config import Config
from meshpar.plan import capacity as capacity_lib

# Analytic categories beside the XLA figure they are part of (see the module docstring).
GROUPS = (
    ("argument", "state + batch (exact)", ("params", "optimizer", "inputs")),
    ("temp", "grads + activations + workspace (estimate)", ("grads", "activations")),
)


@dataclasses.dataclass(frozen=True)
class Report:
    """A config's plan: mesh, analytic breakdown (None, with the reason, when there is none),
    XLA's per-device figures (:func:`meshpar.aot.memory`) and the device capacity."""

    mesh: str
    devices: str
    analytic: object | None  # meshpar.plan.memory.Breakdown
    analytic_missing: str | None
    xla: dict[str, int]
    capacity: capacity_lib.Capacity

    @property
    def needed_bytes(self) -> int:
        """Per-device bytes the plan needs: the larger of XLA's total and the analytic total (the
        analytic one also counts buffers outside the step, such as prefetched batches)."""
        return max(self.xla["total_bytes"], self.analytic.total if self.analytic is not None else 0)

    @property
    def needed_from(self) -> str:
        if self.analytic is not None and self.analytic.total > self.xla["total_bytes"]:
            return "analytic total"
        return "XLA argument + output + temp − alias"

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.capacity.usable_bytes

    def verdict(self) -> str:
        need, have = self.needed_bytes, self.capacity.usable_bytes
        if self.fits:
            return f"fits: needs {fmt_bytes(need)} per device of {fmt_bytes(have)} usable ({fmt_bytes(have - need)} to spare)"
        return f"does not fit: needs {fmt_bytes(need)} per device, {fmt_bytes(need - have)} more than the {fmt_bytes(have)} usable"

    def to_json(self) -> dict:
        a = self.analytic
        return {
            "mesh": self.mesh,
            "devices": self.devices,
            "analytic": None if a is None else {"categories": dict(a.categories), "exact": sorted(a.exact), "total_bytes": a.total},
            "analytic_missing": self.analytic_missing,
            "xla": dict(self.xla),
            "capacity": {
                "bytes": self.capacity.bytes, "source": self.capacity.source,
                "headroom_bytes": self.capacity.headroom_bytes, "usable_bytes": self.capacity.usable_bytes,
            },
            "needed_bytes": self.needed_bytes,
            "needed_from": self.needed_from,
            "fits": self.fits,
            "verdict": self.verdict(),
        }  # fmt: skip


def _analytic(cfg: Config, step: aot.AbstractStep):
    if importlib.util.find_spec("meshpar.plan.memory") is None:
        return None, "not available (no analytic memory model in this build)"
    from meshpar.plan import memory

    return memory.analytic(cfg, step), None


def plan(cfg: Config) -> Report:
    """Compile the config's train step on abstract inputs (nothing is allocated) and set XLA's
    figures beside the analytic model and the device capacity."""
    step = aot.abstract_step(cfg)
    analytic, missing = _analytic(cfg, step)
    xla = aot.memory(step.lower().compile())
    return Report(
        mesh_lib.describe(step.mesh), f"{step.mesh.size} {step.mesh.devices.flat[0].platform}",
        analytic, missing, xla, capacity_lib.device_capacity(cfg, step.mesh),
    )  # fmt: skip


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n} B"


def _diff(analytic: int, xla: int) -> str:
    return f"{(analytic - xla) / xla:+.1%}" if xla else ""


def table(report: Report):
    """The side-by-side table, per device, as a rich Table: each analytic category, then the sum
    of those that make up an XLA figure beside it, the total, and the capacity."""
    from rich.table import Table

    a, x, c = report.analytic, report.xla, report.capacity
    t = Table(
        title=f"memory per device: mesh {report.mesh}, {report.devices} devices", title_justify="left",
        caption=f"capacity: {c.source}; headroom {capacity_lib.HEADROOM_FRACTION:.0%} kept free", caption_justify="left",
    )  # fmt: skip
    t.add_column("analytic category", no_wrap=True)
    t.add_column("analytic", justify="right")
    t.add_column("kind")
    t.add_column("XLA figure (compiled train step)", no_wrap=True)
    t.add_column("XLA", justify="right")
    t.add_column("analytic − XLA", justify="right")
    na = "not available"
    shown = set()
    for field, meaning, cats in GROUPS:
        for cat in cats:
            if a is not None and cat in a.categories:
                t.add_row(
                    f"  {cat}", fmt_bytes(a.categories[cat]), "exact" if cat in a.exact else "estimate", "", "", ""
                )
                shown.add(cat)
        part = sum(a.categories.get(cat, 0) for cat in cats) if a is not None else None
        t.add_row(
            " + ".join(cats), na if part is None else fmt_bytes(part), "", f"{field}: {meaning}",
            fmt_bytes(x[f"{field}_bytes"]), "" if part is None else _diff(part, x[f"{field}_bytes"]), style="bold",
        )  # fmt: skip
    if a is not None:
        for cat, n in a.categories.items():
            if cat not in shown:
                t.add_row(
                    f"  {cat}", fmt_bytes(n), "exact" if cat in a.exact else "estimate", "(outside the step)", "", ""
                )
    t.add_row("", "", "", "output: new state + metrics", fmt_bytes(x["output_bytes"]), "")
    t.add_row("", "", "", "alias: state donated in place", f"−{fmt_bytes(x['alias_bytes'])}", "")
    total = None if a is None else a.total
    t.add_row(
        "total", na if total is None else fmt_bytes(total), "", "argument + output + temp − alias",
        fmt_bytes(x["total_bytes"]), "" if total is None else _diff(total, x["total_bytes"]), style="bold", end_section=True,
    )  # fmt: skip
    t.add_row("capacity", fmt_bytes(c.bytes), "", "", "", "")
    t.add_row("− headroom", fmt_bytes(c.headroom_bytes), "", "", "", "")
    t.add_row("usable", fmt_bytes(c.usable_bytes), "", "", "", "", style="bold")
    return t

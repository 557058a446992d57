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

With host offload the device figures leave out what lives in pinned host memory, and a host
row sets the analytic host column (:mod:`meshpar.plan.memory.analytic`) beside XLA's host bytes — XLA's
own ``host_*`` fields on GPU; on CPU, which reports none, the offloaded state's shard bytes
(:func:`meshpar.step.aot.memory`), as the table says.

The flags XLA compiled the programs with (:attr:`meshpar.step.parts.AbstractStep.compiler_options`:
``xla.flags`` over the GPU defaults) are the report's ``xla_flags``, beside the environment's
``XLA_FLAGS`` (under them: a compile option wins flag by flag).

The run executes other programs too (the eval step, the checkpoint digest), each with its own
peak and with other buffers resident beside it (:mod:`meshpar.plan.programs`). What the plan
needs per device is the largest of those peaks and of the analytic total.
"""

from __future__ import annotations

import dataclasses
import os

from meshpar.backend import xla_flags as xla_flags_lib
from meshpar.plan import cost
from meshpar.plan import programs as programs_lib
from meshpar.plan.memory import analytic as memory
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import aot, parts
from meshpar.step.programs import Programs

# Analytic categories beside the XLA figure they are part of (see the module docstring).
GROUPS = (
    ("argument", "state + batch (exact)", ("params", "optimizer", "inputs")),
    ("temp", "grads + activations + workspace (estimate)", ("grads", "activations", "workspace")),
)


@dataclasses.dataclass(frozen=True)
class Report:
    """A config's plan: mesh, analytic breakdown (None, with the reason, when there is none),
    XLA's per-device figures (:func:`meshpar.step.aot.memory`) and the device capacity."""

    mesh: str
    devices: str
    analytic: object | None  # meshpar.plan.memory.analytic.Breakdown
    analytic_missing: str | None
    xla: dict[str, int]
    capacity: cost.Capacity
    programs: tuple = ()  # meshpar.plan.programs.Peak of every program the run executes
    compiled: object = dataclasses.field(
        default=None, repr=False, compare=False
    )  # the train step, for the run to reuse
    xla_flags: dict = dataclasses.field(default_factory=dict)  # the compile options the programs were compiled with

    @property
    def needed_bytes(self) -> int:
        """Per-device bytes the plan needs: the highest program peak (XLA's figures plus what is
        resident beside the program), or the analytic total when that is higher."""
        return max([self.xla["total_bytes"], *(p.bytes for p in self.programs), self.analytic_total])

    @property
    def analytic_total(self) -> int:
        return self.analytic.total if self.analytic is not None else 0

    @property
    def needed_from(self) -> str:
        top = max(self.programs, key=lambda p: p.bytes, default=None)
        if top is None or self.analytic_total > top.bytes:
            return "analytic total" if self.analytic_total > self.xla["total_bytes"] else "XLA total of the train step"
        return f"{top.program} peak (XLA total + resident {', '.join(top.resident) or 'nothing'})"

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.capacity.usable_bytes

    @property
    def migrated_bytes(self) -> int:
        """Under unified memory, the needed bytes beyond the device's own memory (0 otherwise)."""
        return self.capacity.migrated(self.needed_bytes)

    def verdict(self) -> str:
        need, have = self.needed_bytes, self.capacity.usable_bytes
        if self.fits and self.migrated_bytes:
            return (f"fits with unified memory: needs {fmt_bytes(need)} per device of {fmt_bytes(have)} usable, "
                    f"{fmt_bytes(self.migrated_bytes)} of it migrated to host memory")  # fmt: skip
        if self.fits:
            return f"fits: needs {fmt_bytes(need)} per device of {fmt_bytes(have)} usable ({fmt_bytes(have - need)} to spare)"
        return f"does not fit: needs {fmt_bytes(need)} per device, {fmt_bytes(need - have)} more than the {fmt_bytes(have)} usable"

    def to_json(self) -> dict:
        a = self.analytic
        return {
            "mesh": self.mesh,
            "devices": self.devices,
            "analytic": None if a is None else {
                "categories": dict(a.categories), "exact": sorted(a.exact), "total_bytes": a.total,
                "host": dict(a.host), "host_total_bytes": a.host_total,
            },
            "analytic_missing": self.analytic_missing,
            "xla": dict(self.xla),
            "capacity": {
                "bytes": self.capacity.bytes, "source": self.capacity.source,
                "headroom_bytes": self.capacity.headroom_bytes, "usable_bytes": self.capacity.usable_bytes,
                "device_bytes": self.capacity.device_bytes or self.capacity.bytes,
                "device_usable_bytes": self.capacity.device_usable_bytes,
            },
            "migrated_bytes": self.migrated_bytes,
            "programs": [
                {"program": p.program, "xla": dict(p.xla), "resident": dict(p.resident), "peak_bytes": p.bytes}
                for p in self.programs
            ],
            "needed_bytes": self.needed_bytes,
            "needed_from": self.needed_from,
            "fits": self.fits,
            "verdict": self.verdict(),
            "xla_flags": dict(self.xla_flags),
            "xla_flags_env": os.environ.get("XLA_FLAGS", ""),
        }  # fmt: skip


def platform(step: parts.AbstractStep) -> str:
    """The platform the step is compiled for (``cpu``, ``gpu``, ``tpu``)."""
    return step.mesh.devices.flat[0].platform


def _analytic(step: parts.AbstractStep):
    """The analytic breakdown, or None and why: a config out of the model's scope on this
    platform (:func:`meshpar.plan.memory.analytic.out_of_scope`) gets no figure."""
    reason = memory.out_of_scope(step.cfg, platform(step))
    if reason:
        return None, f"out of scope: {reason}"
    return memory.analytic(step), None


def plan(step: parts.AbstractStep, programs: Programs, analytic=None, capacity=None) -> Report:
    """XLA's figures for the step's compiled `programs` (:func:`meshpar.step.programs.compile_all`)
    beside the analytic model and the device capacity. `analytic`: the step's breakdown when
    known (:func:`meshpar.plan.memory.analytic.analytic`), else computed here. `capacity`: the
    device's (:class:`meshpar.plan.cost.Capacity`) when the step's devices cannot say (a compile
    target's: the machine's, :func:`meshpar.plan.cost.machine_capacity`)."""
    analytic, missing = (analytic, None) if analytic is not None else _analytic(step)  # None: out of scope
    return Report(
        mesh_lib.describe(step.mesh), f"{step.mesh.size} {platform(step)}",
        analytic, missing, aot.memory(programs.train), capacity or cost.device_capacity(step.cfg, step.mesh),
        tuple(programs_lib.peaks(step, programs)), programs.train, step.compiler_options,
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
        caption=f"capacity: {c.source}; headroom {cost.HEADROOM_FRACTION:.0%} kept free\n{flags_line(report)}",
        caption_justify="left",
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
    host_rows(t, a, x)
    t.add_row("capacity", fmt_bytes(c.bytes), "", "", "", "")
    t.add_row("− headroom", fmt_bytes(c.headroom_bytes), "", "", "", "")
    t.add_row("usable", fmt_bytes(c.usable_bytes), "", "", "", "", style="bold")
    if c.device_bytes:  # unified memory: the capacity oversubscribes the device
        t.add_row("  of it on the device", fmt_bytes(c.device_usable_bytes), "", "the device's own memory less headroom",
                  "", "")  # fmt: skip
        t.add_row("migrated (unified memory)", fmt_bytes(report.migrated_bytes), "", "needed beyond the device: paged to "
                  "host memory and back each step", "", "", style="bold")  # fmt: skip
    return t


def flags_line(report: Report) -> str:
    """The XLA flags the programs were compiled with, as ``XLA_FLAGS`` would give them, and the
    environment's ``XLA_FLAGS`` where set (which they override flag by flag)."""
    flags = xla_flags_lib.format_flag_string(report.xla_flags) or "XLA's defaults"
    env = os.environ.get("XLA_FLAGS", "")
    return f"compiled with XLA flags: {flags}" + (f" (over XLA_FLAGS={env})" if env else "")


def host_rows(t, analytic, xla: dict) -> None:
    """Host offload: the analytic host column and XLA's host figure, below the device total.
    XLA:CPU reports no host bytes (it ignores memory kinds inside a computation), so there the
    figure is the ``pinned_host`` arguments' and outputs' shard bytes, taken out of XLA's
    device figures above (:func:`meshpar.step.aot.memory`)."""
    host = {} if analytic is None else analytic.host
    if not host and not xla.get("host_total_bytes"):
        return
    for cat, n in host.items():
        t.add_row(f"  host: {cat}", fmt_bytes(n), "exact" if cat in memory.HOST_EXACT else "estimate", "", "", "")
    source = "XLA's host_* fields" if xla.get("host_from") == "xla" else "shardings (XLA on CPU reports no host bytes)"
    total = sum(host.values())
    t.add_row(
        "host total (pinned host memory)", fmt_bytes(total), "", f"host state: from the {source}",
        fmt_bytes(xla.get("host_total_bytes", 0)), "", style="bold", end_section=True,
    )  # fmt: skip


def programs_table(report: Report):
    """Every program the run executes: XLA's total for it, what is resident beside it, its peak,
    and what the plan needs (the highest peak, or the analytic total when higher)."""
    from rich.table import Table

    t = Table(title="peak per program, per device", title_justify="left")
    t.add_column("program", no_wrap=True)
    t.add_column("XLA total", justify="right")
    t.add_column("resident beside it")
    t.add_column("peak", justify="right")
    for p in report.programs:
        resident = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in p.resident.items() if v) or "nothing"
        t.add_row(p.program, fmt_bytes(p.xla["total_bytes"]), resident, fmt_bytes(p.bytes))
    t.add_row("needed", "", report.needed_from, fmt_bytes(report.needed_bytes), style="bold")
    return t

"""A run's memory pre-flight (``plan.check``): before anything is allocated, does it fit?

:func:`meshpar.run.experiment.build` hands it the built step (shapes and shardings only) and,
once compiled, the run's programs; it returns a verdict or raises a refusal, and never compiles
or builds anything itself:

1. :func:`check_analytic` — the analytic model (:mod:`meshpar.plan.memory.analytic`) against the
   usable bytes of one device (:func:`meshpar.plan.cost.device_capacity`), before anything is
   compiled, so a layout that cannot fit, however absurd its size, is refused in seconds. For a
   config out of the model's scope on its platform only the exact categories (state and
   batches) are held against the capacity here.
2. :func:`check_compiled` — XLA's figures for the compiled programs (the peak of every program
   the run executes: :mod:`meshpar.plan.programs`) against the same capacity.

A refusal is a :class:`~meshpar.configuration.config.ConfigError` (exit 2, one line) that says
what is needed, what is usable and where that figure comes from, the largest category, and the
first change from a fixed list that fits (:mod:`meshpar.plan.search.candidates`), or that none
does. In a multi-process run every process reaches the same verdict: the analytic figures come
from shapes and shardings alone, and the smallest capacity and the largest XLA figure of all
processes are exchanged through the coordination service.
"""

from __future__ import annotations

import dataclasses

import jax

from meshpar.configuration.config import Config, ConfigError
from meshpar.plan import cost
from meshpar.plan import report as report_lib
from meshpar.plan.memory import analytic as memory
from meshpar.plan.report import fmt_bytes
from meshpar.plan.search import candidates as candidates_lib
from meshpar.processes import agreement
from meshpar.step import parts
from meshpar.step.programs import Programs

# How long a process waits for the others' figures (they may still be reading their data).
AGREE_TIMEOUT_S = 600
# The key a refusal names when no candidate fits: what makes the largest category that large.
CATEGORY_KEYS = {"inputs": "train.batch_size", "relay_inputs": "train.batch_size", "activations": "train.batch_size"}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The pre-flight's verdict on a step that fits: what it needs per device and by which
    figure, against the usable capacity."""

    breakdown: memory.Breakdown  # the analytic model's categories
    capacity: cost.Capacity
    needed_bytes: int
    needed_from: str  # "analytic total", "state and batches alone", or the compiled program's peak
    report: report_lib.Report | None = None  # XLA's figures, once the programs are compiled


def _agree(name: str, value, combine):
    """Every process's pre-flight figure `name`, combined (see :func:`meshpar.processes.agreement.agree`)."""
    return agreement.agree(f"preflight/{name}", value, combine, AGREE_TIMEOUT_S)


def device_capacity(cfg: Config, mesh: jax.sharding.Mesh) -> cost.Capacity:
    """The usable capacity every process plans with: the smallest of all processes'."""
    own = cost.device_capacity(cfg, mesh)
    smallest = _agree(
        "capacity", [own.bytes, own.source, own.headroom_bytes, own.device_bytes],
        lambda vs: min(vs, key=lambda v: v[0] - v[2]),
    )  # fmt: skip
    if smallest[0] - smallest[2] < own.usable_bytes:
        return cost.Capacity(smallest[0], f"{smallest[1]} (the smallest of the processes)", smallest[2], smallest[3])
    return own


def in_scope(step: parts.AbstractStep) -> bool:
    """Whether the analytic model gives a figure for this config on its platform: out of its
    scope (:func:`meshpar.plan.memory.analytic.out_of_scope`) the compiled check alone decides; the
    analytic breakdown still names the largest category and sizes the candidates."""
    return memory.out_of_scope(step.cfg, report_lib.platform(step)) is None


def _largest(breakdown: memory.Breakdown) -> tuple[str, int]:
    return max(breakdown.categories.items(), key=lambda kv: kv[1])


def refusal(step: parts.AbstractStep, needed: int, breakdown: memory.Breakdown, capacity: cost.Capacity,
            by: str = "") -> ConfigError:  # fmt: skip
    """The one-line error for a step that needs `needed` bytes per device (`by`: by which
    figure, when not the analytic total), with the first candidate change that fits."""
    usable = capacity.usable_bytes
    scale = max(needed / breakdown.total, 1.0) if breakdown.total else 1.0
    found = candidates_lib.search(step, usable, scale)
    name, size = _largest(breakdown)
    head = (
        f"does not fit: needs {fmt_bytes(needed)} per device{f' ({by})' if by else ''} "
        f"(largest: {name} {fmt_bytes(size)}), {fmt_bytes(usable)} usable on {capacity.source}"
    )
    if found.fit is not None:
        return ConfigError(found.fit.key, f"{head}; fits with {found.fit} (needs {fmt_bytes(found.needed)})")
    if found.closest is not None:
        least = "at least " if found.at_least else ""
        closest = f"closest: {found.closest}, needs {least}{fmt_bytes(found.needed)}"
        tail = f"none of the {found.tried} candidate changes fits ({closest})"
    else:
        tail = "no candidate change applies to this config"
    return ConfigError(CATEGORY_KEYS.get(name, "model"), f"{head}; {tail}")


def check_analytic(step: parts.AbstractStep) -> Verdict:
    """The analytic model against the capacity; raises the refusal (see :func:`refusal`) when it
    does not fit. Nothing is compiled or allocated."""
    capacity = device_capacity(step.cfg, step.mesh)
    breakdown = memory.analytic(step)
    # Out of the model's scope its exact categories (state, batches) still bound the need from below.
    if in_scope(step):
        needed, by = breakdown.total, ""
    else:
        needed, by = sum(breakdown.categories.get(c, 0) for c in breakdown.exact), "state and batches alone"
    if needed > capacity.usable_bytes:
        raise refusal(step, needed, breakdown, capacity, by=by)
    return Verdict(breakdown, capacity, needed, by or "analytic total")


def check_compiled(step: parts.AbstractStep, programs: Programs, verdict: Verdict) -> Verdict:
    """XLA's figures for the run's compiled `programs` against the capacity of the analytic
    `verdict`; raises the refusal when they do not fit (the candidates are then held to the
    analytic totals scaled by XLA's excess)."""
    breakdown, capacity = verdict.breakdown, verdict.capacity
    report = report_lib.plan(step, programs, breakdown if in_scope(step) else None, capacity)
    needed = _agree("needed", report.needed_bytes, max)
    if needed > capacity.usable_bytes:
        raise refusal(step, needed, breakdown, capacity, by=report.needed_from)
    return Verdict(breakdown, capacity, needed, report.needed_from, report)

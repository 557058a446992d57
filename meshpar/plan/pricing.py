"""A planned step priced on machines: the feed, the step time by term, and the comparison of
host offload with the other ways of freeing device memory, as ``python -m meshpar.plan
--topology NAME`` prints them."""

from __future__ import annotations

import dataclasses

from meshpar.plan import cost
from meshpar.plan.out_of_core import offload_cost
from meshpar.plan.time import time_report, timing


class OffloadComparison:
    """The offload comparison of a config on a machine, and its batch-size sweep when asked."""

    def __init__(self, costs, sweep, bandwidth: float, usable: int, overlap: bool, skipped=()):
        self.costs, self.sweep, self.bandwidth, self.usable, self.overlap = costs, sweep, bandwidth, usable, overlap
        self.skipped = list(skipped)  # offload_cost.Skipped: options that do not apply, with why

    def print(self, console, topo) -> None:
        console.print(time_report.offload_table(self.costs, topo, self.bandwidth, self.usable, self.overlap))
        for line in time_report.skipped_lines(self.skipped):
            console.print(line, markup=False, soft_wrap=True)
        if self.sweep:
            console.print(time_report.offload_sweep_table(self.sweep, topo, self.bandwidth, self.usable, self.overlap))

    def to_json(self) -> dict:
        def one(costs):
            # the paging model's passes are left out (``--compare-out-of-core --json`` has its figures)
            return [{**{k: v for k, v in dataclasses.asdict(c).items() if k != "migration"}, "exposed_s": c.exposed_s}
                    for c in costs]  # fmt: skip

        return {"host_bandwidth": self.bandwidth, "usable_bytes": self.usable, "overlap": self.overlap,
                "options": one(self.costs), "sweep": [{"batch_size": b, "options": one(c)} for b, c in self.sweep],
                "skipped": [dataclasses.asdict(s) for s in self.skipped]}  # fmt: skip


def offload_comparison(step, topo, sizes: list[int] | None, overlap: bool, reference_s: float, prepared=None,
             skipped=None) -> OffloadComparison:  # fmt: skip
    """The offload comparison on `topo`, with the sweep over `sizes` (global batch sizes) when given;
    `prepared`, `skipped`: its options planned already (:func:`meshpar.plan.out_of_core.offload_cost.prepare_all`)."""
    cfg = step.cfg
    if prepared is None:
        skipped = []
        prepared = offload_cost.prepare_all(step, skipped)
    costs = offload_cost.priced(prepared, topo, overlap, reference_s)
    sweep = offload_cost.sweep(cfg, topo, sizes, overlap, mesh=step.mesh) if sizes else []
    # The config's planned device when it names one (hardware.memory_gib), else the machine's;
    # without unified memory (its options carry their own oversubscribed capacity).
    usable = cost.machine_capacity(offload_cost.without_unified(cfg), topo, step.mesh).usable_bytes
    return OffloadComparison(
        costs, sweep, offload_cost.host_bandwidth(topo, step.mesh.size), usable, overlap, skipped or ()
    )


@dataclasses.dataclass
class Priced:
    """The config's plan priced on one machine: feed, the step by term, the offload comparison;
    or, where the machine cannot hold the plan's mesh, why (and nothing priced)."""

    topology: object
    feed_s: float = 0.0
    step_time: timing.StepTime | None = None
    offload: OffloadComparison | None = None
    unfit: str = ""  # why the plan does not fit this machine at all


def price(step, report, topos, sizes: list[int] | None = None, overlap: bool = True) -> list[Priced]:
    """The config's plan — its abstract `step` and `report` (:func:`meshpar.plan.report.plan`,
    the step compiled once) — priced on each machine of `topos`, as ``--topology`` prices it;
    the offload comparison's options are planned once for them all."""
    cfg = step.cfg
    skipped: list = []
    prepared = None
    out = []
    for topo in topos:
        if step.mesh.size > topo.num_devices:  # a plan for more devices than the machine has
            out.append(Priced(topo, unfit=f"does not fit on {topo.name}: the plan's mesh "
                                          f"({','.join(f'{a}:{n}' for a, n in step.mesh.shape.items())}) has {step.mesh.size} devices, the machine "
                                          f"{topo.num_devices}"))  # fmt: skip
            continue
        if prepared is None:
            prepared = offload_cost.prepare_all(step, skipped)
        feed_s = cost.feed_seconds(cfg, topo)
        step_time = timing.predict(step, report.compiled, topo, feed_s)
        offload = offload_comparison(step, topo, sizes, overlap, step_time.total_s, prepared, skipped)
        out.append(Priced(topo, feed_s, step_time, offload))
    return out

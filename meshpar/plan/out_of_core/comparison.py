"""The out-of-core comparison (``python -m meshpar.plan --config X --topology T
--compare-out-of-core [--batch-sweep B,...] [--layer]``): every way past a device's memory —
none, swapping to host memory (each offload setting), CUDA Unified Memory, remat, more
microbatches, FSDP — at each global batch size, with the device and host memory per device
and the predicted step time on the machine; and ``--layer``, the same for one layer of the
layer loop: the 2019 out-of-core study's whole-model and single-layer views.

Swapping and the others are priced by :mod:`meshpar.plan.out_of_core.offload_cost`, unified memory by
:mod:`meshpar.plan.out_of_core.unified` on top of the same figures, and the step by the config's compiled
HLO at each batch size (:mod:`meshpar.plan.time.timing`) plus what each method adds. A method
``fits`` when its device bytes fit the device under XLA's allocator fraction — unified memory
when all it needs fits the oversubscribed allocator (``offload.oversubscription`` × the
device's memory; the part beyond the device is "migrated").
"""

from __future__ import annotations

import dataclasses

from meshpar.backend import allocator
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config
from meshpar.plan import cost as cost_lib
from meshpar.plan.out_of_core import offload_cost
from meshpar.plan.report import fmt_bytes
from meshpar.plan.time.time_report import fmt_seconds
from meshpar.step import parts

# Global batch sizes compared when none are given: the config's times these.
BATCH_FACTORS = (1, 4, 16, 64)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Every method at each batch size on one machine (see the module docstring)."""

    topology: object  # meshpar.plan.topology.Topology
    sweep: list  # [(global batch size, [offload_cost.Cost, ...])], "no offload" first
    usable_bytes: int  # what a plan may use per device under XLA's allocator fraction
    device_bytes: int  # the device's own memory less the headroom: what unified memory keeps on it
    oversubscription: float  # the unified-memory rows' allocator fraction
    bandwidth: float  # one device's host-link bytes/s
    skipped: tuple = ()  # offload_cost.Skipped and one-line reasons

    def fits(self, c) -> bool:
        return c.fits(self.usable_bytes)


def compare(cfg: Config, topo, batch_sizes, mesh=None, with_reference: bool = True, overlap: bool = True) -> Comparison:
    """Every method of :func:`meshpar.plan.out_of_core.offload_cost.options` (unified memory among them on a
    GPU machine) at each of `batch_sizes` on `topo`; `mesh`: the config's mesh built already (a
    compile target's), else this host's; `with_reference`: each batch size's step compiled and
    predicted, else the model's figures alone."""
    plain = offload_cost.without_unified(cfg)
    capacity = cost_lib.machine_capacity(plain, topo, mesh)
    unified_cfg = offload_cost.applied(plain, offload_cost.unified_overrides(cfg))
    skipped: list = []
    if topo.device_link.kind == "memcpy":
        skipped.append(f"unified memory: needs a CUDA GPU, and {topo.name} has none")
        over, device = 1.0, capacity.usable_bytes
    else:
        over = allocator.allocator_fraction(oversubscription=unified_cfg.offload.oversubscription)[0]
        device = cost_lib.machine_capacity(unified_cfg, topo).device_usable_bytes
    sweep = offload_cost.sweep(cfg, topo, batch_sizes, overlap, with_reference, mesh=mesh, skipped=skipped)
    return Comparison(topo, sweep, capacity.usable_bytes, device, over,
                      offload_cost.host_bandwidth(topo, _devices(cfg, mesh)), tuple(skipped))  # fmt: skip


def _devices(cfg: Config, mesh) -> int:
    return mesh.size if mesh is not None else parts.make_mesh(cfg).size


def batch_sizes(cfg: Config, text: str, key: str = "--batch-sweep", factors=BATCH_FACTORS) -> list[int]:
    """The global batch sizes of ``key B,B,...`` (empty: the config's × `factors`)."""
    if not text:
        return [cfg.train.batch_size * f for f in factors]
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise config_lib.ConfigError(key, f"expected global batch sizes such as 32,256,2048, got {text!r}")
    return sizes


def _row(b: int, c) -> dict:
    o = c.option
    return {"batch_size": b, "method": o.label, "kind": o.kind, "overrides": list(o.overrides)}


def to_json(comparison: Comparison, layer: bool = False) -> dict:
    """The comparison as JSON: a row per method and batch size (and per layer with `layer`)."""
    c = comparison
    rows, layers = [], []
    for b, costs in c.sweep:
        for x in costs:
            rows.append({**_row(b, x), "device_bytes": x.device_bytes, "host_bytes": x.host_bytes,
                         "migrated_bytes": x.migrated_bytes, "faults": x.faults, "step_s": x.predicted_s or x.step_s,
                         "model_step_s": x.step_s, "fits": c.fits(x)})  # fmt: skip
            if layer and x.layer is not None:
                one = x.layer
                layers.append({**_row(b, x), "layer": one.index, "device_bytes": one.device_bytes,
                               "host_bytes": one.host_bytes, "migrated_bytes": one.migrated_bytes,
                               "forward_s": one.forward_s, "backward_s": one.backward_s})  # fmt: skip
    out = {"topology": c.topology.name, "usable_bytes": c.usable_bytes, "device_bytes": c.device_bytes,
           "oversubscription": c.oversubscription, "host_bandwidth": c.bandwidth, "page_bytes": c.topology.page_bytes,
           "fault_s": c.topology.fault_s, "rows": rows, "skipped": [str(s) for s in c.skipped]}  # fmt: skip
    if layer:
        out["layer"] = layers
    return out


def _caption(c: Comparison) -> str:
    t = c.topology
    return (
        f"{t.name}: {fmt_bytes(c.usable_bytes)} usable per device under XLA's allocator fraction, "
        f"{fmt_bytes(c.device_bytes)} of the device under unified memory ({c.oversubscription:g}x: "
        f"{fmt_bytes(int(c.device_bytes * c.oversubscription))} in all); host link {c.bandwidth / 1e9:.1f} GB/s per "
        f"device each way; unified memory pages {t.page_bytes >> 20} MiB at {t.fault_s * 1e6:.0f} µs per fault, "
        "not overlapped with compute; swapping's copies overlapped with the previous layer. Step: the config's "
        "compiled step (meshpar.plan.time.timing) plus what the method adds (meshpar.plan.out_of_core.offload_cost, meshpar.plan.out_of_core.unified)."
    )


def table(comparison: Comparison):
    """Per batch size and method: device, host and migrated bytes per device, the predicted
    step, against no offload, and whether it fits; last, the fastest that fits."""
    from rich.table import Table

    c = comparison
    t = Table(title=f"out-of-core methods by global batch size, per device, on {c.topology.name}", title_justify="left",
              caption=_caption(c), caption_justify="left")  # fmt: skip
    for name in ("batch", "method", "device", "host", "migrated", "faults", "step", "vs none", "fits"):
        t.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
    for b, costs in c.sweep:
        base = costs[0]
        for i, x in enumerate(costs):
            step = x.predicted_s or x.step_s
            ratio = step / (base.predicted_s or base.step_s) if base.step_s else 0.0
            t.add_row(
                str(b) if i == 0 else "", x.option.label, fmt_bytes(x.device_bytes), fmt_bytes(x.host_bytes),
                fmt_bytes(x.migrated_bytes) if x.option.kind == "unified" else "", f"{x.faults:,}" if x.faults else "",
                fmt_seconds(step), f"×{ratio:.2f}", "yes" if c.fits(x) else "no",
            )  # fmt: skip
        best = fastest(c, costs)
        t.add_row("", "fastest that fits", "", "", "", "", fmt_seconds(best.predicted_s or best.step_s) if best else "",
                  best.option.label if best else "none", "", style="bold", end_section=True)  # fmt: skip
    return t


def fastest(comparison: Comparison, costs):
    """The method with the shortest predicted step that fits, or None."""
    return min((x for x in costs if comparison.fits(x)), key=lambda x: x.predicted_s or x.step_s, default=None)


def layer_table(comparison: Comparison):
    """One layer per method and batch size: what it holds on the device, what of it is in host
    memory (swapped, or paged under unified memory), and its forward and backward time."""
    from rich.table import Table

    c = comparison
    t = Table(title=f"one layer of the layer loop, per device and step, on {c.topology.name}", title_justify="left",
              caption="device: the layer's weights (compute layout), residuals and gradient while its backward runs; "
                      "host: its swapped bytes, or under unified memory the bytes its passes page in and out (the "
                      "layer that pages most); time: forward and backward over the step's microbatches, transfers "
                      "as the step pays them", caption_justify="left")  # fmt: skip
    for name in ("batch", "method", "layer", "device", "host", "forward", "backward", "vs none"):
        t.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
    for b, costs in c.sweep:
        base = costs[0].layer
        for i, x in enumerate(costs):
            one = x.layer
            if one is None:
                continue
            total, base_total = one.forward_s + one.backward_s, base.forward_s + base.backward_s
            t.add_row(
                str(b) if i == 0 else "", x.option.label, str(one.index), fmt_bytes(one.device_bytes),
                fmt_bytes(one.host_bytes), fmt_seconds(one.forward_s), fmt_seconds(one.backward_s),
                f"×{total / base_total:.2f}" if base_total else "", end_section=i == len(costs) - 1,
            )  # fmt: skip
    return t

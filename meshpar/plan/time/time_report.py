"""The planner's time tables: a step's predicted time by term (``--topology``), routed vs direct
placement over batch sizes (``--compare-feeding``) as a rich table and a PNG, and host offload
next to the other ways of freeing device memory (``--topology``, ``--offload-sweep``)."""

from __future__ import annotations

from meshpar.plan.out_of_core import offload_cost
from meshpar.plan.report import fmt_bytes


def fmt_seconds(s: float) -> str:
    """``12.3 µs``, ``4.56 ms``, ``1.23 s``."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


def model_rates(step, step_time, topology) -> dict:
    """What the predicted step means for the model, as a run reports it (:mod:`meshpar.step.throughput`):
    ``model_flops`` (the model's own FLOPs per device per step, the count MFU uses — not the
    compiled program's, which adds recomputation), ``tokens_per_s`` over every device, and ``mfu``
    against the machine's dense peak for the compute dtype (None without a peak). Without the
    family's FLOPs (``flops_per_example`` not given) ``model_flops`` and ``mfu`` are None and
    ``no_flops`` says why."""
    cfg = step.cfg
    family = step.family
    batch = cfg.train.batch_size
    tokens = family.tokens_per_example(cfg.model, step.element_spec)
    seconds = step_time.total_s
    out = {"tokens_per_s": tokens * batch / seconds if seconds else None}
    if family.flops_per_example is None:
        why = f"family {cfg.model.name} gives no FLOPs (flops_per_example not given)"
        return {"model_flops": None, **out, "mfu": None, "no_flops": why}
    model_flops = family.flops_per_example(cfg.model, step.element_spec) * batch / step.mesh.size
    peak = topology.peak(step.traits.compute_dtype)
    mfu = model_flops / seconds / peak if seconds and peak else None
    # With FP8 dots MFU stays against the compute dtype's peak, so that it compares with the same
    # model's bf16 step (the model's FLOPs are the same); the line says which peak.
    return {"model_flops": model_flops, **out, "mfu": mfu, "mfu_peak": step.traits.compute_dtype,
            "fp8": bool(step.traits.fp8)}  # fmt: skip


def rates_line(rates: dict) -> str:
    """One line: the predicted step's model FLOPs per device, tokens/s and MFU."""
    tokens = rates["tokens_per_s"]
    mfu = rates["mfu"]
    if rates["model_flops"] is None:
        return (f"predicted: {'-' if tokens is None else f'{tokens:,.0f}'} tokens/s; model FLOPs and MFU unknown: "
                f"{rates['no_flops']}")  # fmt: skip
    return (
        f"predicted: {rates['model_flops']:.4g} model FLOP per device per step, "
        f"{'-' if tokens is None else f'{tokens:,.0f}'} tokens/s, MFU {'-' if mfu is None else f'{mfu:.1%}'}"
        + (f" of the {rates['mfu_peak']} peak (its FP8 dots run at up to twice it)" if rates.get("fp8") else "")
    )


def step_table(step_time, topology):
    """A :class:`meshpar.plan.time.timing.StepTime` as a rich Table: compute by component (GEMMs,
    attention, memory-bound kernels, each kernel's fixed cost), each collective, the part of
    them hidden behind compute, feed (placed, and the part not hidden behind compute), and the
    total; the caption says what the figures rest on."""
    from rich.table import Table

    t = Table(
        title=f"predicted step time per device on {topology.name}", title_justify="left",
        caption=f"{topology.description}. Rests on: {step_time.basis or topology.source}", caption_justify="left",
    )  # fmt: skip
    t.add_column("term", no_wrap=True)
    t.add_column("detail")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    total = step_time.total_s or 1.0

    def row(term, detail, seconds, **kw):
        t.add_row(term, detail, fmt_seconds(seconds), f"{seconds / total:.0%}", **kw)

    kernels = f", {step_time.kernels:,} kernels" if step_time.kernels else ""
    row("compute", f"{step_time.flops:.4g} FLOP per device{kernels}", step_time.compute_s)
    for name, seconds in step_time.components.items():
        row(f"  {name}", COMPONENTS.get(name, ""), seconds)
    if step_time.launch_s:
        row("  of which launches", "each kernel's fixed cost", step_time.launch_s)
    for c in step_time.collectives:
        row(f"  {c.kind}", f"{fmt_bytes(c.bytes)} over {c.axis}", c.seconds)
    row("collectives", f"{len(step_time.collectives)} ops", step_time.collective_s)
    if step_time.all_to_all_bytes:  # a mixture of experts' routed tokens
        detail = f"{fmt_bytes(step_time.all_to_all_bytes)}: the routed tokens to their experts and back"
        row("  of which all-to-all", detail, step_time.all_to_all_s)
    row(
        "hidden",
        "collective time behind compute scheduled beside it",
        -step_time.hidden_s if step_time.hidden_s else 0.0,
    )
    row("feed (placement)", "one batch", step_time.feed_s)
    row("feed exposed", "not hidden behind compute", step_time.exposed_feed_s)
    row("total", "compute + collectives − hidden + exposed feed", step_time.total_s, style="bold")
    return t


# What each compute component of a step time is (meshpar.plan.time.timing).
COMPONENTS = {
    "gemm": "matrix products by shape (tiles in waves over the SMs)",
    "attention": "fused attention kernels",
    "memory-bound": "kernels bound by their bytes",
    "flop-bound": "ops bound by their FLOPs at the measured rate",
}


def feeding_table(rows, topology, split):
    """Routed vs direct placement time and relay memory per batch size, as a rich Table.
    `rows`: :func:`meshpar.plan.time.feed_time.compare`; `split`: the config's
    :class:`meshpar.plan.time.feed_time.Split` (its own batch is named in the caption)."""
    from rich.table import Table

    t = Table(
        title=(f"placement of one batch on {topology.name}: {split.num_devices} devices, "
               f"{split.shards} batch shards, {split.fields} field(s)"),
        title_justify="left", caption=topology.description, caption_justify="left",
    )  # fmt: skip
    for name in ("batch", "direct", "routed", "routed / direct", "relay memory routed", "relay memory direct"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(
            fmt_bytes(r.batch_bytes), fmt_seconds(r.direct_s), fmt_seconds(r.routed_s), f"{r.ratio:.2f}x",
            fmt_bytes(r.relay_routed_bytes), fmt_bytes(r.relay_direct_bytes),
        )  # fmt: skip
    return t


def feeding_png(rows, topology, split, path: str) -> None:
    """Two panels: placement time and relay memory against batch size, routed vs direct."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    mib = [r.batch_bytes / (1 << 20) for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_t.plot(mib, [r.direct_s * 1e3 for r in rows], "o-", label="direct")
    ax_t.plot(mib, [r.routed_s * 1e3 for r in rows], "s-", label="routed")
    ax_t.set(xscale="log", yscale="log", xlabel="process batch (MiB)", ylabel="placement time (ms)",
             title="predicted placement time")  # fmt: skip
    ax_m.plot(mib, [r.relay_direct_bytes / (1 << 20) for r in rows], "o-", label="direct (none)")
    ax_m.plot(mib, [r.relay_routed_bytes / (1 << 20) for r in rows], "s-", label="routed")
    ax_m.set(xscale="log", xlabel="process batch (MiB)", ylabel="extra relay memory (MiB)",
             title="relay device's extra input memory")  # fmt: skip
    ax_m.set_yscale("symlog", linthresh=1.0)  # direct's zero stays on the plot
    ax_m.set_ylim(bottom=0)
    for ax in (ax_t, ax_m):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{topology.name}: {split.num_devices} devices, {split.shards} batch shards")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _freed(c, base) -> str:
    freed = base.device_bytes - c.device_bytes
    return f"{'−' if freed >= 0 else '+'}{fmt_bytes(abs(freed))}"


def _step(c, base) -> str:
    """The option's step against the config's: ``×1.31`` (predicted, when there is a reference)."""
    new, old = (c.predicted_s, base.predicted_s) if base.predicted_s else (c.step_s, base.step_s)
    return f"×{new / old:.2f}" if old else ""


def _caption(topology, bandwidth: float, overlap: bool) -> str:
    return (
        "frees, step: against no offload; step: the config's own step predicted from its compiled HLO "
        "(meshpar.plan.time.timing) plus what the option adds in the per-layer model (meshpar.plan.out_of_core.offload_cost); "
        f"{topology.name}: host link {bandwidth / 1e9:.1f} GB/s per device each way "
        f"+ {topology.host_link.latency * 1e6:.0f} µs per transfer; compute at peak × {topology.efficiency:.0%}; "
        f"transfers {'overlapped with the previous layer' if overlap else 'not overlapped'}; the update's state "
        "trip never overlapped; remat's repeated collectives and per-kernel launch costs not counted."
    )


def offload_table(costs, topology, bandwidth: float, usable: int, overlap: bool = True):
    """Every way of freeing device memory (:func:`meshpar.plan.out_of_core.offload_cost.compare`): device and
    host memory per device, what it frees, the predicted step by term, and whether it fits
    `usable` bytes (``hardware.memory_gib`` when set, else the topology's memory, less the
    headroom)."""
    from rich.table import Table

    t = Table(
        title=f"offload and the other ways of freeing device memory, per device, on {topology.name}",
        title_justify="left", caption=_caption(topology, bandwidth, overlap), caption_justify="left",
    )  # fmt: skip
    for name in ("option", "device", "host", "frees", "compute", "host transfers", "adds", "step", "vs none", "fits"):
        t.add_column(name, justify="left" if name == "option" else "right", no_wrap=True)
    base = costs[0] if costs else None
    for c in costs:
        t.add_row(
            c.option.label, fmt_bytes(c.device_bytes), fmt_bytes(c.host_bytes), _freed(c, base) if c is not base else "",
            fmt_seconds(c.compute_s), fmt_seconds(c.host_s), fmt_seconds(max(c.step_s - base.step_s, 0.0)),
            fmt_seconds(c.predicted_s or c.step_s), _step(c, base), "yes" if c.fits(usable) else "no",
        )  # fmt: skip
    return t


def skipped_lines(skipped) -> list[str]:
    """One line per option of the offload comparison that does not apply to the config
    (:class:`meshpar.plan.out_of_core.offload_cost.Skipped`): ``skipped: <option>: <why>``."""
    return [f"skipped: {s}" for s in skipped]


def offload_sweep_table(rows, topology, bandwidth: float, usable: int, overlap: bool = True):
    """Options × global batch sizes (:func:`meshpar.plan.out_of_core.offload_cost.sweep`): per cell what the
    option frees and costs against the config at that batch; last, the cheapest per byte freed
    and the fastest option that fits `usable` bytes per device."""
    from rich.table import Table

    t = Table(
        title=f"what frees device memory at what cost, by global batch size, on {topology.name}",
        title_justify="left", caption=_caption(topology, bandwidth, overlap), caption_justify="left",
    )  # fmt: skip
    t.add_column("option", no_wrap=True)
    for b, _ in rows:
        t.add_column(f"batch {b}", justify="right", no_wrap=True)
    labels = [c.option.label for c in rows[0][1]]
    for i, label in enumerate(labels):
        cells = []
        for _, costs in rows:
            c = next((x for x in costs if x.option.label == label), None)
            if c is None:
                cells.append("n/a")
            elif i == 0:
                cells.append(f"{fmt_bytes(c.device_bytes)}, {fmt_seconds(c.predicted_s or c.step_s)}")
            else:
                cells.append(f"{_freed(c, costs[0])} {_step(c, costs[0])}")
        t.add_row(label, *cells, end_section=i == 0)
    for frees, what in ((None, "any"), ("activations", "of activations"), ("state", "of parameters/optimizer state")):
        best = [offload_cost.cheapest(costs, frees) for _, costs in rows]
        t.add_row(f"cheapest per byte freed, {what}", *[c.option.label if c else "none" for c in best], style="bold")
    fastest = [min((c for c in costs if c.fits(usable)), key=lambda c: c.predicted_s or c.step_s, default=None)
               for _, costs in rows]  # fmt: skip
    labels = [c.option.label if c else "none" for c in fastest]
    t.add_row(f"fastest that fits {fmt_bytes(usable)}", *labels, style="bold")
    return t

"""The planner's time tables: a step's predicted time by term (``--topology``), and routed vs
direct placement over batch sizes (``--compare-feeding``) as a rich table and a PNG."""

from __future__ import annotations

from meshpar.plan.report import fmt_bytes


def fmt_seconds(s: float) -> str:
    """``12.3 µs``, ``4.56 ms``, ``1.23 s``."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} µs"


def step_table(step_time, topology):
    """A :class:`meshpar.plan.timing.StepTime` as a rich Table: compute (FLOPs over the peak at
    the topology's efficiency), each collective, feed (placed, and the part not hidden behind
    compute), and the total."""
    from rich.table import Table

    t = Table(
        title=f"predicted step time per device on {topology.name}", title_justify="left",
        caption=f"{topology.description}; step efficiency {topology.efficiency:.0%} of peak ({topology.source})",
        caption_justify="left",
    )  # fmt: skip
    t.add_column("term", no_wrap=True)
    t.add_column("detail")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    total = step_time.total_s or 1.0

    def row(term, detail, seconds, **kw):
        t.add_row(term, detail, fmt_seconds(seconds), f"{seconds / total:.0%}", **kw)

    row("compute", f"{step_time.flops:.4g} FLOP per device", step_time.compute_s)
    for c in step_time.collectives:
        row(f"  {c.kind}", f"{fmt_bytes(c.bytes)} over {c.axis}", c.seconds)
    row("collectives", f"{len(step_time.collectives)} ops", step_time.collective_s)
    row("feed (placement)", "one batch", step_time.feed_s)
    row("feed exposed", "not hidden behind compute", step_time.exposed_feed_s)
    row("total", "compute + collectives + exposed feed", step_time.total_s, style="bold")
    return t


def feeding_table(rows, topology, split):
    """Routed vs direct placement time and relay memory per batch size, as a rich Table.
    `rows`: :func:`meshpar.plan.feed_time.compare`; `split`: the config's
    :class:`meshpar.plan.feed_time.Split` (its own batch is named in the caption)."""
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

"""``python -m meshpar.compare_feeding --config X [section.key=value ...]``

Runs the same training once per feed mode and prefetch depth (default: routed and direct,
prefetch 0 and 2), each in its own process so that per-process device memory figures stay
separate, then writes to the config's workdir:

- ``feed_comparison.md`` (also printed) and ``feed_comparison.json``: batch placement time
  (median, p90; timed as the run placed its batches, overlapping the running step, so on CPU
  it includes that step's load on the same cores), bytes the relay device received per batch, peak input bytes resident on the
  relay and on any other device (the feeder's live-buffer accounting, updated at every
  placement and release: prefetched batches, the batch in use, the relay's staging copy and
  its temporary slices), step time, input stall fraction, final loss; ratios against the
  direct run with the same prefetch depth, measured in this same invocation;
- ``placement_time.png`` (placement time per run) and ``input_memory.png`` (peak input bytes
  per device, relay highlighted);
- each run's own outputs under ``runs/<mode>_prefetch<k>/``.

Losses must agree bit for bit across all runs; the command exits 1 if they do not.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.run.metrics import read_jsonl

COLUMNS = [
    ("mode", "mode", "{}"),
    ("prefetch", "prefetch", "{}"),
    ("place median ms", "median_place_time_s", "{:.3f}"),
    ("place p90 ms", "p90_place_time_s", "{:.3f}"),
    ("routed/direct place", "place_ratio", "{:.2f}"),
    ("relay received B", "relay_input_bytes", "{:,}"),
    ("relay received / direct", "relay_received_ratio", "{:.2f}"),
    ("relay peak input B", "relay_peak_bytes", "{:,}"),
    ("other max peak input B", "other_peak_bytes", "{:,}"),
    ("relay peak / direct", "relay_peak_ratio", "{:.2f}"),
    ("step median ms", "median_step_time_s", "{:.3f}"),
    ("stall %", "stall_fraction", "{:.2%}"),
    ("final loss", "final_loss", "{:.6f}"),
]


def run_one(config: str, overrides: list[str], workdir: pathlib.Path) -> dict:
    """One training run in a fresh process; returns its summary plus per-step data."""
    # Each invocation replaces its own earlier runs (their checkpoints included).
    cmd = [
        sys.executable,
        "-m",
        "meshpar.train",
        "--config",
        config,
        *overrides,
        f"workdir={workdir}",
        "train.progress=false",
        "checkpoint.overwrite=true",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if result.returncode:
        sys.stderr.write(result.stderr)
        raise SystemExit(result.returncode)
    summary = json.loads((workdir / "summary.json").read_text())
    summary["losses"] = [row["loss"] for row in read_jsonl(workdir / "metrics.jsonl")]
    summary["step_times"] = json.loads((workdir / "step_times.json").read_text())
    return summary


def tabulate(runs: list[dict]) -> list[dict]:
    """One row per run, with ratios against the direct run of the same prefetch depth."""
    rows = []
    for run in runs:
        peaks = {int(k): v for k, v in run["input_memory"]["peak_input_bytes"].items()}
        relay = run["relay_device"]
        rows.append(
            {
                "mode": run["feed_mode"],
                "prefetch": run["prefetch"],
                **{k: run[k] for k in ("median_place_time_s", "p90_place_time_s", "median_step_time_s")},
                **{k: run[k] for k in ("stall_fraction", "final_loss", "relay_input_bytes", "batch_input_bytes")},
                "relay_peak_bytes": peaks[relay],
                "other_peak_bytes": max((v for k, v in peaks.items() if k != relay), default=0),
                "peak_input_bytes": peaks,
                "memory_source": run["input_memory"]["source"],
                "memory_stats_peak_bytes_in_use": run["input_memory"].get("memory_stats_peak_bytes_in_use"),
                "host_buffer_aliased": run["host_buffer_aliased"],
            }
        )
    for row in rows:
        base = next((r for r in rows if r["mode"] == "direct" and r["prefetch"] == row["prefetch"]), None)
        row["place_ratio"] = row["median_place_time_s"] / base["median_place_time_s"] if base else None
        row["relay_peak_ratio"] = row["relay_peak_bytes"] / base["relay_peak_bytes"] if base else None
        row["relay_received_ratio"] = row["relay_input_bytes"] / base["relay_input_bytes"] if base else None
    return rows


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| " + " | ".join(c for c, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = []
        for _, key, fmt in COLUMNS:
            value = row.get(key)
            if value is not None and key.endswith("_time_s"):
                value *= 1e3
            cells.append("—" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], rows: list[dict], outdir: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['feed_mode']}\nprefetch {r['prefetch']}" for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.boxplot([[t * 1e3 for t in r["step_times"]["place_s"][1:]] for r in runs], showfliers=False)
    ax.set_xticks(range(1, len(runs) + 1), labels)
    ax.set_ylabel("batch placement time (ms)")
    ax.set_title("Host → devices, per batch (after warm-up)")
    fig.tight_layout()
    fig.savefig(outdir / "placement_time.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.6), sharey=True)
    for ax, row, label in zip(list(getattr(axes, "flat", [axes])), rows, labels):
        devices = sorted(row["peak_input_bytes"])
        relay = runs[rows.index(row)]["relay_device"]
        colors = ["tab:red" if d == relay else "tab:blue" for d in devices]
        ax.bar([str(d) for d in devices], [row["peak_input_bytes"][d] / 2**20 for d in devices], color=colors)
        ax.set_title(label.replace("\n", ", "), fontsize=9)
        ax.set_xlabel("device (relay in red)")
    axes_list = list(getattr(axes, "flat", [axes]))
    axes_list[0].set_ylabel(f"peak input MiB ({rows[0]['memory_source']})")
    fig.tight_layout()
    fig.savefig(outdir / "input_memory.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshpar.compare_feeding", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", required=True)
    parser.add_argument("--modes", default="routed,direct", help="comma-separated feed modes")
    parser.add_argument("--prefetch", default="0,2", help="comma-separated prefetch depths")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    try:
        cfg = config_lib.load(args.config, args.overrides)
        modes = [m.strip() for m in args.modes.split(",")]
        depths = [int(k) for k in args.prefetch.split(",")]
        for mode in modes:
            config_lib.load(args.config, [*args.overrides, f"feed.mode={mode}"])
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except ValueError:
        print(f"config error: --prefetch: {args.prefetch!r} is not a comma-separated list of integers", file=sys.stderr)
        return 2
    outdir = pathlib.Path(cfg.workdir)
    runs = []
    for mode in modes:
        for depth in depths:
            print(f"running feed.mode={mode} feed.prefetch={depth} ...", flush=True)
            extra = [f"feed.mode={mode}", f"feed.prefetch={depth}"]
            runs.append(run_one(args.config, [*args.overrides, *extra], outdir / "runs" / f"{mode}_prefetch{depth}"))
    rows = tabulate(runs)
    identical = all(r["losses"] == runs[0]["losses"] for r in runs)
    header = (
        f"Feeding comparison: mesh {runs[0]['mesh']}, layout `{runs[0]['layout']}`, "
        f"{runs[0]['steps']} steps, {runs[0]['batch_input_bytes']:,} input bytes per batch, "
        f"memory from {rows[0]['memory_source']}; losses bit-identical across runs: {'yes' if identical else 'NO'}. "
        "Placement is timed as each run placed its batches, while a step runs (the loop fetches one step late); "
        "on CPU that includes the step's load on the same cores: scripts/bench_feed.py times placement alone"
    )
    table = markdown(rows, header)
    print(table)
    (outdir / "feed_comparison.md").write_text(table)
    (outdir / "feed_comparison.json").write_text(
        json.dumps(
            {"mesh": runs[0]["mesh"], "layout": runs[0]["layout"], "losses_identical": identical, "runs": rows},
            indent=2,
        )
        + "\n"
    )
    try:
        plot(runs, rows, outdir)
    except ImportError:  # a bare accelerator image: the table and JSON above are the result
        print("plots: skipped: matplotlib is not installed (feed_comparison.md and .json are written)")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

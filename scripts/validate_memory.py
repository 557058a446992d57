"""The analytic memory model against XLA's figures for the compiled train step, per experiment.

    python scripts/validate_memory.py [--json out.json] [experiments/x.yaml ...]

For every shipped ``experiments/*.yaml`` and the variants in VARIANTS (remat, microbatches,
a rolled layer loop), or the configs given: :func:`meshpar.plan.memory.analytic` (nothing
compiled) and the real train step compiled ahead of time on abstract inputs
(:func:`meshpar.aot.memory`), MiB per device. Nothing is allocated and no step runs.

XLA sees one step program, so the analytic figures are compared on what that program holds:

* ``state+batch`` — analytic params + optimizer + one batch's slice, against XLA's argument
  bytes (exact but for the stop flags' 4 bytes);
* ``working set`` — analytic gradients + saved activations + workspace (the larger of the
  backward and the update phase), against XLA's temp bytes (an estimate against a measurement);
* ``step total`` — analytic total without the extra resident batches (prefetched and in
  flight) and the relay's copies, which live outside the step program, against XLA's
  argument + output + temp − alias, with the error; ``plan total`` is the analytic total with
  them.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys

# The microbatch / remat variants, and the layer loop run as a loop (what accelerators do by default).
VARIANTS = [
    ("experiments/quickstart.yaml", ["train.microbatches=4", "model.remat=full"]),
    ("experiments/quickstart.yaml", ["model.remat=dots"]),
    ("experiments/quickstart.yaml", ["model.remat=full"]),
    ("experiments/transformer_fsdp.yaml", ["train.microbatches=2"]),
    ("experiments/mlp_data_parallel.yaml", ["model.remat=full"]),
    ("experiments/mlp_model_parallel.yaml", ["train.microbatches=4"]),
    ("experiments/quickstart.yaml", ["model.scan_unroll=1"]),
]
TARGET = 0.10  # |analytic − XLA| / XLA on the step total


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _err(analytic: int, xla: int) -> float:
    return (analytic - xla) / xla if xla else 0.0


def measure(path: str, overrides: list[str]) -> dict:
    from meshpar import aot, config
    from meshpar.plan import memory

    cfg = config.load(path, [*overrides, "train.progress=false"])
    step = aot.abstract_step(cfg)
    plan = memory.analytic(cfg, step)
    xla = aot.memory(step.lower().compile())
    c = plan.categories
    one_batch = c["inputs"]
    step_total = plan.total - c["queued_inputs"] - c.get("relay_inputs", 0)
    pairs = {
        "state+batch": (c["params"] + c["optimizer"] + one_batch, xla["argument_bytes"]),
        "working set": (c["grads"] + c["activations"] + c.get("workspace", 0), xla["temp_bytes"]),
        "step total": (step_total, xla["total_bytes"]),
    }
    by_label: dict[str, int] = {}  # saved activations by checkpoint_name tag (else the op that makes them)
    for r in memory.saved_activations(cfg, step):
        by_label[r.label] = by_label.get(r.label, 0) + r.total
    return {
        "config": path, "overrides": overrides, "analytic": c, "exact": sorted(plan.exact),
        "activations_by_label": dict(sorted(by_label.items(), key=lambda kv: -kv[1])),
        "plan_total_bytes": plan.total, "xla": xla,
        "compare": {k: {"analytic_bytes": a, "xla_bytes": x, "error": _err(a, x)} for k, (a, x) in pairs.items()},
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", help="experiment YAMLs (default: every experiments/*.yaml + variants)")
    parser.add_argument("--json", help="write the rows here as JSON")
    args = parser.parse_args(argv)
    runs = [(p, []) for p in args.configs] or [(p, []) for p in sorted(glob.glob("experiments/*.yaml"))] + VARIANTS

    from meshpar import config, mesh

    mesh.request_cpu_devices(max(mesh.cpu_device_count(config.load(p, o).mesh) for p, o in runs))
    from rich.console import Console
    from rich.table import Table

    table = Table(title="analytic memory model vs XLA's compiled train step, MiB per device (error vs XLA)")
    for name in ("experiment", "params", "grads", "optimizer", "activations", "workspace", "inputs"):
        table.add_column(name, justify="left" if name == "experiment" else "right", no_wrap=True)
    for name in ("state+batch vs argument", "working set vs temp", "step total vs XLA total", "plan total"):
        table.add_column(name, justify="right")
    rows, misses = [], 0
    for path, overrides in runs:
        r = measure(path, overrides)
        rows.append(r)
        c, cmp = r["analytic"], r["compare"]
        misses += abs(cmp["step total"]["error"]) > TARGET

        def pair(k, cmp=cmp):
            a, x, e = cmp[k]["analytic_bytes"], cmp[k]["xla_bytes"], cmp[k]["error"]
            return f"{_mib(a)} / {_mib(x)} ({e:+.1%})"

        name = path.removeprefix("experiments/").removesuffix(".yaml") + "".join(f" {o}" for o in overrides)
        inputs = c["inputs"] + c["queued_inputs"] + c.get("relay_inputs", 0)
        table.add_row(
            name, *(_mib(c.get(k, 0)) for k in ("params", "grads", "optimizer", "activations", "workspace")),
            _mib(inputs), pair("state+batch"), pair("working set"), pair("step total"), _mib(r["plan_total_bytes"]),
        )  # fmt: skip
    console = Console(width=None if sys.stdout.isatty() else 220)
    console.print(table)
    console.print(f"{len(rows) - misses}/{len(rows)} within {TARGET:.0%} of XLA's total")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": TARGET, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

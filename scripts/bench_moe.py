"""Mixture of experts on this machine: step time against a dense model of the same active
parameters, capacity against dropless dispatch, and the all-to-all bytes planned against compiled.

    python scripts/bench_moe.py [--quick] [--rounds N] [--steps N] [--json runs/bench_moe.json]

moe_tiny's shape (experiments/moe_tiny.yaml: 2 layers of d_model 128, 8 SwiGLU experts of d_ff
256, top 2), one global batch, 8 devices (``data:2,expert:4``), in this one process. Rows:

* ``dense``: the baseline, the same model with a dense SwiGLU MLP of d_ff 2 × 256 = 512 (the
  parameters one token meets in an MoE layer, less the router), data parallel over all 8;
* ``capacity all-to-all``: moe_tiny's own layout, the experts split over ``expert`` with the
  batch split over both axes (``batch:(data,expert); experts:expert``): the routed tokens move
  by all-to-all;
* ``capacity sliced``: ``batch:data; experts:expert``, the batch not split over the experts'
  axis, so each device slices its experts' tokens and gathers their
  outputs back (no all-to-all);
* ``capacity replicated`` and ``dropless replicated``: every expert on every device, data parallel
  over all 8;
* ``dropless split``: dropless dispatch on moe_tiny's layout: each device gathers its group's
  tokens over ``expert``, runs its own experts, and the outputs are reduce-scattered back.

Each row's experiment is built as ``python -m meshpar.train`` builds it (checkpoints, eval and the
memory pre-flight off), its train step compiled ahead of time (``scripts/common.py``), and run on
the experiment's state and batches. After warm-up, rounds of one block of ``--steps`` steps per
row (the order reversed every other round), each step waited for. Reported per row: the median step (measured), its ratio to the dense baseline's of the same
round (median over rounds, 95% bootstrap interval), and the all-to-all bytes per device per step:
measured from the compiled HLO (:func:`meshpar.plan.time.timing.collectives`, loops × their trip
counts) and planned from the traced program, nothing compiled
(:func:`meshpar.plan.time.reshards.all_to_alls`). The simulated CPU devices share this host's
cores and memory: an all-to-all here is a copy, so the step ratios show the dispatch's compute,
not a network's cost.

Exit 1 when a check fails: on every row the planned all-to-all bytes are within TOLERANCE of the
measured (per mesh axis; both zero where the layout implies none), and the all-to-all row has
some. Prints a table, writes JSON.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import common
import numpy as np

CONFIG = "experiments/moe_tiny.yaml"
QUIET = ["train.progress=false", "checkpoint.every=0", "train.eval_every=0", "plan.check=false",
         "data.max_bytes=400000"]  # fmt: skip
QUICK_MODEL = ["model.d_model=64", "model.d_ff=128", "model.max_length=32", "data.length=32", "train.batch_size=16",
               "model.moe_group_size=32"]  # fmt: skip
TOLERANCE = 0.02  # |planned − measured| / measured all-to-all bytes, per mesh axis
ALL_TO_ALL = "batch:(data,expert); experts:expert"
REPLICATED = "batch:(data,expert)"
# (label, layout, overrides); the first row is the baseline.
ROWS = [
    ("dense", REPLICATED, ["model.moe_experts=0", "DENSE_FF"]),
    ("capacity all-to-all", ALL_TO_ALL, []),
    ("capacity sliced", "batch:data; experts:expert", []),
    ("capacity replicated", REPLICATED, []),
    ("dropless replicated", REPLICATED, ["model.moe_dispatch=dropless"]),
    ("dropless split", ALL_TO_ALL, ["model.moe_dispatch=dropless"]),
]


def parse_args(argv=None):
    parser = common.rounds_parser(__doc__, "a smaller model, 2 rounds of 2 steps", "runs/bench_moe.json")
    return parser.parse_args(argv)


class Row:
    """One configuration: its compiled step running on its experiment's arrays, and its figures."""

    def __init__(self, label: str, layout: str, extra: list[str], model: list[str], args, workdir: str):
        from meshpar.configuration import config
        from meshpar.plan.time import reshards

        base = config.load(CONFIG, [*model, *args.overrides])
        dense_ff = f"model.d_ff={base.model.moe_top_k * base.model.d_ff}"  # the active MLP of an MoE layer
        extra = [dense_ff if o == "DENSE_FF" else o for o in extra]
        overrides = [f"layout={layout}", *extra]
        cfg = config.load(CONFIG, [*model, *args.overrides, *QUIET, f"workdir={workdir}", *overrides])
        self.label, self.layout, self.overrides = label, layout, overrides
        self.running = common.materialize(cfg)
        step = self.running.step
        self.planned = reshards.all_to_alls(step.parts)  # from the traced program, not the compiled one
        self.compile_s = step.compile_s
        self.measured: dict[str, int] = {}
        for kind, nbytes, axes in step.collectives():
            if kind == "all-to-all":
                self.measured[axes] = self.measured.get(axes, 0) + nbytes
        self.memory = step.memory()
        self.first_loss = float(self.running(self.running.batches[0])["loss"])
        self.run(args.warmup)

    def run(self, n: int) -> list[float]:
        """`n` steps, each waited for; their wall times."""
        return self.running.run(n)


def disagreements(planned: dict[str, int], measured: dict[str, int]) -> list[str]:
    """The mesh axes whose planned and measured all-to-all bytes differ by more than TOLERANCE."""
    out = []
    for axes in sorted(set(planned) | set(measured)):
        p, m = planned.get(axes, 0), measured.get(axes, 0)
        if abs(p - m) > TOLERANCE * max(m, 1):
            out.append(f"over {axes}: planned {p:,} B, measured {m:,} B")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    model = QUICK_MODEL if args.quick else []
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    started = time.perf_counter()
    from meshpar.sharding import mesh as mesh_lib

    mesh_lib.request_cpu_devices(8)  # before the backend starts
    import jax

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_moe-") as tmp:
        for i, (label, layout, extra) in enumerate(ROWS):
            rows.append(Row(label, layout, extra, model, args, os.path.join(tmp, str(i))))
            print(f"{label}: compiled in {rows[-1].compile_s:.1f} s", file=sys.stderr)
    # Per row: its step times, each round's block median, and their ratios to the dense row's.
    timed = common.timed_rounds(rows, args.rounds, lambda r: r.run(args.steps), rng=np.random.default_rng(0))
    results, failures = [], []
    for r, t in zip(rows, timed):
        failures += [f"{r.label}: all-to-all bytes {d}" for d in disagreements(r.planned, r.measured)]
        results.append({
            "row": r.label, "layout": r.layout, "overrides": r.overrides,
            "median_step_s": statistics.median(t["times"]), "step_s": t["times"], "block_median_s": t["block_median_s"],
            "ratio_to_dense": t["ratio"],
            "all_to_all_measured_bytes": r.measured, "all_to_all_planned_bytes": r.planned,
            "first_loss": r.first_loss, "compile_s": r.compile_s, "memory_analysis": r.memory,
        })  # fmt: skip
    if not rows[1].measured:
        failures.append(f"{rows[1].label}: no all-to-all in the compiled HLO")
    wall = time.perf_counter() - started
    report(results, args, jax.device_count())
    meta = {
        **common.rounds_meta(args, CONFIG, model, wall),
        "tolerance": TOLERANCE,
        "sources": {
            "median_step_s": "measured: wall clock of one train step, waited for; median over every timed block",
            "ratio_to_dense": "measured: per round, the row's block median over the dense row's; median, 95% bootstrap",
            "all_to_all_measured_bytes": "compiled.as_text() parsed by meshpar.plan.time.timing.collectives, per device",
            "all_to_all_planned_bytes": "meshpar.plan.time.reshards.all_to_alls: the traced program, nothing compiled",
            "memory_analysis": "XLA compiled.memory_analysis() of the train step, per device",
        },
        "failures": failures,
    }  # fmt: skip
    return common.finish(args.json, {**meta, "results": results}, failures, wall)


def _bytes(by_axis: dict[str, int]) -> str:
    return ", ".join(f"{b / 2**20:.2f} MiB over {a}" for a, b in sorted(by_axis.items())) or "-"


def report(results: list[dict], args, devices: int) -> None:
    cores = len(os.sched_getaffinity(0))
    print(f"{devices} simulated CPU devices share {cores} cores: an all-to-all here is a copy in one host's memory")
    print(f"{args.rounds} rounds x {args.steps} steps per row; all-to-all bytes per device per step")
    rows = []
    for r in results:
        ratio = r["ratio_to_dense"]
        rows.append([
            r["row"], r["layout"], f"{r['median_step_s'] * 1e3:.1f}", f"{ratio['median']:.2f}",
            "[{:.2f}, {:.2f}]".format(*ratio["ci95"]), _bytes(r["all_to_all_measured_bytes"]),
            _bytes(r["all_to_all_planned_bytes"]), f"{r['memory_analysis']['temp_size_in_bytes'] / 2**20:.2f}",
        ])  # fmt: skip
    columns = [("row", "<20"), ("layout", "<36"), ("step ms (measured)", ">"), ("x dense", ">"), ("95% interval", ">"),
               ("all-to-all (HLO)", ">"), ("all-to-all (planned)", ">"), ("temp MiB/dev", ">")]  # fmt: skip
    print(common.table(columns, rows))


if __name__ == "__main__":
    sys.exit(main())

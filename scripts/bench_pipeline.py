"""Pipeline parallelism (``layers:stage``) on this machine: step time over stages and microbatches.

    python scripts/bench_pipeline.py [--quick] [--rounds N] [--steps N] [--json runs/bench_pipeline.json]

One small Transformer (8 layers), one global batch, 8 devices, in this one process. Rows:

* ``S=1``: the baseline, no stage axis (``data:4,model:2``, the layout without ``layers:stage``),
  one pass over the batch; beside it the same with ``train.microbatches`` = 8 as gradient
  accumulation (the microbatching alone, no pipeline);
* ``S=2`` (``data:2,stage:2,model:2``) and ``S=4`` (``stage:4,model:2``): the layers pipelined
  over the stage axis, GPipe for several M (``train.microbatches``), and the circular schedule
  with R = 2 (``pipeline.repeats``) for a couple of (S, M).

Each row's experiment is built as ``python -m meshpar.train`` builds it (checkpoints, eval and
the memory pre-flight off), its train step compiled ahead of time (``scripts/common.py``), and its
first step run on batch 0 from the same initial state: that loss must equal the baseline's (the
pipeline computes the same function). After warm-up, rounds of one block of ``--steps`` steps per row (the order
reversed every other round, so a drift of the shared machine falls on all rows alike), each step
waited for. Reported per row:

* ``step ms (measured)``: the median wall time of a step over every block;
* ``× S=1``: the median over rounds of the block's median step over the baseline's of the same
  round, with a 95% bootstrap interval;
* ``ticks`` and ``bubble (computed)``: the schedule's forward ticks R·M + S − 1 and idle share per
  stage (S − 1)/(R·M + S − 1) (:class:`meshpar.sharding.stages.Schedule`): arithmetic, not a measurement;
* ``temp MiB/dev``: XLA ``compiled.memory_analysis()`` temp bytes per device (activations kept for
  the backward pass: per stage, ``ticks/RM`` = ticks/(R·M) times the batch's for its layers);
* collective-permute and all-gather ops in the compiled HLO (``compiled.as_text()``, counted once
  per instruction, loops not unrolled), and the mesh axes the permutes run over: the ppermutes
  between stages are what make the pipeline.

The simulated CPU devices share this host's cores, so a stage waiting for its input costs no core
time here: the idle share a bubble means on real devices is not physical on this machine. The
table shows how the step time depends on S and M; nothing in it is a measured bubble.

Exit 1 when a check fails: every pipelined row's HLO has collective-permutes over the stage axis,
and every row's first loss equals the baseline's to 1e-5 relative. Prints a table, writes JSON.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import common
import numpy as np

CONFIG = "experiments/transformer_pipeline.yaml"
# The model (8 layers, small enough for tens of ms a step on CPU) and the global batch of every row.
MODEL = [
    "model.d_model=32", "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.n_layers=8",
    "model.max_length=16", "data.length=16", "data.max_bytes=200000", "train.batch_size=32",
]  # fmt: skip
QUIET = ["train.progress=false", "checkpoint.every=0", "train.eval_every=0", "plan.check=false"]
RULES = "d_ff:model; heads:model; vocab:model"
MESHES = {  # stages -> (mesh, layout): 8 devices each, the model split 2 ways in all
    1: ("data:4,model:2", f"batch:data; {RULES}"),
    2: ("data:2,stage:2,model:2", f"batch:data; layers:stage; {RULES}"),
    4: ("stage:4,model:2", f"layers:stage; {RULES}"),
}
# (stages, microbatches, schedule, repeats); the first row is the baseline.
ROWS = [
    (1, 1, "gpipe", 1), (1, 8, "gpipe", 1),
    (2, 1, "gpipe", 1), (2, 2, "gpipe", 1), (2, 4, "gpipe", 1), (2, 8, "gpipe", 1),
    (4, 4, "gpipe", 1), (4, 8, "gpipe", 1),
    (2, 4, "circular", 2), (4, 4, "circular", 2),
]  # fmt: skip
QUICK = [(1, 1, "gpipe", 1), (2, 2, "gpipe", 1), (2, 2, "circular", 2)]
LOSS_RTOL = 1e-5


def parse_args(argv=None):
    parser = common.rounds_parser(__doc__, f"{len(QUICK)} rows, 2 rounds of 2 steps", "runs/bench_pipeline.json")
    return parser.parse_args(argv)


def label(stages: int, microbatches: int, kind: str, repeats: int) -> str:
    if stages == 1:
        return "S=1" if microbatches == 1 else f"S=1 accum M={microbatches}"
    return f"S={stages} {kind}{f' R={repeats}' if kind == 'circular' else ''} M={microbatches}"


class Row:
    """One configuration: its compiled step running on its experiment's arrays, and its figures."""

    def __init__(self, key: tuple[int, int, str, int], args, workdir: str):
        from meshpar.configuration import config

        stages, microbatches, kind, repeats = key
        mesh, layout = MESHES[stages]
        overrides = [f"mesh={mesh}", f"layout={layout}", f"train.microbatches={microbatches}",
                     f"pipeline.schedule={kind}", f"pipeline.repeats={repeats}"]  # fmt: skip
        cfg = config.load(CONFIG, [*MODEL, *args.overrides, *QUIET, f"workdir={workdir}", *overrides])
        self.running = common.materialize(cfg)
        step = self.running.step
        self.label, self.key, self.overrides = label(*key), key, overrides
        self.build_s, self.compile_s = self.running.build_s, step.compile_s
        self.schedule = step.schedule
        self.memory = step.memory()
        found = step.collectives()  # (kind, bytes, mesh axes) per HLO instruction
        self.permutes = [axes for k, _, axes in found if k == "collective-permute"]
        self.all_gathers = sum(k == "all-gather" for k, _, _ in found)
        self.first_loss = float(self.running(self.running.batches[0])["loss"])
        self.mesh, self.layout = mesh, layout
        self.run(args.warmup)

    def run(self, n: int) -> list[float]:
        """`n` steps, each waited for; their wall times."""
        return self.running.run(n)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    started = time.perf_counter()
    from meshpar.sharding import mesh as mesh_lib

    mesh_lib.request_cpu_devices(8)  # before the backend starts
    import jax

    keys = QUICK if args.quick else ROWS
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_pipeline-") as tmp:
        for i, key in enumerate(keys):
            rows.append(Row(key, args, os.path.join(tmp, str(i))))
            print(
                f"{rows[-1].label}: built in {rows[-1].build_s:.1f} s, compiled in {rows[-1].compile_s:.1f} s",
                file=sys.stderr,
            )
    base = rows[0]
    # Per row: its step times, each round's block median, and their ratios to the baseline's.
    timed = common.timed_rounds(rows, args.rounds, lambda r: r.run(args.steps), rng=np.random.default_rng(0))
    results, failures = [], []
    for r, t in zip(rows, timed):
        sched = r.schedule
        rel = abs(r.first_loss - base.first_loss) / abs(base.first_loss)
        stage_permutes = sum(sched is not None and sched.axis in axes.split(",") for axes in r.permutes)
        if rel > LOSS_RTOL:
            failures.append(
                f"{r.label}: first loss {r.first_loss:.7f} vs the baseline's {base.first_loss:.7f} ({rel:.1e} relative > {LOSS_RTOL:g})"
            )
        if r.key[0] > 1 and (sched is None or (sched.stages, sched.microbatches) != r.key[:2]):
            failures.append(
                f"{r.label}: the layout runs {sched or 'no pipeline'}, not {r.key[0]} stages x {r.key[1]} microbatches"
            )
        elif r.key[0] > 1 and stage_permutes == 0:
            failures.append(f"{r.label}: no collective-permute over the stage axis '{sched.axis}' in the compiled HLO")
        results.append({
            "row": r.label, "stages": r.key[0], "microbatches": r.key[1], "schedule": r.key[2] if sched else None,
            "repeats": r.key[3] if sched else None, "mesh": r.mesh, "layout": r.layout, "overrides": r.overrides,
            "ticks": sched.ticks if sched else None, "bubble_computed": sched.bubble if sched else None,
            "median_step_s": statistics.median(t["times"]), "step_s": t["times"], "block_median_s": t["block_median_s"],
            "ratio_to_baseline": t["ratio"],
            "first_loss": r.first_loss, "first_loss_rel_diff": rel, "compile_s": r.compile_s,
            "memory_analysis": r.memory, "hlo_collective_permutes": len(r.permutes),
            "hlo_collective_permutes_over_stage_axis": stage_permutes, "hlo_collective_permute_axes": sorted(set(r.permutes)),
            "hlo_all_gathers": r.all_gathers,
        })  # fmt: skip
    wall = time.perf_counter() - started
    report(results, args, jax.device_count())
    meta = {
        **common.rounds_meta(args, CONFIG, MODEL, wall),
        "sources": {
            "median_step_s": "measured: wall clock of one train step, waited for; median over every timed block",
            "ratio_to_baseline": "measured: per round, the row's block median over the baseline's; median, 95% bootstrap",
            "ticks, bubble_computed": "computed from the schedule (meshpar.sharding.stages.Schedule), not measured",
            "memory_analysis": "XLA compiled.memory_analysis() of the train step, per device",
            "compile_s": "lowering and XLA compile of the step; may come from jax's persistent compilation cache",
            "hlo_*": "compiled.as_text(), parsed by meshpar.plan.time.timing.collectives: one per HLO instruction",
        },
        "failures": failures,
    }  # fmt: skip
    return common.finish(args.json, {**meta, "results": results}, failures, wall)


def report(results: list[dict], args, devices: int) -> None:
    cores = len(os.sched_getaffinity(0))
    print(
        f"simulated devices: {devices} CPU devices share {cores} cores, so a stage's idle "
        "time is not physical here: step times show their dependence on S and M; the bubble is computed, not measured"
    )
    print(
        f"{args.rounds} rounds x {args.steps} steps per row; temp MiB/dev: XLA memory_analysis() temp bytes per device "
        "(the activations kept for the backward pass, per stage ticks/(R*M) times the batch's for its layers)"
    )
    header = (
        f"{'row':<22} {'mesh':<22} {'ticks':>5} {'bubble (computed)':>17} {'step ms (measured)':>18} "
        f"{'x S=1':>6} {'95% interval':>14} {'ticks/RM':>8} {'temp MiB/dev':>12} {'coll-permute':>12} {'permute axes':>12} "
        f"{'all-gather':>10} {'first loss':>10} {'rel diff':>8}"
    )
    print(header)
    for r in results:
        ratio = r["ratio_to_baseline"]
        ticks = "-" if r["ticks"] is None else str(r["ticks"])
        per_micro = "-" if r["ticks"] is None else f"{r['ticks'] / (r['repeats'] * r['microbatches']):.2f}"
        bubble = "-" if r["bubble_computed"] is None else f"{r['bubble_computed']:.3f}"
        axes = ",".join(r["hlo_collective_permute_axes"]) or "-"
        print(
            f"{r['row']:<22} {r['mesh']:<22} {ticks:>5} {bubble:>17} {r['median_step_s'] * 1e3:>18.1f} "
            f"{ratio['median']:>6.2f} {'[{:.2f}, {:.2f}]'.format(*ratio['ci95']):>14} {per_micro:>8} "
            f"{r['memory_analysis']['temp_size_in_bytes'] / 2**20:>12.2f} {r['hlo_collective_permutes']:>12} {axes:>12} "
            f"{r['hlo_all_gathers']:>10} {r['first_loss']:>10.6f} {r['first_loss_rel_diff']:>8.1e}"
        )


if __name__ == "__main__":
    sys.exit(main())

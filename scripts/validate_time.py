"""The step-time and feed-time model against measurement on this host, per experiment.

    python scripts/validate_time.py [--json out.json] [--rounds 5] [--steps 4] [experiments/x.yaml ...]

For every shipped ``experiments/*.yaml`` (or the configs given; one the memory pre-flight
refuses is listed as skipped), on the ``cpu-sim`` topology, calibrated from separate
microbenchmarks (matmul, memcpy, placements, a small all-reduce: ``meshpar.plan.topology``),
never from these experiments. Per experiment, ``--rounds`` rounds of:

* **calibrate**: cpu-sim measured again (on a shared host the load drifts within minutes;
  each round's prediction uses figures taken next to its measurement);
* **predict**: the train step the run calls (compiled ahead of time), its compute, bytes and
  collectives read from the HLO (:func:`meshpar.plan.time.timing.predict`, no feed), and the
  placement of one batch in each feed mode (:func:`meshpar.plan.time.feed_time.placement_time`);
* **measure**: that same compiled program run in this process on the experiment's real
  materialised state and placed batches (``scripts/common.py``) (as ``python -m meshpar.train`` builds them, with
  ``feed.prefetch=0``), ``--steps`` steps after a warm-up, each waited for
  (``block_until_ready``) before the next is dispatched, so a step's time is one run of the
  program with nothing overlapping it; the median. Placement: each mode's feeder (``direct``,
  ``routed``) placing the experiment's host batches one at a time with nothing else running,
  timed by the feeder itself (``Placement.seconds``: host batch in → every array ready on its
  devices); the median of ``--placements``.

Reported per figure: the medians over rounds of prediction and measurement, and the error as
the median of the rounds' own ratios (target: within 25%). ``--json`` also writes every round
and the prediction's terms. About a minute for the shipped experiments on 2 cores.

Exit status 0 when every figure is within the target, 1 when any is not. An experiment it
cannot plan (the pre-flight's refusal of one that does not fit by design, or any config,
layout, mesh or data error) is one line of the table, with the error, and no figure of its own.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import sys
import tempfile
import time

import common

TARGET = 0.25
MODES = ("direct", "routed")


def _err(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else 0.0


def _median_placement(exp, mode: str, count: int) -> tuple[float, int, bool]:
    """Median seconds a `mode` feeder takes to place one of the experiment's host batches
    (two placements of warm-up first), the batch's bytes and whether any placement aliased."""
    from input_pipeline.feeding import FEEDERS

    feeder = FEEDERS[mode](exp.inputs.shardings, exp.cfg.train.batch_size)
    timed = common.placements(feeder, (exp.inputs.train.batch(i) for i in range(count + 2)), warmup=2)
    return statistics.median(p.seconds for p in timed), timed[-1].total_bytes, any(p.aliased for p in timed)


def _load(name: str, fresh: bool):
    """The topology; cpu-sim measured again when `fresh` (see the module docstring)."""
    from meshpar.plan import topology as topology_lib

    if fresh and name == topology_lib.CPU_SIM:
        topology_lib.calibrated.cache_clear()
    return topology_lib.load(name)


def _summary(predicted: list[float], measured: list[float]) -> dict:
    """Medians over rounds, and the error as the median of the rounds' own ratios (each round's
    prediction is from a calibration taken next to its measurement)."""
    ratios = [p / m for p, m in zip(predicted, measured) if m]
    return {
        "predicted_s": statistics.median(predicted), "measured_s": statistics.median(measured),
        "error": statistics.median(ratios) - 1 if ratios else 0.0,
        "rounds": [{"predicted_s": p, "measured_s": m} for p, m in zip(predicted, measured)],
    }  # fmt: skip


def measure(path: str, args, workdir: str) -> dict:
    import jax

    from meshpar.configuration import config as config_lib
    from meshpar.plan import cost
    from meshpar.plan.time import feed_time, timing

    overrides = [
        "train.progress=false", "train.eval_every=0", "checkpoint.every=0", "feed.prefetch=0",
        f"workdir={workdir}/{path.replace('/', '_')}",
    ]  # fmt: skip
    cfg = config_lib.load(path, overrides)
    running = common.materialize(cfg, batches=4)  # the program the run calls, on its arrays
    exp, text = running.exp, running.step.compiled.as_text()
    predictions, steps, times, placements, sources = [], [], [], {m: [] for m in MODES}, []
    for r in range(args.rounds):
        topology = _load(args.topology, fresh=not args.calibrate_once)
        sources.append(topology.source)
        predicted = timing.predict(running.step.parts, text, topology)
        predictions.append(predicted)
        warmup = args.warmup if r == 0 else 1
        round_times = running.run(warmup + args.steps)[warmup:]
        steps.append(statistics.median(round_times))
        times.append(round_times)
        split = cost.config_split(cfg, topology)
        for mode in MODES:
            seconds, size, aliased = _median_placement(exp, mode, args.placements)
            guess = feed_time.placement_time(
                topology, mode, split.batch_bytes, split.num_devices, split.shards, split.fields
            )
            placements[mode].append((guess, seconds, size, aliased))
    del running
    middle = sorted(range(args.rounds), key=lambda i: predictions[i].total_s)[args.rounds // 2]
    row = {
        "config": path,
        "mesh": dict(exp.mesh.shape),
        "layout": str(exp.layout),
        "predicted": timing.to_json(predictions[middle]),  # the round with the median prediction
        "step": _summary([p.total_s for p in predictions], steps),
        "step_times_s": times,
        "topology_sources": sources,
    }
    for mode in MODES:
        rounds = placements[mode]
        row[f"placement_{mode}"] = {
            **_summary([g for g, *_ in rounds], [s for _, s, *_ in rounds]),
            "batch_bytes": rounds[0][2], "predicted_batch_bytes": split.batch_bytes,
            "aliased": any(a for *_, a in rounds),
        }  # fmt: skip
    jax.clear_caches()
    return row


def _ms(s: float) -> str:
    return f"{s * 1e3:,.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", help="experiment YAMLs (default: every experiments/*.yaml)")
    parser.add_argument("--topology", default="cpu-sim", help="topology name or YAML path (default cpu-sim)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of calibrate, predict, measure per experiment")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before the first round")
    parser.add_argument("--placements", type=int, default=8, help="timed placements per feed mode and round")
    parser.add_argument("--calibrate-once", action="store_true", help="calibrate cpu-sim once per process")
    parser.add_argument("--json", help="write the rows here as JSON")
    args = parser.parse_args(argv)
    paths = args.configs or sorted(glob.glob("experiments/*.yaml"))

    from meshpar.configuration import config
    from meshpar.plan.search import candidates
    from meshpar.sharding import mesh

    counts = []
    for p in paths:  # a config that does not load is measured (and reported) below
        try:
            counts.append(mesh.cpu_device_count(config.load(p).mesh))
        except candidates.ILLEGAL:
            pass
    mesh.request_cpu_devices(max(counts, default=1))
    from rich.console import Console
    from rich.table import Table

    started = time.perf_counter()
    topology = _load(args.topology, fresh=False)
    calibrated_s = time.perf_counter() - started
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="validate-time-") as workdir:
        for path in paths:
            try:
                rows.append(measure(path, args, workdir))
            except candidates.ILLEGAL as e:  # e.g. a refusal: an experiment that does not fit by design
                skipped.append((path, str(e)))

    table = Table(title=f"predicted vs measured on {topology.name}, ms (error vs measured; target ±{TARGET:.0%})")
    for name in ("experiment", "mesh", "GFLOP/dev", "compute", "collectives", "step pred", "step meas", "step err"):
        table.add_column(name, justify="left" if name in ("experiment", "mesh") else "right", no_wrap=True)
    for mode in MODES:
        table.add_column(f"{mode} pred / meas (err)", justify="right")
    misses = 0
    for r in rows:
        p, s = r["predicted"], r["step"]
        cells = []
        for mode in MODES:
            f = r[f"placement_{mode}"]
            misses += abs(f["error"]) > TARGET
            cells.append(f"{_ms(f['predicted_s'])} / {_ms(f['measured_s'])} ({f['error']:+.0%})")
        misses += abs(s["error"]) > TARGET
        table.add_row(
            r["config"].removeprefix("experiments/").removesuffix(".yaml"),
            ",".join(f"{k}:{v}" for k, v in r["mesh"].items()),
            f"{p['flops'] / 1e9:.2f}", _ms(p["compute_s"]), _ms(p["collective_s"]),
            _ms(s["predicted_s"]), _ms(s["measured_s"]), f"{s['error']:+.0%}", *cells,
        )  # fmt: skip
    for path, why in skipped:  # one line: the error, across the figures' columns
        name = path.removeprefix("experiments/").removesuffix(".yaml")
        table.add_row(name, "-", "-", "-", "-", "-", "-", "-", f"cannot plan: {why}", "", end_section=False)
    console = Console(width=None if sys.stdout.isatty() else 220)
    console.print(table)
    total = 3 * len(rows)
    console.print(
        f"{total - misses}/{total} within {TARGET:.0%}, {len(skipped)} cannot plan; "
        f"one calibration took {calibrated_s:.1f} s"
    )
    console.print(f"topology {topology.name}: {topology.description}", markup=False, soft_wrap=True)
    if args.json:
        common.write_json(
            args.json, {"target": TARGET, "topology": topology.name, "rows": rows, "skipped": skipped}, indent=1
        )
    return 1 if misses or not rows else 0


if __name__ == "__main__":
    sys.exit(main())

"""Routed vs direct feeding, whole train steps, in one process: the routed/direct step-time ratio.

One experiment is built from the config (its mesh, layout, model, optimizer, batch shardings);
then, in alternating blocks of ``--block`` steps (the order of the feeders flips every round),
each feeder places the host batch of the next step and the jitted train step runs on it, its
loss fetched before the next batch is placed (``feed.prefetch=0``: placement is on the step's
critical path). A step's time is host batch ready → placed → stepped → loss on the host; the
host loader's own time is left out (it is the same for every feeder). Every feeder trains the
same state in turn, so all see the same program and the same data sizes.

    python scripts/bench_routed.py --config experiments/mlp_model_parallel.yaml \\
        model.hidden=[1024] train.batch_size=256 optimizer.name=sgd

Reports, per feeder, the median step time and placement time, and the median of the
per-round ratios against direct with a 95% interval (bootstrap over rounds). ``--feeder
label=module:Class`` adds any other ``Feeder`` subclass (e.g. an earlier implementation) to
the same rounds. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import statistics
import sys
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--rounds", type=int, default=15, help="rounds; each runs one block per feeder")
    p.add_argument("--block", type=int, default=20, help="steps per feeder per round")
    p.add_argument("--warmup", type=int, default=5, help="steps per feeder before timing")
    p.add_argument(
        "--feeder",
        action="append",
        default=[],
        metavar="LABEL=MODULE:CLASS",
        help="another Feeder class to time in the same rounds (repeatable)",
    )
    p.add_argument("--out", default="runs/bench_routed.json")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p.parse_args(argv)


def interval(ratios: list[float], seed: int = 0, samples: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the median of `ratios`."""
    rng = np.random.default_rng(seed)
    draws = rng.choice(np.asarray(ratios), (samples, len(ratios)), replace=True)
    meds = np.median(draws, axis=1)
    return float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def main(argv=None) -> int:
    args = parse_args(argv)
    from meshpar import config as config_lib
    from meshpar import experiment, stop

    cfg = config_lib.load(args.config, [*args.overrides, "feed.prefetch=0", "checkpoint.every=0"])
    exp = experiment.build(cfg)
    from input_pipeline.feeding import FEEDERS

    classes = {"direct": FEEDERS["direct"], "routed": FEEDERS["routed"]}
    for spec in args.feeder:
        label, _, target = spec.partition("=")
        module, _, name = target.partition(":")
        classes[label] = getattr(importlib.import_module(module), name)
    feeders = {label: cls(exp.inputs.shardings, cfg.train.batch_size) for label, cls in classes.items()}
    loader, flags = exp.inputs.train, stop.make_flags(exp.mesh, 0)
    state, step_index = exp.state, 0

    def run(feeder, n: int) -> tuple[list[float], list[float]]:
        nonlocal state, step_index
        totals, places = [], []
        for _ in range(n):
            host = loader.batch(step_index)
            step_index += 1
            start = time.perf_counter()
            arrays, info = feeder.place(host)
            state, metrics = exp.train_step(state, arrays, flags)
            float(metrics["loss"])
            totals.append(time.perf_counter() - start)
            places.append(info.seconds)
            del arrays
        return totals, places

    for feeder in feeders.values():
        run(feeder, args.warmup)
    labels = list(feeders)
    steps = {k: [] for k in labels}
    places = {k: [] for k in labels}
    per_round = {k: [] for k in labels}  # median step time of each block
    for r in range(args.rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            t, p = run(feeders[label], args.block)
            steps[label] += t
            places[label] += p
            per_round[label].append(statistics.median(t))
    rows = []
    for label in labels:
        ratios = [a / b for a, b in zip(per_round[label], per_round["direct"])]
        lo, hi = interval(ratios)
        rows.append(
            {
                "feeder": label,
                "median_step_ms": statistics.median(steps[label]) * 1e3,
                "median_place_ms": statistics.median(places[label]) * 1e3,
                "ratio_vs_direct": statistics.median(ratios),
                "ratio_95": [lo, hi],
            }
        )
    print(
        f"config {args.config} {' '.join(args.overrides)}; mesh {dict(exp.mesh.shape)}; "
        f"{args.rounds} rounds x {args.block} steps per feeder, alternating"
    )
    print(f"{'feeder':>16} {'step ms':>9} {'place ms':>9} {'step / direct':>14} {'95% interval':>16}")
    for row in rows:
        lo, hi = row["ratio_95"]
        print(
            f"{row['feeder']:>16} {row['median_step_ms']:9.3f} {row['median_place_ms']:9.3f} "
            f"{row['ratio_vs_direct']:14.3f} {f'[{lo:.3f}, {hi:.3f}]':>16}"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "config": args.config,
                "overrides": args.overrides,
                "mesh": dict(exp.mesh.shape),
                "rounds": args.rounds,
                "block": args.block,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time to first step with JAX's persistent compilation cache: a first start into an empty cache
folder against a second start of the same command.

Each pair gets a fresh cache folder (``compile_cache.dir``; the environment's
``JAX_COMPILATION_CACHE_DIR`` and ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` are removed
for the child processes, so the config's settings apply) and runs, twice:

    python -m meshpar.train --config CONFIG train.steps=1 train.log_every=1 train.eval_every=0 \\
        checkpoint.every=0 train.progress=false compile_cache.dir=CACHE workdir=RUN

Time to first step: from launching the process until step 1's row is in ``metrics.jsonl``
(imports, devices, data, model init, compilation and the step itself). Also reported: the
step's own ``first_step_time_s`` (dispatch → loss on the host, the train step's compilation
included), the whole process's time, and the cache folder's entries after the first start.

    python scripts/bench_startup.py                                   # the quickstart, one pair
    python scripts/bench_startup.py --pairs 3 --out runs/bench_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import common
from train_runs import command

SHORT = ["train.steps=1", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", "train.progress=false"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/quickstart.yaml")
    p.add_argument("--pairs", type=int, default=1, help="first/second start pairs, each with a fresh cache folder")
    p.add_argument("--out", default="runs/bench_startup.json")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p.parse_args(argv)


def start(config: str, cache: pathlib.Path, workdir: pathlib.Path, overrides, env) -> dict:
    cmd = command(config, workdir, [*SHORT, *overrides, f"compile_cache.dir={cache}"])
    metrics = workdir / "metrics.jsonl"
    launched = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=common.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = None
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.perf_counter() - launched
        time.sleep(0.005)
    total = time.perf_counter() - launched
    _, err = proc.communicate()
    if proc.returncode:
        sys.stderr.write(err)
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}")
    if first is None:  # the row came in the last poll interval
        first = total
    summary = json.loads((workdir / "summary.json").read_text())
    return {"time_to_first_step_s": first, "process_s": total, "first_step_time_s": summary["first_step_time_s"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    }
    pairs = []
    with tempfile.TemporaryDirectory(prefix="bench_startup-") as tmp:
        for i in range(args.pairs):
            cache = pathlib.Path(tmp) / f"cache{i}"
            first = start(args.config, cache, pathlib.Path(tmp) / f"run{i}a", args.overrides, env)
            entries = sorted(p.name for p in cache.iterdir())
            second = start(args.config, cache, pathlib.Path(tmp) / f"run{i}b", args.overrides, env)
            pairs.append(
                {
                    "first": first,
                    "second": second,
                    "cache_entries": len(entries),
                    "cached_programs": sorted({n.rsplit("-", 2)[0] for n in entries}),
                }
            )
    print(f"{'start':<8} {'to first step s':>16} {'first step s':>13} {'process s':>10}")
    for i, p in enumerate(pairs):
        for which in ("first", "second"):
            r = p[which]
            print(
                f"{which:<8} {r['time_to_first_step_s']:>16.2f} {r['first_step_time_s']:>13.2f} {r['process_s']:>10.2f}"
            )
        print(
            f"pair {i}: {p['cache_entries']} cache entries after the first start; second/first time to first step "
            f"{p['second']['time_to_first_step_s'] / p['first']['time_to_first_step_s']:.2f}"
        )
    ratio = statistics.median(p["second"]["time_to_first_step_s"] / p["first"]["time_to_first_step_s"] for p in pairs)
    out = common.write_json(
        args.out,
        {"config": args.config, "overrides": args.overrides, "pairs": pairs, "median_second_over_first": ratio},
    )
    print(f"median second/first: {ratio:.2f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

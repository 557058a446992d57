"""Train a config twice, float32 and bfloat16 compute (float32 parameters and optimizer state in
both), and compare the eval losses.

    python scripts/precision_check.py [--config experiments/quickstart.yaml] [k=v ...] [--json out.json]

Each run is ``python -m meshpar.train`` in its own subprocess, one after the other, on the same
data, seed and steps, with ``model.compute_dtype`` set (checkpoints off, a fresh workdir under
``--workdir``). Prints every eval step's loss of both runs and the relative difference of the
last one, ``(bf16 − fp32) / fp32``; the target is ``|difference| ≤ 3%`` (``--tolerance``). Exit 0
when within it, 1 when not, 2 when a run fails.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

import common
from train_runs import command

from meshpar.run.metrics import read_jsonl

DTYPES = ("float32", "bfloat16")


def train(config: str, overrides: list[str], compute_dtype: str, workdir: pathlib.Path) -> dict:
    """One run; its eval losses by step and its wall time."""
    cmd = command(config, workdir, [*overrides, f"model.compute_dtype={compute_dtype}", "checkpoint.every=0",
                                    "train.progress=false"])  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    rows = read_jsonl(workdir / "metrics.jsonl")
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    if not evals:
        raise RuntimeError(f"{' '.join(cmd)} logged no eval loss (set train.eval_every)")
    return {"command": " ".join(cmd), "eval_loss": evals, "final_train_loss": rows[-1].get("loss"), "wall_s": wall}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/quickstart.yaml")
    parser.add_argument("--workdir", default="runs/precision_check", help="each run writes under <workdir>/<dtype>")
    parser.add_argument(
        "--tolerance", type=float, default=0.03, help="largest |relative difference| of the final eval loss"
    )
    parser.add_argument("--json", default="runs/precision_check.json", help="write the results here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    runs = {}
    for dtype in DTYPES:
        workdir = pathlib.Path(args.workdir) / dtype
        try:
            runs[dtype] = train(args.config, args.overrides, dtype, workdir)
        except RuntimeError as e:
            print(f"run failed: {e}", file=sys.stderr)
            return 2
    fp32, bf16 = (runs[d]["eval_loss"] for d in DTYPES)
    steps = sorted(set(fp32) & set(bf16))
    print(f"{args.config} {' '.join(args.overrides)}: eval loss, float32 vs bfloat16 compute (float32 parameters)")
    print(f"{'step':>6} {'float32':>10} {'bfloat16':>10} {'rel. diff':>10}")
    for step in steps:
        print(f"{step:>6} {fp32[step]:>10.4f} {bf16[step]:>10.4f} {(bf16[step] - fp32[step]) / fp32[step]:>+10.2%}")
    last = steps[-1]
    rel = (bf16[last] - fp32[last]) / fp32[last]
    ok = abs(rel) <= args.tolerance
    print(f"final eval loss (step {last}): float32 {fp32[last]:.4f}, bfloat16 {bf16[last]:.4f}, "
          f"relative difference {rel:+.2%} ({'within' if ok else 'beyond'} {args.tolerance:.0%})")  # fmt: skip
    print(f"wall time: float32 {runs['float32']['wall_s']:.1f} s, bfloat16 {runs['bfloat16']['wall_s']:.1f} s (machine load: "
          f"{os.getloadavg()[0]:.1f})")  # fmt: skip
    if args.json:
        result = {"config": args.config, "overrides": args.overrides, "final_step": last, "relative_difference": rel,
                  "tolerance": args.tolerance, "within": ok, "runs": runs}  # fmt: skip
        common.write_json(args.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

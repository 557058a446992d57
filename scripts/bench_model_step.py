"""The compiled train step of one config, this tree against a baseline tree, in alternating blocks.

    python scripts/bench_model_step.py --baseline-rev HEAD          # working tree vs its last commit
    python scripts/bench_model_step.py --baseline-rev REV --blocks 12 --steps 10 --out runs/bench_model_step.json
    python scripts/bench_model_step.py --baseline DIR --cases data1 --profile 12 -- model.n_layers=4

Two worker processes per case, one importing meshpar from this tree, one from the baseline (a
folder, or a git revision unpacked with ``git archive`` into a temporary folder, which leaves
the repository untouched). Each builds the experiment from its own tree's copy of the config
(``experiments/<config>``) with the case's overrides, places a few batches once, compiles and
warms up; then the two take turns, ``--blocks`` times, each running ``--steps`` steps and
blocking on the last one (the order swaps every block, so neither always runs first). Only
one worker computes at a time. A block's time per step gives tokens/s; the ratio new/baseline
of each consecutive pair of blocks is one sample, and the table shows their median with a 95%
bootstrap interval. Both trees also report their first losses from the same initial state and
batches, so a change of the math shows up next to the speed. ``--profile N`` then traces
``--steps`` more steps per tree with ``jax.profiler`` and lists the N HLO ops that took longest
(time per step summed over devices, opcode, shape, the jax operation they came from).

Cases: ``data1`` is the config on one device (``mesh=data:1 layout=batch:data``, SGD: the
step is the model, not the optimizer); ``default`` is the config as it ships (the quickstart:
``data:4,model:2`` on 8 simulated CPU devices, AdamW). Prints a table and writes JSON.
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

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
CASES = {
    "data1": ["mesh=data:1", "layout=batch:data", "optimizer.name=sgd"],
    "default": [],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/quickstart.yaml", help="path relative to each tree's root")
    p.add_argument("--baseline", help="a folder holding the baseline tree (meshpar/, input_pipeline/, experiments/)")
    p.add_argument(
        "--baseline-rev", default="HEAD", help="git revision of this repository to use as baseline (when no --baseline)"
    )
    p.add_argument("--new", default=str(ROOT), help="the tree to measure against the baseline (default: this one)")
    p.add_argument("--cases", default="data1,default", help=f"comma-separated: {', '.join(CASES)}")
    p.add_argument("--blocks", type=int, default=10, help="timed blocks per tree and case")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also trace --steps steps per tree and list the N ops that took longest",
    )
    p.add_argument("--out", default="runs/bench_model_step.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="extra section.key=value overrides, for both trees")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Worker: runs with PYTHONPATH set to one tree; reads commands on stdin, answers JSON lines.


def worker(args) -> int:
    from meshpar import config, experiment, stop

    work = tempfile.mkdtemp(prefix="bench_model_step_")
    fixed = ["train.progress=false", "checkpoint.every=0", f"workdir={work}", "train.steps=1000"]
    cfg = config.load(args.config, [*args.overrides, *fixed])
    exp = experiment.build(cfg)
    import jax

    batches = [exp.inputs.feeder.place(exp.inputs.train.batch(i))[0] for i in range(4)]
    flags = stop.make_flags(exp.mesh, 0)
    state, losses = exp.state, []
    start = time.perf_counter()
    state, metrics = exp.train_step(state, batches[0], flags)
    losses.append(float(metrics["loss"]))
    compile_s = time.perf_counter() - start
    for i in range(1, max(args.warmup, 3)):
        state, metrics = exp.train_step(state, batches[i % len(batches)], flags)
        losses.append(float(metrics["loss"]))
    tokens = exp.tokens_per_example * cfg.train.batch_size
    ready = {
        "ready": True,
        "losses": losses,
        "compile_s": compile_s,
        "tokens_per_step": tokens,
        "devices": exp.mesh.size,
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.startswith("profile "):
            compiled = exp.train_step.lower(state, batches[0], flags).compile()
            top, state = profile(exp, state, batches, flags, args.steps, compiled.as_text(), int(line.split()[1]))
            print(json.dumps({"top": top}), flush=True)
            continue
        if line.strip() != "run":
            break
        start = time.perf_counter()
        for i in range(args.steps):
            state, metrics = exp.train_step(state, batches[i % len(batches)], flags)
        jax.block_until_ready(metrics["loss"])
        print(json.dumps({"seconds_per_step": (time.perf_counter() - start) / args.steps}), flush=True)
    return 0


def profile(exp, state, batches, flags, steps: int, hlo: str, top: int):
    """Trace `steps` steps with jax.profiler: the `top` HLO ops by time per step, summed over
    every device's threads (so on 8 simulated devices, more than the wall time), and the state."""
    import collections
    import gzip
    import re

    import jax

    folder = tempfile.mkdtemp(prefix="bench_model_step_trace_")
    jax.profiler.start_trace(folder, create_perfetto_trace=True)
    for i in range(steps):
        state, metrics = exp.train_step(state, batches[i % len(batches)], flags)
    jax.block_until_ready(metrics["loss"])
    jax.profiler.stop_trace()
    with gzip.open(next(pathlib.Path(folder).rglob("perfetto_trace.json.gz"))) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # What each instruction of the compiled step is: its shape, opcode and the jax op it came from.
    ops = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = (\S+(?: \S+)?) ([\w-]+)\((.*)$", hlo, flags=re.MULTILINE):
        source = re.search(r'op_name="([^"]+)"', m.group(4))
        ops[m.group(1)] = (m.group(3), m.group(2), source.group(1) if source else "")
    time, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e["name"] in ops:
            time[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    total = sum(time.values())
    rows = []
    for name, us in time.most_common(top):
        opcode, shape, source = ops[name]
        rows.append(
            {
                "op": name,
                "ms_per_step": us / 1e3 / steps,
                "share": us / total,
                "calls_per_step": count[name] / steps,
                "opcode": opcode,
                "shape": shape,
                "source": source,
            }
        )
    return rows, state


# ---------------------------------------------------------------------------------------------
# Driver.


class Worker:
    def __init__(self, tree: pathlib.Path, args, overrides: list[str]):
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [
            sys.executable,
            str(pathlib.Path(__file__).resolve()),
            "--worker",
            "--config",
            args.config,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--",
            *overrides,
        ]
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return json.loads(line)

    def block(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._read()["seconds_per_step"]

    def profile(self, top: int) -> list[dict]:
        self.proc.stdin.write(f"profile {top}\n")
        self.proc.stdin.flush()
        return self._read()["top"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def baseline_tree(args, scratch: pathlib.Path) -> tuple[pathlib.Path, str]:
    if args.baseline:
        return pathlib.Path(args.baseline).resolve(), args.baseline
    rev = subprocess.run(
        ["git", "rev-parse", args.baseline_rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
    return scratch, rev


def interval(ratios: list[float], seed: int = 0, n: int = 10000) -> tuple[float, float]:
    """95% bootstrap interval of the median."""
    r = np.asarray(ratios)
    medians = np.median(np.random.default_rng(seed).choice(r, (n, len(r))), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def run_case(name: str, base: pathlib.Path, args) -> dict:
    overrides = [*CASES[name], *args.overrides]
    # One at a time: each compiles alone, and at most one runs steps at any moment.
    workers = {
        "baseline": Worker(base, args, overrides),
        "new": Worker(pathlib.Path(args.new).resolve(), args, overrides),
    }
    times = {"baseline": [], "new": []}
    profiles = {}
    try:
        for b in range(args.blocks):
            order = ("baseline", "new") if b % 2 == 0 else ("new", "baseline")
            for who in order:
                times[who].append(workers[who].block())
        if args.profile:
            profiles = {who: w.profile(args.profile) for who, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    tokens = workers["new"].ready["tokens_per_step"]
    ratios = [b / n for b, n in zip(times["baseline"], times["new"])]  # tokens/s new over baseline
    lo, hi = interval(ratios)
    return {
        "case": name,
        "overrides": overrides,
        "tokens_per_step": tokens,
        "baseline_tokens_per_s": tokens / statistics.median(times["baseline"]),
        "new_tokens_per_s": tokens / statistics.median(times["new"]),
        "median_ratio": statistics.median(ratios),
        "ratio_95": [lo, hi],
        "ratios": ratios,
        "seconds_per_step": times,
        "first_losses": {k: w.ready["losses"] for k, w in workers.items()},
        "compile_s": {k: w.ready["compile_s"] for k, w in workers.items()},
        "profile": profiles,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="bench_baseline_") as scratch:
        base, label = baseline_tree(args, pathlib.Path(scratch))
        results = [run_case(name, base, args) for name in args.cases.split(",")]
    print(f"baseline: {label}; {args.blocks} alternating blocks of {args.steps} steps per tree; config {args.config}")
    print(
        f"{'case':<9} {'baseline tok/s':>15} {'new tok/s':>10} {'median ratio':>13} {'95% interval':>16}  first losses (baseline | new)"
    )
    for r in results:
        lo, hi = r["ratio_95"]
        fl = r["first_losses"]
        losses = " ".join(f"{x:.6f}" for x in fl["baseline"]) + " | " + " ".join(f"{x:.6f}" for x in fl["new"])
        print(
            f"{r['case']:<9} {r['baseline_tokens_per_s']:>15,.0f} {r['new_tokens_per_s']:>10,.0f} {r['median_ratio']:>13.3f} {f'[{lo:.3f}, {hi:.3f}]':>16}  {losses}"
        )
    for r in results:
        for who, rows in r["profile"].items():
            print(f"\n{r['case']} {who}: top ops, ms per step summed over devices (share of all op time)")
            for row in rows:
                source = row["source"].removeprefix("jit(step)/")
                print(
                    f"  {row['ms_per_step']:8.1f} {100 * row['share']:5.1f}%  x{row['calls_per_step']:<4g} {row['opcode']:<14} {row['shape'][:34]:<34} {source[-80:]}"
                )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"baseline": label, "config": args.config, "blocks": args.blocks, "steps": args.steps, "results": results},
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FP8 matmuls against bf16: one model's train step both ways, in this one process, and the plan's
prediction of both for a GPU.

    python scripts/bench_fp8.py [--quick] [--config experiments/gpu_lm.yaml] [--topology h100-sxm-8]
        [--rounds N] [--steps N] [--warmup N] [--json runs/bench_fp8.json] [k=v ...]

Rows, the first the baseline: ``bf16`` (``model.fp8=[]``, every matmul in bfloat16), ``fp8``
(``model.fp8=[mlp,attention]``: the MLP's and attention's weight matmuls with e4m3 operands and
e5m2 output gradients, current scaling; docs/fp8.md) and ``fp8-delayed`` (the same with
``model.fp8_scaling=delayed``, MaxText's and Transformer Engine's recipe). Both built as ``python -m meshpar.train``
builds them (checkpoints, eval and the memory pre-flight off), their train steps compiled ahead
of time and run on their experiments' state and batches (``scripts/common.py``); after warm-up,
rounds of one block of ``--steps`` steps per row (the order reversed every other round), each
step waited for. Reported per row: the median step and its ratio to the bf16 row's of the same
round (median over rounds, 95% bootstrap interval), the first step's loss, and the compiled
step's FP8 dots (:mod:`meshpar.plan.fp8_check`: on a GPU, how many became FP8 GEMMs).

Where the step runs matters, and the table says which: on a GPU with FP8 tensor cores the steps
are *measured*; on this host's CPU (simulated devices) they are *emulated*: XLA:CPU rounds the
operands to FP8 and multiplies in bfloat16, so the ratio shows the quantizing work, never an FP8
GEMM's speed. Beside them, the plan's *predicted* step of each row on ``--topology`` (``python -m
meshpar.plan --topology T --json``, compiled deviceless by XLA's GPU compiler where the
``gpu-plan`` extra is installed; ``--plan-overrides``, by default ``mesh=data:1``: one of its
GPUs, as gpu_lm's header plans it), at the config's own size: what an H100 would do, said as a
prediction.

``--quick`` (the test's): the config at laptop size (gpu_lm's header's model), 2 rounds of 2
steps, the prediction for that small model. Off a GPU without ``--quick`` the measured rows run
at laptop size too (the full model does not fit this host). Exit 1 when a check fails: a row's
first loss is not finite, or on a GPU an FP8 dot fell back. Prints a table, writes JSON.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import common
import numpy as np

CONFIG = "experiments/gpu_lm.yaml"
TOPOLOGY = "h100-sxm-8"
QUIET = ["train.progress=false", "checkpoint.every=0", "train.eval_every=0", "plan.check=false"]
# gpu_lm's header's laptop size (experiments/gpu_lm.yaml: "The same config at laptop size").
LAPTOP = ["model.d_model=128", "model.n_heads=4", "model.d_head=32", "model.d_ff=512", "model.n_layers=2",
          "model.max_length=128", "data.length=128", "data.max_bytes=1000000", "train.batch_size=8"]  # fmt: skip
# The plan's prediction on one GPU of the machine, as gpu_lm's header plans it (--plan-overrides).
PLAN = "mesh=data:1"
FP8 = "model.fp8=[mlp,attention]"
ROWS = [
    ("bf16", ["model.fp8=[]"]),
    ("fp8", [FP8]),
    ("fp8-delayed", [FP8, "model.fp8_scaling=delayed"]),
]  # the first is the baseline


def parse_args(argv=None):
    parser = common.rounds_parser(__doc__, "laptop size, 2 rounds of 2 steps", "runs/bench_fp8.json")
    parser.add_argument("--config", default=CONFIG, help="the experiment both rows run")
    parser.add_argument("--topology", default=TOPOLOGY, help="the GPU machine the plan predicts on")
    parser.add_argument("--plan-overrides", default=PLAN, help="space-separated overrides for the prediction only")
    return parser.parse_args(argv)


class Row:
    """One precision: its compiled step running on its experiment's arrays, and its FP8 dots."""

    def __init__(self, label: str, extra: list[str], config: str, model: list[str], args, workdir: str):
        from meshpar.configuration import config as config_lib
        from meshpar.plan import fp8_check

        cfg = config_lib.load(config, [*model, *args.overrides, *QUIET, f"workdir={workdir}", *extra])
        self.label, self.overrides = label, extra
        self.running = common.materialize(cfg)
        step = self.running.step
        device = step.mesh.devices.flat[0]
        checked = fp8_check.check(cfg.model.fp8, step.compiled, device.platform, device.device_kind)
        self.fp8 = checked.to_json() if checked else None
        self.fp8_lines = checked.lines() if checked else []
        self.compile_s = step.compile_s
        self.first_loss = float(self.running(self.running.batches[0])["loss"])
        self.running.run(args.warmup)


def predicted(config: str, topology: str, overrides: list[str], workdir: str) -> dict:
    """``python -m meshpar.plan --config C --topology T --json`` of one row: its predicted step,
    memory, where it was compiled for and its FP8 dots; or ``{"error": line}``."""
    out = os.path.join(workdir, "plan.json")
    cmd = [sys.executable, "-m", "meshpar.plan", "--config", config, "--topology", topology, "--json", out, *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=common.REPO)
    if not os.path.exists(out):
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    plan = json.loads(pathlib.Path(out).read_text())
    step = (plan.get("time") or {}).get("step") or {}
    return {"compiled_for": plan["compiled_for"], "step_s": step.get("total_s"), "gemm_s": step.get("components", {}).get("gemm"),
            "memory_bound_s": step.get("components", {}).get("memory-bound"), "needed_bytes": plan["needed_bytes"],
            "fits": plan["fits"], "fp8": plan.get("fp8"), "deviceless": "compile-only" in plan["compiled_for"]}  # fmt: skip


def predictions(args, model: list[str], tmp: str) -> dict:
    """The plan's prediction of each row on ``--topology`` (with ``--plan-overrides``)."""
    one = args.plan_overrides.split()
    out = {}
    for i, (label, extra) in enumerate(ROWS):
        os.makedirs(os.path.join(tmp, f"plan{i}"))
        out[label] = predicted(args.config, args.topology, [*model, *args.overrides, *one, *extra],
                               os.path.join(tmp, f"plan{i}"))  # fmt: skip
    base = out["bf16"].get("step_s")
    over = {label: base / row["step_s"] if base and row.get("step_s") else None for label, row in out.items()}
    return {
        "topology": args.topology,
        "overrides": one,
        "rows": out,
        "bf16_over_fp8": over["fp8"],
        "bf16_over_fp8_delayed": over["fp8-delayed"],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    started = time.perf_counter()
    from meshpar.sharding import mesh as mesh_lib

    mesh_lib.request_cpu_devices(8)  # before the backend starts (a CPU host: 8 simulated devices)
    import jax

    gpu = jax.devices()[0].platform == "gpu"
    measured_model = [] if gpu and not args.quick else LAPTOP
    with tempfile.TemporaryDirectory(prefix="bench_fp8-") as tmp:
        rows = [Row(label, extra, args.config, measured_model, args, os.path.join(tmp, str(i)))
                for i, (label, extra) in enumerate(ROWS)]  # fmt: skip
        plan = predictions(args, LAPTOP if args.quick else [], tmp)
    timed = common.timed_rounds(rows, args.rounds, lambda r: r.running.run(args.steps), rng=np.random.default_rng(0))
    kind = "measured" if gpu else "emulated"
    results, failures = [], []
    for r, t in zip(rows, timed):
        if not math.isfinite(r.first_loss):
            failures.append(f"{r.label}: first loss {r.first_loss}")
        if gpu and r.fp8 and r.fp8["emitted"] < r.fp8["meant"]:
            failures.append(f"{r.label}: {r.fp8['meant'] - r.fp8['emitted']} FP8 dots fell back: {r.fp8_lines[1:]}")
        results.append({
            "row": r.label, "overrides": r.overrides, "kind": kind, "median_step_s": statistics.median(t["times"]),
            "step_s": t["times"], "block_median_s": t["block_median_s"], "ratio_to_bf16": t["ratio"],
            "first_loss": r.first_loss, "compile_s": r.compile_s, "fp8": r.fp8, "fp8_lines": r.fp8_lines,
        })  # fmt: skip
    wall = time.perf_counter() - started
    report(results, plan, jax.devices()[0].device_kind, kind)
    meta = {
        **common.rounds_meta(args, args.config, measured_model, wall), "kind": kind, "predicted": plan,
        "sources": {
            "median_step_s": f"{kind}: wall clock of one train step, waited for; median over every timed block",
            "ratio_to_bf16": f"{kind}: per round, the row's block median over the bf16 row's; median, 95% bootstrap",
            "predicted": "python -m meshpar.plan --topology T --json: the time model on XLA:GPU's compiled program",
        },
        "failures": failures,
    }  # fmt: skip
    return common.finish(args.json, {**meta, "results": results}, failures, wall)


def _dots(check: dict | None) -> str | None:
    """A row's FP8 dots in a few words: checked (a GPU's program) or emulated (XLA:CPU's)."""
    if not check:
        return None
    if check["mode"] == "emulated":
        return f"emulated, {check['meant']} dots"
    return f"{check['emitted']} of {check['meant']} FP8 GEMMs"


def report(results: list[dict], plan: dict, device: str, kind: str) -> None:
    if kind == "emulated":
        print(
            f"{kind} on {device}: XLA:CPU rounds to FP8 and multiplies in bfloat16 (no FP8 GEMM: the speed is not FP8's)"
        )
    rows = []
    for r in results:
        p = plan["rows"][r["row"]]
        ratio = r["ratio_to_bf16"]
        rows.append([
            r["row"], f"{r['median_step_s'] * 1e3:.2f}", f"{ratio['median']:.3f}", "[{:.3f}, {:.3f}]".format(*ratio["ci95"]),
            None if p.get("step_s") is None else f"{p['step_s'] * 1e3:.1f}",
            None if p.get("needed_bytes") is None else f"{p['needed_bytes'] / 2**30:.2f}",
            _dots(r["fp8"]), _dots(p.get("fp8")),
        ])  # fmt: skip
    columns = [("row", "<11"), (f"step ms ({kind})", ">"), ("x bf16", ">"), ("95% interval", ">"),
               (f"predicted ms ({plan['topology']})", ">"), ("predicted GiB/dev", ">"), ("FP8 dots (run)", ">"),
               ("FP8 dots (predicted)", ">")]  # fmt: skip
    print(common.table(columns, rows))
    errors = [f"{label}: {p['error']}" for label, p in plan["rows"].items() if "error" in p]
    for line in errors:
        print(f"not predicted: {line}")
    for label, key in (("fp8", "bf16_over_fp8"), ("fp8-delayed", "bf16_over_fp8_delayed")):
        if plan[key]:
            print(f"predicted bf16 / {label} step on {plan['topology']}: {plan[key]:.3f}")


if __name__ == "__main__":
    sys.exit(main())

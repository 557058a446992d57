"""How long planning a cluster takes on this host: a 70B model on up to 2,048 GPUs.

    python scripts/plan_at_scale.py [--nodes 32,128,256] [--json out.json]

For each node count, ``python -m meshpar.plan`` on Llama-2 70B's shapes (80 layers of d_model
8192, 64 query heads and 8 key/value heads of 128, MLP 28672, vocabulary 32000, sequence 4096;
MaxText's dgxc-benchmarking recipe: FSDP over every GPU, 2 sequences per GPU, its ``custom``
save list, cuDNN's fused attention) on ``h100-sxm-8`` × that many nodes on InfiniBand NDR, run
as its own process, as a user runs it: the program is compiled for every device of the cluster
by XLA's GPU compiler (deviceless; the ``gpu-plan`` extra) and priced. Printed per node count:
the wall time of the whole command, its peak resident memory (the child's ``ru_maxrss``), the
predicted step and the per-device memory the plan gives. Targets (exit 1 when missed): each
plan under 10 minutes and 16 GiB.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import common

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = {"wall_s": 600.0, "rss_gib": 16.0}
LLAMA2_70B = ["model.d_model=8192", "model.n_heads=64", "model.n_kv_heads=8", "model.d_head=128", "model.d_ff=28672",
              "model.n_layers=80", "model.vocab_size=32000", "model.max_length=4096", "model.rope_scaling=none",
              "model.rope_theta=10000.0", "data.length=4096", "model.remat=custom",
              "model.remat_save=[query_proj,key_proj,value_proj,out_proj,mlpwo]"]  # fmt: skip


def plan(nodes: int) -> dict:
    """One plan of the 70B model on `nodes` nodes of 8 H100, in its own process."""
    gpus = 8 * nodes
    cmd = [sys.executable, "-m", "meshpar.plan", "--config", "experiments/llama3_8b.yaml", "--topology", "h100-sxm-8",
           "--nodes", str(nodes), f"mesh=data:{gpus}", f"train.batch_size={2 * gpus}", *LLAMA2_70B]  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        out = pathlib.Path(folder) / "plan.json"
        started = time.perf_counter()
        result = subprocess.run([*cmd, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        planned = json.loads(out.read_text()) if out.is_file() else {}
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # kB on Linux; the largest child so far
    step = planned.get("time", {}).get("step", {}).get("total_s")
    needed = planned.get("needed_bytes")
    return {"nodes": nodes, "gpus": gpus, "exit": result.returncode, "wall_s": wall, "rss_gib": rss / 2**30,
            "step_s": step, "needed_gib": needed / 2**30 if needed else None, "fits": planned.get("fits"),
            "compiled_for": planned.get("compiled_for"),
            "error": (result.stderr.strip().splitlines() or [""])[-1] if result.returncode not in (0, 1) else ""}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="32,128,256", help="node counts, comma-separated")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows, missed = [], []
    print(f"{'GPUs':>6s} {'wall':>8s} {'peak RSS':>9s}  predicted step / memory per device")
    for nodes in (int(n) for n in args.nodes.split(",")):
        row = plan(nodes)
        rows.append(row)
        step = f"{row['step_s']:.3f} s" if row["step_s"] else "-"
        memory = f"{row['needed_gib']:.2f} GiB" if row["needed_gib"] else "-"
        print(f"{row['gpus']:6d} {row['wall_s']:7.1f}s {row['rss_gib']:7.2f} GiB  {step} / {memory} ({row['compiled_for']})"
              + (f"  ({row['error']})" if row["error"] else ""), flush=True)  # fmt: skip
        if row["error"] or not row["step_s"]:
            missed.append(f"{row['gpus']} GPUs: the plan failed: {row['error'] or 'no step time'}")
        for key, limit in TARGETS.items():
            if row[key] > limit:
                missed.append(f"{row['gpus']} GPUs: {key} {row[key]:.1f} above {limit:g}")
    if args.json:
        common.write_json(args.json, {"targets": TARGETS, "rows": rows, "missed": missed})
    for line in missed:
        print(f"missed: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

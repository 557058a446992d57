"""The search estimate's kernel launches against XLA:GPU's program of the same step.

For Megatron's GPT (hidden 1024, 24 layers, remat full, bf16) on 8 × A100 under three layouts,
prints the launches the analytic estimate counts (:func:`meshpar.plan.search.estimates.pass_kernels` per
pass, times the passes) beside the kernels the compiled program launches (compiled deviceless by
XLA's GPU compiler: needs the gpu-plan extra) and their ratio; the estimate is a lower bound, so
the script exits 1 where it counts more than the program has.

    python scripts/search_launches.py
"""

from __future__ import annotations

import json
import sys

import validate_published as vp

from meshpar import models
from meshpar.configuration import config as config_lib
from meshpar.plan import gpu_target, topology
from meshpar.plan.memory import stage_axis as stages
from meshpar.plan.search import estimates
from meshpar.plan.time import timing
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import parts

LAYOUT = "batch:data; heads:model; d_ff:model; vocab:model; layers:stage"
CASES = [([("data", 8)], 2), ([("data", 4), ("model", 2)], 4), ([("data", 2), ("stage", 2), ("model", 2)], 8)]


def main() -> int:
    topo = topology.load("a100-sxm-8")
    target = gpu_target.target(topo, (("model", 8),))
    if not target.compile_only:
        print("needs the gpu-plan extra (XLA's GPU compiler): pip install -e '.[gpu-plan]'")
        return 2
    model = vp.gpt(1024, 16, 24, 2048, vp.MEGATRON_VOCAB, dropout=0.1, remat="full")
    print(f"{'mesh':<24} {'micro':>5} {'per pass':>8} {'estimate':>9} {'compiled':>9} {'ratio':>6}")
    ok = True
    for mesh, k in CASES:
        cfg = config_lib.from_dict(json.loads(json.dumps(vp._config(mesh, LAYOUT, model, 2048, 16, k))))
        step = parts.abstract_step(cfg, mesh_lib.build_mesh(cfg.mesh, target.devices[:8]))
        per_pass = estimates.pass_kernels(step)
        sched = step.plan.schedule
        share = stages.layer_share(models.family(cfg.model.name), cfg.model, step.element_spec)
        passes = k * stages.compute_scale(sched, share)  # a stage's share of each pass (1: no stage axis)
        estimated = per_pass * passes
        compiled = timing.predict(step, step.lower().compile(), topo, 0.0).kernels
        ok &= estimated <= compiled
        print(f"{cfg.mesh_str:<24} {k:>5} {per_pass:>8} {estimated:>9.0f} {compiled:>9} {compiled / estimated:>6.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Check the model FLOP count against XLA's cost analysis of the compiled train step.

    python scripts/check_flops.py [--config experiments/quickstart.yaml] [k=v ...]

Compiles the config's train step on a one-device mesh (so XLA's figure is the whole step, not
one shard of it) and prints the model's count (``flops_per_example`` × batch) next to XLA's
``cost_analysis()["flops"]``. XLA counts everything the step executes — the optimizer update,
softmax, norms, and for rotary positions the rotations — so its figure is expected a few
percent above the model count; a large gap means the formula misses a matmul. Two known gaps:
XLA's cost analysis counts a ``while`` loop's body once, not once per trip, so layers stacked
with ``lax.scan`` are compiled unrolled here (``model.scan_layers=false``; same math); and 6·N
charges every layer an input gradient, which the first layer of an MLP (whose input is data)
never computes, so XLA's figure for the MLP is below the 6·N count.
"""

from __future__ import annotations

import argparse
import json
import sys

import common


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/quickstart.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", 1)
    from meshpar import models
    from meshpar.configuration import config

    cfg = config.load(args.config, [*args.overrides, "mesh=data:1", "layout=batch:data", "train.progress=false"])
    if hasattr(cfg.model, "scan_layers"):  # count every layer (see above)
        cfg = config.load(args.config, [*args.overrides, "mesh=data:1", "layout=batch:data", "model.scan_layers=false"])
    step = common.compile_step(cfg)
    xla = step.flops()
    model = models.family(cfg.model.name).flops_per_example(cfg.model, step.element_spec) * cfg.train.batch_size
    result = {
        "config": args.config,
        "model_flops_per_step": model,
        "xla_flops_per_step": xla,
        "xla_over_model": xla / model,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

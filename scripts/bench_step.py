"""meshpar's train loop against a hand-written ``jax.jit`` loop: what the loop costs per step.

For each config, in this one process: an experiment is built as ``python -m meshpar.train``
builds it (eval, checkpoints and the progress bar off; logging as the config says), and a
hand-written loop gets the same model, optimizer, shardings and initial state, its own
``jax.jit`` step (the same loss, gradient, gradient norm and update, no stop flag) and the
same batches, placed on the devices before it starts; it fetches each step's loss and
gradient norm one step late, as meshpar's loop does. Then, in rounds of one block per arm,
the order reversed every other round (so a slow drift of the machine falls on all alike):

- ``meshpar``: ``meshpar.run.loop.train`` for one block of steps, fed the same placed batches as
  the hand loop (the loop's own cost: results fetched a step late, metrics rows, run
  statistics, stop flags, NaN guard);
- ``hand``: the hand-written loop for the same number of steps;
- ``meshpar_pipeline``: ``meshpar.run.loop.train`` with its own input pipeline placing the batches
  (host batches read and placed on a background thread, ``feed.prefetch`` ahead): the loop
  and its input pipeline together. On CPU the pipeline's host work (about half a millisecond
  per batch of mlp_model_parallel) competes with XLA's compute for the same cores.

Each block's figure is its steady period per step: the time between the dispatch of its third
step and of its last, over those steps (every arm is timed by the same wrapper around its step
function; the first steps, with the pipeline starting, and the final wait are left out). That
stretch is a whole number of logging periods holding one logged row each (meshpar writes a
row a step late, in the stretch), about ``--block-s`` seconds. Reported: per arm the median
period, and for each meshpar arm the median of its per-round ratios to the hand loop's block
of the same round, with a 95% interval (bootstrap of the median over rounds). Prints a table
and writes JSON.

    python scripts/bench_step.py                                  # mlp_model_parallel and the quickstart
    python scripts/bench_step.py --configs experiments/quickstart.yaml --pairs 12 --out runs/bench_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import statistics
import sys
import tempfile
import time

import common
import numpy as np

CONFIGS = "experiments/mlp_model_parallel.yaml,experiments/quickstart.yaml"
SKIP = 2  # dispatches left out of each block's period (the input pipeline starting)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=CONFIGS, help="comma-separated experiment YAMLs")
    p.add_argument("--pairs", type=int, default=12, help="rounds of blocks (one per arm) per config")
    p.add_argument("--block-s", type=float, default=2.0, help="about how long one block runs")
    p.add_argument("--arms", default="meshpar,hand,meshpar_pipeline", help="some of: meshpar, hand, meshpar_pipeline")
    p.add_argument("--out", default="runs/bench_step.json")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for every config")
    return p.parse_args(argv)


class Dispatches:
    """Wraps a step function; records when each call was made (perf_counter)."""

    def __init__(self, fn):
        self.fn, self.times = fn, []

    def __call__(self, *args):
        self.times.append(time.perf_counter())
        return self.fn(*args)

    def period(self) -> float:
        t = self.times[SKIP:]
        return (t[-1] - t[0]) / (len(t) - 1)


def hand_step(exp):
    """A plain jitted train step on the experiment's model, optimizer and shardings."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from meshpar import models
    from meshpar.sharding import layout as layout_lib
    from meshpar.step import parts

    tx, plan = parts.plan_model(
        exp.cfg,
        models.family(exp.cfg.model.name),
        exp.mesh,
        exp.layout,
        exp.inputs.element_spec,
        exp.record["decay_steps"],
    )

    def step(state, batch):
        rng, step_rng = jax.random.split(jax.random.wrap_key_data(state.rng))

        def loss_fn(params):
            return nnx.merge(plan.graphdef, params).loss(batch, rngs=nnx.Rngs(dropout=step_rng))

        with layout_lib.activate(exp.layout, exp.mesh):
            (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        new = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(rng))
        return new, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    replicated = NamedSharding(exp.mesh, PartitionSpec())
    jitted = jax.jit(
        step,
        in_shardings=(plan.shardings, dict(exp.inputs.shardings)),
        out_shardings=(plan.shardings, replicated),
        donate_argnums=0,
    )
    return jitted, plan.materialize(exp.layout, exp.mesh)


def hand_loop(step, state, batches, n: int):
    """The hand-written loop: dispatch step i, then fetch step i-1's loss and gradient norm."""
    import jax

    previous = None
    for i in range(n):
        state, metrics = step(state, batches[i % len(batches)])
        if previous is not None:
            loss, grad_norm = jax.device_get((previous["loss"], previous["grad_norm"]))
            float(loss), float(grad_norm)
        previous = metrics
    jax.device_get(previous["loss"])
    return state


def placed_batches(exp, count: int):
    """Placed train batches 0..count-1, as meshpar's feeder places them, with their placements."""
    out = []
    for i in range(count):
        arrays, info = exp.inputs.feeder.place(exp.inputs.train.batch(i))
        out.append((arrays, info))
    return out


def preplaced(batches):
    """A stand-in for ``Inputs.batches`` that hands out already-placed batches."""
    from input_pipeline.prefetch import Fed

    @contextlib.contextmanager
    def feed(start: int, stop: int):
        yield (Fed(s, *batches[s % len(batches)], 0.0) for s in range(start, stop))

    return feed


def bench(config_path: str, args, workdir: pathlib.Path) -> dict:
    from meshpar.configuration import config
    from meshpar.run import experiment, loop

    arms = [a.strip() for a in args.arms.split(",")]
    overrides = [
        "train.progress=false",
        "train.eval_every=0",
        "checkpoint.every=0",
        "train.steps=1000000",
        f"workdir={workdir}",
        *args.overrides,
    ]
    cfg = config.load(config_path, overrides)
    exp = experiment.build(cfg)
    step, hand_state = hand_step(exp)
    timed_hand = Dispatches(step)
    meshpar_step = exp.train_step
    log_every = cfg.train.log_every
    batches = placed_batches(exp, max(2 * log_every, 16))
    real_batches = exp.inputs.batches

    def run_meshpar(n: int, placed: bool = True) -> float:
        timed = Dispatches(meshpar_step)
        exp.train_step = timed
        exp.inputs.batches = preplaced(batches) if placed else real_batches
        start = int(exp.state.step)
        exp.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=start + n))
        loop.train(exp)
        return timed.period()

    def run_hand(n: int) -> float:
        nonlocal hand_state
        timed_hand.times.clear()
        hand_state = hand_loop(timed_hand, hand_state, [b for b, _ in batches], n)
        return timed_hand.period()

    # Warm-up (compilation, first placements), then size the blocks from the faster of two
    # short runs (a busy machine makes single periods long; a block too long only costs time).
    run_meshpar(log_every, placed=False)
    run_hand(log_every)
    estimate = min(run_meshpar(2 * log_every), run_hand(2 * log_every))
    # Timed from the 3rd dispatch to the last: k * log_every steps holding exactly k logged rows.
    n = log_every * max(1, round(args.block_s / (estimate * log_every))) + SKIP + 1
    run = {
        "meshpar": lambda: run_meshpar(n),
        "meshpar_pipeline": lambda: run_meshpar(n, placed=False),
        "hand": lambda: run_hand(n),
    }
    periods = dict(zip(arms, common.interleaved(arms, args.pairs, lambda arm: run[arm]())))
    exp.inputs.batches = real_batches
    rng = np.random.default_rng(0)
    out = {
        "config": config_path,
        "steps_per_block": n,
        "pairs": args.pairs,
        "log_every": log_every,
        "prefetch": cfg.feed.prefetch,
        "median_s_per_step": {a: statistics.median(p) for a, p in periods.items()},
        "periods_s": periods,
    }
    for arm in arms:
        if arm == "hand":
            continue
        ratios = [m / h for m, h in zip(periods[arm], periods["hand"])]
        lo, hi = common.bootstrap_median(ratios, rng)
        out[f"{arm}_over_hand"] = {"median": statistics.median(ratios), "ci95": [lo, hi], "ratios": ratios}
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    results = []
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp:
        for i, path in enumerate(c.strip() for c in args.configs.split(",")):
            results.append(bench(path, args, pathlib.Path(tmp) / str(i)))
            r = results[-1]
            print(f"{path}: {r['steps_per_block']} steps per block, {r['pairs']} pairs, done", file=sys.stderr)
    arms = [a.strip() for a in args.arms.split(",") if a.strip() != "hand"]
    header = f"{'config':<36} {'steps/block':>11} {'hand ms/step':>12}" + "".join(
        f" {a + ' ms/step':>19} {a + '/hand median':>25} {'95% interval':>15}" for a in arms
    )
    print(header)
    for r in results:
        line = f"{pathlib.Path(r['config']).stem:<36} {r['steps_per_block']:>11} {r['median_s_per_step']['hand'] * 1e3:>12.3f}"
        for a in arms:
            ratio = r[f"{a}_over_hand"]
            line += f" {r['median_s_per_step'][a] * 1e3:>19.3f} {ratio['median']:>25.3f} {'[{:.3f}, {:.3f}]'.format(*ratio['ci95']):>15}"
        print(line)
    device = jax.devices()[0]
    meta = {"platform": device.platform, "devices": jax.device_count(), "jax": jax.__version__}
    print(f"wrote {common.write_json(args.out, {**meta, 'results': results})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kill-and-resume demonstration: a run SIGKILLed again and again ends bit-identical.

    python scripts/kill_resume.py                                   # 10 cycles, seed 0
    python scripts/kill_resume.py --cycles 3 --seed 1 feed.mode=routed feed.prefetch=0

1. Runs the config uninterrupted to the end (``<workdir>/reference``).
2. In ``<workdir>/killed``, starts the same run with ``--resume`` and SIGKILLs it at a seeded
   random moment, ``--cycles`` times; then lets a last ``--resume`` run finish. A kill lands
   right after a random step is logged ("step"), right after a checkpoint step is logged, with
   its async save most likely still writing ("save"), a random few milliseconds after a step
   ("delay"), or at a random time after launch, often during start-up or restore ("startup").
3. Loads the final checkpoint of both runs in this process and compares every leaf of the
   train state (step, params, opt_state, rng) bit for bit; also the logged losses.

Prints a table of the cycles and ``bit-identical: yes|NO (n leaves compared)``; writes
``<workdir>/kill_resume.json``. Exit status 0 only if the states (and losses) are identical
and no process the killed run had started (e.g. its data workers) outlived it by more than
a few seconds. Trailing ``section.key=value`` overrides apply to both runs (e.g.
``feed.mode=routed``, or ``data.workers=2``: batches assembled in worker processes).

Running, killing and reading back the runs is ``scripts/train_runs.py``'s (the tests of faults
use the same helpers).
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import common
from train_runs import committed_steps, compare_states, interrupt, load_state, logged_steps, losses, run_to_end

from meshpar.configuration import config as config_lib

# ~25-30 s uninterrupted on 2 CPU cores (the saves every 7 steps cost about as much as the steps).
DEFAULT_OVERRIDES = ("train.steps=600", "train.log_every=1", "train.progress=false", "checkpoint.every=7")
MODES = ("step", "save", "delay", "startup")


# --------------------------------------------------------------------------------------------
# The demonstration.


def choose_kill(
    rng: random.Random, last: int, steps: int, every: int, cycles_left: int
) -> tuple[str, int, float, float | None]:
    """(mode, target step, delay s after it, limit s after launch) for the next kill. Targets
    advance from `last` (the newest logged step) by about a share of what remains, so every
    cycle has room; a "startup" kill comes at a random time, or at the target if that is sooner."""
    mode = rng.choices(MODES, weights=(3, 3, 3, 1))[0]
    within = rng.uniform(0.5, 6.0) if mode == "startup" else None
    room = max(steps - every - 1 - last, 1)
    target = last + 1 + rng.randrange(max(2 * room // (cycles_left + 1), 1))
    if mode == "save" and every:
        target = -(-target // every) * every
    target = min(target, max(steps - every - 1, last + 1))
    return mode, target, rng.uniform(0.0, 0.3) if mode == "delay" else 0.0, within


def kill_cycles(
    config, workdir, overrides=(), *, cycles: int, seed: int, steps: int, every: int, env=None, log=print
) -> list[dict]:
    """`cycles` SIGKILLed --resume runs in `workdir`; returns one record per cycle."""
    rng, records = random.Random(seed), []
    for i in range(cycles):
        last = max(logged_steps(workdir), default=0)
        mode, target, delay, within = choose_kill(rng, last, steps, every, cycles - i)
        if target >= steps:
            log(f"cycle {i + 1}: no room left before step {steps}; stopping the cycles early")
            break
        rec = interrupt(config, workdir, overrides, target=target, delay=delay, within=within, env=env)
        rec.update(cycle=i + 1, mode=mode, delay_s=round(delay, 3), within_s=within and round(within, 3))
        if rec["rc"] != -signal.SIGKILL:
            raise RuntimeError(f"cycle {i + 1}: the run ended with {rec['rc']} before the kill:\n{rec['stderr']}")
        if rec["outlived"]:
            raise RuntimeError(f"cycle {i + 1}: processes {rec['outlived']} of the killed run are still running")
        records.append(rec)
        log(_row(rec))
    return records


HEADER = (
    f"{'cycle':>5}  {'mode':<7}  {'resumed from':>12}  {'target':>6}  {'killed at':>9}  {'in-flight save':<14}  "
    f"{'children':>8}  checkpoints after"
)


def _row(r: dict) -> str:
    target = "-" if r["target"] is None else r["target"] if r.get("within_s") is None else f"{r['within_s']:.1f}s"
    killed = "startup" if r["killed_at"] is None else r["killed_at"]
    inflight = ",".join(n.split(".")[0] for n in r["inflight_after"]) or "-"
    return (
        f"{r['cycle']:>5}  {r['mode']:<7}  {r['resumed_from']:>12}  {target!s:>6}  {killed!s:>9}  {inflight:<14}  "
        f"{r['children']:>8}  {r['checkpoints_after']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/mlp_model_parallel.yaml")
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="runs/kill_resume")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="applied to both runs, after the defaults"
    )
    args = parser.parse_args(argv)
    config = str(Path(args.config).absolute())
    overrides = [*DEFAULT_OVERRIDES, *args.overrides]
    cfg = config_lib.load(config, overrides)  # a config mistake stops here, before any run
    steps, every = cfg.train.steps, cfg.checkpoint.every
    if cfg.checkpoint.dir:
        print("checkpoint.dir must be empty here (each run keeps its checkpoints in its workdir)", file=sys.stderr)
        return 2
    root = Path(args.workdir).absolute()
    ref_dir, kill_dir = root / "reference", root / "killed"
    for d in (ref_dir, kill_dir):
        shutil.rmtree(d, ignore_errors=True)
    print(f"config {args.config} {' '.join(overrides)}; {steps} steps, checkpoint every {every}; seed {args.seed}")

    t0 = time.monotonic()
    ref = run_to_end(config, ref_dir, overrides)
    ref_s = time.monotonic() - t0
    if ref.returncode != 0:
        print(f"uninterrupted run failed ({ref.returncode}):\n{ref.stderr}", file=sys.stderr)
        return 1
    print(f"uninterrupted run: {ref_s:.1f} s")

    print(HEADER)
    t1 = time.monotonic()
    records = kill_cycles(config, kill_dir, overrides, cycles=args.cycles, seed=args.seed, steps=steps, every=every)
    resumed_from = (committed_steps(kill_dir / "checkpoints") or [0])[-1]
    final = run_to_end(config, kill_dir, overrides, resume=True)
    kill_s = time.monotonic() - t1
    print(f"final --resume run from step {resumed_from}: exit {final.returncode}; killed runs + final: {kill_s:.1f} s")
    if final.returncode != 0:
        print(final.stderr, file=sys.stderr)
        return 1
    notes = [line for line in final.stderr.splitlines() if line.strip()]
    for line in notes:
        print(f"  final run stderr: {line}")

    ref_state, ref_step, _ = load_state(config, ref_dir, overrides)
    got_state, got_step, skipped = load_state(config, kill_dir, overrides)
    identical, n, differ = compare_states(ref_state, got_state)
    identical = identical and ref_step == got_step == steps
    same_losses = losses(ref_dir) == losses(kill_dir)
    logged = [s for s, _ in losses(kill_dir)]
    report = {
        "config": args.config,
        "overrides": overrides,
        "seed": args.seed,
        "steps": steps,
        "every": every,
        "uninterrupted_s": round(ref_s, 2),
        "killed_and_final_s": round(kill_s, 2),
        "cycles": [{k: v for k, v in r.items() if k not in ("stdout", "stderr")} for r in records],
        "final_resumed_from": resumed_from,
        "final_stderr": notes,
        "reference_step": ref_step,
        "resumed_step": got_step,
        "restore_fallbacks": skipped,
        "leaves_compared": n,
        "differing_leaves": differ,
        "bit_identical": identical,
        "losses_identical": same_losses,
        "metrics_steps_once_each": logged == list(range(1, steps + 1)),
    }
    common.write_json(root / "kill_resume.json", report)
    if differ:
        print(f"differing leaves: {', '.join(differ[:10])}{' ...' if len(differ) > 10 else ''}")
    print(
        f"metrics.jsonl losses identical: {'yes' if same_losses else 'NO'} "
        f"(steps 1..{steps} logged once each: {'yes' if report['metrics_steps_once_each'] else 'NO'})"
    )
    print(f"bit-identical: {'yes' if identical else 'NO'} ({n} leaves compared)")
    return 0 if identical and same_losses and report["metrics_steps_once_each"] else 1


if __name__ == "__main__":
    sys.exit(main())

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

The functions here are also used by tests/test_faults.py.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ~25-30 s uninterrupted on 2 CPU cores (the saves every 7 steps cost about as much as the steps).
DEFAULT_OVERRIDES = ("train.steps=600", "train.log_every=1", "train.progress=false", "checkpoint.every=7")
MODES = ("step", "save", "delay", "startup")


# --------------------------------------------------------------------------------------------
# Reading a run's files from outside (read-only: never touch what the run owns).


def logged_steps(workdir: str | Path) -> list[int]:
    """Steps in ``metrics.jsonl``, complete lines only (the run may be writing the last one)."""
    try:
        text = (Path(workdir) / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.split("\n")[:-1]:  # the piece after the last newline may be half-written
        try:
            out.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError):
            pass
    return out


def losses(workdir: str | Path) -> list[tuple[int, float]]:
    path = Path(workdir) / "metrics.jsonl"
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


def committed_steps(ckpt_dir: str | Path) -> list[int]:
    """Committed checkpoint steps: orbax renames ``<step>.orbax-checkpoint-tmp-*`` to ``<step>``."""
    d = Path(ckpt_dir)
    return sorted(int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()) if d.is_dir() else []


def inflight_saves(ckpt_dir: str | Path) -> list[str]:
    """Folders of saves that never committed (left by a kill mid-save)."""
    d = Path(ckpt_dir)
    return sorted(p.name for p in d.iterdir() if "orbax-checkpoint-tmp" in p.name) if d.is_dir() else []


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc; [] elsewhere or once it is gone)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def still_running(pids: list[int], wait: float = 10.0) -> list[int]:
    """The processes of `pids` still alive (not zombies) after up to `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# Running the CLI.


def command(config: str | Path, workdir: str | Path, overrides=(), resume: bool = False) -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshpar.train",
        "--config",
        str(config),
        *overrides,
        f"workdir={workdir}",
        *(["--resume"] if resume else []),
    ]


def launch(config, workdir, overrides=(), resume=True, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        command(config, workdir, overrides, resume),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_to_end(config, workdir, overrides=(), resume=False, env=None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(config, workdir, overrides, resume),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for_step(proc: subprocess.Popen, workdir, step: int, timeout: float = 600) -> int | None:
    """Poll metrics.jsonl until a row of `step` or later is there; its step, or None if the
    process ended first. `step` must be above any row a killed run left (those stay until the
    resumed run truncates the file at start)."""
    path, size, deadline = Path(workdir) / "metrics.jsonl", -1, time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            now = path.stat().st_size
        except FileNotFoundError:
            now = -1
        if now != size:
            size = now
            seen = [s for s in logged_steps(workdir) if s >= step]
            if seen:
                return seen[0]
        if proc.poll() is not None:
            return None
        time.sleep(0.002)
    raise TimeoutError(f"no step {step} in {path} after {timeout} s")


def interrupt(
    config,
    workdir,
    overrides=(),
    *,
    target: int | None,
    sig=signal.SIGKILL,
    delay: float = 0.0,
    within: float | None = None,
    resume: bool = True,
    env=None,
    timeout: float = 600,
) -> dict:
    """Start the run and send `sig` `delay` s after step `target` is logged, or `within` s
    after launch if that comes first (None: no such limit); wait for the run to end.
    Returns what happened."""
    workdir = Path(workdir)
    ckpt = workdir / "checkpoints"
    before = committed_steps(ckpt)
    stale = max(logged_steps(workdir), default=0)
    if target is not None and target <= stale:
        raise ValueError(f"target step {target} is not above the {stale} already logged in {workdir}")
    launched = time.time_ns()
    proc = launch(config, workdir, overrides, resume=resume, env=env)
    reached = None
    try:
        if target is not None:
            try:
                reached = wait_for_step(proc, workdir, target, timeout if within is None else within)
            except TimeoutError:
                if within is None:
                    raise
            else:
                if delay:
                    time.sleep(delay)
        elif within is not None:
            time.sleep(within)
        children = []
        if proc.poll() is None:
            children = descendants(proc.pid)  # e.g. data workers, which must not outlive the run
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    metrics = workdir / "metrics.jsonl"
    wrote = metrics.exists() and metrics.stat().st_mtime_ns >= launched  # this run got to its MetricsWriter
    resumed_from = before[-1] if (resume and before) else 0
    last = max(logged_steps(workdir), default=0) if wrote else None
    return {
        "rc": proc.returncode,
        "stdout": out,
        "stderr": err,
        "target": target,
        "reached": reached,
        "resumed_from": resumed_from,
        # last step this run logged (None: killed before its first step)
        "killed_at": last if last is not None and last > resumed_from else None,
        "checkpoints_after": committed_steps(ckpt),
        "inflight_after": inflight_saves(ckpt),
        "children": len(children),
        # processes the run had started that are still alive 10 s after it ended
        "outlived": still_running(children) if sig == signal.SIGKILL else [],
    }


# --------------------------------------------------------------------------------------------
# The final state, read back in-process.


def load_state(config, workdir, overrides=()) -> tuple[dict, int, list[str]]:
    """The newest checkpoint of `workdir`, restored as the CLI's --resume would (same build):
    ({leaf name: host numpy array}, restored step, restore fallback notes)."""
    import jax
    import numpy as np

    from meshpar import config as config_lib
    from meshpar import experiment as experiment_lib
    from meshpar.checkpoint import _path_name

    cfg = config_lib.load(config, [*overrides, f"workdir={workdir}", "checkpoint.resume=auto"])
    exp = experiment_lib.build(cfg)
    try:
        skipped = list(exp.checkpointer.skipped) if exp.checkpointer else []
        flat, _ = jax.tree_util.tree_flatten_with_path(exp.state)
        leaves = {_path_name(path): np.asarray(jax.device_get(x)) for path, x in flat}
        return leaves, int(exp.state.step), skipped
    finally:
        if exp.checkpointer:
            exp.checkpointer.close()


def compare_states(a: dict, b: dict) -> tuple[bool, int, list[str]]:
    """Bit-for-bit (dtype, shape and raw bytes) over every leaf: (identical, leaves compared, differing)."""
    import numpy as np

    differ = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        same = x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) and x.tobytes() == y.tobytes()
        if not same:
            differ.append(name)
    return not differ, len(set(a) & set(b)), differ


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

    sys.path.insert(0, str(REPO))
    from meshpar import config as config_lib

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
    (root / "kill_resume.json").write_text(json.dumps(report, indent=2) + "\n")
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

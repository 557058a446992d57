"""A lost peer: two processes train, one is SIGKILLed, and the survivor says so.

    python scripts/lost_peer.py                         # experiments/mlp_model_parallel.yaml, process 1 killed
    python scripts/lost_peer.py --victim 0              # the coordination service's process instead
    python scripts/lost_peer.py distributed.heartbeat_timeout_seconds=5

Starts two processes of the config on this host (CPU devices, gloo), waits for their first
committed checkpoint and one second more, SIGKILLs `--victim`, and reports the survivor: its
exit status, the seconds from the kill to its end, and its last stderr line. A killed process
cannot tell anyone, so the survivor learns of it from meshpar's own heartbeat check
(meshpar.processes.liveness) or, failing that, from jax's abort (exit 134 and a C++ stack trace).

Prints a table, writes ``<workdir>/lost_peer.json``. Exit status 0 only if the survivor ended
with exit 1 and one ``training error: lost ...`` line naming the last checkpoint, within
``distributed.heartbeat_timeout_seconds`` + 5 s of the kill (its check reads once a second).
Trailing ``section.key=value`` overrides apply to both processes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import common
from train_runs import command, free_port

from meshpar.checkpoints.rundir import committed_steps

OVERRIDES = ("train.steps=100000", "train.log_every=1", "checkpoint.every=10", "train.progress=false")
MARGIN_S = 5.0  # beyond the heartbeat timeout: the check reads about once a second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/mlp_model_parallel.yaml")
    parser.add_argument("--workdir", default="runs/lost_peer")
    parser.add_argument("--victim", type=int, choices=(0, 1), default=1, help="the process to SIGKILL")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    heartbeat = 10  # meshpar's default, unless overridden
    for item in args.overrides:
        key, _, value = item.partition("=")
        if key == "distributed.heartbeat_timeout_seconds":
            heartbeat = int(value)
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    distributed = ["distributed.num_processes=2", f"distributed.coordinator={coordinator}"]
    procs = [
        subprocess.Popen(
            command(args.config, workdir, [*OVERRIDES, *distributed, f"distributed.process_id={i}", *args.overrides]),
            cwd=common.REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    checkpoints = workdir / "checkpoints"
    started = time.monotonic()
    while not committed_steps(checkpoints):
        if any(p.poll() is not None for p in procs) or time.monotonic() - started > 300:
            for p in procs:
                p.kill()
            print("lost_peer: the run ended or stalled before its first checkpoint:", procs[0].communicate()[1][-2000:])
            return 1
        time.sleep(0.05)
    time.sleep(1.0)
    procs[args.victim].kill()
    killed = time.monotonic()
    survivor = 1 - args.victim
    try:
        _, err = procs[survivor].communicate(timeout=300)
    except subprocess.TimeoutExpired:
        procs[survivor].kill()
        _, err = procs[survivor].communicate()
    took = time.monotonic() - killed
    procs[args.victim].communicate()
    lines = err.strip().splitlines()
    last = lines[-1] if lines else ""
    newest = committed_steps(checkpoints)[-1]
    expected_end = f"last checkpoint: step {newest} in {checkpoints}"
    ok = (
        procs[survivor].returncode == 1
        and last.startswith("training error: lost ")
        and expected_end in last
        and "Traceback" not in err
        and took <= heartbeat + MARGIN_S
    )
    result = {
        "config": args.config, "killed": args.victim, "survivor": survivor, "heartbeat_timeout_s": heartbeat,
        "exit_status": procs[survivor].returncode, "seconds_to_end": round(took, 2), "last_line": last,
        "stderr_lines": len(lines), "newest_checkpoint": newest, "target_s": heartbeat + MARGIN_S, "ok": ok,
    }  # fmt: skip
    common.write_json(workdir / "lost_peer.json", result)
    print(f"{'killed':>8} {'survivor':>9} {'exit':>5} {'ended after':>12}  last line")
    print(f"{args.victim:>8} {survivor:>9} {procs[survivor].returncode:>5} {took:>10.1f} s  {last}")
    print(f"stderr lines: {len(lines)}; target: exit 1, one 'training error: lost ...' line naming step {newest}, "
          f"within {heartbeat + MARGIN_S:.0f} s: {'met' if ok else 'MISSED'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

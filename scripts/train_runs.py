"""``python -m meshpar.train`` driven from outside, as a user or a scheduler drives it: build its
command line, launch it, run it to the end, or kill it at a chosen moment; read what a run
leaves (its logged steps and losses, its committed and half-written saves, the processes it
started) without touching any of it; restore its newest checkpoint in this process and compare
two train states bit for bit.

Used by ``scripts/kill_resume.py``, ``scripts/lost_peer.py``, ``scripts/bench_startup.py`` and
``scripts/precision_check.py``, and by the tests of kills, signals and workers (which load it
through ``tests.support``). A module, not a script.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import common
import numpy as np

from meshpar.checkpoints.checkpoint import _path_name
from meshpar.checkpoints.rundir import (
    committed_steps,  # also for callers: the library's own reading of a checkpoint folder
)
from meshpar.configuration import config as config_lib
from meshpar.run import experiment as experiment_lib
from meshpar.run.metrics import read_jsonl

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
    """(step, loss) of every row of a finished run's ``metrics.jsonl``."""
    return [(r["step"], r["loss"]) for r in read_jsonl(Path(workdir) / "metrics.jsonl")]


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
    """The train command line: the overrides, then the workdir (so it wins), then ``--resume``."""
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


def free_port() -> int:
    """A TCP port free on this host now (for a run's ``distributed.coordinator``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config, workdir, overrides=(), resume=True, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        command(config, workdir, overrides, resume),
        cwd=common.REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_to_end(config, workdir, overrides=(), resume=False, env=None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(config, workdir, overrides, resume),
        cwd=common.REPO,
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
    import jax  # not at the top: meshpar first, which quiets jax's CUDA plugin on a host without a GPU

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
    differ = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        same = x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) and x.tobytes() == y.tobytes()
        if not same:
            differ.append(name)
    return not differ, len(set(a) & set(b)), differ

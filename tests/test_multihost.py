"""Two processes on jax.distributed (CPU devices, gloo collectives) train like one, stop on a
signal together, and resume after being killed bit-identically to a run never stopped.

The CLI runs in subprocesses; the helpers here are also used by tests/test_distributed.py.
"""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from meshpar import train
from meshpar.configuration import config
from meshpar.run.metrics import read_jsonl
from tests.support import script

REPO = Path(__file__).resolve().parents[1]
runs = script("train_runs")
free_port = runs.free_port  # also test_distributed's

CONFIG = """
mesh: data:4,model:2
layout: batch:data; hidden:model
model: {name: mlp, hidden: [64, 32]}
data: {num_examples: 2048, num_eval_examples: 0, num_features: 32}
optimizer: {learning_rate: 0.003}
train: {steps: 12, batch_size: 64, log_every: 1, progress: false}
hardware: {peak_tflops: 1.0}  # for MFU only; skips measuring this CPU's matmul rate (~3 s a run)
"""
# Short distributed timeouts: a test that goes wrong fails in seconds, not minutes.
FAST = (
    "distributed.initialization_timeout=30",
    "distributed.heartbeat_timeout_seconds=5",
    "distributed.shutdown_timeout_seconds=10",
)
EVERY = 4  # checkpoint cadence of the reference run and of the killed one
STOPPED = r"stopped by SIGTERM at step (\d+); checkpoint saved at step (\d+)"


def launch(path, workdir, *overrides, env, each=((), ()), resume=False) -> list[subprocess.Popen]:
    """Two CLI processes of one run; `each[i]` are process i's own extra overrides."""
    port = free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshpar.train",
                "--config",
                str(path),
                f"workdir={workdir}",
                *FAST,
                *overrides,
                "distributed.num_processes=2",
                f"distributed.process_id={i}",
                f"distributed.coordinator=127.0.0.1:{port}",
                *each[i],
                *(["--resume"] if resume else []),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]


def finish(procs, timeout: float = 240) -> list[tuple[int, str]]:
    """(exit status, stderr) of each process; fails (and kills them all) if one runs past `timeout`."""
    deadline, results = time.monotonic() + timeout, []
    try:
        for i, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"process {i} of {len(procs)} still running after {timeout} s")
            results.append((p.returncode, err or ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def wait_until(condition, procs, timeout: float = 120) -> None:
    """Poll until `condition()`; fails if a process ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p.returncode for p in procs if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            errs = [p.communicate()[1][-1500:] for p in procs]
            pytest.fail(f"condition not reached (exits {ended}): {errs}")
        time.sleep(0.005)


def run_two(path, workdir, *overrides, env, resume=False) -> None:
    for rc, err in finish(launch(path, workdir, *overrides, env=env, resume=resume)):
        assert rc == 0, err[-2000:]
        # Nothing reported: the stop-together watcher stayed quiet through a normal finish.
        assert "Traceback" not in err and not re.search(r"^\w+ error: ", err, re.M), err[-2000:]


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("multihost") / "cfg.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def single(cfg_path, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("single") / "run"
    train.run(config.load(cfg_path, [f"workdir={workdir}"]))
    return [r["loss"] for r in read_jsonl(workdir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(cfg_path, env, tmp_path_factory):
    """Two processes, uninterrupted, direct feeding, checkpointing: (final state leaves, workdir)."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    run_two(cfg_path, workdir, f"checkpoint.every={EVERY}", env=env)
    state, step, _ = runs.load_state(cfg_path, workdir)  # in this process, one process, same mesh
    assert step == 12
    return state, workdir


def test_two_processes_train_like_one_in_both_feed_modes(single, reference, cfg_path, env, tmp_path):
    direct = [r["loss"] for r in read_jsonl(reference[1] / "metrics.jsonl")]
    run_two(cfg_path, tmp_path / "routed", "feed.mode=routed", env=env)
    routed = [r["loss"] for r in read_jsonl(tmp_path / "routed" / "metrics.jsonl")]
    assert direct == routed  # each process routes its own rows through its own relay: same arrays
    assert len(direct) == len(single) == 12
    # Gloo's all-reduce sums in another order than the in-process one: equal up to that.
    np.testing.assert_allclose(direct, single, rtol=1e-6)
    assert (reference[1] / "metrics.jsonl").read_text().count('"step": 1,') == 1  # one process writes


def test_sigterm_to_one_process_stops_both_at_one_step_and_saves_it(cfg_path, env, tmp_path):
    workdir = tmp_path / "run"
    # Enough steps that the signal lands mid-run; no periodic save before it.
    procs = launch(cfg_path, workdir, "train.steps=400", "checkpoint.every=200", env=env)
    wait_until(lambda: max(runs.logged_steps(workdir), default=0) >= 2, procs)  # rows come from process 0
    procs[1].send_signal(signal.SIGTERM)
    results = finish(procs)
    steps = []
    for i, (rc, err) in enumerate(results):
        lines = err.strip().splitlines()
        assert rc == 128 + signal.SIGTERM and len(lines) == 1, f"process {i} exited {rc}: {err[-2000:]}"
        m = re.fullmatch(STOPPED, lines[0])
        assert m and m[1] == m[2], lines[0]
        steps.append(int(m[1]))
    assert steps[0] == steps[1] < 400  # both stopped at the step the flag reached them, together
    assert runs.committed_steps(workdir / "checkpoints")[-1] == steps[0]  # the line said so: it is saved
    assert max(runs.logged_steps(workdir)) == steps[0]


def test_both_killed_after_a_checkpoint_then_resumed_end_bit_identical(reference, cfg_path, env, tmp_path):
    # Killed while each process's batches come from 2 worker processes of its own, resumed with
    # none: the data position is the step, whoever assembles the batches.
    workdir, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    procs = launch(cfg_path, workdir, f"checkpoint.every={EVERY}", "data.workers=2", env=env)
    wait_until(lambda: bool(runs.committed_steps(ckpt)), procs)  # step 4 committed; 8 steps to go
    children = [pid for p in procs for pid in runs.descendants(p.pid)]
    for p in procs:
        p.kill()
    assert [rc for rc, _ in finish(procs)] == [-signal.SIGKILL] * 2
    assert len(children) >= 4 and runs.still_running(children) == []  # no worker outlives its process
    killed_at = max(runs.logged_steps(workdir))
    assert EVERY <= runs.committed_steps(ckpt)[-1] < 12 and killed_at < 12
    run_two(cfg_path, workdir, f"checkpoint.every={EVERY}", env=env, resume=True)
    state, step, skipped = runs.load_state(cfg_path, workdir)
    assert step == 12 and not skipped
    identical, n, differ = runs.compare_states(reference[0], state)
    assert identical and n == len(reference[0]) > 0, f"leaves differing from the uninterrupted run: {differ}"
    assert runs.losses(workdir) == runs.losses(reference[1])  # the killed run's later rows were redone, same bits

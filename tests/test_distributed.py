"""When one process of a multi-process run fails, every process ends, in bounded time, with a
non-zero status and (where Python gets control) one line saying what happened.

Timeouts here are short (seconds); the bounds the tests check are generous (tens of seconds),
and still far below what jax's own defaults take (minutes).
"""

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshpar.checkpoints import rundir
from meshpar.processes import liveness
from tests.test_multihost import CONFIG, REPO, finish, free_port, launch, wait_until

START_FAIL_TIMEOUT = 3  # distributed.initialization_timeout of the start-up failure tests


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("distributed") / "cfg.yaml"
    path.write_text(CONFIG)
    return path


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_a_preflight_error_on_one_process_ends_every_process(cfg_path, env, tmp_path):
    # Process 1 alone reads a corpus folder that does not exist: a data error raised after the
    # processes joined, while process 0 goes on building and waits for process 1 in a collective.
    missing = tmp_path / "no_such_corpus"
    procs = launch(cfg_path, tmp_path / "run", env=env, each=((), ("data.source=text", f"data.corpus_dir={missing}")))
    (rc0, err0), (rc1, err1) = finish(procs, timeout=90)
    own = f"data error: corpus_dir does not exist: {missing}"
    assert (rc1, _one_line(err1)) == (2, own)
    assert (rc0, _one_line(err0)) == (2, f"{own} (on process 1)")


def _catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: SigCgt in /proc/<pid>/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)[1], 16)
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_during_start_up_ends_both_processes(cfg_path, env, tmp_path):
    # Right after joining, long before the train loop: jax's preemption notifier used to catch
    # this SIGTERM and drop it (the run trained to the end and exited 0).
    procs = launch(cfg_path, tmp_path / "run", env=env)
    wait_until(lambda: _catches(procs[1].pid, signal.SIGTERM), procs)  # no handler before the join
    procs[1].send_signal(signal.SIGTERM)
    (rc0, err0), (rc1, err1) = finish(procs, timeout=90)
    line = "stopped by SIGTERM at once, not at a step: no checkpoint saved for it"
    assert (rc1, _one_line(err1)) == (143, line)
    assert (rc0, _one_line(err0)) == (143, f"{line} (on process 1)")


def test_a_killed_peer_is_named_by_the_survivor_with_the_last_checkpoint(cfg_path, env, tmp_path):
    # SIGKILL leaves process 1 no chance to tell anyone, and gloo does not report its closed
    # connection: process 0's collective would wait until jax's coordination service missed
    # process 1's heartbeats, and jax would abort process 0 (134, a C++ stack trace).
    # meshpar's own liveness check ends it first, in one line, with exit status 1.
    workdir, heartbeat = tmp_path / "run", 3
    checkpoints = workdir / "checkpoints"
    procs = launch(
        cfg_path,
        workdir,
        "train.steps=100000",
        "checkpoint.every=3",
        f"distributed.heartbeat_timeout_seconds={heartbeat}",
        env=env,
    )
    # Saves and their compiles on the way: the check does not fire while both are alive.
    wait_until(lambda: len(rundir.committed_steps(checkpoints)) >= 2, procs)
    procs[1].kill()
    killed = time.monotonic()
    rc1 = procs[1].wait()
    ((rc0, err0),) = finish(procs[:1], timeout=60)
    took = time.monotonic() - killed
    assert rc1 == -signal.SIGKILL
    last = err0.strip().splitlines()[-1]
    m = re.fullmatch(
        rf"training error: lost process 1 \(no heartbeat for (\d+) s\); "
        rf"last checkpoint: step (\d+) in {re.escape(str(checkpoints))}",
        last,
    )
    assert rc0 == 1 and m, f"exit {rc0}: {err0[-3000:]}"
    assert heartbeat <= int(m[1]) <= heartbeat + 3  # the timeout, and a read or two late at most
    assert int(m[2]) == rundir.committed_steps(checkpoints)[-1]  # what --resume would start from
    assert "Traceback" not in err0 and "detected fatal errors" not in err0, err0[-3000:]
    # Before jax's own abort could come: jax declares a process dead half its heartbeat
    # timeout after its last beat at the earliest (and the old code, with jax's timeout at
    # `heartbeat`, ended here with exit 134).
    assert took < liveness.jax_heartbeat_timeout(heartbeat) / 2, took


def _alone(cfg_path, env, workdir, process_id, coordinator):
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "meshpar.train",
            "--config",
            str(cfg_path),
            f"workdir={workdir}",
            "distributed.num_processes=2",
            f"distributed.process_id={process_id}",
            f"distributed.coordinator={coordinator}",
            f"distributed.initialization_timeout={START_FAIL_TIMEOUT}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


# A peer that joins but never starts its devices: jax's own join, then nothing.
_JOINS_AND_HANGS = """
import sys, time, jax
jax.config.update("jax_enable_preemption_service", False)
jax.distributed.initialize(sys.argv[1], 2, 1, initialization_timeout=60, heartbeat_timeout_seconds=60)
time.sleep(120)
"""


def test_start_up_failures_end_within_the_timeout_with_one_line(cfg_path, env, tmp_path):
    # Three runs at once, each waiting out its own 3 s: jax alone would wait 300 s (2 to 5 min
    # more for devices), then abort with a C++ stack trace.
    closed = free_port()  # nothing listens there
    hang_port = free_port()
    started = time.monotonic()
    procs = {
        "no peer": _alone(cfg_path, env, tmp_path / "a", 0, f"127.0.0.1:{free_port()}"),
        "no coordinator": _alone(cfg_path, env, tmp_path / "b", 1, f"127.0.0.1:{closed}"),
        "no devices": _alone(cfg_path, env, tmp_path / "c", 0, f"127.0.0.1:{hang_port}"),
        "hangs": subprocess.Popen(
            [sys.executable, "-c", _JOINS_AND_HANGS, f"127.0.0.1:{hang_port}"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    }
    results = dict(zip(procs, finish(list(procs.values()), timeout=60)))
    assert time.monotonic() - started < 60
    expected = {
        "no peer": r"not all 2 processes joined the coordinator at 127\.0\.0\.1:\d+ within 3 s .*a process never came",
        "no coordinator": rf"process 1 cannot reach the coordinator at 127\.0\.0\.1:{closed} \(connection refused\) "
        r"within 3 s .*",
        "no devices": r"process 0: the 2 processes joined, but not all of them started their devices within 3 s .*",
    }
    for name, pattern in expected.items():
        rc, err = results[name]
        line = _one_line(err)
        assert rc == 2 and re.fullmatch(f"distributed error: {pattern}", line), f"{name}: exit {rc}: {err[-2000:]}"
    assert results["hangs"][0] != 0  # its coordinator (process 0 of "no devices") went away: jax aborts it

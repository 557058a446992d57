"""Faults at the CLI level, as a user meets them: kill -9 (also mid-save), SIGTERM / SIGINT,
a damaged newest checkpoint, a loss gone NaN. Every interrupted run, once resumed, must end
bit-identical (every leaf of step, params, opt_state, rng) to the uninterrupted run.

The CLI runs in subprocesses (the helpers come from scripts/train_runs.py); one test runs the
train loop in-process, to land a signal at an exact point.
"""

import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from meshpar.checkpoints.checkpoint import Checkpointer
from meshpar.configuration import config
from meshpar.processes import stop
from meshpar.run import experiment, loop
from tests.support import script

REPO = Path(__file__).resolve().parents[1]
runs = script("train_runs")

# When a restore fails on one array, tensorstore may complete the other reads after orbax has
# closed its event loop; the callback's "Event loop is closed" is harmless but unraisable.
pytestmark = pytest.mark.filterwarnings("ignore:Exception ignored in. None:pytest.PytestUnraisableExceptionWarning")

STEPS, EVERY = 30, 3
TINY = f"""
mesh: data:4,model:2
layout: batch:data; hidden:model
model: {{name: mlp, hidden: [64, 32]}}
data: {{num_examples: 4096, num_eval_examples: 256, num_features: 64}}
optimizer: {{learning_rate: 0.003}}
train: {{steps: {STEPS}, batch_size: 64, log_every: 1, progress: false}}
checkpoint: {{every: {EVERY}}}
"""
STOPPED = r"stopped by {} at step (\d+); checkpoint saved at step (\d+)"


@pytest.fixture(scope="module")
def cfg_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def reference(cfg_path, env, tmp_path_factory):
    """The uninterrupted run: (final state leaves, its workdir)."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    result = runs.run_to_end(cfg_path, workdir, env=env)
    assert result.returncode == 0, result.stderr
    state, step, _ = runs.load_state(cfg_path, workdir)
    assert step == STEPS
    return state, workdir


def _assert_like_reference(reference, cfg_path, workdir, overrides=()):
    ref_state, ref_dir = reference
    state, step, skipped = runs.load_state(cfg_path, workdir, overrides)
    assert step == STEPS and not skipped
    identical, n, differ = runs.compare_states(ref_state, state)
    assert identical and n == len(ref_state) > 0, f"leaves differing from the uninterrupted run: {differ}"
    assert runs.losses(workdir) == runs.losses(ref_dir)  # rows after each kill's checkpoint were dropped, then redone
    assert not runs.inflight_saves(Path(workdir) / "checkpoints")


def _resume(cfg_path, workdir, env, overrides=()):
    result = runs.run_to_end(cfg_path, workdir, overrides, resume=True, env=env)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stderr.splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------
# kill -9


# The routed variant is `-m slow` (and `python scripts/kill_resume.py feed.mode=routed
# feed.prefetch=0`): feeding does not touch what a kill can damage, and the suite keeps its time.
@pytest.mark.parametrize(
    "feed",
    [
        ["feed.mode=direct"],
        pytest.param(["feed.mode=routed", "feed.prefetch=0"], marks=pytest.mark.slow),
        ["data.workers=2"],
    ],
    ids=["direct", "routed-prefetch0", "workers2"],
)
def test_kill9_cycles_then_resume_is_bit_identical(reference, cfg_path, env, tmp_path, feed):
    # Routed feeding trains bit-identically to direct (tests/test_trainer.py), and worker
    # processes assemble the same batches as the training process, so one uninterrupted run
    # (direct, no workers) is the reference for all. With workers, the last run resumes with
    # none: the data position in a checkpoint does not depend on them.
    workdir, rng = tmp_path / "run", random.Random(f"kill9 {feed}")
    workers = "data.workers=2" in feed
    for cycle in range(3):
        last = max(runs.logged_steps(workdir), default=0)
        target = rng.randint(last + 1, last + max((STEPS - 6 - last) // (3 - cycle), 1))
        rec = runs.interrupt(
            cfg_path, workdir, feed, target=target, delay=rng.choice([0.0, rng.uniform(0, 0.02)]), env=env
        )
        assert rec["rc"] == -signal.SIGKILL, rec["stderr"]
        assert rec["killed_at"] >= target and max(rec["checkpoints_after"], default=0) <= rec["killed_at"]
        if workers:  # the run had its workers (and their resource tracker) when it was killed; none outlives it
            assert rec["children"] >= 2
        assert rec["outlived"] == []
    final = [f for f in feed if f != "data.workers=2"] if workers else feed
    assert _resume(cfg_path, workdir, env, final) == []
    _assert_like_reference(reference, cfg_path, workdir, final)


def test_kill9_while_a_save_is_in_flight_keeps_the_previous_one(reference, cfg_path, env, tmp_path):
    # The row of a checkpoint step is written after its save has started (async: the files
    # are still being written by orbax's thread). Kill right then.
    # On a busy machine the kill can come after the commit; then nothing was in flight and the
    # attempt says nothing about mid-save kills, so it is made again (a few times at most).
    for attempt in range(4):
        workdir = tmp_path / f"run{attempt}"
        rec = runs.interrupt(cfg_path, workdir, target=3 * EVERY, env=env)
        assert rec["rc"] == -signal.SIGKILL and rec["killed_at"] >= 3 * EVERY
        inflight = [int(name.split(".")[0]) for name in rec["inflight_after"]]
        if inflight:
            break
    assert inflight, f"the save had already committed ({rec['checkpoints_after']}) in every attempt"
    newest = rec["checkpoints_after"][-1]
    assert newest < min(inflight) and newest >= 2 * EVERY  # the one before is committed, the new one is not
    assert _resume(cfg_path, workdir, env) == []  # from `newest`: no fallback needed, nothing unreadable
    _assert_like_reference(reference, cfg_path, workdir)


def test_resume_of_a_finished_run_is_a_no_op(reference, cfg_path, env, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(reference[1], workdir)
    result = runs.run_to_end(cfg_path, workdir, resume=True, env=env)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr


# ----------------------------------------------------------------------------------------------
# SIGTERM / SIGINT


_stopped = {}


@pytest.fixture(scope="module")
def stopped(cfg_path, env, tmp_path_factory):
    """stopped(sig): a fresh run sent `sig` after step 10 (once per module); (record, workdir).
    Tests copy the workdir before touching it."""

    def get(sig):
        if sig not in _stopped:
            workdir = tmp_path_factory.mktemp(sig.name) / "run"
            _stopped[sig] = runs.interrupt(cfg_path, workdir, target=10, sig=sig, resume=False, env=env), workdir
        return _stopped[sig]

    return get


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_saves_exits_128_plus_signum_and_resumes_bit_identical(
    reference, cfg_path, env, tmp_path, stopped, sig
):
    rec, saved = stopped(sig)
    assert rec["rc"] == 128 + sig, rec["stderr"]  # 143 / 130
    lines = rec["stderr"].strip().splitlines()
    assert len(lines) == 1, rec["stderr"]
    m = re.fullmatch(STOPPED.format(sig.name), lines[0])
    assert m and m[1] == m[2], lines[0]
    step = int(m[1])
    assert 10 <= step < STEPS and step == rec["killed_at"]  # its row is the last one
    assert not rec["inflight_after"]  # the save finished before the exit
    assert rec["checkpoints_after"][-1] == step  # the line said so: the checkpoint exists
    workdir = tmp_path / "run"
    shutil.copytree(saved, workdir)
    assert _resume(cfg_path, workdir, env) == []
    _assert_like_reference(reference, cfg_path, workdir)


def test_stop_signal_after_the_save_call_still_saves(tmp_path, monkeypatch):
    # In-process, to land the signal deterministically after a step's save call: during step 10's eval.
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are only installed from the main thread")
    cfg = config.load(
        REPO / "experiments" / "mlp_model_parallel.yaml",
        [
            "model.hidden=[64,32]",
            "data.num_examples=2048",
            "data.num_eval_examples=256",
            "data.num_features=48",
            "train.steps=20",
            "train.batch_size=32",
            "train.log_every=1",
            "train.eval_every=10",
            "train.progress=false",
            "checkpoint.every=3",
            f"workdir={tmp_path / 'run'}",
        ],
    )
    exp, evaluate = experiment.build(cfg), loop.evaluate

    def evaluate_then_signal(exp, state):
        if int(state.step) == 10:
            os.kill(os.getpid(), signal.SIGTERM)
        return evaluate(exp, state)

    monkeypatch.setattr(loop, "evaluate", evaluate_then_signal)
    with pytest.raises(stop.Interrupted) as stopped:
        loop.train(exp)
    # The flag set during step 10's eval rides into step 11, whose results are read a step late
    # (meshpar.run.loop), once step 12 has taken its state: every process stops at 12 and saves it.
    assert stopped.value.step == 12 and stopped.value.saved
    assert 12 in exp.checkpointer.steps(), (
        f"'checkpoint saved at step 12', yet the checkpoints are {exp.checkpointer.steps()}"
    )


# ----------------------------------------------------------------------------------------------
# A damaged newest checkpoint


def _garble(step_dir: Path):
    """Overwrite the middle third of the largest array data file of the checkpoint."""
    files = sorted(
        (p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
        key=lambda p: -p.stat().st_size,
    )
    assert files, f"no data files under {step_dir / 'state'}"
    data = files[0].read_bytes()
    third = len(data) // 3
    files[0].write_bytes(data[:third] + np.random.default_rng(0).bytes(third) + data[2 * third :])


_damaged = {}


@pytest.fixture(scope="module", params=["garbage", "no-manifest"])
def damaged(request, cfg_path, env, tmp_path_factory, stopped):
    """The SIGTERMed run, its newest checkpoint damaged, resumed to the end (once per kind):
    (kind, workdir, newest step, the one before, the resumed run's stderr lines)."""
    how = request.param
    if how not in _damaged:
        _, saved = stopped(signal.SIGTERM)
        workdir = tmp_path_factory.mktemp(how) / "run"
        shutil.copytree(saved, workdir)
        steps = runs.committed_steps(workdir / "checkpoints")
        if how == "garbage":
            _garble(workdir / "checkpoints" / str(steps[-1]))
        else:
            (workdir / "checkpoints" / str(steps[-1]) / "state" / "manifest.ocdbt").unlink()
        result = runs.run_to_end(cfg_path, workdir, resume=True, env=env)
        assert result.returncode == 0, result.stderr
        _damaged[how] = how, workdir, steps[-1], steps[-2], result.stderr
    return _damaged[how]


def test_damaged_newest_checkpoint_falls_back_and_still_ends_bit_identical(reference, cfg_path, damaged):
    _, workdir, newest, before, stderr = damaged
    # Searched in the whole text: other output (see the next test) may even break into the line.
    notes = re.findall(
        r"checkpoint: step (\d+) is damaged \((.+?)\); kept as (\S+); falling back to step (\d+)", stderr
    )
    assert [(int(a), c, int(d)) for a, _, c, d in notes] == [(newest, f"{newest}.damaged", before)], stderr
    _assert_like_reference(reference, cfg_path, workdir)
    assert (Path(workdir) / "checkpoints" / f"{newest}.damaged").is_dir()  # kept, never deleted


def test_damaged_newest_checkpoint_says_only_what_happened(damaged):
    kind, _, newest, _, stderr = damaged
    lines = stderr.strip().splitlines()
    why = (
        "state/manifest.ocdbt is missing" if kind == "no-manifest" else r"state/\S+ holds other bytes than were written"
    )
    assert len(lines) == 1 and re.fullmatch(rf"checkpoint: step {newest} is damaged \({why}\); .*", lines[0]), stderr


# ----------------------------------------------------------------------------------------------
# NaN guard

NAN = [
    "optimizer.name=sgd",
    "optimizer.learning_rate=1e30",
    "optimizer.b1=0",
    "checkpoint.every=1",
    "checkpoint.keep=0",
]
NAN_LINE = (
    r"training error: step (\d+): loss is (nan|inf|-inf), gradient norm is \S+(; last good checkpoint: step (\d+))?"
)


@pytest.fixture(scope="module")
def nan_run(cfg_path, env, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("nan") / "run"
    return runs.run_to_end(cfg_path, workdir, NAN, env=env), workdir


def test_non_finite_loss_exits_1_and_every_checkpoint_left_is_finite(cfg_path, nan_run, tmp_path):
    result, original = nan_run
    workdir = shutil.copytree(original, tmp_path / "run")  # checkpoints are removed one by one below
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    m = re.fullmatch(NAN_LINE, lines[0])
    assert m, lines[0]
    kept = runs.committed_steps(workdir / "checkpoints")
    assert kept and max(kept) < int(m[1]) and not runs.inflight_saves(workdir / "checkpoints")
    # Every checkpoint left restores (newest first; each then removed) to finite values.
    exp = experiment.build(config.load(cfg_path, [*NAN, "checkpoint.every=0", f"workdir={tmp_path / 'target'}"]))
    target = (
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), exp.state),
        jax.tree.map(lambda x: x.sharding, exp.state),
    )
    for step in reversed(kept):
        with Checkpointer(workdir / "checkpoints", every=0, keep=0) as ckpt:
            restored = ckpt.restore(*target)
        assert restored.step == step and not ckpt.skipped
        for leaf in jax.tree.leaves((restored.state.params, restored.state.opt_state)):
            assert np.isfinite(np.asarray(leaf)).all(), f"non-finite values in the checkpoint of step {step}"
        shutil.rmtree(workdir / "checkpoints" / str(step))


def test_non_finite_loss_names_the_newest_checkpoint(nan_run):
    result, workdir = nan_run
    m = re.fullmatch(NAN_LINE, result.stderr.strip())
    assert m and m[4] is not None and int(m[4]) == max(runs.committed_steps(workdir / "checkpoints")), result.stderr

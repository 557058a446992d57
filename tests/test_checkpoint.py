"""Checkpoints: bit-exact round trip, re-sharding on restore, retention, and the three ways a
restore can go wrong — verified damage (set aside, fall back), a healthy checkpoint of another
config (config error, nothing changes), a checkpoint that cannot be read right now (checkpoint
error, nothing changes) — plus half-written and failed saves."""

import errno
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshpar.checkpoints import integrity
from meshpar.checkpoints.checkpoint import Checkpointer, CheckpointError, Codec
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.processes.stop import make_flags
from meshpar.run import experiment
from meshpar.sharding import stages as pipeline
from meshpar.step import parts
from meshpar.step.trainer import TrainState

REPO = Path(__file__).resolve().parents[1]

# When a restore fails on one array, tensorstore may complete the other reads after orbax has
# closed its event loop; the callback's "Event loop is closed" is harmless but unraisable.
pytestmark = pytest.mark.filterwarnings("ignore:Exception ignored in. None:pytest.PytestUnraisableExceptionWarning")


def _cfg(mesh="data:8", layout="batch:data", hidden=(64, 32)):
    return config.from_dict(
        {
            "mesh": mesh,
            "layout": layout,
            "model": {"name": "mlp", "hidden": list(hidden)},
            "data": {"num_examples": 512, "num_eval_examples": 64, "num_features": 48},
            "train": {"steps": 20, "batch_size": 32, "progress": False},
        }
    )


def _target(exp):
    """(abstract state, shardings) of an experiment, as a restarted run would have them."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), exp.state)
    return abstract, jax.tree.map(lambda x: x.sharding, exp.state)


def _train(exp, state, start, stop):
    for i in range(start, stop):
        batch = exp.inputs.feeder.place(exp.inputs.train.batch(i))[0]
        state, _ = exp.train_step(state, batch, make_flags(exp.mesh, 0))  # donates state
    return state


def _position(step):
    return {"next_batch": step}


RECORD = {"config": {"train.seed": 0}, "decay_steps": 20}


def _snapshot(directory):
    """Every entry under `directory` with its bytes: what 'nothing on disk changed' compares."""
    return {
        p.relative_to(directory).as_posix(): (p.read_bytes() if p.is_file() else None)
        for p in sorted(Path(directory).rglob("*"))
    }


def _assert_equal(restored, saved):
    assert jax.tree.structure(restored) == jax.tree.structure(saved)  # incl. nnx metadata (dims)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit-exact (no NaNs here)


@pytest.fixture(scope="module")
def exp8():
    exp = experiment.build(_cfg())
    exp.target = _target(exp)  # before exp.state is donated to a train step
    return exp


@pytest.fixture(scope="module")
def saved(exp8, tmp_path_factory):
    """Checkpoints at steps 2 and 4 (saved async while training went on); host copies of both."""
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    ckpt = Checkpointer(directory, every=2, keep=3)
    state, refs = jax.tree.map(jnp.copy, exp8.state), {}
    for step in range(1, 5):
        state = _train(exp8, state, step - 1, step)
        if ckpt.maybe_save(state, _position(step), RECORD):
            refs[step] = jax.device_get(state)  # the next train step donates `state`
    ckpt.close()
    assert sorted(refs) == [2, 4]
    return directory, refs


@pytest.fixture
def copy(saved, tmp_path):
    shutil.copytree(saved[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_round_trip_is_bit_identical_in_the_target_shardings(exp8, saved, copy, capsys):
    abstract, shardings = exp8.target
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        assert ckpt.steps() == [2, 4]
        restored = ckpt.restore(abstract, shardings)
    state, step = restored.state, restored.step
    assert step == 4 and int(state.step) == 4
    assert restored.position == _position(4) and restored.record == RECORD
    _assert_equal(state, saved[1][4])
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert leaf.sharding == sharding
    assert ckpt.skipped == [] and capsys.readouterr() == ("", "")  # nothing from orbax either
    _train(exp8, state, 4, 5)  # the restored state feeds the jitted step as is


def test_every_and_force(exp8, tmp_path):
    state = jax.tree.map(jnp.copy, exp8.state)
    with Checkpointer(tmp_path / "never", every=0, keep=2) as ckpt:
        assert not ckpt.maybe_save(state, _position(0), RECORD)
        assert ckpt.maybe_save(state, _position(0), RECORD, force=True)
        assert not ckpt.maybe_save(state, _position(0), RECORD, force=True)  # step 0 already saved
        ckpt.wait()
        assert ckpt.steps() == [0]


def test_keep_two_keeps_the_two_newest(exp8, tmp_path):
    state = jax.tree.map(jnp.copy, exp8.state)
    with Checkpointer(tmp_path / "ckpt", every=1, keep=2) as ckpt:
        for step in range(1, 5):
            state = _train(exp8, state, step - 1, step)
            assert ckpt.maybe_save(state, _position(step), RECORD)
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["3", "4"]


def test_a_step_on_disk_that_this_run_did_not_save_is_never_skipped_silently(exp8, saved, copy):
    state = jax.tree.map(jnp.copy, exp8.state)
    state = _train(exp8, state, 0, 2)  # step 2, which the copied folder already holds
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        with pytest.raises(CheckpointError, match=r"step 2 already exists in .* and was not saved by this run"):
            ckpt.maybe_save(state, _position(2), RECORD)


def test_a_failed_save_ends_with_one_line_naming_the_step_and_the_last_saved(exp8, tmp_path, monkeypatch):
    # The manifest is written while orbax finishes the save: an error there (a full disk, say)
    # fails the whole save, which then never commits.
    state = jax.tree.map(jnp.copy, exp8.state)
    with Checkpointer(tmp_path / "ckpt", every=1, keep=3) as ckpt:
        state = _train(exp8, state, 0, 1)
        assert ckpt.maybe_save(state, _position(1), RECORD)
        ckpt.wait()

        def full(step_dir, step):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(integrity, "write_manifest", full)
        state = _train(exp8, state, 1, 2)
        assert ckpt.maybe_save(state, _position(2), RECORD)
        with pytest.raises(CheckpointError) as e:
            ckpt.wait()
        monkeypatch.undo()
        assert ckpt.steps() == [1] and ckpt.last_saved == 1
    assert re.fullmatch(
        r"cannot write step 2 to .*ckpt/2 \(.*No space left on device.*\); last step saved: 1", str(e.value)
    ), str(e.value)


def test_restore_reshards_into_another_mesh_and_layout(saved, copy):
    exp = experiment.build(_cfg("data:4,model:2", "batch:data; hidden:model"))
    abstract, shardings = _target(exp)
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        restored = ckpt.restore(abstract, shardings)
    state = restored.state
    assert restored.step == 4 and restored.position == _position(4)
    _assert_equal(state, saved[1][4])
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert leaf.sharding == sharding
    kernel = state.params["layers"][0]["kernel"].get_value()
    assert kernel.sharding.spec == P(None, "model") and kernel.sharding.mesh.shape == {"data": 4, "model": 2}
    assert {s.data.shape for s in kernel.addressable_shards} == {(48, 32)}
    assert state.opt_state[0].mu["layers"][0]["kernel"].get_value().sharding == kernel.sharding
    _train(exp, state, 4, 5)


def _rolled(shift):
    """A state → the same state, every leaf with more than two rows rolled by `shift` rows: with
    shift -1 the inverse of shift 1, and neither the identity nor its own inverse."""

    def roll(x):
        return jnp.roll(x, shift, axis=0) if x.ndim and x.shape[0] > 2 else x

    return lambda state: jax.tree.map(roll, state)


def test_save_and_restore_apply_the_codec_both_ways(exp8, tmp_path):
    """The checkpointer writes ``codec.to_saved(state)`` and gives back ``codec.from_saved`` of
    what it reads: the caller gets its own state back without converting anything."""
    abstract, shardings = exp8.target
    codec = Codec(jax.jit(_rolled(1), out_shardings=shardings), jax.jit(_rolled(-1), out_shardings=shardings))
    state = _train(exp8, jax.tree.map(jnp.copy, exp8.state), 0, 2)
    original = jax.device_get(state)
    with Checkpointer(tmp_path / "ckpt", every=2, keep=3, codec=codec) as ckpt:
        assert ckpt.maybe_save(state, _position(2), RECORD)
    with Checkpointer(tmp_path / "ckpt", every=2, keep=3, codec=codec) as ckpt:
        restored = ckpt.restore(abstract, shardings)
    assert restored.step == 2 and restored.position == _position(2) and not ckpt.skipped
    _assert_equal(restored.state, original)
    for leaf, sharding in zip(jax.tree.leaves(restored.state), jax.tree.leaves(shardings)):
        assert leaf.sharding == sharding
    # On disk: the saved form, in the usual format (a checkpointer without a codec reads it as
    # saved, digests verified), which is not the state itself.
    with Checkpointer(tmp_path / "ckpt", every=2, keep=3) as plain:
        raw = plain.restore(abstract, shardings).state
    _assert_equal(raw, jax.device_get(_rolled(1)(original)))
    raw = jax.device_get(raw)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(raw), jax.tree.leaves(original)))
    _train(exp8, restored.state, 2, 3)  # the restored state feeds the jitted step as is


def test_a_circular_pipeline_saves_canonical_layers_and_restores_its_own_order(tmp_path):
    """Codec.of_plan: a circular schedule stores its layers permuted; the checkpoint holds them in
    the canonical order, and restore returns them in the stored order again."""
    cfg = config.load("experiments/transformer_pipeline.yaml", ["pipeline.schedule=circular", "pipeline.repeats=2"])
    plan = parts.abstract_step(cfg).plan
    assert not plan.reorder.identity
    # Every value distinct (the optimizer's moments too, zeros after init), step 0; no compiling.
    rng = np.random.default_rng(0)

    def value(x, sharding):
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        v = rng.standard_normal(x.shape).astype(x.dtype) if floating else np.zeros(x.shape, x.dtype)
        return jax.device_put(v, sharding)

    state = jax.tree.map(value, plan.abstract, plan.shardings)
    original = jax.device_get(state)
    with Checkpointer(tmp_path / "ckpt", every=0, keep=0, codec=Codec.of_plan(plan)) as ckpt:
        assert ckpt.maybe_save(state, _position(0), RECORD, force=True)
    with Checkpointer(tmp_path / "ckpt", every=0, keep=0, codec=Codec.of_plan(plan)) as ckpt:
        restored = ckpt.restore(plan.abstract, plan.shardings)
    _assert_equal(restored.state, original)
    with Checkpointer(tmp_path / "ckpt", every=0, keep=0) as plain:
        raw = jax.device_get(plain.restore(plan.abstract, plan.shardings).state)
    # Stored position i holds canonical layer order[i]: the file's layer order[i] is the state's i.
    order = pipeline.stored_order(cfg.model.n_layers, plan.schedule)
    assert order.tolist() != list(range(cfg.model.n_layers))
    variables = functools.partial(jax.tree.leaves, is_leaf=lambda x: isinstance(x, nnx.Variable))
    permuted = 0
    for saved, kept in zip(variables(raw), variables(original)):
        if isinstance(kept, nnx.Variable) and (kept.get_metadata().get("dims") or (None,))[0] == "layers":
            np.testing.assert_array_equal(saved.get_value()[order], kept.get_value())
            permuted += 1
        else:
            np.testing.assert_array_equal(np.asarray(saved), np.asarray(kept))
    assert permuted > 0


def test_every_step_carries_a_manifest_that_verifies(saved, copy):
    for step in (2, 4):
        manifest = json.loads((copy / str(step) / integrity.MANIFEST).read_text())
        assert manifest["step"] == step and any(name.startswith("state/") for name in manifest["files"])
        integrity.verify_files(copy / str(step), step)  # raises on any difference


def _data_files(step_dir):
    """Files holding the arrays (tensorstore OCDBT data files), largest first."""
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: -p.stat().st_size)


def _corrupt(step_dir, how):
    if how == "delete":
        (step_dir / "state" / "manifest.ocdbt").unlink()
    elif how == "manifest":
        path = step_dir / integrity.MANIFEST  # a recorded size changed: fails the manifest's own digest
        text = json.loads(path.read_text())
        text["files"][next(iter(text["files"]))][0] += 1
        path.write_text(json.dumps(text))
    for path in _data_files(step_dir) if how in ("truncate", "garbage") else []:
        data = path.read_bytes()
        if how == "truncate":
            path.write_bytes(data[: len(data) // 2])
        else:
            third = len(data) // 3
            path.write_bytes(data[:third] + np.random.default_rng(0).bytes(third) + data[2 * third :])


@pytest.mark.parametrize("how", ["delete", "truncate", "garbage", "manifest"])
def test_damaged_newest_is_set_aside_and_the_one_before_restored(exp8, saved, copy, capsys, how):
    _corrupt(copy / "4", how)
    damaged = _snapshot(copy / "4")
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        assert ckpt.steps() == [2, 4]  # committed, yet damaged
        restored = ckpt.restore(*exp8.target)
        assert restored.step == 2 and restored.position == _position(2)
        _assert_equal(restored.state, saved[1][2])
        assert len(ckpt.skipped) == 1 and ckpt.skipped[0].startswith("step 4: ")
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and re.fullmatch(
            r"checkpoint: step 4 is damaged \(.+\); kept as 4\.damaged; falling back to step 2", err[0]
        ), err
        # Kept, byte for byte, out of the steps; training goes on from step 2 and saves a new 4.
        assert ckpt.steps() == [2] and _snapshot(copy / "4.damaged") == damaged
        state = _train(exp8, restored.state, 2, 4)
        assert ckpt.maybe_save(state, _position(4), RECORD)
        ckpt.wait()
        assert ckpt.steps() == [2, 4]
        again = ckpt.restore(*exp8.target)
    assert again.step == 4 and len(ckpt.skipped) == 1
    _assert_equal(again.state, jax.device_get(state))


def test_flipped_bits_never_restore_wrong_values(exp8, saved, copy, capsys):
    # zstd keeps poorly compressible float bytes as raw literals, without a checksum: a flipped
    # bit there reads back with no error from tensorstore. The manifest catches every flip; the
    # array digests would catch one the manifest missed (next test).
    path = _data_files(copy / "4")[0]
    data = path.read_bytes()
    at = len(data) // 2
    path.write_bytes(data[:at] + bytes([data[at] ^ 0x08]) + data[at + 1 :])
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        restored = ckpt.restore(*exp8.target)
    assert restored.step == 2 and ckpt.skipped == [
        "step 4: state/" + path.relative_to(copy / "4" / "state").as_posix() + " holds other bytes than were written"
    ]
    assert "falling back to step 2" in capsys.readouterr().err


def test_without_a_manifest_the_array_digests_still_catch_silent_flips(exp8, saved, tmp_path, capsys):
    # A step whose save stopped between orbax's commit and the manifest has no manifest: then
    # the digests of the arrays, saved inside the commit, decide.
    original = _data_files(saved[0] / "4")[0]
    data = original.read_bytes()
    caught = []
    # Where the arrays lie in the file depends on the order orbax's writes finished, and most
    # flips tensorstore notices itself: probe until one is silent to it (a few probes, usually).
    for at in range(len(data) // 48, len(data), len(data) // 48):
        if caught:
            break
        copy = shutil.copytree(saved[0], tmp_path / f"flip{at}")
        (copy / "4" / integrity.MANIFEST).unlink()
        path = copy / original.relative_to(saved[0])  # the same file (another may have its size)
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x08]) + data[at + 1 :])
        try:
            with Checkpointer(copy, every=2, keep=3) as ckpt:
                restored = ckpt.restore(*exp8.target)
        except CheckpointError:
            continue  # tensorstore noticed: with no manifest, damage cannot be told from I/O
        if restored.step == 4:  # the flip hit bytes no array is read from
            _assert_equal(restored.state, saved[1][4])
        else:
            assert restored.step == 2
            caught += [r for r in ckpt.skipped if r.endswith("does not match its saved digest")]
    assert caught, "no flip was silent to tensorstore: the digest check went untested"
    capsys.readouterr()


def test_all_damaged_raises_one_line_naming_the_directory(exp8, copy, capsys):
    _corrupt(copy / "4", "truncate")
    _corrupt(copy / "2", "delete")
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*ckpt \(newest: step 4: ") as e:
            ckpt.restore(*exp8.target)
    assert "\n" not in str(e.value) and str(copy) in str(e.value)
    assert capsys.readouterr().err.splitlines()[-1].endswith("; no older checkpoint")
    assert sorted(p.name for p in copy.iterdir()) == ["2.damaged", "4.damaged"]  # both kept
    with Checkpointer(copy.parent / "empty", every=2, keep=3) as ckpt:
        with pytest.raises(CheckpointError, match=r"empty \(none saved\)$"):
            ckpt.restore(*exp8.target)


def test_a_checkpoint_of_another_model_is_a_config_error_and_nothing_changes(copy, capsys):
    exp = experiment.build(_cfg(hidden=(64, 16)))
    before = _snapshot(copy)
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        with pytest.raises(ConfigError) as e:
            ckpt.restore(*_target(exp))
        assert ckpt.skipped == []
    assert str(e.value) == (
        "checkpoint: the checkpoint at step 4 holds params/layers/1/bias/value as float32[32]; "
        "this config makes it float32[16]"
    )
    assert _snapshot(copy) == before and capsys.readouterr().err == ""  # no fallback, nothing set aside


def test_a_run_record_the_caller_refuses_stops_before_any_array_is_read(exp8, copy, monkeypatch):
    def refuse(record, step):
        raise ConfigError("optimizer.learning_rate", f"changed since step {step}")

    read = []
    monkeypatch.setattr(integrity, "array_digests", lambda *a: read.append(a) or {})
    before = _snapshot(copy)
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        with pytest.raises(ConfigError, match=r"optimizer.learning_rate: changed since step 4$"):
            ckpt.restore(*exp8.target, accept=refuse)
    assert not read and _snapshot(copy) == before


@pytest.mark.parametrize("where", ["files", "arrays"])
def test_an_error_during_restore_is_a_checkpoint_error_and_nothing_changes(exp8, copy, monkeypatch, where):
    # (c) Neither damage nor a mismatch can be told: an I/O error while verifying the files, or
    # a tensorstore error reading files that match their manifest. Nothing is set aside or
    # deleted — not even by the next save.
    if where == "files":

        def failing(path):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

        monkeypatch.setattr(integrity, "_sha256", failing)
    else:
        restore = ocp.CheckpointManager.restore

        def failing(self, step, args=None, **kw):
            if "state" in args:
                raise ValueError("DEADLINE_EXCEEDED: reading ocdbt manifest timed out")
            return restore(self, step, args=args, **kw)

        monkeypatch.setattr(ocp.CheckpointManager, "restore", failing)
    before = _snapshot(copy)
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        with pytest.raises(CheckpointError) as e:
            ckpt.restore(*exp8.target)
        assert ckpt.skipped == [] and ckpt.steps() == [2, 4]
    cause = "Input/output error" if where == "files" else "DEADLINE_EXCEEDED"
    assert re.fullmatch(
        rf"step 4 in .*ckpt cannot be read \(.*{cause}.*\); nothing on disk was changed: .*", str(e.value)
    ), str(e.value)
    assert _snapshot(copy) == before


# A stand-alone saver for the process tests: a small TrainState, no model to compile.
_SAVER = textwrap.dedent(
    """
    import os, sys, threading
    os.environ["JAX_PLATFORMS"] = "cpu"
    guard = threading.Timer(60, os._exit, (3,))  # never outlive a failed test
    guard.daemon = True
    guard.start()
    import jax.numpy as jnp
    from meshpar.checkpoints import integrity
    from meshpar.checkpoints.checkpoint import Checkpointer
    from meshpar.step.trainer import TrainState

    def state(k):
        w, rng = jnp.arange(4096.0) * k, jnp.array([k, 7], jnp.uint32)
        return TrainState(step=jnp.int32(k), params={"w": w}, opt_state=(), rng=rng)

    ckpt = Checkpointer(sys.argv[1], every=1, keep=5)
    ckpt.maybe_save(state(1), {"next_batch": 1}, {})
    ckpt.wait()
    if sys.argv[2] == "kill":
        # Every item is written; hold the save where its manifest is written, before orbax
        # commits it (as a slow disk would), and get SIGKILLed there.
        def stuck(step_dir, step):
            print("writing", flush=True)
            threading.Event().wait()
        integrity.write_manifest = stuck
    ckpt.maybe_save(state(2), {"next_batch": 2}, {})
    print("saving", flush=True)
    if sys.argv[2] == "kill":
        threading.Event().wait()
    # "exit": leave without wait() or close()
    """
)


def _tiny(k):
    w, rng = jnp.arange(4096.0) * k, jnp.array([k, 7], jnp.uint32)  # as in _SAVER
    return TrainState(step=jnp.int32(k), params={"w": w}, opt_state=(), rng=rng)


def test_killed_mid_save_leaves_nothing_restorable_and_exit_finishes_or_reports_the_save(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(tmp_path / mode), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in ("kill", "exit")
    }  # both at once: the two interpreters start in parallel
    kill = procs["kill"]
    assert "writing\n" in iter(kill.stdout.readline, "")  # step 2's files are written, its commit held
    kill.send_signal(signal.SIGKILL)
    assert kill.wait(timeout=60) == -signal.SIGKILL
    _, exit_err = procs["exit"].communicate(timeout=60)
    # Python 3.11: the exit hook finishes the save (status 0); 3.12: it cannot, reports it in one
    # line and leaves with status 1 (orbax's threads would otherwise hold the exit for good).
    assert procs["exit"].returncode == (0 if sys.version_info < (3, 12) else 1), exit_err

    left = sorted(p.name for p in (tmp_path / "kill").iterdir())
    assert "2" not in left and any(name.startswith("2.orbax-checkpoint-tmp") for name in left), left
    target = _tiny(0)
    with Checkpointer(tmp_path / "kill", every=1, keep=5) as ckpt:
        assert ckpt.steps() == [1]
        restored = ckpt.restore(target)
        assert restored.step == 1 and restored.position == {"next_batch": 1} and ckpt.skipped == []
        _assert_equal(restored.state, _tiny(1))
        assert ckpt.maybe_save(_tiny(2), {"next_batch": 2}, {})  # the leftover tmp folder is no obstacle
        ckpt.wait()
        assert ckpt.steps() == [1, 2]
    assert sorted(p.name for p in (tmp_path / "kill").iterdir()) == ["1", "2"]

    # A normal exit with a save in flight. Python 3.11: Checkpointer's exit hook finishes it
    # (without it, orbax's writes fail once interpreter shutdown has begun). Python 3.12 starts
    # no thread once shutdown has begun, so nothing can finish it: the hook says so in one
    # line, and step 1 stays the newest, intact. (The train loop always closes: no save of a
    # run is ever left to the hook.)
    with Checkpointer(tmp_path / "exit", every=1, keep=5) as ckpt:
        finished = sys.version_info < (3, 12)
        assert ckpt.steps() == ([1, 2] if finished else [1])
        restored = ckpt.restore(target)
    assert restored.step == (2 if finished else 1)
    _assert_equal(restored.state, _tiny(restored.step))
    if not finished:
        lines = exit_err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("checkpoint error: cannot write step 2 to "), exit_err


def test_a_save_not_yet_committed_is_not_listed(exp8, copy, monkeypatch):
    # Hold the save where its manifest is written (every item written, not yet committed).
    holding, release = threading.Event(), threading.Event()
    write = integrity.write_manifest

    def held(step_dir, step):
        holding.set()
        release.wait(30)
        write(step_dir, step)

    monkeypatch.setattr(integrity, "write_manifest", held)
    state = jax.tree.map(jnp.copy, exp8.state)
    with Checkpointer(copy, every=1, keep=3) as ckpt:
        state = _train(exp8, state, 0, 5)
        assert ckpt.maybe_save(state, _position(5), RECORD)
        assert holding.wait(30)
        assert ckpt.steps() == [2, 4] and not (copy / "5").exists()
        assert [p.name for p in copy.iterdir() if p.name.startswith("5.")] == ["5.orbax-checkpoint-tmp"]
        release.set()
        ckpt.wait()
        assert ckpt.steps() == [2, 4, 5]


def test_asyncio_reports_of_abandoned_orbax_writes_are_dropped_and_nothing_else():
    import logging
    import sys

    from meshpar.checkpoints.checkpoint import _drop_abandoned_orbax_tasks

    def record(message, filename):
        try:
            exec(compile("raise ValueError('OUT_OF_RANGE: Error writing')", filename, "exec"))
        except ValueError:
            exc_info = sys.exc_info()
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, exc_info)

    orbax_file = "/site-packages/orbax/checkpoint/_src/serialization/serialization.py"
    gathering = (
        "_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished exception=ValueError()>"
    )
    assert not _drop_abandoned_orbax_tasks(record(gathering, orbax_file))
    task = f"Task exception was never retrieved\nfuture: <Task finished coro=<write() done, defined at {orbax_file}:1>>"
    assert not _drop_abandoned_orbax_tasks(record(task, "/elsewhere.py"))
    assert _drop_abandoned_orbax_tasks(record(gathering, "/site-packages/mylib/io.py"))  # not orbax's: kept
    assert _drop_abandoned_orbax_tasks(
        record("Executing <Task ...> took 0.2 seconds", orbax_file)
    )  # another report: kept

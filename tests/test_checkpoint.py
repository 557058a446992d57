"""Checkpoints: bit-exact round trip, re-sharding on restore, retention, and recovery from
damaged or half-written checkpoints."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshpar import config, train
from meshpar.checkpoint import Checkpointer, CheckpointError
from meshpar.trainer import TrainState

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
        state, _ = exp.train_step(state, exp.inputs.feeder.place(exp.inputs.train.batch(i))[0])  # donates state
    return state


def _position(step):
    return {"next_batch": step, "seed": 0, "batch_size": 32}


def _assert_equal(restored, saved):
    assert jax.tree.structure(restored) == jax.tree.structure(saved)  # incl. nnx metadata (dims)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit-exact (no NaNs here)


@pytest.fixture(scope="module")
def exp8():
    exp = train.build(_cfg())
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
        if ckpt.maybe_save(state, _position(step)):
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
        state, position, step = ckpt.restore(abstract, shardings)
    assert step == 4 and int(state.step) == 4
    assert position == _position(4)
    _assert_equal(state, saved[1][4])
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert leaf.sharding == sharding
    assert ckpt.skipped == [] and capsys.readouterr() == ("", "")  # nothing from orbax either
    _train(exp8, state, 4, 5)  # the restored state feeds the jitted step as is


def test_every_and_force(exp8, tmp_path):
    state = jax.tree.map(jnp.copy, exp8.state)
    with Checkpointer(tmp_path / "never", every=0, keep=2) as ckpt:
        assert not ckpt.maybe_save(state, _position(0))
        assert ckpt.maybe_save(state, _position(0), force=True)
        assert not ckpt.maybe_save(state, _position(0), force=True)  # step 0 already saved
        ckpt.wait()
        assert ckpt.steps() == [0]


def test_keep_two_keeps_the_two_newest(exp8, tmp_path):
    state = jax.tree.map(jnp.copy, exp8.state)
    with Checkpointer(tmp_path / "ckpt", every=1, keep=2) as ckpt:
        for step in range(1, 5):
            state = _train(exp8, state, step - 1, step)
            assert ckpt.maybe_save(state, _position(step))
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["3", "4"]


def test_restore_reshards_into_another_mesh_and_layout(saved, copy):
    exp = train.build(_cfg("data:4,model:2", "batch:data; hidden:model"))
    abstract, shardings = _target(exp)
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        state, position, step = ckpt.restore(abstract, shardings)
    assert step == 4 and position == _position(4)
    _assert_equal(state, saved[1][4])
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert leaf.sharding == sharding
    kernel = state.params["layers"][0]["kernel"].get_value()
    assert kernel.sharding.spec == P(None, "model") and kernel.sharding.mesh.shape == {"data": 4, "model": 2}
    assert {s.data.shape for s in kernel.addressable_shards} == {(48, 32)}
    assert state.opt_state[0].mu["layers"][0]["kernel"].get_value().sharding == kernel.sharding
    _train(exp, state, 4, 5)


def _data_files(step_dir):
    """Files holding the arrays (tensorstore OCDBT data files), largest first."""
    files = [p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: -p.stat().st_size)


def _corrupt(step_dir, how):
    if how == "delete":
        (step_dir / "state" / "manifest.ocdbt").unlink()
    for path in _data_files(step_dir):
        data = path.read_bytes()
        if how == "truncate":
            path.write_bytes(data[: len(data) // 2])
        elif how == "garbage":
            third = len(data) // 3
            path.write_bytes(data[:third] + np.random.default_rng(0).bytes(third) + data[2 * third :])


@pytest.mark.parametrize("how", ["delete", "truncate", "garbage"])
def test_damaged_newest_falls_back_to_the_one_before(exp8, saved, copy, capsys, how):
    _corrupt(copy / "4", how)
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        assert ckpt.steps() == [2, 4]  # committed, yet unreadable
        state, position, step = ckpt.restore(*exp8.target)
        assert step == 2 and position == _position(2)
        _assert_equal(state, saved[1][2])
        assert len(ckpt.skipped) == 1 and ckpt.skipped[0].startswith("step 4: ")
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("checkpoint: step 4 unreadable (")
        assert err[0].endswith("); falling back to step 2")
        # Training goes on from step 2; its new step 4 replaces the unreadable one.
        state = _train(exp8, state, 2, 4)
        assert ckpt.maybe_save(state, _position(4))
        ckpt.wait()
        assert ckpt.steps() == [2, 4]
        restored, _, step = ckpt.restore(*exp8.target)
    assert step == 4 and len(ckpt.skipped) == 1
    _assert_equal(restored, jax.device_get(state))


def test_flipped_bits_never_restore_wrong_values(exp8, saved, copy, capsys):
    # zstd keeps poorly compressible float bytes as raw literals, without a checksum: a flipped
    # bit there reads back with no error from tensorstore. The saved digests must catch it.
    path = _data_files(copy / "4")[0]
    data = path.read_bytes()
    caught = []
    for at in range(len(data) // 8, len(data), len(data) // 8):
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x08]) + data[at + 1 :])
        with Checkpointer(copy, every=2, keep=3) as ckpt:
            state, _, step = ckpt.restore(*exp8.target)
        if step == 4:  # the flip hit bytes no array is read from
            _assert_equal(state, saved[1][4])
        else:
            assert step == 2 and len(ckpt.skipped) == 1
            caught += [r for r in ckpt.skipped if r.endswith("does not match its saved digest")]
    path.write_bytes(data)
    assert caught, "no flip was silent to tensorstore: the digest check went untested"
    assert "falling back to step 2" in capsys.readouterr().err


def test_all_damaged_raises_one_line_naming_the_directory(exp8, copy, capsys):
    _corrupt(copy / "4", "truncate")
    _corrupt(copy / "2", "delete")
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*ckpt \(newest: step 4: ") as e:
            ckpt.restore(*exp8.target)
    assert "\n" not in str(e.value) and str(copy) in str(e.value)
    assert capsys.readouterr().err.splitlines()[-1].endswith("; no older checkpoint")
    with Checkpointer(copy.parent / "empty", every=2, keep=3) as ckpt:
        with pytest.raises(CheckpointError, match=r"empty \(none saved\)$"):
            ckpt.restore(*exp8.target)


def test_mismatched_model_is_reported(copy):
    exp = train.build(_cfg(hidden=(64, 16)))
    with Checkpointer(copy, every=2, keep=3) as ckpt:
        with pytest.raises(CheckpointError, match=r"1/bias/value is float32\[32\], the model wants float32\[16\]\)$"):
            ckpt.restore(*_target(exp))


# A stand-alone saver for the process tests: a small TrainState, no model to compile.
_SAVER = textwrap.dedent(
    """
    import os, sys, threading
    os.environ["JAX_PLATFORMS"] = "cpu"
    guard = threading.Timer(60, os._exit, (3,))  # never outlive a failed test
    guard.daemon = True
    guard.start()
    import jax.numpy as jnp
    from meshpar.checkpoint import Checkpointer
    from meshpar.trainer import TrainState

    def state(k):
        w, rng = jnp.arange(4096.0) * k, jnp.array([k, 7], jnp.uint32)
        return TrainState(step=jnp.int32(k), params={"w": w}, opt_state=(), rng=rng)

    ckpt = Checkpointer(sys.argv[1], every=1, keep=5)
    ckpt.maybe_save(state(1), {"next_batch": 1})
    ckpt.wait()
    if sys.argv[2] == "kill":
        # Hold every commit before its rename, as a slow disk would, and get SIGKILLed there.
        from orbax.checkpoint._src.path import atomicity
        async def stuck(self):
            print("writing", flush=True)
            threading.Event().wait()
        atomicity.AtomicRenameTemporaryPath.finalize = stuck
    ckpt.maybe_save(state(2), {"next_batch": 2})
    print("saving", flush=True)
    # "exit": leave without wait() or close()
    """
)


def _tiny(k):
    w, rng = jnp.arange(4096.0) * k, jnp.array([k, 7], jnp.uint32)  # as in _SAVER
    return TrainState(step=jnp.int32(k), params={"w": w}, opt_state=(), rng=rng)


def test_killed_mid_save_leaves_nothing_restorable_and_exit_finishes_the_save(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(tmp_path / mode), mode],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        for mode in ("kill", "exit")
    }  # both at once: the two interpreters start in parallel
    kill = procs["kill"]
    assert "writing\n" in iter(kill.stdout.readline, "")  # step 2's files are written, its commit held
    kill.send_signal(signal.SIGKILL)
    assert kill.wait(timeout=60) == -signal.SIGKILL
    assert procs["exit"].wait(timeout=60) == 0

    left = sorted(p.name for p in (tmp_path / "kill").iterdir())
    assert "2" not in left and any(name.startswith("2.orbax-checkpoint-tmp") for name in left), left
    target = _tiny(0)
    with Checkpointer(tmp_path / "kill", every=1, keep=5) as ckpt:
        assert ckpt.steps() == [1]
        state, position, step = ckpt.restore(target)
        assert step == 1 and position == {"next_batch": 1} and ckpt.skipped == []
        _assert_equal(state, _tiny(1))
        assert ckpt.maybe_save(_tiny(2), {"next_batch": 2})  # the leftover tmp folder is no obstacle
        ckpt.wait()
        assert ckpt.steps() == [1, 2]
    assert sorted(p.name for p in (tmp_path / "kill").iterdir()) == ["1", "2"]

    # A normal exit with a save in flight finishes it first (Checkpointer's exit hook: without
    # it, orbax's writes fail once interpreter shutdown has begun and the save is lost).
    with Checkpointer(tmp_path / "exit", every=1, keep=5) as ckpt:
        assert ckpt.steps() == [1, 2]
        state, position, step = ckpt.restore(target)
    assert step == 2 and position == {"next_batch": 2}
    _assert_equal(state, _tiny(2))


def test_uncommitted_save_in_this_process_is_not_listed(exp8, copy, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    async def never_renamed(self):  # as if the process died just before the commit's rename
        pass

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", never_renamed)
    state = jax.tree.map(jnp.copy, exp8.state)
    with Checkpointer(copy, every=1, keep=3) as ckpt:
        state = _train(exp8, state, 0, 5)
        assert ckpt.maybe_save(state, _position(5))
        ckpt.wait()
        assert ckpt.steps() == [2, 4]
        assert (copy / "5.orbax-checkpoint-tmp").is_dir() and not (copy / "5").exists()
        _, _, step = ckpt.restore(*exp8.target)
    assert step == 4

"""Exact resume: continuing from a mid-run checkpoint ends bit-identical to never stopping."""

import shutil

import jax
import numpy as np
import pytest

from meshpar.configuration import config
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl


def _cfg(workdir, **over):
    raw = {
        "mesh": "data:4,model:2",
        "layout": "batch:data; hidden:model",
        "model": {"name": "mlp", "hidden": [32, 16]},
        "data": {"num_examples": 512, "num_eval_examples": 0, "num_features": 16},
        "optimizer": {"schedule": "cosine", "warmup_steps": 2},
        "train": {"steps": 12, "batch_size": 32, "log_every": 1, "progress": False},
        "checkpoint": {"every": 4, "keep": 0},
        "workdir": str(workdir),
    }
    for key, value in over.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return config.from_dict(raw)


def _leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.mark.parametrize("mode, depth", [("direct", 0), ("routed", 2), ("direct", 3)])
def test_resume_from_a_mid_run_checkpoint_is_bit_identical(tmp_path, mode, depth):
    feed = {"mode": mode, "prefetch": depth}
    full = experiment.build(_cfg(tmp_path / "full", feed=feed))
    loop.train(full)
    # A run that died after its step-4 checkpoint: only that checkpoint survives.
    shutil.copytree(tmp_path / "full" / "checkpoints" / "4", tmp_path / "part" / "checkpoints" / "4")
    part = experiment.build(_cfg(tmp_path / "part", feed=feed, checkpoint={"resume": "auto"}))
    assert int(part.state.step) == 4
    loop.train(part)
    for a, b in zip(_leaves(full.state), _leaves(part.state), strict=True):
        np.testing.assert_array_equal(a, b)
    full_losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")}
    part_losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "part" / "metrics.jsonl")}
    assert sorted(part_losses) == list(range(5, 13))
    assert all(part_losses[s] == full_losses[s] for s in part_losses)


def test_resume_on_a_different_mesh_and_layout_reshards(tmp_path):
    dp = {"mesh": "data:8", "layout": "batch:data"}
    full = experiment.build(_cfg(tmp_path / "dp", **dp))
    loop.train(full)
    shutil.copytree(tmp_path / "dp" / "checkpoints" / "8", tmp_path / "mp" / "checkpoints" / "8")
    mp = experiment.build(_cfg(tmp_path / "mp", checkpoint={"resume": "auto"}))
    kernel = mp.state.params["layers"][0]["kernel"].get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 16)}
    saved = experiment.build(_cfg(tmp_path / "dp", **dp, checkpoint={"resume": "auto"}))  # newest there: step 12
    loop.train(mp)
    # Same math, other placement: equal up to float reassociation of the sharded matmuls.
    for a, b in zip(_leaves(saved.state.params), _leaves(mp.state.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def _state_leaves(exp):
    return _leaves(exp.state)


def test_extending_a_run_keeps_its_schedule(tmp_path):
    # `--resume train.steps=<more>`: the cosine schedule keeps the horizon of the first launch
    # (train.steps=8), so the extended run is bit-identical to one that ran 12 steps with
    # optimizer.decay_steps=8 from the start — and not to one decaying over 12.
    part = experiment.build(_cfg(tmp_path / "part", train={"steps": 8}))
    loop.train(part)
    extended = experiment.build(_cfg(tmp_path / "part", checkpoint={"resume": "auto"}))
    assert extended.resumed_from == 8 and extended.record["decay_steps"] == 8
    summary = loop.train(extended)
    assert summary["decay_steps"] == 8 and summary["resumed_from"] == 8
    fixed = experiment.build(
        _cfg(tmp_path / "fixed", optimizer={"schedule": "cosine", "warmup_steps": 2, "decay_steps": 8})
    )
    loop.train(fixed)
    for a, b in zip(_state_leaves(fixed), _state_leaves(extended), strict=True):
        np.testing.assert_array_equal(a, b)
    reshaped = experiment.build(_cfg(tmp_path / "reshaped"))  # decays over its own 12 steps
    loop.train(reshaped)
    assert any(not np.array_equal(a, b) for a, b in zip(_leaves(reshaped.state.params), _leaves(extended.state.params)))


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 12-step run to resume with changed settings (copied per test)."""
    workdir = tmp_path_factory.mktemp("finished") / "run"
    loop.train(experiment.build(_cfg(workdir)))
    return workdir


@pytest.mark.parametrize(
    "change, key, saved, new",
    [
        ({"train": {"seed": 3}}, "train.seed", "0", "3"),
        ({"train": {"batch_size": 16}}, "train.batch_size", "32", "16"),
        ({"model": {"name": "mlp", "hidden": [32, 8]}}, "model.hidden", "[32, 16]", "[32, 8]"),
        ({"optimizer": {"name": "sgd"}}, "optimizer.name", "adamw", "sgd"),
        ({"optimizer": {"learning_rate": 0.01}}, "optimizer.learning_rate", "0.001", "0.01"),
        ({"optimizer": {"decay_steps": 20}}, "optimizer.decay_steps", "12", "20"),
        ({"data": {"num_features": 12}}, "data.num_features", "16", "12"),
    ],
)
def test_resume_refuses_a_changed_run_setting_in_one_line(finished, tmp_path, change, key, saved, new):
    shutil.copytree(finished, tmp_path / "run")
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(config.ConfigError) as e:
        experiment.build(_cfg(tmp_path / "run", **change, checkpoint={"resume": "auto"}))
    assert str(e.value) == (
        f"{key}: {new} but the checkpoint at step 12 was saved with {saved}; a resumed run keeps its settings "
        f"(to change it anyway: checkpoint.allow_changes=[{key}])"
    )
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before  # nothing set aside


def test_allow_changes_lets_a_named_setting_change_and_keeps_the_rest_guarded(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    allowed = {"resume": "auto", "allow_changes": ["optimizer.learning_rate"]}
    exp = experiment.build(
        _cfg(tmp_path / "run", optimizer={"learning_rate": 0.01}, train={"steps": 14}, checkpoint=allowed)
    )
    assert exp.resumed_from == 12 and exp.record["config"]["optimizer.learning_rate"] == 0.01
    loop.train(exp)  # its checkpoints record the new rate: the next resume keeps it
    again = experiment.build(
        _cfg(tmp_path / "run", optimizer={"learning_rate": 0.01}, train={"steps": 14}, checkpoint={"resume": "auto"})
    )
    assert again.resumed_from == 14
    with pytest.raises(config.ConfigError, match=r"^train.seed: 5 but"):
        experiment.build(_cfg(tmp_path / "run", train={"seed": 5}, checkpoint=allowed))


def test_resume_with_no_checkpoint_starts_fresh(tmp_path):
    exp = experiment.build(_cfg(tmp_path, checkpoint={"resume": "auto"}))
    assert int(exp.state.step) == 0 and exp.resumed_from is None


@pytest.fixture(scope="module")
def twelve_steps_decaying_over_eight(tmp_path_factory):
    """The final state of a 12-step run whose schedule decays over 8 steps, never stopped."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    optimizer = {"schedule": "cosine", "warmup_steps": 2, "decay_steps": 8}
    exp = experiment.build(_cfg(workdir, optimizer=optimizer, checkpoint={"every": 0}, plan={"check": False}))
    loop.train(exp)
    return _leaves(exp.state)


@pytest.mark.parametrize("longer", [False, True], ids=["same-horizon", "longer-horizon"])
@pytest.mark.parametrize("check", [True, False], ids=["preflight", "no-preflight"])
def test_resume_with_or_without_the_preflight_on_the_same_or_a_longer_horizon(
    tmp_path, twelve_steps_decaying_over_eight, check, longer
):
    # A first launch of 8 steps (its schedule decays over 8) saves steps 4 and 8; the relaunch
    # goes on from step 4 to 8 (same horizon), or from step 8 to 12 (`--resume train.steps=12`:
    # the schedule keeps its 8). plan.check=false once ended here in a KeyError.
    plan = {"check": check}
    first = experiment.build(_cfg(tmp_path, train={"steps": 8}, plan=plan))
    loop.train(first)
    if not longer:
        shutil.rmtree(tmp_path / "checkpoints" / "8")  # the run died after its step-4 save
    steps = 12 if longer else 8
    resumed = experiment.build(_cfg(tmp_path, train={"steps": steps}, plan=plan, checkpoint={"resume": "auto"}))
    assert resumed.resumed_from == (8 if longer else 4) and resumed.record["decay_steps"] == 8
    # The pre-flight's ahead-of-time step runs, unless it was compiled for the other horizon.
    assert hasattr(resumed.train_step, "compiled") == (check and not longer)
    summary = loop.train(resumed)
    assert summary["resumed_from"] == resumed.resumed_from and summary["decay_steps"] == 8
    expected = twelve_steps_decaying_over_eight if longer else _leaves(first.state)
    for a, b in zip(expected, _leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)

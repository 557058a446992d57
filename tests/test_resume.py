"""Exact resume: continuing from a mid-run checkpoint ends bit-identical to never stopping."""

import shutil

import jax
import numpy as np
import pytest

from meshpar import config, train
from meshpar.metrics import read_jsonl


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
    full = train.build(_cfg(tmp_path / "full", feed=feed))
    train.train(full)
    # A run that died after its step-4 checkpoint: only that checkpoint survives.
    shutil.copytree(tmp_path / "full" / "checkpoints" / "4", tmp_path / "part" / "checkpoints" / "4")
    part = train.build(_cfg(tmp_path / "part", feed=feed, checkpoint={"resume": "auto"}))
    assert int(part.state.step) == 4
    train.train(part)
    for a, b in zip(_leaves(full.state), _leaves(part.state), strict=True):
        np.testing.assert_array_equal(a, b)
    full_losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")}
    part_losses = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "part" / "metrics.jsonl")}
    assert sorted(part_losses) == list(range(5, 13))
    assert all(part_losses[s] == full_losses[s] for s in part_losses)


def test_resume_on_a_different_mesh_and_layout_reshards(tmp_path):
    dp = {"mesh": "data:8", "layout": "batch:data"}
    full = train.build(_cfg(tmp_path / "dp", **dp))
    train.train(full)
    shutil.copytree(tmp_path / "dp" / "checkpoints" / "8", tmp_path / "mp" / "checkpoints" / "8")
    mp = train.build(_cfg(tmp_path / "mp", checkpoint={"resume": "auto"}))
    kernel = mp.state.params["layers"][0]["kernel"].get_value()
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 16)}
    saved = train.build(_cfg(tmp_path / "dp", **dp, checkpoint={"resume": "auto"}))  # newest there: step 12
    train.train(mp)
    # Same math, other placement: equal up to float reassociation of the sharded matmuls.
    for a, b in zip(_leaves(saved.state.params), _leaves(mp.state.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_resume_refuses_a_changed_batch_size(tmp_path):
    train.train(train.build(_cfg(tmp_path)))
    with pytest.raises(config.ConfigError, match=r"train.batch_size: 16 but the checkpoint at step 12 was saved with 32"):
        train.build(_cfg(tmp_path, train={"batch_size": 16}, checkpoint={"resume": "auto"}))


def test_resume_with_no_checkpoint_starts_fresh(tmp_path):
    exp = train.build(_cfg(tmp_path, checkpoint={"resume": "auto"}))
    assert int(exp.state.step) == 0

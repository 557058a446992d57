"""Sharded state and the train step: routed and direct feeding train bit-identically."""

import dataclasses

import jax
import numpy as np
import pytest

from meshpar.configuration import config, errors
from meshpar.plan.memory import analytic as memory
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl


def _cfg(**sections):
    raw = {
        "mesh": "data:4,model:2",
        "layout": "batch:data; hidden:model",
        "model": {"name": "mlp", "hidden": [64, 32]},
        "data": {"num_examples": 2048, "num_eval_examples": 256, "num_features": 48},
        "train": {"steps": 20, "batch_size": 32, "log_every": 5, "progress": False},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return config.from_dict(raw)


def _run(cfg, tmp_path, name):
    cfg = dataclasses.replace(cfg, workdir=str(tmp_path / name))
    exp = experiment.build(cfg)
    summary = loop.train(exp)
    losses = [r["loss"] for r in _rows(tmp_path / name / "metrics.jsonl")]
    return exp, summary, losses


def _rows(path):
    return read_jsonl(path)


def test_routed_and_direct_train_bit_identically(tmp_path):
    cfg = _cfg(train={"log_every": 1})
    direct_exp, direct, direct_losses = _run(cfg, tmp_path, "direct")
    routed_exp, routed, routed_losses = _run(
        dataclasses.replace(cfg, feed=config.FeedConfig(mode="routed")), tmp_path, "routed"
    )
    assert len(direct_losses) == 20
    assert direct_losses == routed_losses  # exact float equality, step for step
    for a, b in zip(jax.tree.leaves(direct_exp.state.params), jax.tree.leaves(routed_exp.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert routed["relay_input_bytes"] == 4 * direct["relay_input_bytes"]  # data axis has 4 devices
    assert direct_losses[-1] < direct_losses[0]


def test_state_shardings_follow_the_layout():
    exp = experiment.build(_cfg())
    params = exp.state.params
    first = params["layers"][0]["kernel"].get_value()
    assert first.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert {s.data.shape for s in first.addressable_shards} == {(48, 32)}  # hidden 64 split 2 ways
    second = params["layers"][1]["kernel"].get_value()  # [hidden, hidden_2]: rows split
    assert {s.data.shape for s in second.addressable_shards} == {(32, 32)}
    # Adam's moments are sharded exactly like the parameters they track.
    adam = exp.state.opt_state[0]
    for moment in (adam.mu, adam.nu):
        assert moment["layers"][0]["kernel"].get_value().sharding == first.sharding
    assert exp.state.step.sharding.is_fully_replicated


def test_eval_reports_loss_and_accuracy(tmp_path):
    _, summary, _ = _run(_cfg(train={"eval_every": 10, "eval_batches": 2}), tmp_path, "eval")
    assert 0 < summary["final_eval_loss"] < 10 and 0 <= summary["final_eval_accuracy"] <= 1
    rows = _rows(tmp_path / "eval" / "metrics.jsonl")
    assert "eval_loss" in rows[1] and "eval_loss" not in rows[0]  # first eval at step 10


def test_non_finite_loss_stops_with_the_step(tmp_path):
    cfg = _cfg(optimizer={"name": "sgd", "learning_rate": 1e30, "b1": 0.0})
    with pytest.raises(errors.TrainingError, match=r"step \d+: loss is (nan|inf)"):
        _run(cfg, tmp_path, "nan")


def test_eval_places_through_its_own_feeder_and_leaves_the_train_figures_alone(tmp_path):
    # Routed, prefetching: evaluating through the train feeder would overwrite its relay staging
    # while the prefetch thread places, and its batches would count as train input memory.
    feed = {"mode": "routed", "prefetch": 2}
    exp, with_eval, _ = _run(_cfg(feed=feed, train={"steps": 8, "eval_every": 2, "eval_batches": 2}), tmp_path, "eval")
    _, without, _ = _run(_cfg(feed=feed, train={"steps": 8, "eval_every": 0}), tmp_path, "plain")
    assert exp.inputs.eval_feeder is not exp.inputs.feeder and "final_eval_loss" in with_eval
    # The train feeder's peak stays within the train inputs the memory plan counts (the step's
    # batch, the prefetched and in-flight ones, the relay's staging): eval batches are not in it.
    c = memory.analytic(exp.step).categories
    bound = c["inputs"] + c["queued_inputs"] + c["relay_inputs"]
    for peaks in (with_eval["input_memory"]["peak_input_bytes"], without["input_memory"]["peak_input_bytes"]):
        assert 0 < max(peaks.values()) <= bound, (peaks, bound)
    assert exp.inputs.eval_feeder.memory_report()["peak_input_bytes"] != {
        k: 0 for k in with_eval["input_memory"]["peak_input_bytes"]
    }

"""Gradient accumulation (train.microbatches): the same training as one batch, in less memory,
with no data moved between devices; divisibility checked at config time."""

import re

import numpy as np
import pytest

from meshpar import models
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.plan import topology
from meshpar.plan.time import timing
from meshpar.processes import stop
from meshpar.run import experiment
from meshpar.step import aot, parts, trainer

# A small byte-level Transformer on the quickstart's data + model parallel layout (data:4,model:2).
TINY = [
    "model.d_model=32", "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.max_length=16",
    "data.length=16", "data.max_bytes=200000", "train.batch_size=32", "train.progress=false", "checkpoint.every=0",
    "hardware.peak_tflops=1",
]  # fmt: skip


def _cfg(tmp_path, *overrides):
    return config.load("experiments/quickstart.yaml", [*TINY, f"workdir={tmp_path}", *overrides])


def test_microbatched_steps_train_like_one_batch(tmp_path):
    # fp32, no dropout: k microbatches (gradients summed in float32, one update) give the losses
    # of the whole batch at once, to float reassociation.
    cfg = _cfg(tmp_path)
    exp = experiment.build(cfg)
    tx, plan = parts.plan_model(
        cfg, models.family(cfg.model.name), exp.mesh, exp.layout, exp.inputs.element_spec, cfg.train.steps
    )
    flags = stop.make_flags(exp.mesh, 0)
    batches = [exp.inputs.feeder.place(exp.inputs.train.batch(i))[0] for i in range(4)]
    micro = trainer.make_train_step(plan.graphdef, tx, exp.layout, exp.mesh, plan.shardings, exp.inputs.shardings, 4)
    losses = {}
    for k, step, state in ((1, exp.train_step, exp.state), (4, micro, plan.materialize(exp.layout, exp.mesh))):
        losses[k] = []
        for batch in batches:
            state, metrics = step(state, batch, flags)
            losses[k].append(float(metrics["loss"]))
    assert losses[1][-1] != losses[1][0]  # it trains
    np.testing.assert_allclose(losses[4], losses[1], rtol=1e-5)


def test_microbatches_stay_on_their_devices_and_shrink_temp_memory(tmp_path):
    texts, temp = {}, {}
    for k in (1, 4):
        compiled = aot.compile_train_step(_cfg(tmp_path, f"train.microbatches={k}"))
        texts[k], temp[k] = compiled.as_text(), aot.memory(compiled)["temp_bytes"]
    # A scan over the microbatches: one more while loop than the layer scans (forward, backward).
    assert texts[4].count(" while(") == texts[1].count(" while(") + 1
    # Each device splits its own rows: nothing in the step moves rows between devices.
    for k, text in texts.items():
        assert not re.search(r"all-to-all|collective-permute", text), k
    assert temp[4] < 0.5 * temp[1]  # the activations of a quarter of the batch at a time


def test_microbatches_must_divide_each_batch_shard(tmp_path):
    # batch 32 over data:4 is 8 rows per shard: 8 microbatches are fine, 3 or 16 are not.
    assert _cfg(tmp_path, "train.microbatches=8").train.microbatches == 8
    for k in (3, 16):
        with pytest.raises(ConfigError) as e:
            _cfg(tmp_path, f"train.microbatches={k}")
        msg = str(e.value)
        assert (
            msg
            == f"train.microbatches: {k} does not divide the 8 rows of each of the 4 batch shards (layout batch:data)"
        )
    # A -1 batch axis is sized when the mesh is built, and checked then.
    cfg = _cfg(tmp_path, "mesh=data:-1", "layout=batch:data", "train.microbatches=8")
    config.check_batch_size(cfg, {"data": 4})
    with pytest.raises(
        ConfigError, match=r"^train\.microbatches: 8 does not divide the 4 rows of each of the 8 batch shards"
    ):
        config.check_batch_size(cfg, {"data": 8})
    with pytest.raises(ConfigError, match=r"^train\.microbatches: 3 does not divide the batch of 32$"):
        _cfg(tmp_path, "layout=d_ff:model", "train.microbatches=3")
    with pytest.raises(ConfigError, match=r"^train\.microbatches: must be >= 1"):
        _cfg(tmp_path, "train.microbatches=0")


@pytest.mark.parametrize(
    "layout", [["mesh=data:8", "layout=batch:data"], []]
)  # data parallel; the quickstart's data:4,model:2
def test_gradients_are_reduced_once_per_step_not_per_microbatch(tmp_path, layout):
    # Each device sums its own rows' gradients over the microbatches; one all-reduce per step
    # moves them (float32 either way here), where one per microbatch would move k times as much.
    moved = {}
    for k in (1, 4):
        cfg = _cfg(tmp_path, *layout, f"train.microbatches={k}")
        text = aot.compile_train_step(cfg).as_text()
        step = timing.predict_program(text, dict(cfg.mesh), "float32", cfg.feed.prefetch, topology.load("cpu-sim"))
        moved[k] = sum(c.bytes for c in step.collectives if c.kind == "all-reduce")
    assert moved[1] > 0 and moved[4] < 1.25 * moved[1], moved

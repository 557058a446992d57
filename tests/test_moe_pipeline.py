"""Mixture-of-experts layers under a stage axis (meshpar.sharding.stages, meshpar.models.moe_stats):
training a pipelined MoE model gives the single device's losses and per-layer MoE metrics (the
load-balancing loss combined from its factors, the z-loss and the dropped share averaged over the
microbatches, idle ticks adding nothing, circular repeats back in canonical order), with the
experts on an axis of their own or sharing the batch's (all-to-all inside a stage); what cannot
run is one config line, and the planner plans it."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from meshpar import train
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.models.llama import build, layout_rules
from meshpar.plan import report
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.sharding import stages as pipeline
from meshpar.sharding import tracing
from meshpar.step import parts, programs, trainer
from meshpar.step.inputs import batch_shardings
from tests.test_moe import SPEC, TINY, _batch, _one_line
from tests.test_pipeline import RTOL

# 4 layers, each an MoE layer of 4 experts (top 2), capacity dispatch dropping some assignments
# in routing groups of one sequence (LENGTH tokens).
CFG = dataclasses.replace(TINY, d_model=32, n_layers=4, moe_experts=4, moe_capacity_factor=1.0, moe_group_size=16)
RUNS = {  # mesh, layout, schedule, repeats, microbatches
    "gpipe": ("data:2,stage:2,expert:2", "batch:data; layers:stage; experts:expert", "gpipe", 1, 2),
    "circular": ("data:2,stage:2,expert:2", "batch:data; layers:stage; experts:expert", "circular", 2, 2),
    "all-to-all": ("data:4,stage:2", "batch:data; layers:stage; experts:data", "gpipe", 1, 2),
}
MOE_TINY = "experiments/moe_tiny.yaml"
STAGED = ["mesh=data:2,stage:2,expert:2", "layout=batch:data; layers:stage; experts:expert", "train.microbatches=2"]


@functools.cache
def _train(name: str | None, steps: int = 3):
    """(losses, metrics, compiled HLO text) of `steps` SGD steps on fixed batches, on one device
    (`name` None) or under run `name` of :data:`RUNS` (its stored layer order, its pipeline)."""
    graphdef, params = nnx.split(build(CFG, SPEC, nnx.Rngs(0)))
    batches = [_batch(i) for i in range(steps)]
    layout = mesh = sched = None
    if name is not None:
        mesh_text, rules, kind, repeats, micro = RUNS[name]
        mesh = mesh_lib.build_mesh(mesh_text)
        sizes = dict(mesh.shape)
        layout = layout_lib.Layout.create(layout_rules(CFG, layout_lib.on_mesh(rules, sizes), sizes), sizes)
        sched = pipeline.schedule_for(layout, kind, repeats, micro)
        params = pipeline.Reorder(sched).to_stored(params)
        params = jax.device_put(params, trainer.tree_shardings(params, layout.params, mesh))
        batches = [jax.device_put(b, batch_shardings(SPEC, layout, mesh)) for b in batches]

    def step(p, b):
        with tracing.using(layout=layout, mesh=mesh, schedule=sched):
            (loss, metrics), g = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(b), has_aux=True)(p)
        return loss, metrics, jax.tree.map(lambda w, d: w - 0.5 * d, p, g)

    compiled = jax.jit(step).lower(params, batches[0]).compile()
    losses, metrics = [], []
    for b in batches:
        loss, m, params = compiled(params, b)
        losses.append(float(loss))
        metrics.append({k: float(v) for k, v in m.items()})
    return losses, metrics, compiled.as_text()


@pytest.mark.parametrize("name", list(RUNS))
def test_a_pipelined_moe_model_trains_to_the_single_devices_losses_and_moe_metrics(name):
    losses, metrics, _ = _train(None)
    assert losses[-1] < losses[0] and any(m["moe3_dropped"] > 0 for m in metrics)  # capacity drops some
    got, got_metrics, hlo = _train(name)
    if name == "all-to-all":  # the experts share the batch's axis: tokens move to them and back inside a stage
        assert "all-to-all" in hlo
    np.testing.assert_allclose(got, losses, rtol=RTOL, err_msg=name)
    for step, (want, have) in enumerate(zip(metrics, got_metrics)):
        assert have.keys() == want.keys() and {
            f"moe{i}_{s}" for i in range(4) for s in ("balance", "z", "dropped")
        } <= set(want)
        for key in want:
            np.testing.assert_allclose(have[key], want[key], rtol=RTOL, err_msg=f"{name} step {step} {key}")


def test_experts_on_the_stage_axis_are_one_config_line():
    with pytest.raises(ConfigError) as e:
        config.load(MOE_TINY, ["mesh=data:4,stage:2", "layout=batch:data; layers:stage; experts:stage"])
    assert e.value.key == "layout"
    _one_line(e.value, "experts:stage uses the stage axis 'stage'", "carries only layers")


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["model.moe_group_size=256"], "model.moe_group_size",
         ("routing groups of 256", "32×128 tokens span sequences", "2 microbatches of layers:stage", "divides the sequence length 128")),
        # 2 MoE layers (one per moe_every layers): their experts' stack does not split into 2 stages × 2 repeats
        (["model.n_layers=4", "model.moe_every=2", "pipeline.schedule=circular", "pipeline.repeats=2"], "layout",
         ("a stack of 2 along dim 'layers' does not split into 2 stages × 2 repeats",)),
    ],
)  # fmt: skip
def test_moe_layers_a_pipeline_cannot_run_are_one_config_line(overrides, key, words):
    cfg = config.load(MOE_TINY, [*STAGED, *overrides, "train.progress=false"])
    with pytest.raises(ConfigError) as e:
        parts.abstract_step(cfg)
    assert e.value.key == key
    _one_line(e.value, *words)


def test_the_train_command_exits_2_on_routing_groups_that_span_sequences(tmp_path, capsys):
    overrides = [*STAGED, "model.moe_group_size=256", "data.max_bytes=200000", f"workdir={tmp_path}"]
    assert train.main(["--config", MOE_TINY, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: model.moe_group_size: 256: routing groups"), err


@pytest.mark.slow
def test_the_planner_plans_a_pipelined_moe_model():
    cfg = config.load(MOE_TINY, [*STAGED, "train.progress=false"])
    step = parts.abstract_step(cfg)
    planned = report.plan(step, programs.compile_all(step))
    assert planned.fits

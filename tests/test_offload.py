"""Host offload (the ``offload`` section): offloaded state lives in pinned host memory after every
step and after a resume; optimizer and parameter offload train bit-identically to no offload;
activation offload matches the same names saved on the devices; config errors in one line.

On CPU no bytes move (XLA ignores memory spaces inside a computation), but the memory kinds are
real and mixing them in one operation is a trace-time error, so these tests catch every place
an offloaded array would be used without being moved first.
"""

from __future__ import annotations

import functools
import shutil
import tempfile

import jax
import numpy as np
import pytest

from meshpar import models
from meshpar.configuration import config, errors
from meshpar.configuration.config import ConfigError
from meshpar.processes import stop
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl
from meshpar.sharding import offload
from meshpar.step import parts, trainer

# A small byte-level Transformer on the quickstart's data + model parallel layout (data:4,model:2).
TINY = (
    "model.d_model=32", "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.max_length=16",
    "data.length=16", "data.max_bytes=200000", "train.batch_size=32", "train.progress=false", "checkpoint.every=0",
    "hardware.peak_tflops=1", "optimizer.decay_steps=8",
)  # fmt: skip
MLP = (
    "model={name: mlp, hidden: [32, 16]}", "layout=batch:data; hidden:model",
    "data={num_examples: 512, num_eval_examples: 0, num_features: 16}", "train.batch_size=32", "train.progress=false",
    "checkpoint.every=0",
)  # fmt: skip
STEPS = 3
BOTH = ("offload.optimizer=true", "offload.params=true")


def _cfg(tmp_path, *overrides, base=TINY):
    return config.load("experiments/quickstart.yaml", [*base, f"workdir={tmp_path}", *overrides])


def _kinds(tree) -> set[str]:
    return offload.memory_kinds(tree)


@functools.cache
def _steps(base: tuple, overrides: tuple, reduce_each: bool = False) -> tuple[list[float], list[dict]]:
    """STEPS train steps of the built experiment on its first batches: the losses, and after
    each step the memory kinds of the state's params, opt_state and step. `reduce_each`: with
    microbatches, the gradients reduced per microbatch (as under offload.params) instead of once."""
    workdir = tempfile.mkdtemp(prefix="meshpar-offload-")  # nothing is written: no checkpoints, no loop
    once = trainer.reduced_once
    if reduce_each:
        trainer.reduced_once = lambda *args: ()
    try:
        exp = experiment.build(config.load("experiments/quickstart.yaml", [*base, f"workdir={workdir}", *overrides]))
    finally:
        trainer.reduced_once = once
    flags = stop.make_flags(exp.mesh, 0)
    state, losses, kinds = exp.state, [], []
    for i in range(STEPS):
        batch, _ = exp.inputs.feeder.place(exp.inputs.train.batch(i))
        state, metrics = exp.train_step(state, batch, flags)
        losses.append(float(metrics["loss"]))
        assert np.isfinite(float(metrics["grad_norm"]))
        kinds.append({"params": _kinds(state.params), "opt_state": _kinds(state.opt_state), "step": _kinds(state.step)})
    return losses, kinds


@pytest.mark.parametrize(
    "base, extra",
    [
        pytest.param(TINY, (), id="quickstart-like"),
        pytest.param(TINY, ("feed.mode=routed",), id="routed"),
        pytest.param(TINY, ("param_layout=embed:data",), id="fsdp"),
        pytest.param(TINY, ("train.microbatches=2",), id="microbatches"),
        pytest.param(MLP, (), id="mlp"),
    ],
)
def test_optimizer_and_param_offload_train_bit_identically_with_state_in_pinned_host(base, extra):
    reference, ref_kinds = _steps(base, (*extra, "plan.check=false"))
    assert reference[-1] != reference[0]  # it trains
    assert all(k == {"params": {"device"}, "opt_state": {"device"}, "step": {"device"}} for k in ref_kinds)
    settings = [BOTH] if extra else [("offload.optimizer=true",), ("offload.params=true",)]
    if "train.microbatches=2" in extra:
        # Offloaded parameters keep the reduction of each microbatch's gradients (jax cannot move
        # host arrays in the partially manual region that reduces once: meshpar.step.trainer.reduced_once);
        # that is the same training to float reassociation, and bit for bit the program offload changes.
        once = reference
        reference, _ = _steps(base, (*extra, "plan.check=false"), reduce_each=True)
        np.testing.assert_allclose(once, reference, rtol=1e-5)
    for setting in settings:
        losses, kinds = _steps(base, (*extra, "plan.check=false", *setting))
        assert losses == reference, setting  # bit for bit: offload moves bytes, never changes arithmetic
        want = {
            "params": {"pinned_host"} if "offload.params=true" in setting else {"device"},
            "opt_state": {"pinned_host"} if "offload.optimizer=true" in setting else {"device"},
            "step": {"device"},
        }
        assert kinds == [want] * STEPS, setting


@pytest.mark.parametrize("setting", ["layer_outputs", "dots"])
def test_activation_offload_matches_the_same_names_saved_on_device(tmp_path, setting):
    cfg = _cfg(tmp_path, f"offload.activations={setting}", "plan.check=false")
    exp = experiment.build(cfg)
    tx, plan = parts.plan_model(cfg, models.family(cfg.model.name), exp.mesh, exp.layout, exp.inputs.element_spec, 8)
    step_args = (plan.graphdef, tx, exp.layout, exp.mesh, plan.shardings, exp.inputs.shardings, 1, setting)
    saved = trainer.make_train_step(*step_args, activations_memory="device")
    flags = stop.make_flags(exp.mesh, 0)
    batches = [exp.inputs.feeder.place(exp.inputs.train.batch(i))[0] for i in range(STEPS)]
    # The offloading program moves every name its policy lists to host memory (each a residual);
    # the reference keeps them on the devices.
    moved = offload.names_moved_to_host(exp.train_step.trace(exp.state, batches[0], flags).jaxpr)
    assert moved == set(models.family(cfg.model.name).kept_activations(setting))
    assert offload.names_moved_to_host(saved.trace(exp.state, batches[0], flags).jaxpr) == set()
    losses = {}
    fresh = plan.materialize(exp.layout, exp.mesh)  # the same initial state (exp.state is donated below)
    for name, step, state in (("offloaded", exp.train_step, exp.state), ("saved", saved, fresh)):
        losses[name] = []
        for batch in batches:
            state, metrics = step(state, batch, flags)
            losses[name].append(float(metrics["loss"]))
    assert losses["offloaded"][-1] != losses["offloaded"][0]
    assert losses["offloaded"] == losses["saved"]


def _leaves(state):
    return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(state)]


def test_eval_checkpoints_and_resume_with_offload_toggled(tmp_path):
    # One run of 8 steps without offload; the same run in three launches, offload on, off, on
    # again, each resuming from the last's checkpoint: eval, the checkpoint digests and the
    # restores all run with offloaded state, and the losses are the uninterrupted run's.
    common = ("train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=2")
    full = experiment.build(_cfg(tmp_path / "full", *common, "train.steps=8"))
    loop.train(full)
    launches = [(4, BOTH), (6, ()), (8, ("offload.optimizer=true", "offload.activations=dots"))]
    for i, (steps, setting) in enumerate(launches):
        resume = ("checkpoint.resume=auto",) if i else ()
        exp = experiment.build(_cfg(tmp_path / "part", *common, f"train.steps={steps}", *resume, *setting))
        want = {
            "params": {"pinned_host"} if "offload.params=true" in setting else {"device"},
            "opt_state": {"pinned_host"} if "offload.optimizer=true" in setting else {"device"},
        }
        if i:  # restored straight into this launch's memory kinds, whatever the saved run used
            assert exp.resumed_from == launches[i - 1][0]
        assert {"params": _kinds(exp.state.params), "opt_state": _kinds(exp.state.opt_state)} == want
        loop.train(exp)
        assert {"params": _kinds(exp.state.params), "opt_state": _kinds(exp.state.opt_state)} == want
    rows = {r["step"]: r for r in read_jsonl(tmp_path / "part" / "metrics.jsonl")}
    full_rows = {r["step"]: r for r in read_jsonl(tmp_path / "full" / "metrics.jsonl")}
    assert sorted(rows) == list(range(1, 9))
    # The last launch's activation offload changes the compiled program (a remat policy): its
    # steps agree to float rounding; the others bit for bit.
    for step in range(1, 7):
        assert rows[step]["loss"] == full_rows[step]["loss"], step
        assert rows[step].get("eval_loss") == full_rows[step].get("eval_loss"), step
    for step in (7, 8):
        np.testing.assert_allclose(rows[step]["loss"], full_rows[step]["loss"], rtol=1e-5)
    assert all("eval_loss" in rows[s] for s in (2, 4, 6, 8))
    for a, b in zip(_leaves(full.state.params), _leaves(exp.state.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # A checkpoint saved with offload restores into device memory bit for bit.
    shutil.copytree(tmp_path / "part" / "checkpoints" / "4", tmp_path / "again" / "checkpoints" / "4")
    again = experiment.build(_cfg(tmp_path / "again", *common, "train.steps=8", "checkpoint.resume=auto"))
    assert _kinds(again.state.opt_state) == {"device"} and int(again.state.step) == 4


def test_the_nan_guard_stops_an_offloaded_run_at_its_first_non_finite_step(tmp_path):
    exp = experiment.build(_cfg(tmp_path, *BOTH, "checkpoint.every=2", "train.steps=6", base=MLP))
    step_fn, calls = exp.train_step, [0]

    def poisoned(state, batch, flags):
        calls[0] += 1
        if calls[0] == 3:
            batch = {**batch, "inputs": batch["inputs"] * np.float32("nan")}
        return step_fn(state, batch, flags)

    exp.train_step = poisoned
    with pytest.raises(errors.TrainingError, match=r"^step 3: loss is nan.*last good checkpoint: step 2$"):
        loop.train(exp)
    assert exp.checkpointer.steps() == [2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("offload.activations=dots", "model.remat=full"), "dots replaces model.remat's policy"),
        (("offload.activations=layer_outputs", "model.scan_layers=false"), "layer_outputs needs the layer loop"),
        (("offload.activations=dots", "model.scan_unroll=2"), "dots needs a layer loop, but model.scan_unroll 2"),
        (("offload.activations=sometimes",), ""),
    ],
)
def test_activation_offload_config_errors_are_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        _cfg(tmp_path, *overrides)
    assert str(e.value).startswith(f"offload.activations: {message}") and "\n" not in str(e.value)


def test_activation_offload_needs_a_layer_loop_the_mlp_has_not(tmp_path):
    with pytest.raises(ConfigError, match=r"^offload.activations: dots needs a layer loop, and model mlp has none"):
        _cfg(tmp_path, "offload.activations=dots", base=MLP)

"""Delayed FP8 scaling: the amax histories the train step keeps are the max over every device,
microbatch and pipeline tick of what each FP8 dot saw (never a sum), equal an independent
computation, roll step by step, survive a checkpoint, and stay out of Hugging Face files."""

import shutil

import jax
import numpy as np
import pytest

from meshpar import train
from meshpar.configuration import config
from meshpar.models import fp8
from meshpar.processes import stop
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl
from tests.support.cli import refuses_in_one_line

TINY = [
    "model.d_model=32", "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.max_length=16",
    "data.length=16", "data.max_bytes=200000", "train.batch_size=32", "train.progress=false", "checkpoint.every=0",
    "hardware.peak_tflops=1", "model.fp8=[mlp,attention]", "model.fp8_scaling=delayed", "model.fp8_history=4",
]  # fmt: skip
WEIGHTS = ("wq", "wk", "wv", "wo", "w_in", "w_out")  # the quickstart's (gelu MLP) FP8 weights


def _cfg(tmp_path, *overrides):
    return config.load("experiments/quickstart.yaml", [*TINY, f"workdir={tmp_path}", *overrides])


def _histories(params) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, fp8.History))[0]
    return {jax.tree_util.keystr(p): np.asarray(v[...]) for p, v in flat if isinstance(v, fp8.History)}


def _train(tmp_path, *overrides, steps: int = 2):
    """The histories after `steps` steps of the same batches, the first batch and the initial params."""
    exp = experiment.build(_cfg(tmp_path, *overrides))
    flags, state = stop.make_flags(exp.mesh, 0), exp.state
    first = exp.inputs.train.batch(0)
    params0 = jax.tree.map(np.asarray, state.params)
    per_step = []
    for i in range(steps):
        state, _ = exp.train_step(state, exp.inputs.feeder.place(exp.inputs.train.batch(i))[0], flags)
        per_step.append(_histories(state.params))
    return per_step, first, params0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Two steps on the quickstart's layout: batch split 4 ways, heads, d_ff and vocab 2 ways."""
    return _train(tmp_path_factory.mktemp("reference"))


def test_histories_hold_each_steps_amaxes_newest_first(reference):
    (one, two), batch, params0 = reference
    assert sorted(one) == sorted(f"['blocks']['fp8_{w}']" for w in WEIGHTS)
    for name, h in two.items():
        assert h.shape == (2, 3, 4)  # [layers, (input, weight, output gradient), history]
        assert (h[:, :, 0] > 0).all() and (h[:, :, 2:] == 0).all()  # two steps, two amaxes each
        np.testing.assert_array_equal(h[:, :, 1], one[name][:, :, 0])  # rolled by one
    # Independently of the model code: the first layer's query projection sees the RMS-normed
    # embeddings (rotary positions come after it; the norm's scale is 1 at init) and the weights.
    p = params0["blocks"]
    inputs = np.asarray(batch["tokens"])[:, :-1].astype(np.int64)
    x = np.asarray(params0["embed"][...])[inputs]
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    wq = one["['blocks']['fp8_wq']"]
    np.testing.assert_allclose(wq[0, 0, 0], np.abs(x).max(), rtol=1e-5)
    np.testing.assert_array_equal(wq[:, 1, 0], np.abs(np.asarray(p["wq"][...])).reshape(2, -1).max(axis=1))


@pytest.mark.parametrize(
    "layout", [("mesh=data:8", "layout=batch:data"), ("param_layout=embed:data", "model.fp8_gather=true")],
    ids=["data", "fsdp-fp8-gather"],
)  # fmt: skip
def test_histories_are_the_max_over_every_device(tmp_path, reference, layout):
    # The reference splits batch 4 ways and heads/d_ff/vocab 2 ways: an amax of one device's
    # shard, or a sum of the devices', would differ from the other layouts' whole-tensor max.
    ref = reference[0][0]
    other = _train(tmp_path, *layout, steps=1)[0][0]
    for name in ref:
        np.testing.assert_allclose(other[name], ref[name], rtol=1e-5, err_msg=name)


def test_microbatches_keep_the_max_of_the_forward_amaxes(tmp_path, reference):
    ref = reference[0][0]
    micro = _train(tmp_path, "train.microbatches=4", steps=1)[0][0]
    for name in ref:
        # Inputs and weights are the same tensors cut four ways: their max, exactly; a sum
        # over the microbatches would be up to 4x. The output gradient is each microbatch's own
        # loss's (a mean over its rows), so it is larger, by a factor the program sets.
        np.testing.assert_allclose(micro[name][:, :2], ref[name][:, :2], rtol=1e-6, err_msg=name)


def test_a_pipeline_keeps_the_max_over_its_ticks(tmp_path):
    # The pipeline's loss is the whole batch's (its microbatches are ticks of one pass), so its
    # output gradients are the unpipelined step's too.
    flat, _, _ = _train(tmp_path / "flat", "model.n_layers=4", "mesh=data:2,model:4", "layout=batch:data", steps=1)
    piped, _, _ = _train(tmp_path / "piped", "model.n_layers=4", "train.microbatches=4", "mesh=data:2,stage:4",
                         "layout=batch:data; layers:stage", steps=1)  # fmt: skip
    for name in flat[0]:
        assert (flat[0][name][:, :, 0] > 0).all()
        # Each stage's layers run once per microbatch tick: gradients over the ticks would add up
        # to about 4x the whole batch's amax; stages.fan_out_max keeps their max.
        np.testing.assert_allclose(piped[0][name], flat[0][name], rtol=1e-5, err_msg=name)


def test_resume_restores_the_histories_bit_identically(tmp_path):
    # Delayed scales come from the histories: a resumed run that lost them would quantize differently.
    over = ("train.steps=4", "train.log_every=1", "checkpoint.every=2", "checkpoint.keep=0")
    full = experiment.build(_cfg(tmp_path / "full", *over))
    loop.train(full)
    shutil.copytree(tmp_path / "full" / "checkpoints" / "2", tmp_path / "part" / "checkpoints" / "2")
    part = experiment.build(_cfg(tmp_path / "part", *over, "checkpoint.resume=auto"))
    restored = _histories(part.state.params)["['blocks']['fp8_wq']"]  # step 2's: two amaxes of four
    assert (restored[:, :, :2] > 0).all() and (restored[:, :, 2:] == 0).all()
    loop.train(part)
    for name, h in _histories(full.state.params).items():
        np.testing.assert_array_equal(_histories(part.state.params)[name], h)
    losses = [{r["step"]: r["loss"] for r in read_jsonl(tmp_path / run / "metrics.jsonl")} for run in ("full", "part")]
    assert all(losses[1][s] == losses[0][s] for s in (3, 4))


@pytest.mark.parametrize(
    "override, expected",
    [("model.fp8_history=0", "config error: model.fp8_history:"),
     ("model.fp8_scaling=late", "config error: model.fp8_scaling:")],
)  # fmt: skip
def test_bad_scaling_settings_are_one_line(tmp_path, capsys, override, expected):
    argv = ["--config", "experiments/quickstart.yaml", *TINY, f"workdir={tmp_path}", override]
    refuses_in_one_line(train.main, argv, capsys, expected)


def test_init_from_a_run_keeps_the_histories_that_fit_and_starts_the_others_empty(tmp_path):
    # FP8 settings are how a model runs, not what its weights are: init_from a run takes its
    # weights whatever they are, and its histories only where this model keeps them alike.
    saved = experiment.build(_cfg(tmp_path / "saved", "train.steps=2", "checkpoint.every=2"))
    loop.train(saved)
    held = _histories(saved.state.params)
    same = experiment.build(_cfg(tmp_path / "same", f"checkpoint.init_from={tmp_path / 'saved'}"))
    for name, h in _histories(same.state.params).items():
        np.testing.assert_array_equal(h, held[name])
    longer = experiment.build(
        _cfg(tmp_path / "longer", "model.fp8_history=8", f"checkpoint.init_from={tmp_path / 'saved'}")
    )
    assert all((h == 0).all() and h.shape[-1] == 8 for h in _histories(longer.state.params).values())
    np.testing.assert_array_equal(longer.state.params["blocks"]["wq"][...], saved.state.params["blocks"]["wq"][...])

"""Pipeline parallelism over a stage axis (meshpar.sharding.stages): the pipelined stack computes the
sequential one's loss and gradients, the compiled step passes activations between stages
instead of gathering weights, training follows the layout without a stage axis in both feed
modes, checkpoints move between pipelined and non-pipelined layouts both ways, and bad settings
are one-line config errors."""

import functools
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshpar import train
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.models import llama, transformer
from meshpar.plan.time import timing
from meshpar.run.metrics import read_jsonl
from meshpar.sharding import layout, tracing
from meshpar.sharding import stages as pipeline
from meshpar.sharding.mesh import build_mesh
from meshpar.step import parts
from tests.support import script

kr = script("train_runs")  # the run helpers scripts/kill_resume.py uses: a final state read back
EXPERIMENT = "experiments/transformer_pipeline.yaml"
FLAT = "batch:data; d_ff:model; heads:model; vocab:model"  # the experiment's layout without layers:stage
# Float32 sums in another order (the microbatches' gradients summed inside the pipeline's
# backward scan instead of accumulated after each; the stage axis's psum): equal up to rounding.
RTOL = 2e-6


def _loss_and_grads(model_cfg, layout_text, sched, params, batch, graphdef, mesh, param_layout=None):
    lay = layout.Layout.create(layout_text, dict(mesh.shape), params=param_layout)

    def loss(p):
        with tracing.using(layout=lay, mesh=mesh, schedule=sched):
            return nnx.merge(graphdef, p).loss(batch)[0]

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize(
    "family, kind, repeats, micro, param_layout",
    [
        ("transformer", "gpipe", 1, 4, None),
        ("transformer", "gpipe", 1, 1, None),  # fewer microbatches than stages: idle, still right
        ("transformer", "circular", 2, 2, None),
        ("llama", "circular", 2, 4, "embed:data"),  # with FSDP parameters gathered inside the stages
    ],
)
def test_the_pipelined_stack_gives_the_sequential_loss_and_gradients(family, kind, repeats, micro, param_layout):
    if family == "transformer":
        cfg = transformer.TransformerConfig(
            d_model=32, n_heads=4, d_head=8, d_ff=64, n_layers=8, vocab_size=64, max_length=16
        )
        module = transformer
    else:
        cfg = llama.LlamaConfig(
            d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=64, n_layers=8, vocab_size=64, max_length=16
        )
        module = llama
    graphdef, params = nnx.split(module.build(cfg, {"tokens": ((17,), np.uint8)}, nnx.Rngs(1)))
    batch = {"tokens": jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 17)), jnp.uint8)}
    mesh = build_mesh("data:2,stage:2,model:2")
    staged = layout.Layout.create(f"layers:stage; {FLAT}", dict(mesh.shape))
    sched = pipeline.schedule_for(staged, kind, repeats, micro)
    reorder = pipeline.Reorder(sched)
    assert reorder.identity == (repeats == 1)
    loss0, grads0 = _loss_and_grads(cfg, FLAT, None, params, batch, graphdef, mesh, param_layout)
    loss1, grads1 = _loss_and_grads(
        cfg, f"layers:stage; {FLAT}", sched, reorder.to_stored(params), batch, graphdef, mesh, param_layout
    )
    grads1 = reorder.to_canonical(grads1)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
    for (path, g0), g1 in zip(jax.tree_util.tree_flatten_with_path(grads0)[0], jax.tree.leaves(grads1)):
        np.testing.assert_allclose(
            np.asarray(g1), np.asarray(g0), rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


def test_stored_order_puts_each_stages_groups_in_its_slice():
    sched = pipeline.Schedule("stage", 2, 2, "circular", 2)
    # 8 layers, 2 stages × 2 repeats of 2: stage 0 holds canonical blocks 0 and 2, stage 1 blocks 1 and 3.
    assert pipeline.stored_order(8, sched).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert pipeline.stored_order(8, pipeline.Schedule("stage", 2, 2)).tolist() == list(range(8))
    assert sched.ticks == 2 * 2 + 1 and sched.bubble == pytest.approx(1 / 5)


def _collectives(overrides):
    cfg = config.load(EXPERIMENT, overrides)
    step = parts.abstract_step(cfg)
    return timing.collectives(step.lower().compile(), step.mesh)


def test_the_compiled_step_passes_activations_over_the_stage_axis_and_gathers_no_layer_weights():
    staged = _collectives(["model.scan_unroll=1"])
    over_stage = {kind for kind, _, axis in staged if "stage" in axis.split(",")}
    assert "collective-permute" in over_stage
    assert "all-gather" not in over_stage
    # The same weights split over the stage axis by param_layout alone (no pipeline): XLA
    # gathers every layer's weights over it, which the pipeline does not.
    sharded = _collectives(["model.scan_unroll=1", f"layout={FLAT}", "param_layout=layers:stage"])
    kinds = {kind for kind, _, axis in sharded if "stage" in axis.split(",")}
    assert "all-gather" in kinds and "collective-permute" not in kinds


def _losses(workdir):
    return {r["step"]: r["loss"] for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r}


def _header_claims():
    head = [line[2:] for line in open(EXPERIMENT).read().splitlines() if line.startswith("#")]
    return " ".join(head)


def test_training_follows_the_layout_without_a_stage_axis_in_both_feed_modes_as_the_header_says(tmp_path):
    runs = {
        "direct": [],
        "routed": ["feed.mode=routed"],
        "flat": [f"layout={FLAT}"],
    }
    for name, extra in runs.items():
        train.run(
            config.load(
                EXPERIMENT, ["train.progress=false", "checkpoint.every=20", f"workdir={tmp_path / name}", *extra]
            )
        )
    direct, routed, flat = (_losses(tmp_path / n) for n in runs)
    assert direct == routed  # bit-identical: the feed places the same arrays
    steps = sorted(flat)
    np.testing.assert_allclose([direct[s] for s in steps], [flat[s] for s in steps], rtol=RTOL)
    a, _, _ = kr.load_state(EXPERIMENT, tmp_path / "direct")
    b, _, _ = kr.load_state(EXPERIMENT, tmp_path / "routed")
    assert kr.compare_states(a, b)[0]
    # What the header says, from these runs.
    text = _header_claims()
    first, last = min(direct), max(direct)
    assert f"loss {direct[first]:.2f} at step {first} → {direct[last]:.2f} at step {last}" in text, text
    evals = {r["step"]: r["eval_loss"] for r in read_jsonl(tmp_path / "direct" / "metrics.jsonl") if "eval_loss" in r}
    for step, value in evals.items():
        assert f"{value:.2f} at step {step}" in text, (step, value, text)
    worst = max(abs(direct[s] - flat[s]) / abs(flat[s]) for s in steps)
    assert worst < float(re.search(r"within ([0-9.e-]+) relative", text).group(1)) == RTOL


def test_checkpoints_move_between_pipelined_and_flat_layouts_both_ways(tmp_path):
    """Circular repeats store the layers permuted; checkpoints hold them in canonical order, so a
    flat run resumes a circular one's checkpoint and the other way round, on the same losses."""
    circular = ["pipeline.schedule=circular", "pipeline.repeats=2"]
    common = ["train.progress=false", "train.log_every=1", "train.eval_every=6", "checkpoint.every=3", "train.steps=6"]
    summaries = {
        name: train.run(config.load(EXPERIMENT, [*common, f"workdir={tmp_path / name}", *extra]))
        for name, extra in (("flat", [f"layout={FLAT}"]), ("circular", circular))
    }
    # Evaluation runs the stored order through the pipeline too (the pre-flight's compiled eval step).
    np.testing.assert_allclose(
        summaries["circular"]["final_eval_loss"], summaries["flat"]["final_eval_loss"], rtol=RTOL
    )
    # The saved states agree leaf by leaf at step 6 (canonical order in both).
    a, step_a, _ = kr.load_state(EXPERIMENT, tmp_path / "flat", [f"layout={FLAT}"])
    b, step_b, _ = kr.load_state(EXPERIMENT, tmp_path / "circular", [f"layout={FLAT}"])
    assert step_a == step_b == 6 and a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-6, err_msg=name)
    # Resume each one's step 3 under the other layout.
    for src, extra in (("flat", circular), ("circular", [f"layout={FLAT}"])):
        moved = tmp_path / f"{src}-moved"
        shutil.copytree(tmp_path / src, moved)
        for d in (moved / "checkpoints").iterdir():
            if d.name == "6":
                shutil.rmtree(d)
        (moved / "metrics.jsonl").write_text(
            "".join(
                line + "\n"
                for line in (moved / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("step", 0) <= 3
            )
        )
        train.run(config.load(EXPERIMENT, [*common, f"workdir={moved}", "checkpoint.resume=auto", *extra]))
        resumed, reference = _losses(moved), _losses(tmp_path / "flat")
        assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
        np.testing.assert_allclose([resumed[s] for s in (4, 5, 6)], [reference[s] for s in (4, 5, 6)], rtol=RTOL)


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (
            ["pipeline.schedule=circular", "pipeline.repeats=4"],
            "model.n_layers",
            "4 layers do not split evenly into 2 stages × 4 repeats",
        ),
        (["model.n_layers=3"], "model.n_layers", "3 layers do not split evenly into 2 stages"),
        (["pipeline.schedule=circular", "train.microbatches=1"], "train.microbatches", "fewer than the 2 stages"),
        (["pipeline.repeats=2"], "pipeline.repeats", "need pipeline.schedule: circular"),
        (["layout=batch:stage; layers:stage"], "layout", "uses the stage axis 'stage'"),
        (["layout=layers:(stage,model)"], "layout", "over one mesh axis"),
        ([f"layout={FLAT}", "pipeline.schedule=circular"], "pipeline.schedule", "needs a stage axis"),
        (["offload.params=true"], "offload.params", "not supported"),
    ],
)
def test_bad_pipeline_settings_are_one_line_config_errors(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        config.load(EXPERIMENT, overrides)
    assert e.value.key == key and words in str(e.value) and "\n" not in str(e.value)


def test_a_stage_axis_on_a_model_without_a_layer_stack_is_refused():
    with pytest.raises(ConfigError, match="pipelines a layer stack, and this model has none") as e:
        config.load("experiments/mlp_model_parallel.yaml", ["mesh=data:4,stage:2", "layout=batch:data; layers:stage"])
    assert e.value.key == "layout"


def test_gpipe_with_fewer_microbatches_than_stages_runs_and_says_its_bubble(capsys):
    cfg = config.load(EXPERIMENT, ["train.microbatches=1"])
    step = parts.abstract_step(cfg)
    parts.say_unused_rules(step)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "train.microbatches 1 < 2 pipeline stages: each stage idles 50% of the step (bubble (S-1)/(M+S-1)); "
        "use at least 2 microbatches"
    ]


TWO_PROCESSES = """
mesh: stage:2,data:2,model:2   # stage major: process 0 holds stage 0's devices, process 1 stage 1's
layout: batch:data; layers:stage; d_ff:model; heads:model; vocab:model
pipeline: {schedule: circular, repeats: 2}
model: {name: transformer, d_model: 32, n_heads: 4, d_head: 8, d_ff: 64, n_layers: 4, max_length: 32, positions: rotary}
data: {source: text, length: 32, max_bytes: 200000}
optimizer: {learning_rate: 0.003}
train: {steps: 8, batch_size: 16, microbatches: 4, log_every: 1, progress: false}
hardware: {peak_tflops: 1.0}
"""


def test_two_processes_with_the_stage_axis_across_them_train_and_resume(env, tmp_path):
    from tests import test_multihost as mh

    path = tmp_path / "cfg.yaml"
    path.write_text(TWO_PROCESSES)
    train.run(config.load(path, [f"workdir={tmp_path / 'one'}"]))
    mh.run_two(path, tmp_path / "two", "train.steps=4", "checkpoint.every=2", env=env)
    mh.run_two(path, tmp_path / "two", "checkpoint.every=2", env=env, resume=True)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(two) == list(range(1, 9))
    # Gloo's collectives sum in another order than the in-process ones: equal up to that.
    np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5)


@pytest.mark.gpu_target
def test_the_gpu_program_of_a_pipeline_passes_activations_between_stages():
    """XLA's GPU compiler (compiled here for an H100 machine, no GPU needed) keeps the pipeline:
    collective-permutes over the stage axis, no all-gather over it, and the tick loop."""
    from meshpar.plan import gpu_target, hlo, topology
    from tests.test_gpu_target import _need_compiler

    _need_compiler()
    # XLA's own loop form: the GPU default flags' while-loop double buffering runs two ticks per iteration
    cfg = config.load(EXPERIMENT, ["xla.gpu_defaults=false"])
    target = gpu_target.target(topology.load("h100-sxm-8"), cfg.mesh)
    step = parts.abstract_step(cfg, devices=target.devices)
    compiled = step.lower().compile()
    found = timing.collectives(compiled, step.mesh)
    over_stage = {kind for kind, _, axis in found if "stage" in axis.split(",")}
    assert "collective-permute" in over_stage and "all-gather" not in over_stage, found
    module = hlo.parse(compiled.as_text())
    whiles = [op for ops in module.computations.values() for op in ops if op.opcode == "while"]
    ticks = cfg.train.microbatches + 2 - 1
    assert sum(hlo.trip_count(module, op) == ticks for op in whiles) >= 2  # the forward's ticks and the backward's


def test_blockwise_attention_runs_in_the_stages():
    """Its scans' fresh carries take the stage's type (varying over the stage axis): the
    pipelined stack with blockwise attention gives the sequential loss and gradients."""
    cfg = transformer.TransformerConfig(d_model=32, n_heads=4, d_head=8, d_ff=64, n_layers=2, vocab_size=64, max_length=16,
                                        attention="blockwise", attention_block=8)  # fmt: skip
    graphdef, params = nnx.split(transformer.build(cfg, {"tokens": ((17,), np.uint8)}, nnx.Rngs(1)))
    batch = {"tokens": jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 17)), jnp.uint8)}
    mesh = build_mesh("data:2,stage:2,model:2")
    sched = pipeline.schedule_for(layout.Layout.create(f"layers:stage; {FLAT}", dict(mesh.shape)), "gpipe", 1, 2)
    loss0, grads0 = _loss_and_grads(cfg, FLAT, None, params, batch, graphdef, mesh)
    loss1, grads1 = _loss_and_grads(cfg, f"layers:stage; {FLAT}", sched, params, batch, graphdef, mesh)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-6)
    for (path, g0), g1 in zip(jax.tree_util.tree_flatten_with_path(grads0)[0], jax.tree.leaves(grads1)):
        where = jax.tree_util.keystr(path)
        np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-4, atol=1e-6, err_msg=where)


ATTENTION_DIMS = ("batch", None, "heads", None)


@pytest.mark.parametrize(
    "rules, per_device",
    [
        ("batch:data; heads:model", (2, 16, 2, 8)),
        ("batch:data", (1, 16, 4, 8)),  # heads not split: the model axis joins data in splitting the batch
    ],
)
def test_manual_runs_an_op_on_each_devices_block_inside_a_stage(rules, per_device):
    """pipeline.manual (how cuDNN's attention runs in a stage: its custom_partitioning cannot
    run in a partially manual region) gives the op one device's block, with the value and
    gradients of the op left to the partitioner. XLA's attention stands in for cuDNN's here."""
    mesh = build_mesh("data:2,stage:2,model:2")
    lay = layout.Layout.create(f"layers:stage; {rules}", dict(mesh.shape))
    seen = []

    def op(q, k, v):
        seen.append(q.shape)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    def loss(w, q, k, v, manual):
        def stage(w, q, k, v):
            q = q * w[0]  # varies over the stage axis, as a stage's activations do
            f = pipeline.manual(op, (ATTENTION_DIMS,) * 3, ATTENTION_DIMS, "batch") if manual else op
            return jax.lax.psum(f(q, k, v), "stage")

        with layout.activate(lay, mesh):
            out = jax.shard_map(
                stage, mesh=mesh, in_specs=(P("stage"), P(), P(), P()), out_specs=P(), axis_names={"stage"}
            )(w, q, k, v)
        return (out**2).sum()

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(4, 16, 4, 8)), jnp.float32) for _ in range(3))
    w = jnp.asarray([1.5, -0.5], jnp.float32)
    results = {}
    for manual in (False, True):
        seen.clear()
        grad = jax.jit(jax.value_and_grad(functools.partial(loss, manual=manual), argnums=(0, 1, 2, 3)))
        results[manual] = grad(w, q, k, v)
        assert set(seen) == {per_device if manual else (4, 16, 4, 8)}, seen
    (want, want_grads), (got, got_grads) = results[False], results[True]
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for name, a, b in zip("wqkv", want_grads, got_grads):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a).max() > 0, name
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), (name, np.abs(a - b).max(), np.abs(a).max())


def test_cudnn_attention_in_a_stage_falls_back_where_the_batch_cannot_take_a_spare_axis(monkeypatch):
    """Heads unsplit and one row per data shard in a microbatch: the model axis has no dim of
    the call's to split, so the stage takes cudnn's fallback (blockwise), as off a CUDA GPU."""
    from meshpar.models import attention

    called = []
    monkeypatch.setattr(attention, "resolve", lambda *args: "cudnn")
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *args, **kwargs: called.append("cudnn"))
    monkeypatch.setattr(attention, "blockwise", lambda q, k, v, block: (called.append("blockwise"), q)[1])
    mesh = build_mesh("data:2,stage:2,model:2")
    lay = layout.Layout.create("layers:stage; batch:data; d_ff:model; vocab:model", dict(mesh.shape))
    q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.float32)  # a microbatch of 2 rows: 1 per data shard

    def stage(q):
        return attention.attention(q, q, q, "cudnn")

    with layout.activate(lay, mesh):
        jax.eval_shape(jax.shard_map(stage, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"stage"}), q)
    assert called == ["blockwise"]


@pytest.mark.gpu_target
@pytest.mark.parametrize(
    "overrides",
    [["model.attention=cudnn"], ["model.attention=auto", "pipeline.schedule=circular", "pipeline.repeats=2"]],
    ids=["cudnn-gpipe", "auto-circular"],
)
def test_the_gpu_program_of_a_pipeline_runs_cudnn_attention_in_its_stages(overrides):
    """A stage axis with cuDNN's fused attention (asked for, or auto's choice for bfloat16 on a
    GPU), compiled for an H100 machine (no GPU needed): the stages' program calls cuDNN's flash
    attention forward and backward; a fallback to blockwise or XLA attention has no such call."""
    from meshpar.plan import gpu_target, topology
    from tests.test_gpu_target import _need_compiler

    _need_compiler()
    cfg = config.load(EXPERIMENT, [*overrides, "model.compute_dtype=bfloat16", "model.d_head=64"])
    target = gpu_target.target(topology.load("h100-sxm-8"), cfg.mesh)
    step = parts.abstract_step(cfg, devices=target.devices)
    text = step.lower().compile().as_text()
    calls = set(re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', text))
    assert calls == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}, calls

"""Parameter layouts (param_layout, FSDP / ZeRO-3) and rules that map a dim to several mesh axes."""

import math
import pathlib
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshpar import models
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.models import decoder, transformer
from meshpar.processes import stop
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl
from meshpar.sharding.layout import Layout, LayoutError, format_rules, parse_rules
from meshpar.sharding.mesh import build_mesh
from meshpar.step import aot, parts, trainer
from meshpar.step.inputs import make_source

SIZES = {"replica": 2, "data": 2, "model": 2}
MODEL_PARALLEL = "d_ff:model; heads:model; vocab:model"


def test_a_dim_may_take_several_mesh_axes():
    rules = parse_rules("batch:(replica, data); embed:data")
    assert rules == (("batch", ("replica", "data")), ("embed", "data"))
    assert parse_rules({"batch": ["replica", "data"], "embed": "(data)"}) == rules
    assert format_rules(rules) == "batch:(replica,data); embed:data" and parse_rules(format_rules(rules)) == rules
    layout = Layout.create(rules, SIZES)
    assert layout.spec(("batch", "length", "vocab")) == P(("replica", "data"), None, None)
    assert layout.axis_size("batch") == 4
    with pytest.raises(
        LayoutError,
        match=r"^dims 'batch' and 'embed' of one tensor \('batch', 'embed'\) are both mapped to mesh axis 'data'$",
    ):
        layout.check_shape(("batch", "embed"), (8, 8))
    with pytest.raises(LayoutError) as e:
        layout.check_shape(("batch", "length"), (6, 3), what="activation ('batch', 'length')")
    assert str(e.value) == (
        "dim 'batch' of activation ('batch', 'length') has size 6, not divisible by mesh axes ('replica', 'data') of sizes 2×2 = 4"
    )
    # A param layout on top of a layout: its dims follow it, the others keep the layout's rule.
    params = Layout.create("batch:data; d_ff:model; embed:model", SIZES).overlay("embed:(replica,data)")
    assert params.spec(("layers", "embed", "d_ff")) == P(None, ("replica", "data"), "model")
    assert params.spec(("batch",)) == P("data")


@pytest.mark.parametrize(
    "param_layout, message",
    [
        ("embed:(data,data)", "param_layout: rule 'embed:(data,data)' names mesh axis 'data' twice"),
        ("embed:(data", "param_layout: rules 'embed:(data' have an unclosed parenthesis"),
    ],
)
def test_param_layout_mistakes_are_one_line_config_errors(param_layout, message):
    raw = {"mesh": "replica:2,data:2,model:2", "model": {"name": "transformer"}, "param_layout": param_layout}
    with pytest.raises(ConfigError) as e:
        config.from_dict(raw)
    assert str(e.value) == message


def test_param_layout_is_checked_against_every_parameter():
    mesh = build_mesh("replica:2,data:2,model:2")

    def plan(param_layout, **model):
        raw = {
            "mesh": "replica:2,data:2,model:2", "layout": f"batch:(replica,data); {MODEL_PARALLEL}", "param_layout": param_layout,
            "model": {"name": "transformer", "d_model": 12, "n_heads": 2, "d_head": 4, "d_ff": 16, "max_length": 16, **model},
            "data": {"source": "text", "length": 16, "max_bytes": 100000}, "train": {"batch_size": 8},
        }  # fmt: skip
        cfg = config.from_dict(raw)
        spec = make_source(cfg.data, "train", 0).element_spec
        return parts.plan_model(
            cfg, models.family(cfg.model.name), mesh, Layout.create(cfg.layout, dict(mesh.shape)), spec, 10
        )

    _, ok = plan("embed:(replica,data)")  # 12 = 3 × 4
    assert ok.shardings.params["blocks"]["w_in"].get_value().spec == P(None, ("replica", "data"), "model")
    with pytest.raises(ConfigError) as e:
        plan("embed:(replica,data)", d_model=6)
    assert str(e.value) == (
        "param_layout: dim 'embed' of parameter blocks/attn_norm ('layers', 'embed') has size 6, "
        "not divisible by mesh axes ('replica', 'data') of sizes 2×2 = 4"
    )
    with pytest.raises(ConfigError) as e:
        plan("embed:model")  # w_in (layers, embed, d_ff): d_ff is on model already
    assert str(e.value).startswith("param_layout: parameter blocks/w_in ('layers', 'embed', 'd_ff'): dims ")
    assert "are both mapped to mesh axis 'model'" in str(e.value)


def test_block_dims_are_the_stacked_parameters_dims():
    cfg = transformer.switches(transformer.TransformerConfig())
    model = nnx.eval_shape(lambda: decoder.Decoder(cfg, 8, rngs=nnx.Rngs(0)))
    for name, dims in decoder.block_dims(cfg).items():
        assert getattr(model.blocks, name).dims == ("layers", *dims)


# A tiny byte-level Transformer on a hybrid mesh: the batch over (replica, data), weights over
# model, and with param_layout every weight with an embed dim split over data as well
# (split within each replica group, whole across groups).
TINY = [
    "mesh=replica:2,data:2,model:2", f"layout=batch:(replica,data); {MODEL_PARALLEL}", "model.d_model=32",
    "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.max_length=16", "data.length=16",
    "data.max_bytes=200000", "train.batch_size=16", "train.steps=20", "train.log_every=1", "train.eval_every=0",
    "train.progress=false", "optimizer.warmup_steps=2", "hardware.peak_tflops=1",
]  # fmt: skip
FSDP = "param_layout=embed:data"


def _load(tmp_path, *overrides):
    return config.load("experiments/quickstart.yaml", [*TINY, f"workdir={tmp_path}", *overrides])


def _split(dims) -> int:
    """How many ways the hybrid FSDP layout splits an array of these dims: model for d_ff, heads
    or vocab, data for embed (and nothing for the rest)."""
    return (2 if {"d_ff", "heads", "vocab"} & set(dims) else 1) * (2 if "embed" in dims else 1)


def _check_state_bytes(state):
    """Every state array holds exactly its share on each device, read from its shards."""
    seen = 0
    for tree in (state.params, state.opt_state):
        for path, var in jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: hasattr(x, "dims")):
            dims = getattr(var, "dims", None)
            if dims is None:
                continue
            array = var.get_value()
            n = math.prod(
                dict(SIZES)[a] for e in array.sharding.spec if e for a in (e if isinstance(e, tuple) else (e,))
            )
            assert n == _split(dims), (path, dims, array.sharding.spec)
            assert {s.data.nbytes for s in array.addressable_shards} == {array.nbytes // n}, path
            assert len(array.addressable_shards) == 8
            seen += 1
    assert seen > 20  # params, Adam's mu and nu


def test_fsdp_trains_like_the_plain_layout_and_resumes_from_its_checkpoints(tmp_path):
    plain = experiment.build(_load(tmp_path, "checkpoint.every=20"))
    loop.train(plain)  # saves its state at step 20
    plain_losses = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")]
    # The same 20 batches through the FSDP layout's own state and step.
    cfg = _load(tmp_path, FSDP)
    tx, plan = parts.plan_model(
        cfg, models.family(cfg.model.name), plain.mesh, plain.layout, plain.inputs.element_spec, cfg.train.steps
    )
    step = trainer.make_train_step(plan.graphdef, tx, plain.layout, plain.mesh, plan.shardings, plain.inputs.shardings)
    state, flags, fsdp_losses = plan.materialize(plain.layout, plain.mesh), stop.make_flags(plain.mesh, 0), []
    for i in range(20):
        state, metrics = step(state, plain.inputs.feeder.place(plain.inputs.train.batch(i))[0], flags)
        fsdp_losses.append(float(metrics["loss"]))
    assert len(plain_losses) == 20 and plain_losses[-1] < plain_losses[0]
    np.testing.assert_allclose(fsdp_losses, plain_losses, rtol=1e-5)
    _check_state_bytes(state)
    # The plain run's checkpoint restores into the FSDP layout, re-sharded on the way in.
    resumed = experiment.build(_load(tmp_path, FSDP, "checkpoint.every=20", "checkpoint.resume=auto", "train.steps=21"))
    assert resumed.resumed_from == 20
    _check_state_bytes(resumed.state)
    for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _computations(hlo: str) -> dict[str, str]:
    """HLO module text → {computation name: its text}."""
    found = re.findall(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)\n\}$", hlo, flags=re.MULTILINE | re.DOTALL)
    return dict(found)


def _in_loops(comps: dict[str, str]) -> set[str]:
    """Names of the computations a while loop's body runs (directly or through calls, fusions)."""
    todo = [b for text in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", text)]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo += [c for c in re.findall(r"%([\w.\-]+)", comps[name]) if c in comps]
    return seen


def _gathers(compiled) -> tuple[list, list]:
    """Shapes gathered (leading 1s dropped) inside while bodies, and outside them."""
    comps = _computations(compiled.as_text())
    loops = _in_loops(comps)
    inside, outside = [], []
    for name, text in comps.items():
        for dims in re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", text):
            shape = tuple(int(d) for d in dims.split(",") if d)
            while shape and shape[0] == 1:
                shape = shape[1:]
            (inside if name in loops else outside).append(shape)
    return inside, outside


def test_fsdp_gathers_each_layer_inside_the_scan_and_keeps_temp_memory(tmp_path):
    # The shipped FSDP experiment at 16 layers, under full remat (weights re-gathered in the
    # backward pass instead of saved), against the same model without param_layout.
    deep = ["model.n_layers=16", "model.remat=full", "data.max_bytes=100000", f"workdir={tmp_path}"]
    fsdp = aot.compile_train_step(config.load("experiments/transformer_fsdp.yaml", deep))
    plain = aot.compile_train_step(config.load("experiments/transformer_fsdp.yaml", [*deep, "param_layout="]))
    inside, outside = _gathers(fsdp)
    # One layer's weights, embed whole, d_ff and heads still split over model: wq/wk/wv
    # [embed, heads/2, kv], wo [heads/2, kv, embed], w_in [embed, d_ff/2], w_out [d_ff/2, embed].
    layer = {(128, 2, 32), (2, 32, 128), (128, 256), (256, 128)}
    assert layer <= set(inside)
    assert not [s for s in outside if s and s[0] == 16]  # never the whole stack up front
    assert not layer & set(_gathers(plain)[0])  # the plain layout gathers no weights
    temp = {name: aot.memory(c)["temp_bytes"] for name, c in (("fsdp", fsdp), ("plain", plain))}
    assert temp["fsdp"] <= 1.5 * temp["plain"], temp
    args = {name: aot.memory(c)["argument_bytes"] for name, c in (("fsdp", fsdp), ("plain", plain))}
    assert args["fsdp"] < 0.3 * args["plain"], args  # the state itself: most of it 4 ways smaller


def test_bfloat16_weights_are_gathered_in_bfloat16(tmp_path):
    # XLA:CPU widens bf16 collectives to f32 in a later pass, so the gathers are read where the
    # partitioner makes them. Without the cast pinned to each weight's own placement, the
    # partitioner moves every gather in front of the cast: all of them would be float32.
    cfg = config.load(
        "experiments/transformer_fsdp.yaml",
        ["model.n_layers=2", "model.compute_dtype=bfloat16", "data.max_bytes=100000", f"workdir={tmp_path}"],
    )
    dump = tmp_path / "hlo"
    options = {"xla_dump_to": str(dump), "xla_dump_hlo_pass_re": "spmd-partitioning"}
    parts.abstract_step(cfg).lower().compile(compiler_options=options)
    (after,) = [f for f in dump.glob("*after_spmd-partitioning*") if "jit_step" in f.name]
    dtypes = re.findall(r"= (\w+)\[[^\]]*\][^=\n]*? all-gather\(", after.read_text())
    # One layer's six matmul weights in each pass (forward, and the backward's recompute), the
    # embedding tables; only the norm scales (never cast: RMSNorm works in float32) stay f32.
    assert dtypes.count("bf16") >= 12, dtypes
    assert dtypes.count("f32") <= 6, dtypes


def test_shipped_fsdp_experiment_keeps_a_quarter_of_the_state_per_device(tmp_path):
    # The figures its header states, from the state's plan (each array's shard shape).
    kib = {}
    for name, extra in (("fsdp", []), ("plain", ["param_layout="])):
        cfg = config.load("experiments/transformer_fsdp.yaml", ["data.max_bytes=100000", f"workdir={tmp_path}", *extra])
        state = aot.state_bytes(parts.abstract_step(cfg).plan)
        kib[name] = round(sum(a["per_device_bytes"] for a in state.values()) / 1024)
    header = pathlib.Path("experiments/transformer_fsdp.yaml").read_text()
    assert f"{kib['fsdp']:,} KiB per device instead of {kib['plain']:,} KiB" in header, kib

"""Llama-family decoder: shapes and dims, grouped-query attention, causality, FLOPs, layouts
(key/value heads following the query heads' split where they divide), remat and attention
implementations, and a run through the train command's parts with bf16, microbatches and
activation offload."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.models import MODELS
from meshpar.models.llama import LlamaConfig, build, flops_per_token, layout_rules, num_params
from meshpar.plan import __main__ as plan_cli
from meshpar.run import experiment, loop
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import parts, trainer
from meshpar.step.inputs import batch_shardings

VOCAB = {"batch", "length", "embed", "heads", "kv_heads", "kv", "d_ff", "vocab", "layers"}
LENGTH, BATCH, V = 32, 8, 256
SPEC = {"tokens": ((LENGTH + 1,), np.dtype(np.uint8))}
TINY = LlamaConfig(d_model=32, n_heads=4, n_kv_heads=2, d_head=8, d_ff=48, n_layers=2, vocab_size=V, max_length=LENGTH)


def _with(cfg: LlamaConfig, **changes) -> LlamaConfig:
    return dataclasses.replace(cfg, **changes)


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    return {"tokens": np.random.default_rng(seed).integers(0, V, (BATCH, LENGTH + 1)).astype(np.uint8)}


def _inputs(seed: int = 0) -> np.ndarray:
    return _batch(seed)["tokens"][:, :-1].astype(np.int32)


@functools.cache
def _logits_fn(cfg: LlamaConfig):
    graphdef, params = nnx.split(build(cfg, SPEC, nnx.Rngs(0)))
    return params, jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_shapes_dims_and_param_count(tied):
    cfg = _with(TINY, tie_embeddings=tied)
    params, fn = _logits_fn(cfg)
    logits = fn(params, _inputs())
    assert logits.shape == (BATCH, LENGTH, V) and logits.dtype == jnp.float32
    total = 0
    for path, var in nnx.to_flat_state(params):
        name, dims = "/".join(map(str, path)), var.get_metadata().get("dims")
        assert dims is not None and len(dims) == var[...].ndim and set(dims) <= VOCAB, (name, dims)
        total += var[...].size
    shapes = {"/".join(map(str, p)): v[...].shape for p, v in nnx.to_flat_state(params)}
    assert shapes["blocks/wq"] == (2, 32, 4, 8) and shapes["blocks/wk"] == shapes["blocks/wv"] == (2, 32, 2, 8)
    assert shapes["blocks/w_gate"] == shapes["blocks/w_up"] == (2, 32, 48) and shapes["blocks/w_down"] == (2, 48, 32)
    assert ("unembed" in shapes) is not tied
    assert total == num_params(cfg)


@pytest.mark.parametrize(
    "changes, match",
    [({"n_kv_heads": 3}, "n_kv_heads 3 does not divide n_heads 4"), ({"d_head": 7}, "even d_head"),
     ({"max_length": LENGTH - 1}, "exceeds max_length")],
)  # fmt: skip
def test_build_rejects_bad_configs(changes, match):
    with pytest.raises(ValueError, match=match):
        build(_with(TINY, **changes), SPEC, nnx.Rngs(0))


def test_grouped_query_attention_is_multi_head_attention_with_shared_key_value_heads():
    # GQA with 2 key/value heads for 4 query heads equals MHA whose key/value projections repeat
    # each key/value head for its 2 consecutive query heads.
    gqa_params, gqa = _logits_fn(TINY)
    mha_cfg = _with(TINY, n_kv_heads=4)
    mha_params, mha = _logits_fn(mha_cfg)
    flat = dict(nnx.to_flat_state(gqa_params))
    repeated = {}
    for path, var in nnx.to_flat_state(mha_params):
        w = flat[path][...]
        if path[-1] in ("wk", "wv"):
            w = jnp.repeat(w, 2, axis=2)  # [layers, embed, kv_heads → heads, kv]
        repeated[path] = var.replace(w)
    mha_params = nnx.from_flat_state(repeated)
    a, b = np.asarray(gqa(gqa_params, _inputs())), np.asarray(mha(mha_params, _inputs()))
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # and the sharing matters: another key/value head for the second query head changes the logits
    other = dict(nnx.to_flat_state(mha_params))
    wk = other[("blocks", "wk")][...]
    other[("blocks", "wk")] = other[("blocks", "wk")].replace(wk.at[:, :, 1].set(wk[:, :, 2]))
    c = np.asarray(mha(nnx.from_flat_state(other), _inputs()))
    assert np.abs(c - b).max() > 1e-3


def test_causal():
    params, fn = _logits_fn(TINY)
    x, t = _inputs(), 13
    x2 = x.copy()
    x2[:, t] = (x2[:, t] + 1) % V
    a, b = np.asarray(fn(params, x)), np.asarray(fn(params, x2))
    np.testing.assert_array_equal(a[:, :t], b[:, :t])
    assert np.abs(a[:, t:] - b[:, t:]).max(axis=-1).min() > 0


def test_rope_scaling_changes_only_long_wavelengths():
    from meshpar.models.llama import rope_frequencies

    cfg = _with(TINY, d_head=64, rope_theta=500000.0, rope_original_max_length=64)
    plain, scaled = rope_frequencies(cfg), rope_frequencies(_with(cfg, rope_scaling="llama3"))
    wavelen = 2 * np.pi / plain
    short, long = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    np.testing.assert_array_equal(scaled[short], plain[short])
    np.testing.assert_allclose(scaled[long], plain[long] / 8, rtol=1e-6)
    between = ~short & ~long
    assert np.all(scaled[between] < plain[between]) and np.all(scaled[between] > plain[between] / 8)


def test_flops_per_token_hand_count_and_xla():
    # N = layers * (2 * d * (heads + kv_heads) * d_head + 3 * d * d_ff) + d * vocab
    #   = 2 * (2*32*6*8 + 3*32*48) + 32*256 = 2 * (3072 + 4608) + 8192 = 23552
    # attention = 12 * layers * heads*d_head * length = 12 * 2 * 32 * 32 = 24576
    assert flops_per_token(TINY, LENGTH) == 6 * 23552 + 24576
    # XLA's count of the forward + backward on one device (unrolled: XLA counts a loop body once)
    cfg = _with(TINY, scan_layers=False, d_model=128, d_head=32, d_ff=384)
    graphdef, params = nnx.split(build(cfg, SPEC, nnx.Rngs(0)))
    grad = jax.jit(jax.grad(lambda p, b: nnx.merge(graphdef, p).loss(b)[0]))
    cost = grad.lower(params, _batch()).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]
    model = MODELS["llama"].flops_per_example(cfg, SPEC) * BATCH
    # XLA also counts softmax, norms, rotary and SwiGLU's elementwise work: a few percent above
    assert model <= xla <= 1.15 * model, (model, xla)


def test_kv_heads_follow_heads_where_they_divide():
    sizes = {"data": 4, "model": 2}
    rules = (("batch", "data"), ("heads", "model"))
    assert layout_rules(TINY, rules, sizes) == (*rules, ("kv_heads", "model"))
    assert layout_rules(_with(TINY, n_kv_heads=1), rules, sizes) == rules  # replicated: 1 head cannot split
    own = (*rules, ("kv_heads", "data"))
    assert layout_rules(TINY, own, sizes) == own  # a rule of its own wins
    assert layout_rules(TINY, (("batch", "data"),), sizes) == (("batch", "data"),)


LAYOUTS = {
    "data": ("data:8", "batch:data", "", {}),
    "model": ("data:4,model:2", "batch:data; heads:model; d_ff:model; vocab:model", "", {}),
    # 1 key/value head cannot be split 2 ways: it stays whole on every device (multi-query)
    "model-mqa": ("data:4,model:2", "batch:data; heads:model; d_ff:model; vocab:model", "", {"n_kv_heads": 1}),
    "fsdp": ("data:8", "batch:data", "embed:data", {}),
    "2d": ("data:4,model:2", "batch:data; embed:model", "", {}),
    "sequence": ("data:4,model:2", "batch:data; length:model", "", {}),
}


def _under(name: str):
    """Loss and gradients of one fixed batch with the parameters placed by layout `name`; the
    parameters, as placed."""
    mesh_text, rules, params_rules, changes = LAYOUTS[name]
    cfg = _with(TINY, **changes)
    mesh = mesh_lib.build_mesh(mesh_text)
    sizes = dict(mesh.shape)
    derived = layout_rules(cfg, layout_lib.on_mesh(rules, sizes), sizes)
    layout = layout_lib.Layout.create(derived, sizes, params=params_rules)
    graphdef, params = nnx.split(build(cfg, SPEC, nnx.Rngs(0)))
    params = jax.device_put(params, trainer.tree_shardings(params, layout.params, mesh))
    batch = {
        k: jax.device_put(v, s) for (k, v), s in zip(_batch().items(), batch_shardings(SPEC, layout, mesh).values())
    }
    with layout_lib.activate(layout, mesh):
        loss, grads = jax.jit(jax.value_and_grad(lambda p, b: nnx.merge(graphdef, p).loss(b)[0]))(params, batch)
    return params, float(loss), np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])


@pytest.fixture(scope="module")
def runs():
    return {name: _under(name) for name in LAYOUTS}


def _split_ways(params, name: str) -> int:
    arr = dict(nnx.to_flat_state(params))[tuple(name.split("/"))][...]
    return arr.size // int(np.prod(arr.addressable_shards[0].data.shape))


def test_every_layout_family_computes_the_same_loss_and_gradients(runs):
    # float32; the layouts differ only in the reduction order of split contractions
    _, loss, grads = runs["data"]
    for name in ("model", "fsdp", "2d", "sequence"):
        np.testing.assert_allclose(runs[name][1], loss, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(runs[name][2], grads, rtol=1e-4, atol=1e-6, err_msg=name)
    # multi-query attention is another model (1 key/value head), under the model-parallel layout
    assert np.isfinite(runs["model-mqa"][1]) and np.isfinite(runs["model-mqa"][2]).all()


def test_key_value_weights_split_with_the_query_heads_or_stay_whole(runs):
    model, mqa = runs["model"][0], runs["model-mqa"][0]
    assert _split_ways(model, "blocks/wq") == _split_ways(model, "blocks/wk") == _split_ways(model, "blocks/wv") == 2
    assert _split_ways(mqa, "blocks/wq") == 2 and _split_ways(mqa, "blocks/wk") == 1
    assert _split_ways(runs["fsdp"][0], "blocks/wk") == 8  # FSDP: embed over data


def test_a_kv_heads_rule_that_cannot_split_is_one_config_line():
    cfg = config_lib.load(
        "experiments/llama_tiny.yaml",
        ["model.n_kv_heads=1", "layout=batch:data; heads:model; kv_heads:model", "train.progress=false"],
    )
    with pytest.raises(ConfigError) as e:
        step = parts.abstract_step(cfg)
        del step
    text = str(e.value)
    assert "\n" not in text and "kv_heads" in text and "not divisible" in text, text


def _loss_and_grads(cfg: LlamaConfig):
    graphdef, params = nnx.split(build(cfg, SPEC, nnx.Rngs(0)))
    fn = jax.jit(jax.value_and_grad(lambda p, b: nnx.merge(graphdef, p).loss(b)[0]))
    loss, grads = fn(params, _batch())
    return float(loss), np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])


@pytest.mark.parametrize(
    "changes",
    [{"remat": "full"}, {"remat": "dots"}, {"attention": "blockwise", "attention_block": 8}, {"scan_layers": False}],
    ids=["remat-full", "remat-dots", "blockwise", "unrolled"],
)
def test_remat_attention_and_loop_form_keep_the_math(changes):
    ref_loss, ref_grads = _loss_and_grads(TINY)
    loss, grads = _loss_and_grads(_with(TINY, **changes))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-4, atol=1e-6)


def test_trains_with_bf16_microbatches_and_activation_offload(tmp_path):
    cfg = config_lib.load(
        "experiments/llama_tiny.yaml",
        ["train.steps=4", "optimizer.warmup_steps=0", "train.batch_size=16", "train.microbatches=2", "train.eval_every=0", "train.progress=false",
         "model.compute_dtype=bfloat16", "model.scan_unroll=1", "offload.activations=dots", "data.max_bytes=200000",
         f"workdir={tmp_path}"],
    )  # fmt: skip
    summary = loop.train(experiment.build(cfg))
    assert np.isfinite(summary["final_loss"]) and summary["final_loss"] < summary["first_loss"]
    assert summary["mfu"] is None or summary["mfu"] > 0


@pytest.mark.gpu_target
def test_llama3_8b_fits_eight_h100s_as_its_header_says(tmp_path):
    """experiments/llama3_8b.yaml, planned for h100-sxm-8 with XLA's GPU compiler (deviceless):
    the full 8 B model's program, its figures as the header states them."""
    path = pathlib.Path("experiments/llama3_8b.yaml")
    header = " ".join(line[2:] for line in path.read_text().splitlines() if line.startswith("#"))
    needs = float(re.search(r"plan says \"needs ([\d.]+) GiB per device", header).group(1))
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--config", str(path), "--topology", "h100-sxm-8", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["fits"] and "H100" in plan["compiled_for"]
    # the arguments are the whole model: float32 weights and two AdamW moments, 12 B per parameter, split 8 ways
    assert plan["xla"]["argument_bytes"] * 8 / 12 == pytest.approx(num_params(config_lib.load(path).model), rel=1e-3)
    assert plan["needed_bytes"] / 2**30 == pytest.approx(needs, rel=0.01)

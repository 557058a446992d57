"""Mixture-of-experts layers (meshpar.models.moe) in the decoder: capacity and dropless dispatch
against a per-token reference routed by hand, the tokens a small capacity drops, the same losses
under every layout with an all-to-all where the experts share the batch's axis, FLOPs and
parameter counts, and the config errors."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.models import llama, moe
from meshpar.models.llama import LlamaConfig, build, flops_per_token, layout_rules, num_params
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import parts, trainer
from meshpar.step.inputs import batch_shardings

LENGTH, BATCH, V = 16, 8, 64
SPEC = {"tokens": ((LENGTH + 1,), np.dtype(np.uint8))}
TINY = LlamaConfig(d_model=16, n_heads=2, n_kv_heads=1, d_head=8, d_ff=24, n_layers=2, vocab_size=V,
                   max_length=LENGTH, moe_experts=8, moe_top_k=2, moe_group_size=16)  # fmt: skip
D, E, F = 16, 8, 24


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"router": (D, E), "experts_gate": (E, D, F), "experts_up": (E, D, F), "experts_down": (E, F, D)}
    return {k: (rng.standard_normal(s) / math.sqrt(s[-2])).astype(np.float32) for k, s in shapes.items()}


def _h(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((4, LENGTH, D)).astype(np.float32)  # [batch, length, embed]


def _reference(p: dict[str, np.ndarray], h: np.ndarray, k: int, group: int, slots: int | None):
    """Each token through its top-k experts, by hand, in float64; with `slots`, each expert of a
    group takes assignments first choices first, in token order, until it has `slots`. Returns
    the output and the number of assignments dropped."""
    x = h.reshape(-1, D).astype(np.float64)
    logits = x @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :k]  # [tokens, k]
    weights = np.take_along_axis(probs, top, -1)
    weights = weights if k == 1 else weights / weights.sum(-1, keepdims=True)
    out, dropped = np.zeros_like(x), 0
    for start in range(0, len(x), group):
        taken = np.zeros(E, int)
        for j in range(k):
            for t in range(start, start + group):
                e = top[t, j]
                if slots is not None and taken[e] >= slots:
                    dropped += 1
                    continue
                taken[e] += 1
                gate, up = x[t] @ p["experts_gate"][e], x[t] @ p["experts_up"][e]
                out[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ p["experts_down"][e])
    return out.reshape(h.shape), dropped


def _moe(changes: dict, p, h):
    cfg = llama.switches(dataclasses.replace(TINY, **changes))
    y, stats = jax.jit(lambda p, h: moe.moe(cfg, p, h))(p, h)
    return cfg, np.asarray(y), {k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in stats.items()}


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_with_room_for_every_token_is_the_per_token_reference(k):
    p, h = _weights(), _h()
    # capacity factor experts / k: every expert has a slot for every token of its group
    cfg, y, stats = _moe({"moe_top_k": k, "moe_capacity_factor": E / k, "moe_group_size": 16}, p, h)
    assert moe.capacity(cfg, 16) == 16
    ref, dropped = _reference(p, h, k, 16, None)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    assert dropped == 0 and stats["dropped"] == 0.0


def test_dropless_is_the_per_token_reference():
    p, h = _weights(), _h()
    _, y, stats = _moe({"moe_dispatch": "dropless"}, p, h)
    ref, _ = _reference(p, h, 2, 16, None)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)
    assert stats["dropped"] == 0.0


def test_a_small_capacity_drops_the_assignments_past_it():
    p, h = _weights(), _h()
    cfg, y, stats = _moe({"moe_capacity_factor": 0.5, "moe_group_size": 16}, p, h)
    slots = moe.capacity(cfg, 16)
    assert slots == math.ceil(0.5 * 16 * 2 / E) == 2
    ref, dropped = _reference(p, h, 2, 16, slots)
    assert dropped > 0
    np.testing.assert_allclose(stats["dropped"], dropped / (h.shape[0] * LENGTH * 2), rtol=1e-6)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)  # the dropped assignments add nothing


def test_groups_depend_on_the_tokens_only():
    cfg = llama.switches(dataclasses.replace(TINY, moe_group_size=48))
    assert moe.group_size(cfg, 128) == 32 and moe.group_size(cfg, 96) == 48 and moe.group_size(cfg, 8) == 8


def test_aux_losses_are_switch_and_st_moe():
    p, h = _weights(), _h()
    _, _, stats = _moe({}, p, h)
    logits = h.reshape(-1, D).astype(np.float64) @ p["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1)[:, :2]
    f = np.bincount(top.ravel(), minlength=E) / top.size
    np.testing.assert_allclose(stats["balance"], E * np.sum(f * probs.mean(0)), rtol=1e-5)
    np.testing.assert_allclose(stats["share"], f, rtol=1e-6)  # the factors a pipeline averages
    np.testing.assert_allclose(stats["probs"], probs.mean(0), rtol=1e-5)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(stats["z"], np.mean(lse**2), rtol=1e-5)


def test_model_loss_adds_the_weighted_aux_losses_and_reports_each_layer():
    model = build(dataclasses.replace(TINY, moe_every=2), SPEC, nnx.Rngs(0))
    loss, metrics = jax.jit(lambda b: model.loss(b))(_batch())
    assert set(metrics) >= {"moe1_balance", "moe1_z", "moe1_dropped", "cross_entropy"} and "moe0_z" not in metrics
    extra = 0.01 * metrics["moe1_balance"] + 0.001 * metrics["moe1_z"]
    np.testing.assert_allclose(loss, metrics["cross_entropy"] + extra, rtol=1e-6)
    shapes = {"/".join(map(str, p)): v[...].shape for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert shapes["blocks/wq"][0] == 2 and shapes["blocks/w_gate"] == (1, D, F)  # one dense MLP, one MoE layer
    assert shapes["blocks/experts_gate"] == (1, E, D, F) and shapes["blocks/router"] == (1, D, E)


def test_params_and_flops_count_every_expert_but_only_the_active_ones():
    cfg = TINY
    model = build(cfg, SPEC, nnx.Rngs(0))
    assert sum(v[...].size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))) == num_params(cfg)
    dense = dataclasses.replace(cfg, moe_experts=0, d_ff=F)
    # each MoE layer: k experts' three matrices instead of one MLP's, plus the router
    per_layer = (2 - 1) * 3 * D * F + D * E
    assert flops_per_token(cfg, LENGTH) - flops_per_token(dense, LENGTH) == 6 * 2 * per_layer
    assert num_params(cfg) - num_params(dense) == 2 * ((E - 1) * 3 * D * F + D * E)


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    return {"tokens": np.random.default_rng(seed).integers(0, V, (BATCH, LENGTH + 1)).astype(np.uint8)}


LAYOUTS = {
    "experts": ("data:2,expert:4", "batch:data; experts:expert"),
    "all-to-all": ("data:8", "batch:data; experts:data"),
    "experts-model": ("data:4,model:2", "batch:data; experts:model; heads:model; vocab:model"),
}


def _train(name: str | None, steps: int = 3, lower: bool = False, cfg: LlamaConfig = TINY):
    """Losses of `steps` SGD steps of `cfg` on fixed batches, on one device (`name` None) or under
    layout `name`; with `lower`, the compiled step's HLO text instead."""
    graphdef, params = nnx.split(build(cfg, SPEC, nnx.Rngs(0)))

    def step(p, b):
        loss, g = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(b)[0])(p)
        return loss, jax.tree.map(lambda w, d: w - 0.5 * d, p, g)

    batches = [_batch(i) for i in range(steps)]
    if name is None:
        fn = jax.jit(step)
        losses = []
        for b in batches:
            loss, params = fn(params, b)
            losses.append(float(loss))
        return losses
    mesh_text, rules = LAYOUTS[name]
    mesh = mesh_lib.build_mesh(mesh_text)
    sizes = dict(mesh.shape)
    layout = layout_lib.Layout.create(layout_rules(cfg, layout_lib.on_mesh(rules, sizes), sizes), sizes)
    params = jax.device_put(params, trainer.tree_shardings(params, layout.params, mesh))
    shardings = batch_shardings(SPEC, layout, mesh)
    losses = []
    with layout_lib.activate(layout, mesh):
        fn = jax.jit(step)
        if lower:
            return fn.lower(params, jax.device_put(batches[0], shardings)).compile().as_text()
        for b in batches:
            loss, params = fn(params, jax.device_put(b, shardings))
            losses.append(float(loss))
    return losses


def test_every_layout_trains_to_the_same_losses():
    single = _train(None)
    assert single[-1] < single[0]
    for name in LAYOUTS:
        np.testing.assert_allclose(_train(name), single, rtol=1e-6, err_msg=name)


def test_experts_on_the_batch_axis_move_tokens_by_all_to_all():
    assert "all-to-all" in _train("all-to-all", lower=True)


def test_expert_groups_follow_the_batch_less_the_experts_axes():
    sizes = {"data": 2, "expert": 4}
    rules = (("batch", ("data", "expert")), ("experts", "expert"))
    assert ("expert_groups", "data") in layout_rules(TINY, rules, sizes)
    assert layout_rules(dataclasses.replace(TINY, moe_experts=0), rules, sizes) == rules


def _one_line(error: ConfigError, *words: str) -> str:
    text = str(error)
    assert "\n" not in text and all(w in text for w in words), text
    return text


def test_experts_that_do_not_divide_their_axis_are_one_config_line():
    with pytest.raises(ConfigError) as e:
        config_lib.load("experiments/moe_tiny.yaml", ["model.moe_experts=6"])  # checked as it is read
    assert _one_line(e.value, "6 experts", "experts:expert").startswith("model.moe_experts:")


@pytest.mark.parametrize(
    "override, words",
    [("model.moe_top_k=9", ("moe_top_k 9", "moe_experts 8")), ("model.moe_capacity_factor=0", ("moe_capacity_factor",)),
     ("model.moe_every=3", ("moe_every 3",))],
)  # fmt: skip
def test_top_k_capacity_and_spacing_are_one_config_line(override, words):
    cfg = config_lib.load("experiments/moe_tiny.yaml", [override, "train.progress=false"])
    with pytest.raises(ConfigError) as e:
        parts.abstract_step(cfg)
    assert _one_line(e.value, *words).startswith("model:")


def test_top_k_below_one_is_one_config_line():
    with pytest.raises(ConfigError) as e:
        config_lib.load("experiments/moe_tiny.yaml", ["model.moe_top_k=0"])
    assert _one_line(e.value, "must be >= 1").startswith("model.moe_top_k:")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dropless_with_split_experts_trains_to_the_single_device_losses(name):
    dropless = dataclasses.replace(TINY, moe_dispatch="dropless")
    np.testing.assert_allclose(_train(name, cfg=dropless), _train(None, cfg=dropless), rtol=1e-6, err_msg=name)


def test_dropless_with_split_experts_gathers_the_tokens_and_scatters_the_outputs():
    hlo = _train("all-to-all", lower=True, cfg=dataclasses.replace(TINY, moe_dispatch="dropless"))
    assert "all-gather" in hlo and "reduce-scatter" in hlo  # each device's experts see every token of its group


def test_dropless_with_split_experts_under_a_stage_axis_is_one_config_line():
    cfg = config_lib.load("experiments/moe_tiny.yaml", [
        "model.moe_dispatch=dropless", "mesh=data:2,stage:2,expert:2", "layout=batch:data; layers:stage; experts:expert",
        "train.microbatches=2", "train.progress=false"])  # fmt: skip
    with pytest.raises(ConfigError) as e:
        parts.abstract_step(cfg)
    _one_line(e.value, "dropless", "pipeline stage")


def test_build_rejects_bad_moe_configs():
    with pytest.raises(ValueError, match="moe_top_k 9"):
        build(dataclasses.replace(TINY, moe_top_k=9), SPEC, nnx.Rngs(0))


def test_dense_models_are_unchanged():
    dense = dataclasses.replace(TINY, moe_experts=0)
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(build(dense, SPEC, nnx.Rngs(0)), nnx.Param))}
    assert not any("expert" in n or "router" in n for n in names)
    model = build(dense, SPEC, nnx.Rngs(0))
    loss, metrics = jax.jit(lambda b: model.loss(b))(_batch())
    assert set(metrics) == {"accuracy"} and jnp.isfinite(loss)

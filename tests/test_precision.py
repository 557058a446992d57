"""Mixed precision for every model: float32 parameters and optimizer state, bfloat16 matmuls,
the softmax and the loss in float32."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshpar.configuration import config
from meshpar.configuration.config import ConfigError, OptimizerConfig
from meshpar.models import mlp, transformer
from meshpar.processes import stop
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import throughput, trainer
from meshpar.step.inputs import batch_shardings

BATCH, LENGTH = 8, 16
FAMILIES = {
    "mlp": (
        mlp.build,
        mlp.MLPConfig(hidden=(64, 32), num_classes=10),
        {"inputs": ((8, 8), np.dtype(np.uint8)), "targets": ((), np.dtype(np.int32))},
    ),
    "transformer": (
        transformer.build,
        transformer.TransformerConfig(
            d_model=32, n_heads=2, d_head=16, d_ff=64, n_layers=2, max_length=LENGTH, positions="rotary"
        ),
        {"tokens": ((LENGTH + 1,), np.dtype(np.uint8))},
    ),
}


def _setup(family: str, **dtypes):
    build, cfg, spec = FAMILIES[family]
    cfg = type(cfg)(**{**cfg.__dict__, **dtypes})
    mesh = mesh_lib.build_mesh("data:2")
    layout = layout_lib.Layout.create("batch:data", dict(mesh.shape))
    tx = trainer.make_optimizer(OptimizerConfig(name="adamw", learning_rate=0.01), 10)
    plan = trainer.plan_state(functools.partial(build, cfg, spec), tx, 0, layout, mesh)
    bs = batch_shardings(spec, layout, mesh)
    step = trainer.make_train_step(plan.graphdef, tx, layout, mesh, plan.shardings, bs)
    return mesh, layout, plan, spec, bs, step


def _abstract_args(mesh, plan, spec, bs):
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), plan.abstract, plan.shardings)
    batch = {k: jax.ShapeDtypeStruct((BATCH, *shape), dtype, sharding=bs[k]) for k, (shape, dtype) in spec.items()}
    flags = jax.ShapeDtypeStruct((mesh.size,), jnp.int32, sharding=stop.flag_sharding(mesh))
    return state, batch, flags


def _float_dtypes(tree) -> set:
    return {jnp.dtype(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_master_weights_and_optimizer_state_under_bfloat16_compute(family):
    _, _, plan, *_ = _setup(family, param_dtype="float32", compute_dtype="bfloat16")
    assert _float_dtypes(plan.abstract.params) == {jnp.dtype(jnp.float32)}
    mu = [x for x in jax.tree.leaves(plan.abstract.opt_state) if x.ndim > 0]  # adam's moments
    assert len(mu) == 2 * len(jax.tree.leaves(plan.abstract.params))
    assert _float_dtypes(plan.abstract.opt_state) == {jnp.dtype(jnp.float32)}
    # param_dtype is what decides: bfloat16 parameters give bfloat16 moments.
    _, _, plan16, *_ = _setup(family, param_dtype="bfloat16", compute_dtype="bfloat16")
    assert _float_dtypes(plan16.abstract.params) == {jnp.dtype(jnp.bfloat16)}


def _dot_operand_types(text: str) -> list[str]:
    """The element types of both operands of every dot_general in StableHLO text."""
    sigs = re.findall(r"stablehlo\.dot_general .*?: \(tensor<([^>]*)>, tensor<([^>]*)>\)", text)
    return [t.split("x")[-1] for pair in sigs for t in pair]  # tensor<8x64xbf16> → bf16


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_compute_runs_every_matmul_in_bfloat16(family):
    dots = {}
    for compute in ("float32", "bfloat16"):
        mesh, _, plan, spec, bs, step = _setup(family, compute_dtype=compute)
        dots[compute] = _dot_operand_types(step.lower(*_abstract_args(mesh, plan, spec, bs)).as_text())
    # forward and backward: at least 2 matmuls per layer, all of them in the compute dtype
    assert len(dots["bfloat16"]) == len(dots["float32"]) >= 2 * 3 * 2
    assert set(dots["float32"]) == {"f32"}
    assert set(dots["bfloat16"]) == {"bf16"}


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_and_loss_in_float32(family):
    build, cfg, spec = FAMILIES[family]
    cfg = type(cfg)(**{**cfg.__dict__, "compute_dtype": "bfloat16"})
    graphdef, params = trainer.abstract_model(functools.partial(build, cfg, spec))
    batch = {k: jax.ShapeDtypeStruct((BATCH, *shape), dtype) for k, (shape, dtype) in spec.items()}

    def loss(params, batch):
        return nnx.merge(graphdef, params).loss(batch)[0]

    jaxpr = jax.make_jaxpr(loss)(params, batch)
    assert jaxpr.out_avals[0].dtype == jnp.float32
    # exp/log appear only in softmaxes (attention's, the cross-entropy's log-sum-exp)
    types = re.findall(r":(\w+)\[[^\]]*\] = (?:exp|log) ", str(jaxpr))
    assert types and set(types) == {"f32"}, types


def test_bfloat16_mlp_trains_with_float32_state():
    mesh, layout, plan, _, bs, step = _setup("mlp", compute_dtype="bfloat16")
    state = plan.materialize(layout, mesh)
    rng = np.random.default_rng(0)
    host = {
        "inputs": rng.integers(0, 256, (BATCH, 8, 8), dtype=np.uint8),
        "targets": rng.integers(0, 10, BATCH, dtype=np.int32),
    }
    batch = {k: jax.device_put(v, bs[k]) for k, v in host.items()}
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch, stop.make_flags(mesh, 0))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] and np.isfinite(losses).all()
    assert _float_dtypes(state.params) == _float_dtypes(state.opt_state) == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("key", ["compute_dtype", "param_dtype", "remat"])
def test_mlp_precision_and_remat_keys_are_checked(key):
    with pytest.raises(ConfigError, match=rf"^model\.{key}: "):
        config.from_dict({"mesh": "data:8", "layout": "batch:data", "model": {"name": "mlp", key: "float16"}})
    cfg = config.from_dict(
        {"mesh": "data:8", "layout": "batch:data", "model": {"name": "mlp", "compute_dtype": "bfloat16"}}
    )
    assert throughput.compute_dtype(cfg.model) == "bfloat16"  # MFU against the bf16 peak

"""model.remat: the same losses as without it, less compiled temp memory, and named values that a
name-based policy keeps."""

from __future__ import annotations

import contextlib
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshpar.configuration.config import OptimizerConfig
from meshpar.models import decoder, mlp, remat, transformer
from meshpar.processes import stop
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import trainer
from meshpar.step.inputs import batch_shardings

LENGTH, BATCH, STEPS = 32, 8, 3
LM_SPEC = {"tokens": ((LENGTH + 1,), np.dtype(np.uint8))}  # byte windows, as the text source serves them
# Dropout on, so a recomputed layer must redraw the same masks.
LM = transformer.TransformerConfig(
    d_model=32, n_heads=4, d_head=8, d_ff=128, n_layers=4, max_length=LENGTH, dropout=0.1
)
MLP_SPEC = {"inputs": ((64,), np.dtype(np.float32)), "targets": ((), np.dtype(np.int32))}
MLP = mlp.MLPConfig(hidden=(128, 128, 64), num_classes=10)
# The names block() tags, each one a value its backward pass reads.
NAMES = ("layer_in", "attn_in", "query", "key", "value", "context", "attn_out", "attn_residual", "mlp_in", "mlp_hidden")


def _batch() -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(0).integers(0, 256, (BATCH, LENGTH + 1), dtype=np.int32)
    return {"tokens": tokens.astype(np.uint8)}  # the model cuts inputs and targets


def _tx():
    return trainer.make_optimizer(OptimizerConfig(name="adamw", learning_rate=0.01), STEPS)


@functools.cache
def _initial():
    """The initial train state and its shardings (remat changes neither: built once, with none)."""
    mesh = mesh_lib.build_mesh("data:2")
    layout = layout_lib.Layout.create("batch:data", dict(mesh.shape))
    _, state, shardings = trainer.init_state(functools.partial(transformer.build, LM, LM_SPEC), _tx(), 0, layout, mesh)
    return mesh, layout, state, shardings


@functools.cache
def _run(remat_: str) -> tuple[np.ndarray, int]:
    """LM's real train step (adamw, data:2) under `remat_`, on one batch again and again:
    (losses of STEPS steps, compiled temp bytes per device)."""
    mesh, layout, state, shardings = _initial()
    state = jax.tree.map(jnp.copy, state)  # the step donates its state
    graphdef, _ = trainer.abstract_model(functools.partial(transformer.build, _with(LM, remat=remat_), LM_SPEC))
    bs = batch_shardings(LM_SPEC, layout, mesh)
    batch = {k: jax.device_put(v, bs[k]) for k, v in _batch().items()}
    flags = stop.make_flags(mesh, 0)
    step = trainer.make_train_step(graphdef, _tx(), layout, mesh, shardings, bs).lower(state, batch, flags).compile()
    losses = []
    for _ in range(STEPS):
        state, metrics = step(state, batch, flags)
        losses.append(float(metrics["loss"]))
    return np.array(losses), int(step.memory_analysis().temp_size_in_bytes)


def _with(cfg, **changes):
    return type(cfg)(**{**cfg.__dict__, **changes})


@pytest.mark.parametrize("remat_", ["full", "dots"])
def test_remat_trains_like_none(remat_):
    losses, _ = _run(remat_)
    reference, _ = _run("none")
    assert reference[-1] < reference[0]
    np.testing.assert_allclose(losses, reference, rtol=1e-6)


def test_remat_lowers_temp_memory_of_a_deep_model():
    none, dots, full = (_run(r)[1] for r in ("none", "dots", "full"))
    # none keeps every layer's intermediates ([length, length] scores and probabilities
    # included); dots keeps the weight matmuls' outputs; full only each layer's input.
    assert full < dots < none, (full, dots, none)
    assert full < none / 2, (full, none)


def _saved(f, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    return out.getvalue()


def test_layers_tag_the_values_they_keep():
    cfg = _with(LM, positions="rotary", dropout=0.0)
    dcfg = transformer.switches(cfg)
    blocks = nnx.eval_shape(lambda: decoder.Blocks(dcfg, rngs=nnx.Rngs(0)))  # shapes only
    stacked = {name: getattr(blocks, name).get_value() for name in decoder.block_params(dcfg)}
    p = {name: jax.ShapeDtypeStruct(w.shape[1:], w.dtype) for name, w in stacked.items()}  # one layer
    x = jax.ShapeDtypeStruct((2, LENGTH, cfg.d_model), jnp.float32)

    def layer(policy):
        return jax.checkpoint(lambda p, x: decoder.block(dcfg, p, x, None).sum(), policy=policy)

    # A policy that keeps one name keeps exactly that value (and the layer's arguments).
    for name in NAMES:
        saved = _saved(layer(jax.checkpoint_policies.save_only_these_names(name)), p, x)
        assert saved.count("named ") == 1 and f"named '{name}'" in saved, (name, saved)
    assert f"f32[2,{LENGTH},{cfg.d_ff}] named 'mlp_hidden'" in saved
    # Attention's [length, length] scores and probabilities carry no name, so are never kept.
    by_name = _saved(layer(jax.checkpoint_policies.save_only_these_names(*NAMES)), p, x)
    assert f"[2,{cfg.n_heads},{LENGTH},{LENGTH}]" not in by_name and "named 'query'" in by_name
    assert f"[2,{cfg.n_heads},{LENGTH},{LENGTH}]" in _saved(layer(jax.checkpoint_policies.everything_saveable), p, x)
    assert "named " not in _saved(layer(jax.checkpoint_policies.nothing_saveable), p, x)


def test_mlp_layers_tag_the_values_they_keep(monkeypatch):
    graphdef, params = trainer.abstract_model(functools.partial(mlp.build, _with(MLP, remat="full"), MLP_SPEC))
    batch = {k: jax.ShapeDtypeStruct((BATCH, *shape), dtype) for k, (shape, dtype) in MLP_SPEC.items()}

    def loss(params, batch):
        return nnx.merge(graphdef, params).loss(batch)[0]

    assert "named " not in _saved(loss, params, batch)  # full: nothing kept inside a layer
    # The same model under a policy that keeps one name: every hidden layer keeps that value.
    monkeypatch.setitem(remat.POLICIES, "full", remat.Policy(saves=("pre_activation",)))
    saved = _saved(loss, params, batch)
    assert saved.count("named 'pre_activation'") == len(MLP.hidden), saved


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_remat_applies_to_every_layer_scanned_or_unrolled(scan_layers):
    cfg = _with(LM, n_layers=2, scan_layers=scan_layers)
    batch = {k: jax.ShapeDtypeStruct((BATCH, *shape), dtype) for k, (shape, dtype) in LM_SPEC.items()}
    scores = f"{BATCH},{cfg.n_heads},{LENGTH},{LENGTH}]"  # attention's probabilities (stacked or not)
    counts = {}
    for remat_ in ("none", "full"):
        graphdef, params = trainer.abstract_model(
            functools.partial(transformer.build, _with(cfg, remat=remat_), LM_SPEC)
        )

        def loss(params, batch, graphdef=graphdef):
            return nnx.merge(graphdef, params).loss(batch)[0]

        counts[remat_] = _saved(loss, params, batch).count(scores)
    assert counts["none"] > 0 and counts["full"] == 0, counts

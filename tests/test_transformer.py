"""Decoder-only Transformer: shapes, dims metadata, FLOPs, causality, overfitting, layouts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from meshpar.models.transformer import TransformerConfig, build, flops_per_token, num_params
from meshpar.processes import stop
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import trainer
from meshpar.step.inputs import batch_shardings

VOCAB = {"batch", "length", "embed", "heads", "kv", "d_ff", "vocab", "layers"}
LENGTH, BATCH = 32, 8
SPEC = {"tokens": ((LENGTH + 1,), np.dtype(np.uint8))}  # as TextSource serves bytes
TINY = TransformerConfig(d_model=32, n_heads=4, d_head=8, d_ff=64, n_layers=2, max_length=LENGTH)


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Random byte windows ``[batch, length + 1]``, as TextSource serves them."""
    return {
        "tokens": np.random.default_rng(seed).integers(0, 256, (BATCH, LENGTH + 1), dtype=np.int32).astype(np.uint8)
    }


def _inputs(seed: int = 0) -> np.ndarray:
    """The model's int32 inputs ``[batch, length]``: each window but its last token."""
    return _batch(seed)["tokens"][:, :-1].astype(np.int32)


def _params(model) -> list[tuple[str, nnx.Variable]]:
    return [("/".join(map(str, p)), v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


@functools.cache
def _logits_fn(cfg: TransformerConfig):
    graphdef, params = nnx.split(build(cfg, SPEC, nnx.Rngs(0)))
    return params, jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))


@functools.partial(jax.jit, static_argnums=(0, 3))
def _jit_loss(graphdef, params, batch, dropout_seed):
    """model.loss jitted (one compile instead of op-by-op dispatch); seed None = eval."""
    rngs = None if dropout_seed is None else nnx.Rngs(dropout=dropout_seed)
    return nnx.merge(graphdef, params).loss(batch, rngs)


def _loss(model, batch, dropout_seed=None):
    graphdef, params = nnx.split(model)
    return _jit_loss(graphdef, params, batch, dropout_seed)


@pytest.mark.parametrize(
    "cfg",
    [
        TINY,
        TransformerConfig(**{**TINY.__dict__, "positions": "rotary", "tie_embeddings": True, "scan_layers": False}),
    ],
    ids=["learned-untied-scan", "rotary-tied-unrolled"],
)
def test_shapes_dims_and_param_count(cfg):
    model = build(cfg, SPEC, nnx.Rngs(0))
    batch = _batch()
    logits = _logits_fn(cfg)[1](nnx.state(model), _inputs())
    assert logits.shape == (BATCH, LENGTH, 256) and logits.dtype == jnp.float32
    loss, metrics = _loss(model, batch)
    assert loss.shape == () and set(metrics) == {"accuracy"}
    assert abs(float(loss) - np.log(256)) < 1.0  # near-uniform at init
    total = 0
    for name, var in _params(model):
        dims = var.get_metadata().get("dims")
        assert dims is not None and len(dims) == var[...].ndim, name
        assert set(dims) <= VOCAB and len(set(dims)) == len(dims), (name, dims)
        if name.startswith("blocks/"):
            assert dims[0] == "layers" and var[...].shape[0] == cfg.n_layers, name
        total += var[...].size
    assert total == num_params(cfg)


def test_build_rejects_bad_configs():
    with pytest.raises(ValueError, match="exceeds max_length"):
        build(TransformerConfig(**{**TINY.__dict__, "max_length": LENGTH - 1}), SPEC, nnx.Rngs(0))
    with pytest.raises(ValueError, match="even d_head"):
        build(TransformerConfig(**{**TINY.__dict__, "d_head": 7, "positions": "rotary"}), SPEC, nnx.Rngs(0))


def test_flops_per_token_hand_count():
    # N = layers * (4 * d_model * heads*d_head + 2 * d_model * d_ff) + d_model * vocab
    #   = 2 * (4*32*32 + 2*32*64) + 32*256 = 2 * (4096 + 4096) + 8192 = 24576
    # attention = 12 * layers * heads*d_head * length = 12 * 2 * 32 * 32 = 24576
    assert flops_per_token(TINY, LENGTH) == 6 * 24576 + 24576 == 172032.0
    # the count does not depend on positions / tying (no matmul difference)
    tied = TransformerConfig(**{**TINY.__dict__, "tie_embeddings": True, "positions": "rotary"})
    assert flops_per_token(tied, LENGTH) == 172032.0


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_causal(positions):
    cfg = TransformerConfig(**{**TINY.__dict__, "positions": positions})
    params, fn = _logits_fn(cfg)
    x = _inputs()
    t = 13
    x2 = x.copy()
    x2[:, t] = (x2[:, t] + 1) % 256
    a, b = np.asarray(fn(params, x)), np.asarray(fn(params, x2))
    np.testing.assert_array_equal(a[:, :t], b[:, :t])  # the past does not see the future
    assert np.abs(a[:, t:] - b[:, t:]).max(axis=-1).min() > 0  # every later position does


def test_scan_and_unrolled_agree_with_dropout():
    cfg = TransformerConfig(**{**TINY.__dict__, "dropout": 0.2})
    batch = _batch()
    model = build(cfg, SPEC, nnx.Rngs(0))
    unrolled = build(TransformerConfig(**{**cfg.__dict__, "scan_layers": False}), SPEC, nnx.Rngs(0))
    train = [float(_loss(m, batch, 1)[0]) for m in (model, unrolled)]
    evals = [float(_loss(m, batch)[0]) for m in (model, unrolled)]
    np.testing.assert_allclose(train[0], train[1], rtol=1e-6)
    np.testing.assert_allclose(evals[0], evals[1], rtol=1e-6)
    assert train[0] != evals[0]  # dropout on in training, off in eval
    assert float(_loss(model, batch, 1)[0]) == train[0]  # seeded
    assert float(_loss(model, batch, 2)[0]) != train[0]


def test_bfloat16_compute_loss_is_float32():
    cfg = TransformerConfig(**{**TINY.__dict__, "compute_dtype": "bfloat16", "param_dtype": "bfloat16"})
    model = build(cfg, SPEC, nnx.Rngs(0))
    assert all(v[...].dtype == jnp.bfloat16 for _, v in _params(model))
    loss, _ = _loss(model, _batch())
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    f32, _ = _loss(build(TINY, SPEC, nnx.Rngs(0)), _batch())
    assert abs(float(loss) - float(f32)) < 0.05


def test_overfits_one_batch():
    model = build(TINY, SPEC, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = optax.adam(3e-3)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}

    @jax.jit
    def steps(params, opt_state):
        def one(carry, _):
            p, o = carry
            loss, g = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(batch)[0])(p)
            u, o = tx.update(g, o, p)
            return (optax.apply_updates(p, u), o), loss

        (params, opt_state), losses = jax.lax.scan(one, (params, opt_state), None, length=100)
        return losses

    losses = np.asarray(steps(params, tx.init(params)))
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


LAYOUTS = [
    "batch:data; d_ff:model; heads:model; vocab:model",  # Mesh TensorFlow data + model
    "batch:data",  # pure data parallel
    "d_ff:model; heads:model; vocab:model",  # pure model parallel
    "batch:data; embed:model",  # 2-D: [batch, length, embed] split on both axes
    "d_ff:model; heads:model; vocab:model; embed:data",  # 2-D weights, batch replicated
]
STEPS = 3


def _train(rules: str, mesh):
    layout = layout_lib.Layout.create(rules, dict(mesh.shape))
    tx = optax.adam(1e-2)
    build_fn = functools.partial(build, TINY, SPEC)
    graphdef, state, shardings = trainer.init_state(build_fn, tx, 0, layout, mesh)
    bs = batch_shardings(SPEC, layout, mesh)
    step = trainer.make_train_step(graphdef, tx, layout, mesh, shardings, bs)
    losses = []
    for i in range(STEPS):
        batch = {k: jax.device_put(v, bs[k]) for k, v in _batch(i).items()}
        state, metrics = step(state, batch, stop.make_flags(mesh, 0))
        losses.append(float(metrics["loss"]))
    return layout, state, np.array(losses)


@pytest.fixture(scope="module")
def mesh():
    return mesh_lib.build_mesh("data:4,model:2")


@pytest.fixture(scope="module")
def runs(mesh):
    return {rules: _train(rules, mesh) for rules in LAYOUTS}


def test_weights_are_split_by_their_dims(runs):
    split_ways = {}
    for rules, (layout, state, _) in runs.items():
        for path, var in nnx.to_flat_state(state.params):
            dims, arr = var.get_metadata()["dims"], var[...]
            local = arr.addressable_shards[0].data.shape
            want = tuple(n // layout.axis_size(d) for n, d in zip(arr.shape, dims))
            assert local == want, (rules, path, dims, arr.shape, local)
            split_ways[rules, "/".join(map(str, path))] = arr.size // int(np.prod(local))
    mtf = {name: n for (rules, name), n in split_ways.items() if rules == LAYOUTS[0]}
    # Mesh TensorFlow layout: every d_ff / heads / vocab weight is split 2 ways, nothing else is
    halves = {"blocks/wq", "blocks/wk", "blocks/wv", "blocks/wo", "blocks/w_in", "blocks/w_out", "embed", "unembed"}
    assert {name for name, n in mtf.items() if n == 2} == halves
    assert all(n == 1 for name, n in mtf.items() if name not in halves)
    # 2-D weights: embed over data (4) x heads / d_ff / vocab over model (2) = 8 ways
    assert split_ways[LAYOUTS[4], "blocks/wq"] == split_ways[LAYOUTS[4], "blocks/w_in"] == 8


def test_layouts_change_placement_not_math(runs):
    # float32; differences are only reduction order in sharded contractions (seen: <= 2.4e-7 relative)
    reference = runs[LAYOUTS[1]][2]
    assert reference[-1] < reference[0]
    for rules, (_, _, losses) in runs.items():
        np.testing.assert_allclose(losses, reference, rtol=1e-5, err_msg=rules)


def test_batch_and_embed_cannot_share_an_axis(mesh):
    # Every parameter is fine under this layout; the [batch, length, embed] activation is not.
    layout = layout_lib.Layout.create("batch:data; embed:data", dict(mesh.shape))
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    with layout_lib.activate(layout, mesh), pytest.raises(layout_lib.LayoutError, match="'batch' and 'embed'"):
        jax.eval_shape(lambda: build(TINY, SPEC, nnx.Rngs(0)).loss(batch))  # traces only


def test_the_token_window_is_cut_on_device_and_a_layout_may_split_length(mesh):
    # The host sends one uint8 [batch, length + 1] window per row; the loss cuts inputs (its
    # first length tokens) and targets (its last length) on the devices. The window dim is never
    # split (length + 1 does not divide by the axis), so a layout that splits length still runs.
    params, logits_fn = _logits_fn(TINY)
    graphdef = nnx.graphdef(build(TINY, SPEC, nnx.Rngs(0)))
    tokens = _batch()["tokens"]
    logits = logits_fn(params, _inputs())
    by_hand = float(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:].astype(np.int32)).mean())
    layout = layout_lib.Layout.create("batch:data; length:model", dict(mesh.shape))
    placed = jax.device_put(tokens, batch_shardings(SPEC, layout, mesh)["tokens"])  # [batch, length + 1]
    with layout_lib.activate(layout, mesh):
        loss = float(jax.jit(lambda p, t: nnx.merge(graphdef, p).loss({"tokens": t})[0])(params, placed))
    # float32; only the reduction order of the split contractions differs (as between layouts)
    np.testing.assert_allclose(loss, by_hand, rtol=1e-5)

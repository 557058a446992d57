"""Attention cores (xla, blockwise, cudnn's fallback) and the layer loop's unroll choice."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.models import attention
from meshpar.models.layers import scan_unroll
from meshpar.models.transformer import TransformerConfig, build
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import trainer
from meshpar.step.inputs import batch_shardings

LENGTH, BATCH = 32, 8
SPEC = {"tokens": ((LENGTH + 1,), np.dtype(np.uint8))}
TINY = TransformerConfig(d_model=32, n_heads=4, d_head=8, d_ff=64, n_layers=3, max_length=LENGTH, positions="rotary")
MTF = "batch:data; d_ff:model; heads:model; vocab:model"


def _with(cfg, **changes):
    return type(cfg)(**{**cfg.__dict__, **changes})


def _batch(seed: int) -> dict[str, np.ndarray]:
    return {
        "tokens": np.random.default_rng(seed).integers(0, 256, (BATCH, LENGTH + 1), dtype=np.int32).astype(np.uint8)
    }


@functools.cache
def _adam_losses(cfg: TransformerConfig, steps: int = 4) -> tuple[float, ...]:
    """Adam(1e-2) on one device, batches 0..steps-1: the loss of each step."""
    graphdef, params = nnx.split(build(cfg, SPEC, nnx.Rngs(0)))
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(batch)[0])(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    opt, losses = tx.init(params), []
    for i in range(steps):
        params, opt, loss = step(params, opt, _batch(i))
        losses.append(float(loss))
    return tuple(losses)


# The same four steps run by the model as it was before the dense projections became 2-D
# matmuls and the layer scan was unrolled on CPU (einsums, one layer per scan iteration).
BEFORE = (6.0889058113098145, 6.012034893035889, 6.0367279052734375, 5.970252513885498)


@pytest.mark.parametrize("changes", [{}, {"scan_unroll": 1}], ids=["unrolled", "loop"])
def test_losses_are_those_of_the_step_before(changes):
    np.testing.assert_allclose(_adam_losses(_with(TINY, **changes)), BEFORE, rtol=1e-5)


def test_blockwise_trains_like_plain_with_heads_and_batch_split():
    # Mesh TensorFlow's layout: batch over data, heads over model. SGD steps by hand, so the
    # gradients themselves can be compared, leaf by leaf.
    mesh = mesh_lib.build_mesh("data:4,model:2")
    layout = layout_lib.Layout.create(MTF, dict(mesh.shape))
    bs = batch_shardings(SPEC, layout, mesh)
    losses, grads = {}, {}
    for name, cfg in (
        ("xla", _with(TINY, attention="xla")),
        ("blockwise", _with(TINY, attention="blockwise", attention_block=8)),
    ):
        graphdef, state, _ = trainer.init_state(functools.partial(build, cfg, SPEC), optax.sgd(0.1), 0, layout, mesh)

        @jax.jit
        def step(params, batch, graphdef=graphdef):
            with layout_lib.activate(layout, mesh):
                loss, g = jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(batch)[0])(params)
            return loss, g, jax.tree.map(lambda p, d: p - 0.1 * d, params, g)

        params, losses[name] = state.params, []
        for i in range(3):
            loss, g, params = step(params, {k: jax.device_put(v, bs[k]) for k, v in _batch(i).items()})
            losses[name].append(float(loss))
            grads.setdefault(name, g)  # the first step's
    np.testing.assert_allclose(losses["blockwise"], losses["xla"], rtol=1e-5)
    assert losses["xla"][-1] < losses["xla"][0]
    for (path, a), (_, b) in zip(nnx.to_flat_state(grads["xla"]), nnx.to_flat_state(grads["blockwise"])):
        a, b = np.asarray(a[...]), np.asarray(b[...])
        assert np.abs(a).max() > 0, path
        assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), (path, np.abs(a - b).max(), np.abs(a).max())


def _attention_temp(implementation: str, length: int, block: int = 128) -> int:
    """Temp bytes of attention's forward + backward on one device, ``[1, length, 2, 16]`` fp32."""
    shape = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)

    def loss(q, k, v):
        return attention.attention(q, k, v, implementation, block).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def test_blockwise_never_holds_length_squared():
    scores = 2 * 1024 * 1024 * 4  # one [batch=1, heads=2, 1024, 1024] float32 array
    plain, blocked = _attention_temp("xla", 1024), _attention_temp("blockwise", 1024)
    assert plain >= 4 * scores, plain  # scores, probabilities and their gradients, whole
    assert blocked < scores, blocked  # blocks of [length, 128] only
    assert _attention_temp("blockwise", 2048) < 2.1 * blocked  # grows with length x block, not length²


def test_attention_block_must_divide_the_length(tmp_path):
    base = ["model.attention=blockwise", f"workdir={tmp_path}"]
    with pytest.raises(ConfigError) as e:
        config.load("experiments/quickstart.yaml", [*base, "model.attention_block=48"])
    assert (
        str(e.value)
        == "model.attention_block: 48 does not divide data.length 128 (model.attention: blockwise splits it into blocks)"
    )
    assert config.load("experiments/quickstart.yaml", [*base, "model.attention_block=32"]).model.attention_block == 32
    assert config.load("experiments/quickstart.yaml", [*base, "model.attention_block=512"])  # one block of 128
    assert config.load(
        "experiments/quickstart.yaml", ["model.attention_block=48", f"workdir={tmp_path}"]
    )  # xla: unused
    with pytest.raises(ValueError, match="attention_block 12 does not divide the sequence length 32"):
        build(_with(TINY, attention="cudnn", attention_block=12), SPEC, nnx.Rngs(0))


def test_choices_by_backend():
    # On CPU: auto is the plain XLA path, cudnn falls back to blockwise (and says why).
    shape = (2, 64, 4, 16)
    assert attention.resolve("auto", shape, jnp.bfloat16, 16) == "xla"
    assert attention.resolve("cudnn", shape, jnp.bfloat16, 16) == "blockwise"
    assert attention.resolve("xla", shape, jnp.bfloat16, 16) == "xla"
    assert "not a CUDA GPU" in attention.cudnn_problem(shape, jnp.dtype(jnp.bfloat16))
    # The layer loop: unrolled on CPU up to 8 layers without remat, else one layer per iteration; as set otherwise.
    assert [scan_unroll(_with(TINY, n_layers=n)) for n in (3, 8, 9)] == [3, 8, 1]
    assert scan_unroll(_with(TINY, remat="full")) == 1  # rematerialised layers keep their loop
    assert scan_unroll(_with(TINY, scan_unroll=2)) == 2 and scan_unroll(_with(TINY, scan_unroll=5)) == 3

    def loops(cfg) -> int:
        graphdef, params = nnx.split(build(cfg, SPEC, nnx.Rngs(0)))
        grad = jax.jit(jax.grad(lambda p, b: nnx.merge(graphdef, p).loss(b)[0]))
        return grad.lower(params, _batch(0)).as_text().count("stablehlo.while")

    assert loops(TINY) == 0  # no layer loop at all
    assert loops(_with(TINY, scan_unroll=1)) == 2  # forward and backward scans

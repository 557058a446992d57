"""Hybrid sharding: FSDP within a node and data parallel across nodes (``mesh: data:N,fsdp:M``,
``layout: batch:(data,fsdp)``, ``param_layout: embed:fsdp``). Each weight's gradient is reduced
straight into its own split (:func:`meshpar.sharding.layout.use`): reduced over fsdp, and only that shard
over data, never the whole gradient all-reduced over both axes (the slow link between nodes
included). It trains as the plain data-parallel layout does."""

import math

import jax
import numpy as np
import pytest

from meshpar.configuration import config
from meshpar.plan import gpu_target, topology
from meshpar.plan.time import timing
from meshpar.processes import stop
from meshpar.run import experiment
from meshpar.step import parts

# A small byte-level Transformer, its batch over (data, fsdp): 2 "nodes" of 4 devices each.
TINY = [
    "mesh=data:2,fsdp:4", "layout=batch:(data,fsdp)", "model.d_model=32", "model.n_heads=2", "model.d_head=16",
    "model.d_ff=64", "model.max_length=16", "data.length=16", "data.max_bytes=200000", "train.batch_size=16",
    "train.progress=false", "checkpoint.every=0", "optimizer.warmup_steps=2", "hardware.peak_tflops=1",
]  # fmt: skip
HYBRID = "param_layout=embed:fsdp"


def _cfg(tmp_path, *overrides):
    return config.load("experiments/quickstart.yaml", [*TINY, f"workdir={tmp_path}", *overrides])


def _steps(cfg, n: int) -> list[tuple[float, float]]:
    """(loss, gradient norm) of the first `n` steps."""
    exp = experiment.build(cfg)
    flags, state, out = stop.make_flags(exp.mesh, 0), exp.state, []
    for i in range(n):
        state, metrics = exp.train_step(state, exp.inputs.feeder.place(exp.inputs.train.batch(i))[0], flags)
        out.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return out


def _gradient_bytes(step, itemsize: int) -> int:
    """The whole gradient's bytes at `itemsize` bytes per parameter."""
    return itemsize * sum(math.prod(x.shape) for x in jax.tree.leaves(step.plan.abstract.params))


def _over(found, kind: str, axes: set[str]) -> int:
    """Bytes per device the `kind` collectives whose groups span exactly `axes` move."""
    return sum(b for k, b, a in found if k == kind and set(a.split(",")) == axes)


def test_hybrid_sharding_trains_like_plain_data_parallel(tmp_path):
    # float32, no dropout: the same losses and gradient norms, step for step, to float
    # reassociation (the gradients are summed in another order).
    plain = _steps(_cfg(tmp_path / "plain"), 5)
    hybrid = _steps(_cfg(tmp_path / "hybrid", HYBRID), 5)
    assert plain[-1][0] < plain[0][0]  # it trains
    np.testing.assert_allclose(hybrid, plain, rtol=1e-5)


def test_no_gradient_is_all_reduced_over_both_axes_on_cpu(tmp_path):
    step = parts.abstract_step(_cfg(tmp_path, HYBRID))
    found = timing.collectives(step.lower().compile(), step.mesh)
    # Only the loss's sums and the norm scales' few floats, not the float32 gradient.
    assert _over(found, "all-reduce", {"data", "fsdp"}) < 0.05 * _gradient_bytes(step, 4), found


@pytest.mark.gpu_target
def test_the_gpu_program_reduce_scatters_within_a_node_and_all_reduces_shards_across(tmp_path):
    """Compiled for 2 hosts of 8 H100s (deviceless): the layer scan's weight gradients, bfloat16,
    are reduce-scattered over fsdp (NVLink) and only their 1/8 shards all-reduced over data
    (InfiniBand). jax's own transpose all-reduced each whole gradient over all 16 devices."""
    cfg = _cfg(
        tmp_path, HYBRID, "mesh=data:2,fsdp:8", "model.d_model=256", "model.n_heads=4", "model.d_head=64",
        "model.d_ff=1024", "model.max_length=128", "data.length=128", "model.compute_dtype=bfloat16",
    )  # fmt: skip
    target = gpu_target.target(topology.load("h100-sxm-2x8"), cfg.mesh)
    step = parts.abstract_step(cfg, devices=target.devices)
    found = timing.collectives(step.lower().compile(), step.mesh)
    gradient = _gradient_bytes(step, 2)
    assert _over(found, "all-reduce", {"data", "fsdp"}) < 0.05 * gradient, found
    within = _over(found, "reduce-scatter", {"fsdp"})
    assert within > 0.9 * gradient, found
    assert _over(found, "all-reduce", {"data"}) < 1.1 * within / 8, found

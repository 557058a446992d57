"""The step-time model: FLOPs and collectives read from real compiled train steps."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import pytest

from meshpar.configuration import config
from meshpar.plan import topology
from meshpar.plan.time import timing
from meshpar.step import aot, parts

# A transformer small enough to compile in about a second.
TINY = (
    "model.d_model=32", "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.max_length=16",
    "data.length=16", "data.max_bytes=200000", "train.batch_size=8",
)  # fmt: skip


@functools.cache
def compiled(path: str, *overrides: str):
    """(abstract step, compiled train step) of `path` with `overrides`."""
    step = parts.abstract_step(config.load(path, [*overrides, "train.progress=false"]))
    return step, step.lower().compile()


def xla_flops(program) -> float:
    cost = program.cost_analysis()
    return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])


@pytest.mark.parametrize(
    "path,overrides",
    [("experiments/mlp_model_parallel.yaml", ()), ("experiments/quickstart.yaml", TINY)],
    ids=["mlp", "transformer-unrolled"],
)
def test_hlo_flops_equal_xla_cost_analysis_when_nothing_loops(path, overrides):
    _, program = compiled(path, *overrides)
    ours, xla = timing.hlo_flops(program), xla_flops(program)
    assert xla > 0
    assert ours == pytest.approx(xla, rel=0.01)


def test_scanned_layers_are_counted_once_per_trip():
    # XLA counts a scan's body once: its figure barely moves from 4 to 8 scanned layers.
    quickstart = "experiments/quickstart.yaml"
    runs = {n: compiled(quickstart, *TINY, f"model.n_layers={n}", "model.scan_unroll=1") for n in (4, 8)}
    ours = {n: timing.hlo_flops(p) for n, (_, p) in runs.items()}
    xla = {n: xla_flops(p) for n, (_, p) in runs.items()}
    per_layer = (ours[8] - ours[4]) / 4
    assert per_layer > 0.1 * ours[4]
    outside = (xla[8] - xla[4]) / 4  # what XLA does count per layer: the optimizer's update of it
    assert outside < 0.2 * per_layer  # XLA's count misses most of each added layer
    # Four trips of the layer body where XLA counts one: three bodies more than XLA's figure.
    assert (ours[4] - xla[4]) / (per_layer - outside) == pytest.approx(3, rel=0.01)


def test_nested_loops_multiply_their_trip_counts_with_or_without_xlas_annotation():
    w = jnp.ones((64, 64))

    def f(x):
        def outer(c, _):
            return jax.lax.scan(lambda d, _: (jnp.tanh(d @ w), None), c, None, length=4)[0], None

        return jax.lax.scan(outer, x, None, length=3)[0]

    program = jax.jit(f).lower(jnp.ones((64, 64))).compile()
    matmul = 2 * 64**3
    assert xla_flops(program) < 2 * matmul  # one matmul, counted once
    text = program.as_text()
    assert timing.hlo_flops(text) == pytest.approx(12 * matmul, rel=0.01)
    # Without known_trip_count the bound comes from each loop condition's comparison.
    bare = re.sub(r',?"known_trip_count":\{"n":"\d+"\}', "", text)
    assert "known_trip_count" not in bare
    assert timing.hlo_flops(bare) == pytest.approx(12 * matmul, rel=0.01)


def param_bytes_per_device(step) -> int:
    return sum(v["per_device_bytes"] for k, v in aot.state_bytes(step.plan).items() if k.startswith("params/"))


def test_data_parallel_step_all_reduces_its_gradients_over_data():
    step, program = compiled("experiments/mlp_data_parallel.yaml")
    found = timing.collectives(program, step.mesh)
    assert {axis for _, _, axis in found} == {"data"}
    grads = [b for kind, b, axis in found if kind == "all-reduce"]
    # Every gradient once (the params' bytes), plus the loss's few scalars riding along.
    assert param_bytes_per_device(step) <= max(grads) <= param_bytes_per_device(step) + 64


def test_model_parallel_step_reduces_activations_over_model_and_gradient_shards_over_data():
    step, program = compiled("experiments/mlp_model_parallel.yaml")
    found = timing.collectives(program, step.mesh)
    # hidden:model splits the second layer's rows: its [batch/4, 256] float32 partial sums are
    # all-reduced over model (the 2 devices of a data row, devices {0,1}, {2,3}, ...).
    rows = step.cfg.train.batch_size // step.mesh.shape["data"]
    assert ("all-reduce", rows * 256 * 4, "model") in found
    # The gradients of each device's parameter shards are reduced over data (devices {0,2,4,6}
    # and {1,3,5,7}: strided groups), half the data-parallel bytes for the split layers.
    data = [b for kind, b, axis in found if kind == "all-reduce" and axis == "data"]
    assert param_bytes_per_device(step) <= max(data) <= param_bytes_per_device(step) + 64


def test_fsdp_gathers_its_parameters_over_data():
    step, program = compiled("experiments/transformer_fsdp.yaml", *TINY)
    plain_step, plain = compiled("experiments/quickstart.yaml", *TINY)
    gathers = [(b, axis) for kind, b, axis in timing.collectives(program, step.mesh) if kind == "all-gather"]
    assert any(axis == "data" for _, axis in gathers)
    assert not [a for k, _, a in timing.collectives(plain, plain_step.mesh) if k == "all-gather" and a == "data"]


HLO = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[16,4]) -> f32[16,4] {
  %p = f32[16,4]{1,0} parameter(0)
  ROOT %r = f32[16,4]{1,0} all-reduce(%p), replica_groups=GROUPS, use_global_device_ids=true, to_apply=%add
}
"""


@pytest.mark.parametrize(
    "groups,axis",
    [
        ("{{0,1},{2,3},{4,5},{6,7}}", "model"),
        ("[4,2]<=[8]", "model"),
        ("mesh['x'=4,'y'=2] {'y'}", "model"),
        ("{{0,2,4,6},{1,3,5,7}}", "data"),
        ("[2,4]<=[4,2]T(1,0)", "data"),
        ("mesh['x'=4,'y'=2] {'x'}", "data"),
        ("mesh['x'=1,'y'=2,'z'=4], device_ids=([4,2]T(1,0)) {'z'}", "data"),
        ("{{0,1,2,3,4,5,6,7}}", "data,model"),
        ("mesh['x'=4,'y'=2] {'x','y'}", "data,model"),
    ],
)
def test_every_replica_group_form_maps_onto_the_mesh(groups, axis):
    found = timing.collectives(HLO.replace("GROUPS", groups), {"data": 4, "model": 2})
    assert found == [("all-reduce", 16 * 4 * 4, axis)]


def test_predicted_terms_follow_the_machine():
    h100 = topology.load("h100-sxm-8")
    step, program = compiled("experiments/mlp_data_parallel.yaml")
    base = timing.predict(step, program, h100)
    total = base.compute_s + base.collective_s - base.hidden_s + base.exposed_feed_s
    assert base.total_s == pytest.approx(total) and 0 <= base.hidden_s <= base.collective_s
    assert base.compute_s >= max(base.flops_s, 0.0) and base.flops > 0 and base.bytes > 0
    assert {(c.kind, c.axis) for c in base.collectives} == {("all-reduce", "data")}
    # Every kernel pays the machine's fixed cost, and the step runs as many as its program has.
    assert base.kernels > 0 and base.launch_s == pytest.approx(base.kernels * h100.kernels.launch_s)
    # This small MLP is bound by memory and kernel launches on an H100: twice the tensor-core
    # peak halves the FLOP bound but leaves the compute time within a few percent; twice the HBM
    # bandwidth shortens the part beyond the launches. Collectives stay.
    faster = dataclasses.replace(h100, peak_flops={k: 2 * v for k, v in h100.peak_flops.items()})
    fast = timing.predict(step, program, faster)
    assert fast.flops_s == pytest.approx(base.flops_s / 2)
    assert fast.compute_s == pytest.approx(base.compute_s, rel=0.05) and fast.collective_s == base.collective_s
    wide = dataclasses.replace(h100, device_memory_bandwidth=2 * h100.device_memory_bandwidth)
    wider = timing.predict(step, program, wide)
    assert wider.compute_s - wider.launch_s < 0.9 * (base.compute_s - base.launch_s)
    assert wider.collective_s == base.collective_s
    # The same gradients over a PCIe box take longer than over NVLink.
    pcie = timing.predict(step, program, topology.load("a100-pcie-8"))
    assert pcie.collective_s > base.collective_s
    # A feed longer than the compute: with prefetch it is exposed only past the compute.
    feed = 3 * base.compute_s
    overlapped = timing.predict(step, program, h100, feed_s=feed)
    unfetched = config.load("experiments/mlp_data_parallel.yaml", ["feed.prefetch=0"])
    serial = timing.predict(dataclasses.replace(step, cfg=unfetched), program, h100, feed)
    assert overlapped.exposed_feed_s == pytest.approx(feed - base.compute_s)
    assert serial.exposed_feed_s == feed and serial.total_s > overlapped.total_s


# A two-layer MLP 2048 wide: at a few thousand rows per device its matmuls, not kernel launches,
# take most of its step on a GPU (its data source is synthetic: 256 examples make the spec).
WIDE = ("model.hidden=[2048,2048]", "data.num_features=2048", "data.num_examples=256")
WIDE_MLP = "experiments/mlp_model_parallel.yaml"


def test_the_predicted_step_follows_the_work_and_the_machine():
    """The step time comes from the program's work on the machine's rates: more work per device
    takes longer, a faster machine takes less (a constant or work-blind model fails each)."""
    h100 = topology.load("h100-sxm-8")
    small = timing.predict(*compiled(WIDE_MLP, *WIDE, "train.batch_size=16384", "layout=batch:(data,model)"), h100)
    step, program = compiled(WIDE_MLP, *WIDE, "train.batch_size=65536", "layout=batch:(data,model)")
    big = timing.predict(step, program, h100)
    # Four times the batch: four times the FLOPs per device, and a longer step.
    assert big.flops == pytest.approx(4 * small.flops, rel=0.02)
    assert big.compute_s > 1.5 * small.compute_s and big.total_s > small.total_s
    # The same program on a machine with twice the peak, and on an older GPU: less, and more time.
    doubled = dataclasses.replace(h100, peak_flops={k: 2 * v for k, v in h100.peak_flops.items()})
    assert timing.predict(step, program, doubled).compute_s < 0.85 * big.compute_s
    assert timing.predict(step, program, topology.load("a100-sxm-8")).compute_s > 1.5 * big.compute_s
    # The batch over data alone leaves the model axis's 2 devices of a row computing the same rows:
    # twice the FLOPs per device of the batch over both axes, and a longer compute term.
    whole = timing.predict(*compiled(WIDE_MLP, *WIDE, "train.batch_size=65536", "layout=batch:data"), h100)
    assert whole.flops == pytest.approx(2 * big.flops, rel=0.02)
    assert whole.compute_s > 1.3 * big.compute_s

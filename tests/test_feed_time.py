"""Predicted placement time, routed vs direct: how it scales with devices and shared uplinks,
the relay's memory against the real feeders' ledger, the batch bytes against the real source,
and the --compare-feeding command."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import yaml
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from input_pipeline.feeding import DirectFeeder, RoutedFeeder
from meshpar.configuration import config as config_lib
from meshpar.plan import cost, topology
from meshpar.plan.time import feed_time
from meshpar.sharding.mesh import build_mesh
from meshpar.step import inputs

MIB = 1 << 20


def test_direct_on_independent_links_gets_faster_with_more_devices_and_routed_does_not():
    h100 = topology.load("h100-sxm-8")  # every GPU on its own PCIe link
    batch = 256 * MIB
    direct = [feed_time.placement_time(h100, "direct", batch, n) for n in (2, 4, 8)]
    routed = [feed_time.placement_time(h100, "routed", batch, n) for n in (2, 4, 8)]
    assert direct[0] > direct[1] > direct[2]
    assert routed[0] <= routed[1] <= routed[2]  # the whole batch crosses one link whatever the count
    assert routed[2] / direct[2] > 4


def _one_uplink(**changes) -> topology.Topology:
    """A PCIe box with every device under one switch, no fixed costs, and a device fabric so
    fast that routed costs only its host leg."""
    spec = yaml.safe_load((topology.DIR / "a100-pcie-8.yaml").read_text())
    spec["host_groups"] = [list(range(8))]
    spec["host_link"]["latency_us"] = 0
    spec["device_link"].update(gbps=1e9, latency_us=0)
    spec["device_memory_gbps"] = 1e9
    spec["placement_overhead_us"] = {"direct": 0, "routed": 0}
    return dataclasses.replace(topology.from_dict(spec), **changes)


def test_one_shared_uplink_makes_direct_as_slow_as_routed_host_leg():
    box = _one_uplink()
    for batch in (MIB, 64 * MIB, 1024 * MIB):
        direct = feed_time.placement_time(box, "direct", batch, 8)
        routed = feed_time.placement_time(box, "routed", batch, 8)
        assert direct == pytest.approx(routed, rel=1e-3)
    # Split the same box's devices over their own links and direct pulls ahead.
    own = dataclasses.replace(box, host_groups=tuple((d,) for d in range(8)), uplink=None)
    routed, direct = (feed_time.placement_time(own, mode, 64 * MIB, 8) for mode in ("routed", "direct"))
    assert routed > 4 * direct


def test_shared_uplinks_cut_direct_s_lead_on_the_shipped_boxes():
    rows = {n: feed_time.compare(topology.load(n), 8, 8, sizes=(1024 * MIB,))[0] for n in ("h100-sxm-8", "a100-pcie-8")}
    assert rows["h100-sxm-8"].ratio > rows["a100-pcie-8"].ratio > 1


def test_on_cpu_sim_aligned_host_buffers_move_no_bytes_and_unaligned_ones_do():
    sim = topology.load("cpu-sim")  # measured once per process (see tests/test_topology.py)
    assert sim.host_aliasing and min(sim.placement_overhead) >= 0
    for mode in ("direct", "routed"):
        wrapped = [feed_time.placement_time(sim, mode, b, 8, aliased=True) for b in (MIB, 256 * MIB)]
        copied = [feed_time.placement_time(sim, mode, b, 8) for b in (MIB, 256 * MIB)]
        assert copied[1] > 10 * copied[0] and copied[0] > wrapped[0]
        if mode == "direct":
            assert wrapped[0] == wrapped[1]  # no bytes move, whatever the batch
    # A GPU copies whatever the alignment.
    h100 = topology.load("h100-sxm-8")
    gpu = [feed_time.placement_time(h100, "direct", MIB, 8, aliased=a) for a in (True, False)]
    assert gpu[0] == gpu[1]


def test_relay_memory_is_what_the_real_feeders_hold_on_the_relay():
    mesh = build_mesh("data:4,model:2")  # 4 batch shards, each on 2 devices
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.standard_normal((64, 12), np.float32), "targets": rng.integers(0, 10, 64, dtype=np.int32)}
    shardings = {"inputs": NamedSharding(mesh, P("data", None)), "targets": NamedSharding(mesh, P("data"))}
    total = sum(v.nbytes for v in batch.values())
    peaks = {}
    for mode, feeder in (("direct", DirectFeeder(shardings, 64)), ("routed", RoutedFeeder(shardings, 64))):
        feeder.place(batch)
        peaks[mode] = feeder.memory_report()["peak_input_bytes"][str(feeder.relay.id)]
    assert peaks["routed"] - peaks["direct"] == feed_time.relay_bytes("routed", total, shards=4)
    assert feed_time.relay_bytes("direct", total, shards=4) == 0
    assert feed_time.relay_bytes("routed", total) > total  # the whole batch, and its slices


@pytest.mark.parametrize(
    "data", [{"num_features": 24}, {"source": "text", "length": 16, "max_bytes": 20000, "eval_fraction": 0}]
)
def test_batch_bytes_match_the_real_train_source(data):
    cfg = config_lib.from_dict({"model": {"name": "mlp", "hidden": [8]}, "data": data, "train": {"batch_size": 32}})
    source = inputs.make_source(cfg.data, "train", cfg.train.seed)
    rows = source.read(np.arange(32))
    assert cost.process_batch_bytes(cfg) == sum(v.nbytes for v in rows.values())
    assert inputs.element_spec(cfg.data, cfg.train.seed) == source.element_spec


def test_config_split_follows_the_mesh_and_the_batch_rule():
    cfg = config_lib.from_dict({"mesh": "data:-1,model:2", "layout": "batch:data; hidden:model",
                                "model": {"name": "mlp", "hidden": [8]}, "train": {"batch_size": 64}})  # fmt: skip
    split = cost.config_split(cfg, topology.load("a100-sxm-8"))
    assert (split.num_devices, split.shards, split.fields) == (8, 4, 2)
    assert not split.aliased("routed")  # fresh numpy batches: no alignment promised
    reused = cost.config_split(config_lib.from_dict({**config_lib.to_dict(cfg), "feed": {"reuse_buffers": True}}),
                                    topology.load("a100-sxm-8"))  # fmt: skip
    # 16 rows per shard: slices of 16 × 784 float32 inputs and of 16 int32 targets start on 64-byte boundaries.
    assert reused.aliased("routed") and reused.aliased("direct")
    small = cost.config_split(cfg, topology.load("rtx4090-x4"))
    assert (small.num_devices, small.shards) == (4, 2)


def test_compare_feeding_prints_the_table_and_writes_the_png(tmp_path, env):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("mesh: data:8\nmodel: {name: mlp, hidden: [8]}\ndata: {num_examples: 64, num_features: 8}\n")
    png = tmp_path / "feeding.png"
    result = subprocess.run(
        [sys.executable, "-m", "meshpar.plan", "--config", str(cfg), "--topology", "a100-pcie-8",
         "--compare-feeding", "--png", str(png)],
        check=False, capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = result.stdout
    assert "routed / direct" in out and "1.00 MiB" in out and "1.00 GiB" in out and "relay memory routed" in out
    assert "a100-pcie-8: 8 devices, 8 batch shards" in out

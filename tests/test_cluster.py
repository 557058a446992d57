"""Clusters (a node kind × nodes × a network) and collectives across nodes priced as NCCL runs
them: the mesh's axes placed as a multi-process run places them, each group's share of the
nodes' network cards, NCCL's ring and tree, the published figures they rest on, and bad input
in one line."""

import subprocess
import sys

import pytest

from meshpar.configuration.config import ConfigError
from meshpar.plan import cluster, cost, topology

GIB = 1 << 30


def test_a_cluster_is_its_node_kind_times_nodes_on_the_node_kinds_network():
    node = topology.load("h100-sxm-8")
    big = cluster.machine("h100-sxm-8", nodes=32)
    assert (big.num_devices, big.hosts, big.network) == (256, 32, "ndr-ib")
    assert big.gpu == node.gpu and big.peak_flops == node.peak_flops and big.kernels == node.kernels
    # DGX H100: 8 NDR cards of 400 Gb/s, NCCL reaching 96% of them: 384 GB/s a node, 48 GB/s a GPU.
    assert big.node_link.bandwidth == pytest.approx(48e9)
    assert cluster.machine("a100-sxm-8", nodes=4).network == "hdr-ib"
    tcpx = cluster.machine("h100-sxm-8", nodes=2, network_name="gcp-a3-tcpx")
    # GCP A3: 4 cards of 200 Gb/s for 8 GPUs, 96% of them: 12 GB/s a GPU.
    assert tcpx.node_link.bandwidth == pytest.approx(12e9)


def test_mesh_axes_lie_over_nodes_as_a_multi_process_run_places_them():
    big = cluster.machine("h100-sxm-8", nodes=32)
    hybrid = {"data": 32, "fsdp": 8}  # the last axis within a node, the first across
    inside = cost.axis_link(big, hybrid, "fsdp")
    across = cost.axis_link(big, hybrid, "data")
    both = cost.axis_link(big, hybrid, "data,fsdp")
    assert inside.span is None and inside.kind == "nvlink"
    assert (across.span.nodes, across.span.per_node) == (32, 1)
    assert (both.span.nodes, both.span.per_node) == (32, 8)
    # One GPU per node in a group: that GPU's own card (rail-optimized), an eighth of the node's.
    assert across.span.network_bps == pytest.approx(big.node_link.bandwidth)
    # Eight per node: all eight cards, but the NVLink hops of the ring are slower still.
    assert both.bandwidth == pytest.approx(big.device_link.bandwidth)
    one = cost.collective_seconds("all-reduce", GIB, 32, across)
    whole = cost.collective_seconds("all-reduce", GIB, 256, both)
    assert one > 5 * whole  # the same bytes per device, an eighth of the cards (and no NVLink bound)


def test_large_all_reduces_reach_the_published_bus_bandwidth_across_nodes():
    # NVIDIA/nccl#812: 192 GB/s all-reduce bus bandwidth across DGX A100 nodes (8 x 200 Gb/s HDR).
    a100 = cluster.machine("a100-sxm-8", nodes=4)
    link = cost.axis_link(a100, {"data": 32}, "data")
    seconds = cost.collective_seconds("all-reduce", 4 * GIB, 32, link)
    bus = 4 * GIB * 2 * 31 / 32 / seconds
    assert 180e9 < bus <= 192e9


def test_small_all_reduces_take_the_tree_across_many_nodes():
    # A ring's latency grows with every rank, a tree's with log2(nodes): from 32 nodes to 256 a
    # small all-reduce (the tree) costs far less than 8 times as much.
    small = 64 << 10
    times = {}
    for nodes in (2, 32, 256):
        big = cluster.machine("h100-sxm-8", nodes=nodes)
        n = 8 * nodes
        times[nodes] = cost.collective_seconds("all-reduce", small, n, cost.axis_link(big, {"data": n}, "data"))
    assert times[256] < 1.5 * times[32]  # 8 times the ranks
    # Reduce-scatter and all-gather run as rings only: they grow with the ranks.
    gathers = {}
    for nodes in (2, 32):
        big = cluster.machine("h100-sxm-8", nodes=nodes)
        n = 8 * nodes
        gathers[nodes] = cost.collective_seconds("all-gather", small, n, cost.axis_link(big, {"data": n}, "data"))
    assert gathers[32] > 8 * gathers[2]


def test_within_a_node_all_gathers_are_no_faster_than_the_nvlink_ring():
    # NVLink SHARP speeds up the all-reduce (its measured curve), not the all-gather or the
    # reduce-scatter, which NCCL runs as rings (NVIDIA/nccl-tests#212).
    h100 = topology.load("h100-sxm-8")
    link = h100.device_link
    gathered = cost.collective_seconds("all-gather", GIB, 8, link)
    assert gathered >= GIB * 7 / 8 / link.bandwidth
    assert gathered > cost.collective_seconds("all-reduce", GIB / 2, 8, link)


@pytest.mark.parametrize(
    "call,named",
    [
        (lambda: cluster.machine("h100-sxm-8", nodes=0), "--nodes"),
        (lambda: cluster.machine("h100-sxm-8", nodes=2, network_name="ethernet"), "unknown network 'ethernet'"),
        (lambda: cluster.machine("h100-sxm-8", network_name="ndr-ib"), "add --nodes"),
        (lambda: cluster.machine("h100-sxm-2x8", nodes=2), "already 2 nodes"),
        (lambda: cluster.machine("cpu-sim", nodes=2), "not a GPU node kind"),
    ],
)
def test_bad_clusters_are_one_line(call, named):
    with pytest.raises(ConfigError) as e:
        call()
    assert named in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "args,named",
    [
        (["--nodes", "3"], "3 nodes of h100-sxm-8 are 24 devices; the config's mesh takes 8"),
        (["--nodes", "2", "--network", "token-ring"], "unknown network 'token-ring'"),
    ],
)
def test_the_plan_command_refuses_a_cluster_that_does_not_fit_in_one_line(args, named):
    cmd = [sys.executable, "-m", "meshpar.plan", "--config", "experiments/quickstart.yaml", "--topology", "h100-sxm-8"]
    result = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], result.stderr


def test_nodes_without_a_machine_is_one_line():
    cmd = [sys.executable, "-m", "meshpar.plan", "--config", "experiments/quickstart.yaml", "--nodes", "2"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2 and "add --topology" in result.stderr and len(result.stderr.strip().splitlines()) == 1

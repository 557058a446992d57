"""Machines for the time model: shipped YAML files, links per mesh axis, cpu-sim measured here,
and the one-line error for an unknown machine."""

import json

import jax
import numpy as np
import pytest
import yaml

from meshpar.configuration.config import ConfigError
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import topology

SHIPPED = {"h100-sxm-8", "a100-sxm-8", "a100-pcie-8", "rtx4090-x4", "cpu-sim"}


@pytest.fixture(scope="session")
def cpu_sim():
    """cpu-sim over the 8 simulated devices, measured once for the whole test run."""
    return topology.load("cpu-sim")


@pytest.mark.parametrize("name", sorted(SHIPPED - {"cpu-sim"}))
def test_every_shipped_machine_loads_with_positive_figures_and_a_source_per_figure(name):
    t = topology.load(name)
    assert t.name == name and name in topology.names()
    assert t.peak_flops and all(v > 0 for v in t.peak_flops.values())
    # Dense tensor-core peaks are above the plain FP32 one on every shipped GPU.
    assert t.peak_flops["bfloat16"] > t.peak_flops["float32"]
    assert 0 < t.efficiency <= 1 and t.memory_bytes > 0 and t.device_memory_bandwidth > 0
    for link in (t.host_link, t.device_link, t.uplink):
        assert link is None or (link.bandwidth > 0 and link.latency >= 0)
    assert sorted(d for g in t.host_groups for d in g) == list(range(t.num_devices))
    # Every figure (a non-zero number) has its source in a comment on its line or just above it.
    lines = (topology.DIR / f"{name}.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        key, _, value = line.split("#")[0].partition(":")
        try:
            figure = float(value) != 0 and key.strip() != "num_devices"
        except ValueError:
            figure = False
        if figure and "#" not in line:
            assert lines[i - 1].strip().startswith("#"), f"{name}.yaml line {i + 1} has no source: {line}"


def test_names_lists_every_shipped_machine():
    assert SHIPPED <= set(topology.names())


def test_float32_peak_follows_the_matmul_precision_and_unknown_dtypes_fall_back_to_float32():
    t = topology.load("h100-sxm-8")
    assert t.peak("float32") == t.peak_flops["tf32"]  # JAX's default on NVIDIA GPUs: TF32 tensor cores
    with jax.default_matmul_precision("highest"):
        assert t.peak("float32") == t.peak_flops["float32"]
    assert t.peak("int4") == t.peak("float32")


def test_pcie_axes_that_cross_switches_share_the_uplinks_and_nvlink_axes_do_not():
    pcie = topology.load("a100-pcie-8")  # devices 0-3 under one switch, 4-7 under the other
    shape = {"data": 2, "model": 4}
    inside, across = pcie.axis_link(shape, "model"), pcie.axis_link(shape, "data")
    assert inside == pcie.device_link  # each model group (0-3, 4-7) sits under one switch
    assert across.bandwidth < inside.bandwidth  # four data groups cross the same uplink at once
    # Fewer groups crossing at once: each gets more of the uplink.
    assert pcie.axis_link({"data": 2, "model": 2}, "data").bandwidth > across.bandwidth
    nv = topology.load("a100-sxm-8")
    assert nv.axis_link(shape, "data") == nv.axis_link(shape, "model") == nv.device_link
    with pytest.raises(ValueError, match="more devices"):
        topology.load("rtx4090-x4").axis_link({"data": 8}, "data")


def test_unknown_machine_is_one_config_error_line_with_exit_2(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("model: {name: mlp, hidden: [8]}\ndata: {num_examples: 64, num_features: 8}\n")
    assert plan_cli.main(["--config", str(cfg), "--topology", "x", "--compare-feeding"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: --topology: unknown topology 'x' (known: ")
    assert all(name in err[0] for name in SHIPPED)


def test_a_malformed_machine_file_names_the_key(tmp_path):
    spec = yaml.safe_load((topology.DIR / "a100-pcie-8.yaml").read_text())
    spec["host_link"]["gbps"] = -1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"--topology: bad.yaml.host_link.gbps: expected a positive number"):
        topology.load(str(path))
    spec["host_link"]["gbps"] = 31.5
    spec["host_groups"] = [[0, 1, 2, 3], [4, 5, 6]]
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="host_groups: must list every device 0..7 once"):
        topology.load(str(path))


def test_a_machine_file_with_a_key_twice_is_refused(tmp_path):
    text = (topology.DIR / "a100-pcie-8.yaml").read_text()
    path = tmp_path / "twice.yaml"
    path.write_text(text + "\ndescription: a second one\n")
    with pytest.raises(ConfigError, match=r"--topology: description: appears twice in twice.yaml \(lines 6 and \d+\)"):
        topology.load(str(path))


def test_cpu_sim_is_measured_here_once_per_process_with_sane_figures(cpu_sim):
    assert topology.load("cpu-sim") is cpu_sim  # cached: measured once per process and device count
    assert cpu_sim.num_devices == len(jax.devices("cpu")) == 8
    assert cpu_sim.source.startswith("measured on this host")
    # Orders of magnitude any host running this suite is within.
    assert 1e8 < cpu_sim.host_memory_bandwidth < 1e12
    assert 1e7 < cpu_sim.peak("float32") < 1e13
    for link in (cpu_sim.host_link, cpu_sim.copy_link, cpu_sim.device_link):
        assert 1e6 < link.bandwidth < 1e12 and 0 <= link.latency < 0.1
    # Every simulated device's memory is host memory: one group shares the placement bandwidth.
    assert cpu_sim.host_groups == (tuple(range(8)),) and cpu_sim.uplink is not None


def test_placement_benchmark_copies_instead_of_aliasing():
    host = topology._unaligned(1 << 20)
    assert host.ctypes.data % 64 and host.nbytes == 1 << 20
    placed = jax.device_put(host, jax.devices("cpu")[1])
    assert not np.shares_memory(np.asarray(placed), host)


def test_plan_with_a_topology_prints_and_writes_the_time_breakdown(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("mesh: data:8\nmodel: {name: mlp, hidden: [16]}\ndata: {num_examples: 256, num_features: 16}\n"
                   "train: {batch_size: 64}\nfeed: {mode: routed}\n")  # fmt: skip
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--config", str(cfg), "--topology", "a100-pcie-8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted step time per device on a100-pcie-8" in printed and "feed (placement)" in printed
    time = json.loads(out.read_text())["time"]
    assert time["topology"] == "a100-pcie-8"
    # 64 rows × (16 float32 + 1 int32) routed through the relay: more than the host leg alone.
    a100 = topology.load("a100-pcie-8")
    assert time["feed_s"] > 64 * 68 / a100.host_link.bandwidth
    assert time["step"]["feed_s"] == time["feed_s"] and time["step"]["total_s"] >= time["step"]["compute_s"] > 0

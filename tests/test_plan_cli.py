"""``python -m meshpar.plan``: the side-by-side table, its JSON, one-line errors; device cost."""

import json
import pathlib
import subprocess
import sys

import jax
import pytest
import yaml

from meshpar.configuration import config as config_lib
from meshpar.plan import cost
from meshpar.plan import report as report_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import parts, programs

TINY = """
mesh: data:4,model:2
layout: batch:data; hidden:model
model: {name: mlp, hidden: [64, 32]}
data: {num_examples: 4096, num_eval_examples: 256, num_features: 64}
train: {steps: 10, batch_size: 64, progress: false}
"""


def _host_ram() -> int:
    """This host's RAM from /proc/meminfo, or its cgroup's memory limit where that is lower."""
    ram = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        limit = pathlib.Path(path).read_text().strip() if pathlib.Path(path).exists() else ""
        ram = min(ram, int(limit)) if limit.isdigit() else ram
    return ram


def _plan(tmp_path, env, *args):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return subprocess.run(
        [sys.executable, "-m", "meshpar.plan", "--config", str(path), *args],
        check=False, capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_plan_prints_the_table_and_writes_xla_figures_of_the_real_step(tmp_path, env):
    result = _plan(tmp_path, env, "--json", str(tmp_path / "plan.json"))
    assert result.returncode == 0, result.stderr
    for text in ("argument: state + batch", "temp: grads", "alias", "params", "optimizer", "usable", "fits: needs"):
        assert text in result.stdout, text
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"] == "data:4,model:2" and plan["devices"] == "8 cpu"
    # XLA's figures are those of the very step a run compiles: its memory_analysis(), read here
    # from the step compiled in this process.
    compiled = parts.abstract_step(config_lib.from_dict(yaml.safe_load(TINY))).lower().compile()
    stats = compiled.memory_analysis()
    xla = {f: getattr(stats, f"{f}_size_in_bytes") for f in ("argument", "output", "alias", "temp")}
    assert {f: plan["xla"][f"{f}_bytes"] for f in xla} == xla
    assert plan["xla"]["total_bytes"] == xla["argument"] + xla["output"] + xla["temp"] - xla["alias"]
    # On CPU: the host's RAM (or its container's limit, when lower), shared by the 8 simulated
    # devices, no allocator fraction (nothing caps XLA:CPU's allocator), 5% kept free.
    cap = plan["capacity"]
    assert cap["source"].startswith("host RAM") and cap["source"].endswith("/ 8 simulated cpu devices")
    assert cap["bytes"] == _host_ram() // 8
    assert cap["headroom_bytes"] == int(cap["bytes"] * 0.05)
    assert cap["usable_bytes"] == cap["bytes"] - cap["headroom_bytes"] > 0
    analytic = plan["analytic"]
    if analytic is not None:  # the analytic model's own figures are tested with it
        assert {"params", "grads", "optimizer", "activations", "inputs"} <= set(analytic["categories"])
        assert analytic["total_bytes"] == sum(analytic["categories"].values())
    assert plan["needed_bytes"] >= plan["xla"]["total_bytes"] and plan["fits"] is True


def test_a_device_too_small_is_reported_as_not_fitting_with_exit_1(tmp_path, env):
    result = _plan(tmp_path, env, "hardware.memory_gib=0.00005", "--json", str(tmp_path / "plan.json"))
    assert result.returncode == 1, result.stderr
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["capacity"]["source"] == "hardware.memory_gib=5e-05"
    assert plan["capacity"]["bytes"] == 53687  # 0.00005 GiB
    assert plan["fits"] is False and "does not fit: needs" in result.stdout


def test_a_bad_key_is_one_line_and_exit_2(tmp_path, env):
    result = _plan(tmp_path, env, "hardware.memory_gb=1")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("config error: hardware.memory_gb")


GPU = {"bytes_limit": 80 * 2**30, "bytes_in_use": 123}


def test_capacity_is_the_backends_limit_where_it_reports_one(monkeypatch):
    # bytes_limit already is the device's memory × the allocator's fraction: not applied again.
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    c = cost.capacity_from([GPU, dict(GPU, bytes_limit=60 * 2**30)], 0.0, "gpu", host_bytes=2**40)
    assert c.bytes == 60 * 2**30 and "bytes_limit" in c.source and "XLA_CLIENT_MEM_FRACTION=0.5" in c.source
    assert c.headroom_bytes == 3 * 2**30 and c.usable_bytes == 57 * 2**30  # 5% kept free


def test_unified_memory_capacity_is_the_device_times_the_fraction_set_in_the_environment(monkeypatch):
    # An 80 GiB device, the allocator allowed 1.5 times it (XLA_CLIENT_MEM_FRACTION, which wins
    # over offload.oversubscription), 5% of that kept free; the device's own 80 GiB beside.
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "1.5")
    c = cost.capacity_from([None], 80.0, "gpu", host_bytes=None, oversubscription=2.0)
    assert c.bytes == 120 * 2**30 and c.device_bytes == 80 * 2**30
    assert c.headroom_bytes == 6 * 2**30 and c.usable_bytes == 114 * 2**30
    assert c.device_usable_bytes == 76 * 2**30  # 80 GiB less 5%


def test_memory_gib_plans_for_a_smaller_device_but_never_a_larger_one():
    small = cost.capacity_from([GPU], 16.0, "gpu", host_bytes=None)
    assert small.bytes == 16 * 2**30 and small.source == "hardware.memory_gib=16"
    large = cost.capacity_from([GPU], 100.0, "gpu", host_bytes=None)
    assert large.bytes == 80 * 2**30 and "below hardware.memory_gib=100" in large.source
    cpu = cost.capacity_from([None] * 8, 0.25, "cpu", host_bytes=64 * 2**30)
    assert cpu.bytes == 2**28 and cpu.usable_bytes < 2**28


def test_cpu_capacity_is_the_host_ram_shared_by_the_simulated_devices():
    c = cost.capacity_from([None] * 4, 0.0, "cpu", host_bytes=32 * 2**30)
    assert c.bytes == 8 * 2**30 and c.source == "host RAM 32.0 GiB / 4 simulated cpu devices"
    with pytest.raises(ValueError, match="set hardware.memory_gib"):
        cost.capacity_from([None], 0.0, "gpu", host_bytes=32 * 2**30)  # a backend without a limit
    mesh = mesh_lib.build_mesh("data:2")  # the real devices: CPU reports no limit in the tests
    cfg = config_lib.from_dict({"mesh": "data:2", "model": {"name": "mlp"}})
    real = cost.device_capacity(cfg, mesh)
    assert jax.devices()[0].platform == "cpu" and real.bytes == _host_ram() // 2


@pytest.mark.parametrize("value", ["-1", ".inf", "lots"])
def test_memory_gib_is_a_finite_non_negative_number(value):
    with pytest.raises(config_lib.ConfigError, match=r"^hardware\.memory_gib: "):
        config_lib.from_dict({**yaml.safe_load(TINY), "hardware": {"memory_gib": yaml.safe_load(value)}})


def test_a_config_out_of_the_models_scope_gets_no_analytic_figure_but_says_why():
    """bfloat16 compute on XLA:CPU: the plan shows XLA's figures and says why there is no
    analytic one, rather than a figure the model cannot stand behind; the pre-flight still
    holds the exact state and batch bytes against the capacity."""
    raw = yaml.safe_load(TINY)
    cfg = config_lib.from_dict(
        {**raw, "mesh": "data:4", "layout": "batch:data", "model": {"name": "transformer", "d_model": 32,
         "n_heads": 2, "d_head": 16, "d_ff": 64, "n_layers": 1, "compute_dtype": "bfloat16"},
         "data": {"source": "text", "length": 16, "max_bytes": 20000}}
    )  # fmt: skip
    step = parts.abstract_step(cfg)
    report = report_lib.plan(step, programs.compile_all(step))
    assert report.analytic is None
    assert report.analytic_missing.startswith("out of scope: bfloat16 compute on XLA:CPU")
    assert report.needed_bytes == max(p.bytes for p in report.programs)  # XLA's figures alone

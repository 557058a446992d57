"""GPU machines as compile targets (meshpar.plan.gpu_target): their target descriptions, the plan
without XLA's GPU compiler (CPU figures, labelled), and with it (tests marked ``gpu_target``, run
by .ci/run in a venv with the ``gpu-plan`` extra): the program the GPU will run, compiled here."""

from __future__ import annotations

import json
import re

import pytest

from meshpar.backend import quiet
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import gpu_target, hlo, topology
from meshpar.step import parts

GIB = 1 << 30
GPUS = [n for n in topology.names() if n != topology.CPU_SIM]


def _field(text: str, name: str) -> str:
    m = re.search(rf"^\s*{name}: (.+)$", text, re.M)
    assert m, f"{name} missing from the target description"
    return m.group(1).strip('"')


@pytest.mark.parametrize("name", GPUS)
def test_every_gpu_machine_has_a_target_description(name):
    topo = topology.load(name)
    assert topo.gpu is not None
    text = gpu_target.target_config(topo)
    # The machine's own memory and bandwidth, and its GPU's facts, as XLA reads them.
    assert int(_field(text, "device_memory_size")) == topo.memory_bytes
    assert int(_field(text, "memory_bandwidth")) == int(topo.device_memory_bandwidth)
    assert int(_field(text, "core_count")) == topo.gpu.sm_count
    assert int(_field(text, "major")) == topo.gpu.compute_capability[0]
    assert _field(text, "device_description_str") == topo.gpu.name
    # No field that jaxlib 0.10 refuses (newer target descriptions carry it).
    assert "collective_memory_granularity" not in text


def test_known_gpus_facts():
    h100, a100, ada = (topology.load(n).gpu for n in ("h100-sxm-8", "a100-sxm-8", "rtx4090-x4"))
    assert (h100.sm_count, h100.compute_capability, h100.l2_cache_bytes) == (132, (9, 0), 50 << 20)
    assert (a100.sm_count, a100.compute_capability, a100.shared_memory_per_sm) == (108, (8, 0), 164 << 10)
    assert (ada.sm_count, ada.compute_capability, ada.threads_per_sm) == (128, (8, 9), 1536)
    assert topology.load("h200-sxm-8").gpu.sm_count == h100.sm_count  # the same GH100


def _gpu_section(**changes) -> dict:
    spec = {
        "name": "X", "compute_capability": "9.0", "sm_count": 1, "clock_ghz": 1.0, "l2_cache_mib": 1,
        "shared_memory_per_sm_kib": 1, "shared_memory_per_block_kib": 1, "registers_per_sm": 1,
        "registers_per_block": 1, "threads_per_sm": 1, "fp32_lanes_per_sm": 1, "cuda_runtime": "12.8", "cudnn": "9.8",
    }  # fmt: skip
    spec.update(changes)
    return {k: v for k, v in spec.items() if v is not None}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"sm_count": None}, "gpu.sm_count: expected a positive number"),
        ({"compute_capability": "nine"}, "gpu.compute_capability: expected a version"),
        ({"cudnn": "9.x"}, "gpu.cudnn: expected a version"),
        ({"cores": 3}, "gpu: unknown key 'cores'"),
    ],
)
def test_bad_gpu_section_is_one_line(changes, message):
    with pytest.raises(ConfigError) as e:
        topology.gpu_spec(_gpu_section(**changes), "t.yaml.gpu")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_versions_padded():
    spec = topology.gpu_spec(_gpu_section(cuda_runtime="12", cudnn="9.8"), "gpu")
    assert (spec.cuda_runtime, spec.cudnn) == ("12.0.0", "9.8.0")


def test_multi_host_collectives_cross_the_network():
    topo = topology.load("h100-sxm-2x8")
    assert (topo.num_devices, topo.hosts) == (16, 2)
    mesh = {"data": 2, "model": 8}
    assert topo.axis_link(mesh, "data").kind == "network"  # device i and i + 8: two hosts
    assert topo.axis_link(mesh, "model").kind == "nvlink"  # within one host
    assert topo.axis_link({"model": 8, "data": 2}, "data").kind == "nvlink"  # pairs 0,1 … within a host
    assert topo.axis_link(mesh, "data").bandwidth < topo.axis_link(mesh, "model").bandwidth


def test_hosts_need_their_link():
    spec = topology.parse_yaml(topology.DIR.joinpath("h100-sxm-2x8.yaml").read_text(), "x")
    del spec["node_link"]
    with pytest.raises(ConfigError, match="node_link: 2 hosts need the link between them"):
        topology.from_dict(spec, "x")


def test_without_the_compiler_the_plan_is_labelled_cpu(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(quiet, "CUDA_PLUGIN_MODULES", ("no_such_plugin_module",))
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--config", "experiments/quickstart.yaml", "--topology", "h100-sxm-8",
                          "--json", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr()
    assert "XLA's GPU compiler is not installed (pip install -e '.[gpu-plan]')" in printed.out
    assert "compiled for: cpu" in printed.out
    plan = json.loads(out.read_text())
    assert plan["compiled_for"] == "cpu"
    step = plan["time"]["step"]
    # The model's FLOPs per device: the quickstart's own count, not the compiled program's.
    assert step["model_flops"] > 0 and step["mfu"] > 0 and step["tokens_per_s"] > 0
    assert printed.err == ""


def test_without_the_compiler_devices_is_one_line(monkeypatch):
    monkeypatch.setattr(quiet, "CUDA_PLUGIN_MODULES", ("no_such_plugin_module",))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[gpu-plan\]'"):
        gpu_target.devices(topology.load("h200-sxm-1"))


# ---- with XLA's GPU compiler (the gpu-plan extra) --------------------------------------------


def _need_compiler():
    why = gpu_target.missing()
    if why:
        pytest.skip(f"the gpu-plan extra is not installed ({why})")


@pytest.mark.gpu_target
@pytest.mark.parametrize("name", GPUS)
def test_every_gpu_machine_compiles(name):
    _need_compiler()
    topo = topology.load(name)
    devices = gpu_target.devices(topo)
    assert len(devices) == topo.num_devices
    assert {d.platform for d in devices} == {"gpu"} and devices[0].device_kind == topo.gpu.name
    assert {d.process_index for d in devices} == set(range(topo.hosts))


@pytest.mark.gpu_target
def test_a_field_jaxlib_cannot_parse_is_named():
    _need_compiler()
    text = gpu_target.target_config(topology.load("h100-sxm-8"))
    bad = text.replace("  core_count:", "  no_such_target_field: 1\n  core_count:")
    with pytest.raises(ConfigError, match="cannot parse the target description's field 'no_such_target_field'"):
        gpu_target._devices("h100-sxm-8", bad, "1x1x1")


@pytest.mark.gpu_target
def test_plan_compiles_the_gpu_program(tmp_path, capsys):
    _need_compiler()
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--config", "experiments/quickstart.yaml", "--topology", "h100-sxm-8",
                          "--json", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr()
    assert "compiled for: NVIDIA H100 80GB HBM3 x8 (cuda, compile-only)" in printed.out
    assert printed.err == ""
    plan = json.loads(out.read_text())
    assert plan["compiled_for"] == "NVIDIA H100 80GB HBM3 x8 (cuda, compile-only)"
    assert plan["capacity"]["source"].startswith("h100-sxm-8 80 GiB")


@pytest.mark.gpu_target
def test_loop_form_follows_the_target():
    """The quickstart's layer loop is unrolled for XLA:CPU and kept rolled for a GPU: the choice
    follows the devices compiled for, not this host."""
    _need_compiler()
    # XLA's own loop form: the GPU default flags' while-loop double buffering runs two layers per iteration
    cfg = config_lib.load("experiments/quickstart.yaml", ["xla.gpu_defaults=false"])
    target = gpu_target.target(topology.load("h100-sxm-8"), cfg.mesh)

    def layer_loops(step) -> int:  # while loops of the compiled step that run once per layer
        module = hlo.parse(step.lower().compile().as_text())
        whiles = [op for ops in module.computations.values() for op in ops if op.opcode == "while"]
        return sum(hlo.trip_count(module, op) == cfg.model.n_layers for op in whiles)

    assert layer_loops(parts.abstract_step(cfg, devices=target.devices)) >= 2  # forward and backward
    assert layer_loops(parts.abstract_step(cfg)) == 0  # unrolled for XLA:CPU


@pytest.mark.gpu_target
def test_too_big_for_the_target_is_the_does_not_fit_line(capsys):
    _need_compiler()
    code = plan_cli.main(["--config", "experiments/quickstart.yaml", "--topology", "h200-sxm-8",
                          "hardware.memory_gib=0.001"])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 1
    assert "does not fit" in printed.out and "compiled for: NVIDIA H200 x8" in printed.out


@pytest.mark.gpu_target
def test_mesh_larger_than_the_machine(capsys):
    _need_compiler()
    code = plan_cli.main(["--config", "experiments/quickstart.yaml", "--topology", "h200-sxm-1"])
    printed = capsys.readouterr()
    assert code == 1
    assert "the plan's mesh (data:4,model:2) has 8 devices, the machine 1" in printed.out

"""Every shipped experiment planned on every shipped machine, as ``python -m meshpar.plan --config
X --topology T`` plans it: exit 0 where it fits, 1 where it does not (a machine with fewer
devices than the plan's mesh included), never a config error or a traceback. Each experiment is
planned and compiled once and priced on every topology in this process
(:func:`meshpar.plan.__main__.price`, what the command calls), not run as 13 × 7 commands.

The full path costs 5-10 s per experiment on 2 cores (the offload comparison plans a dozen
options), so the default suite runs it on one experiment of each kind and ``-m slow`` on the
others — the 1 B-parameter ``gpu_lm`` and three that repeat another's model and layout — while
every experiment gets the cheap part (its config, abstract step, the comparison's options and
which machines can hold its mesh) in the default suite."""

import glob
import json
import pathlib

import pytest

from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import modes, pricing, topology
from meshpar.plan import report as report_lib
from meshpar.plan.out_of_core import offload_cost
from meshpar.step import parts, programs

EXPERIMENTS = sorted(pathlib.Path(p).stem for p in glob.glob("experiments/*.yaml"))
DOES_NOT_FIT = {"does_not_fit"}  # shows a refusal: its plan does not fit by design
# 1 B, 8 B (bf16 and FP8) and 46.7 B parameters: whether their plans fit this host's RAM depends on the host
HOST_DEPENDENT = {"gpu_lm", "llama3_8b", "llama3_8b_fp8", "mixtral_8x7b"}
# Planned in full only under -m slow: gpu_lm, llama3_8b (and its FP8 variant) and mixtral_8x7b, and those whose model and layout another repeats
# (quickstart's, does_not_fit's and mlp_model_parallel's, less its model split).
SLOW = {
    "gpu_lm",
    "llama3_8b",
    "llama3_8b_fp8",
    "mixtral_8x7b",
    "transformer_data_model_parallel",
    "transformer_data_parallel",
    "mlp_data_parallel",
}


def _params():
    out = []
    for name in EXPERIMENTS:
        marks = [pytest.mark.slow] if name in SLOW else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params())
def test_every_experiment_plans_on_every_topology(name):
    cfg = config.load(f"experiments/{name}.yaml", [])
    step = parts.abstract_step(cfg)
    report = report_lib.plan(step, programs.compile_all(step))  # compiled once, nothing allocated
    topos = [modes.machine(cfg, t) for t in topology.names()]
    priced = pricing.price(step, report, topos)
    assert [p.topology.name for p in priced] == topology.names()
    if name not in HOST_DEPENDENT:
        assert report.fits == (name not in DOES_NOT_FIT)
    for p in priced:
        too_few = step.mesh.size > p.topology.num_devices
        assert bool(p.unfit) == too_few, (p.topology.name, p.unfit)
        if too_few:
            assert p.unfit.startswith(f"does not fit on {p.topology.name}: the plan's mesh")
            continue
        assert p.step_time.total_s > 0 and p.feed_s >= 0
        costs = p.offload.costs
        assert costs and costs[0].option.label.startswith("no offload")
        assert all(c.step_s > 0 and c.device_bytes > 0 for c in costs)
        json.dumps(p.offload.to_json())  # the --json document holds plain data
    # One compiled program priced by the time model on each machine: the same work everywhere,
    # done sooner on the faster GPUs (H200: H100's peak with more HBM bandwidth; H100: more peak
    # and bandwidth than A100), so a time model that ignores the machine fails here.
    times = {p.topology.name: p.step_time for p in priced if not p.unfit}
    assert len({t.flops for t in times.values()}) == 1 and min(t.flops for t in times.values()) > 0
    if {"a100-sxm-8", "h100-sxm-8", "h200-sxm-8"} <= set(times):
        assert times["h200-sxm-8"].compute_s < times["h100-sxm-8"].compute_s < times["a100-sxm-8"].compute_s
        assert times["h100-sxm-8"].total_s < times["a100-sxm-8"].total_s
    # Options that do not apply to the config are skipped with a reason, never priced.
    skipped = next((p.offload.skipped for p in priced if p.offload), [])
    labels = {c.option.label for p in priced if p.offload for c in p.offload.costs}
    assert all(s.reason and s.label not in labels for s in skipped)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_has_its_options_and_machines_without_compiling(name):
    """The cheap part of the full test above, for every experiment in the default suite."""
    cfg = config.load(f"experiments/{name}.yaml", [])
    step = parts.abstract_step(cfg)
    skipped: list = []
    options = offload_cost.options(step, skipped)
    assert options[0].label.startswith("no offload") and len(options) + len(skipped) >= 11
    assert all(s.label == "param_layout" and s.reason.startswith("FSDP ") for s in skipped)
    fsdp = [o for o in options if o.label.startswith("param_layout=")]
    assert len(fsdp) + len(skipped) == 1  # FSDP proposed, or said why not
    for fsdp_option in fsdp:  # a rule that builds: never two dims of one parameter on one axis
        new = offload_cost.applied(cfg, fsdp_option.overrides)
        parts.abstract_step(new, step.mesh, step.element_spec)
    held = []
    for t in topology.names():
        try:
            held.append(modes.machine(cfg, t).num_devices >= step.mesh.size)
        except ConfigError as e:  # FP8 dots on a GPU without FP8 tensor cores (an A100): refused
            assert e.key == "model.fp8" and step.traits.fp8 and "no FP8 tensor cores" in str(e), e
            held.append(False)
    assert held[topology.names().index(topology.CPU_SIM)]


def test_fsdp_that_does_not_apply_is_one_line_below_the_table(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--config", "experiments/transformer_fsdp.yaml", "--topology", "h100-sxm-8", "--json", str(out)]
    assert plan_cli.main(args) == 0  # the command: planned, compiled, priced, printed
    printed = capsys.readouterr().out
    line = "skipped: param_layout: FSDP over data: embed is split by param_layout already (embed:data)"
    assert line in printed.splitlines()
    plan = json.loads(out.read_text())
    assert plan["offload"]["skipped"] == [
        {"label": "param_layout", "overrides": [], "reason": line.removeprefix("skipped: param_layout: ")}
    ]
    assert not any(o["option"]["label"].startswith("param_layout") for o in plan["offload"]["options"])
    # A machine with fewer devices than the plan's mesh: it does not fit there, exit 1.
    assert plan_cli.main(["--config", "experiments/transformer_fsdp.yaml", "--topology", "h200-sxm-1"]) == 1
    assert "does not fit on h200-sxm-1: the plan's mesh (data:4,model:2) has 8 devices, the machine 1" in (
        capsys.readouterr().out
    )

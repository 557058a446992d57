"""The planner's side of host offload: the memory plan's host column, XLA's figures without the
host bytes, the pre-flight's offload candidate, the per-layer cost model, and
experiments/offload.yaml (refused without offload, accepted and trained with it)."""

import dataclasses
import json
import math
import pathlib
import re

import jax
import numpy as np
import pytest
import yaml

from meshpar import jaxprs
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import cost, preflight, topology
from meshpar.plan.memory import analytic as memory
from meshpar.plan.out_of_core import offload_cost, offload_plan
from meshpar.plan.search import candidates
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl
from meshpar.step import aot, parts, programs

QUICKSTART = "experiments/quickstart.yaml"
OFFLOAD = pathlib.Path("experiments/offload.yaml")
MIB = 1 << 20


def _step(path=QUICKSTART, *overrides):
    cfg = config.load(path, list(overrides))
    return cfg, parts.abstract_step(cfg)


def _state_bytes(step, tree: str) -> int:
    """Per-device bytes of one tree of the state, from the plan's shardings (what each device holds)."""
    return sum(a["per_device_bytes"] for k, a in aot.state_bytes(step.plan).items() if k.startswith(tree + "/"))


def test_host_column_is_the_offloaded_trees_shard_bytes():
    cfg, step = _step(QUICKSTART)
    base = memory.analytic(step)
    assert base.host == {} and base.host_total == 0
    opt = _state_bytes(step, "opt_state")
    cfg, step = _step(QUICKSTART, "offload.optimizer=true")
    off = memory.analytic(step)
    assert offload_plan.placement(cfg, step.plan).from_shardings  # the state plan says pinned_host
    assert off.host == {"optimizer": opt}
    assert off.categories["optimizer"] == base.categories["optimizer"] - opt  # step counter and RNG key stay
    assert off.total == base.total - opt  # the quickstart peaks in its backward pass, not in the update
    cfg, step = _step(QUICKSTART, "offload.params=true")
    params = _state_bytes(step, "params")
    off = memory.analytic(step)
    assert off.host["params"] == params and "params" not in off.exact
    w = offload_plan.weights(step.plan, step.layout, step.mesh)
    assert off.categories["params"] == w.layer + w.other < params  # one layer's slice and the rest
    assert w.layer * cfg.model.n_layers + w.other == params


@pytest.mark.parametrize("policy", ["layer_outputs", "dots"])
def test_offloaded_activations_are_the_named_values(policy):
    cfg, step = _step(QUICKSTART, f"offload.activations={policy}")
    m = cfg.model
    rows = cfg.train.batch_size // 4 // cfg.train.microbatches  # data:4
    tokens, f32 = rows * cfg.data.length, 4
    per_layer = {  # per device: heads and d_ff split over model:2
        "layer_in": tokens * m.d_model, "attn_residual": tokens * m.d_model, "attn_out": tokens * m.d_model,
        "query": tokens * m.n_heads // 2 * m.d_head, "key": tokens * m.n_heads // 2 * m.d_head,
        "value": tokens * m.n_heads // 2 * m.d_head, "context": tokens * m.n_heads // 2 * m.d_head,
        "mlp_hidden": tokens * m.d_ff // 2,
    }  # fmt: skip
    names = offload_plan.OFFLOADED_NAMES[policy]
    plan = memory.analytic(step)
    assert plan.host == {"activations": m.n_layers * f32 * sum(per_layer[n] for n in names)}
    # Everything else is recomputed: the device keeps what remat full keeps.
    full_cfg, full_step = _step(QUICKSTART, "model.remat=full")
    assert plan.categories["activations"] == memory.analytic(full_step).categories["activations"]


def test_xla_figures_leave_out_the_pinned_host_state():
    _, step = _step(QUICKSTART)
    base = aot.memory(step.lower().compile())
    _, step = _step(QUICKSTART, "offload.optimizer=true")
    off = aot.memory(step.lower().compile())
    opt = _state_bytes(step, "opt_state")
    # XLA:CPU counts pinned_host arguments as ordinary ones and reports no host bytes: they
    # come from the shardings and are taken out of argument, output and alias.
    assert off["host_from"] == "shardings"
    assert off["host_argument_bytes"] == off["host_output_bytes"] == off["host_alias_bytes"] == opt
    assert off["argument_bytes"] == base["argument_bytes"] - opt
    assert off["alias_bytes"] == base["alias_bytes"] - opt
    assert off["total_bytes"] == base["total_bytes"] - opt
    assert base["host_from"] == "xla" and base["host_total_bytes"] == 0


def test_offload_is_tried_after_remat_and_before_fsdp():
    cfg, step = _step(OFFLOAD, "offload.optimizer=false")
    order = [str(c) for c in candidates.candidates(cfg, step.mesh, step.plan.abstract.params)]
    single = [c for c in order if " " not in c]
    assert (
        single.index("model.remat=full")
        < single.index("offload.optimizer=true")
        < single.index("param_layout=embed:data")
    )
    assert not any(c for c in order if "offload.params" in c or "offload.activations" in c)


def test_offload_experiment_is_refused_without_and_accepted_with():
    header = " ".join(line.strip() for line in OFFLOAD.read_text().splitlines() if line.startswith("#"))
    refusal = re.search(r"(config error: offload\.optimizer: .+?\(needs [\d.]+ MiB\))", header).group(1)
    cfg = config.load(OFFLOAD, ["offload.optimizer=false"])
    with pytest.raises(ConfigError) as e:
        experiment.build(cfg)  # the analytic check: nothing compiled, nothing allocated
    assert f"config error: {e.value}" == refusal and "\n" not in str(e.value)
    assert e.value.key == "offload.optimizer" and str(e.value).endswith(
        "fits with offload.optimizer=true (needs 91.03 MiB)"
    )
    cfg, step = _step(OFFLOAD)
    assert cfg.offload.optimizer
    verdict = preflight.check_analytic(step)
    breakdown, cap = verdict.breakdown, verdict.capacity
    assert breakdown.total <= cap.usable_bytes < breakdown.total + breakdown.host["optimizer"]
    assert f"{breakdown.total / MIB:.2f} MiB" in header and f"{breakdown.host['optimizer'] / MIB:.2f} MiB" in header
    judged = preflight.check_compiled(step, programs.compile_all(step), verdict)
    assert judged.needed_bytes <= cap.usable_bytes  # XLA's figures, less the host state, fit too
    assert judged.report.xla["host_total_bytes"] > 0  # the offloaded optimizer state is taken out of them


@pytest.mark.slow
def test_offload_experiment_trains(tmp_path):
    cfg = config.load(OFFLOAD, ["train.steps=2", "train.eval_batches=1", "train.progress=false", f"workdir={tmp_path}"])
    exp = experiment.build(cfg)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(exp.state.opt_state)} == {"pinned_host"}
    loop.train(exp)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)


def _topo(name: str, **host_link):
    topo = topology.load(name)
    return dataclasses.replace(topo, host_link=dataclasses.replace(topo.host_link, **host_link)) if host_link else topo


def _file_link(name: str, devices: int) -> tuple[float, float]:
    """(bytes/s, s per transfer) of one device's path to host memory while the first `devices` of
    machine `name` all use theirs, read here from its file: its own link, or its share of the
    uplink its switch group shares."""
    raw = yaml.safe_load((topology.DIR / f"{name}.yaml").read_text())
    link = raw["host_link"]
    bandwidth = link["gbps"] * 1e9 * link["efficiency"]
    if raw.get("uplink"):
        uplink = raw["uplink"]["gbps"] * 1e9 * raw["uplink"]["efficiency"]
        sharing = max(sum(1 for d in g if d < devices) for g in raw["host_groups"])
        bandwidth = min(bandwidth, uplink / sharing)
    return bandwidth, link.get("latency_us", 0) * 1e-6


# Data parallel on the 8 devices: every weight whole on every device, every activation split by
# its batch, so the bytes each device moves are read off the traced arrays' shapes.
DP = ("mesh=data:8", "layout=batch:data")
# The options these tests price: each a label of offload_cost.options and its overrides.
PRICED = {
    "no offload": (), "offload.optimizer": ("offload.optimizer=true",), "offload.params": ("offload.params=true",),
    "offload.activations=layer_outputs": ("offload.activations=layer_outputs",),
    "offload.activations=dots": ("offload.activations=dots",),
}  # fmt: skip


def _program_passes(cfg, step) -> list[tuple[int, int]]:
    """What the traced train step moves between device and host memory, per device: (bytes in,
    bytes out) of each pass that moves any, in program order — one per trip of the forward layer
    loop and of the backward one, the forward and the backward outside the layer loop, and the
    update (the state fetched after the backward pass, and written back where the program's
    outputs live in pinned host memory). Read from jax's ``device_put`` ops between memory
    kinds, not from the planner."""
    traced = step.step.trace(*step.args)
    top = traced.jaxpr.jaxpr.eqns
    loops = [i for i, e in enumerate(top) if e.primitive.name == "scan"]
    forward_loop, backward_loop = loops[0], loops[-1]  # the layer loop and its transpose

    def per_device(aval, placement) -> int:
        nbytes = math.prod(aval.shape) * aval.dtype.itemsize
        if isinstance(placement, jax.sharding.Sharding):
            return math.prod(placement.shard_shape(aval.shape)) * aval.dtype.itemsize
        split = aval.shape and aval.shape[0] == cfg.train.batch_size  # an activation: split by the batch
        return nbytes // step.mesh.size if split else nbytes

    def moves(eqns) -> tuple[int, int]:
        """(bytes to the device, bytes to host memory) of one run of `eqns`, loops multiplied."""
        inward = outward = 0
        for eqn in eqns:
            if eqn.primitive.name == "device_put":
                for var, placement in zip(eqn.invars, eqn.params["devices"]):
                    kind = str(getattr(placement, "memory_kind", None) or placement).lower()
                    if "host" in kind:
                        outward += per_device(var.aval, placement)
                    elif "device" in kind:
                        inward += per_device(var.aval, placement)
            n = eqn.params["length"] if eqn.primitive.name == "scan" else 1
            for inner in jaxprs.subjaxprs(eqn):
                i, o = moves(inner.eqns)
                inward, outward = inward + n * i, outward + n * o
        return inward, outward

    layers = [
        (top[i].params["length"], moves(top[i].params["jaxpr"].jaxpr.eqns)) for i in (forward_loop, backward_loop)
    ]
    rest_in = rest_out = update_in = 0
    for i, eqn in enumerate(top):
        if i in (forward_loop, backward_loop):
            continue
        inward, outward = moves([eqn])
        rest_out += outward  # the gradients of host arrays, on their way back
        if i < backward_loop:
            rest_in += inward  # weights fetched for the forward pass
        else:
            update_in += inward  # the state fetched for the update
    written_back = sum(
        math.prod(o.sharding.shard_shape(o.shape)) * o.dtype.itemsize
        for o in jax.tree.leaves(traced.out_info)
        if o.sharding.memory_kind == "pinned_host"
    )
    passes = [one for trips, one in layers for _ in range(trips)]
    passes += [(rest_in, 0), (0, rest_out), (update_in, written_back)]
    return [p for p in passes if any(p)]


@pytest.fixture(scope="module")
def offloaded():
    """Each PRICED option on the data-parallel quickstart: (prepared for pricing, the passes its
    traced program moves host bytes in)."""
    out = {}
    for label, overrides in PRICED.items():
        cfg = config.load(QUICKSTART, [*DP, *overrides])
        step = parts.abstract_step(cfg)
        out[label] = (
            offload_cost.prepare(step, offload_cost.Option(label, overrides)),
            _program_passes(cfg, step),
        )
    return out


def _link_seconds(passes, bandwidth: float) -> float:
    """The passes' transfers on a full-duplex link of `bandwidth`: one pass after another, each
    moving its bytes in and out at once."""
    return sum(max(inward, outward) for inward, outward in passes) / bandwidth


def test_transfers_are_bytes_over_the_named_topologys_host_link(offloaded):
    # h100-sxm-8: every GPU its own PCIe Gen5 x16; a100-pcie-8: four GPUs share a switch's uplink.
    h100, a100 = topology.load("h100-sxm-8"), topology.load("a100-pcie-8")
    for topo, devices in ((h100, 8), (a100, 8), (a100, 4), (a100, 1)):
        assert offload_cost.host_bandwidth(topo, devices) == pytest.approx(_file_link(topo.name, devices)[0])
    assert _file_link("a100-pcie-8", 8)[0] < _file_link("a100-pcie-8", 1)[0]  # the uplink shared is the bottleneck
    prepared, passes = offloaded["offload.optimizer"]
    ((state_in, state_out),) = passes  # the state, in for the update and back: nothing else moves
    assert state_in == state_out > 0
    for topo in (h100, a100):
        bandwidth, latency = _file_link(topo.name, 8)
        # In and back once per step on a duplex link: the state's bytes once, plus one transfer's latency.
        assert offload_cost.price(prepared, topo).update_s == pytest.approx(state_in / bandwidth + latency)
    # Parameters and activations: every pass's bytes as the program moves them (no latency here).
    for topo in (h100, a100):
        quiet = dataclasses.replace(topo, host_link=dataclasses.replace(topo.host_link, latency=0.0))
        bandwidth = _file_link(topo.name, 8)[0]
        for label in ("offload.params", "offload.activations=layer_outputs"):
            prepared, passes = offloaded[label]
            assert offload_cost.price(prepared, quiet).host_s == pytest.approx(_link_seconds(passes, bandwidth))
    # Twice the bandwidth, no latency: every host transfer takes half as long, the compute as long.
    slow = _topo("h100-sxm-8", latency=0.0)
    fast = _topo("h100-sxm-8", latency=0.0, bandwidth=2 * h100.host_link.bandwidth)
    for label in ("offload.optimizer", "offload.params", "offload.activations=dots"):
        s, f = (offload_cost.price(offloaded[label][0], t) for t in (slow, fast))
        assert f.host_s == pytest.approx(s.host_s / 2) and f.compute_s == s.compute_s


def test_activation_offload_of_dots_moves_what_the_program_moves(offloaded):
    h100 = _topo("h100-sxm-8", latency=0.0)
    prepared, passes = offloaded["offload.activations=dots"]
    assert offload_cost.price(prepared, h100).host_s == pytest.approx(
        _link_seconds(passes, _file_link("h100-sxm-8", 8)[0])
    )


def test_overlap_hides_transfers_behind_compute(offloaded):
    h100 = _topo("h100-sxm-8", latency=0.0)
    bandwidth = _file_link("h100-sxm-8", 8)[0]
    for label in ("offload.params", "offload.activations=layer_outputs"):
        prepared, passes = offloaded[label]
        moved = _link_seconds(passes, bandwidth)  # the program's transfers on the file's link
        on, off = offload_cost.price(prepared, h100), offload_cost.price(prepared, h100, overlap=False)
        # Overlap changes neither the work nor the bytes, only when the bytes move.
        assert on.compute_s == pytest.approx(off.compute_s) and on.host_s == pytest.approx(off.host_s)
        assert off.step_s == pytest.approx(off.compute_s + moved)  # in turn: all of both
        # Overlapped: no shorter than either stream alone, shorter than the two in turn.
        assert max(on.compute_s, moved) <= on.step_s < off.step_s
        # On a link too fast to matter the step is its compute; with compute too fast to
        # matter, it is the program's transfers.
        wide = dataclasses.replace(h100, host_link=dataclasses.replace(h100.host_link, bandwidth=1e9 * bandwidth))
        assert offload_cost.price(prepared, wide).step_s == pytest.approx(on.compute_s, rel=1e-3)
        quick = dataclasses.replace(h100, peak_flops={k: 1e9 * v for k, v in h100.peak_flops.items()},
                                    device_memory_bandwidth=1e9 * h100.device_memory_bandwidth)  # fmt: skip
        assert offload_cost.price(prepared, quick).step_s == pytest.approx(moved, rel=1e-3)
    # The optimizer's trip for the update is never overlapped: the step without offload, then the
    # state in and back.
    ((state, _),) = offloaded["offload.optimizer"][1]
    base = offload_cost.price(offloaded["no offload"][0], h100)
    optimizer = offload_cost.price(offloaded["offload.optimizer"][0], h100)
    assert optimizer.step_s == pytest.approx(base.step_s + state / bandwidth)


def test_bigger_batches_make_state_offload_relatively_cheaper():
    cfg = config.load(QUICKSTART, [])
    topo = topology.load("h100-sxm-8")
    rows = offload_cost.sweep(cfg, topo, [32, 512], with_reference=False)
    (_, small), (_, big) = rows
    ratio = {b: {c.option.label.removesuffix(" (as configured)"): c.step_s / costs[0].step_s for c in costs}
             for b, costs in rows}  # fmt: skip
    # Parameters and optimizer state do not grow with the batch, the compute does.
    for label in ("offload.optimizer", "offload.params"):
        assert ratio[512][label] < ratio[32][label]
    # Activations grow with the batch like the compute, and their transfers outrun it on this
    # machine: the added time grows with the bytes (16x), less the per-transfer latency.
    added = {b: {c.option.label: c.step_s - costs[0].step_s for c in costs} for b, costs in rows}
    for label in ("offload.activations=layer_outputs", "offload.activations=dots"):
        assert 8 * added[32][label] < added[512][label] < 16 * added[32][label]
    # Freed bytes scale with the batch.
    for label in ("offload.activations=layer_outputs", "model.remat=full"):
        s, b = (next(c for c in costs if c.option.label == label) for costs in (small, big))
        assert (big[0].device_bytes - b.device_bytes) / (small[0].device_bytes - s.device_bytes) == pytest.approx(
            16, rel=0.05
        )
    assert offload_cost.cheapest(big, "state").option.frees == "state"


def test_plan_cli_prints_the_offload_comparison(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--config", QUICKSTART, "--topology", "h100-sxm-8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "offload and the other ways of freeing device memory" in printed
    options = {o["option"]["label"]: o for o in json.loads(out.read_text())["offload"]["options"]}
    assert {"no offload (as configured)", "offload.optimizer", "offload.activations=dots", "model.remat=full",
            "train.microbatches=2", "param_layout=embed:data"} <= set(options)  # fmt: skip
    base = options["no offload (as configured)"]
    assert base["predicted_s"] > base["step_s"]  # the config's own step from its HLO: collectives, feed
    assert options["offload.optimizer"]["host_bytes"] > 0 and options["model.remat=full"]["host_bytes"] == 0
    # The same usable bytes as the search and the pre-flight plan with (meshpar.plan.cost).
    usable = cost.machine_capacity(config.load(QUICKSTART), topology.load("h100-sxm-8")).usable_bytes
    assert json.loads(out.read_text())["offload"]["usable_bytes"] == usable
    assert plan_cli.main(["--config", QUICKSTART, "--offload-sweep"]) == 2  # needs a machine
    assert "--offload-sweep" in capsys.readouterr().err

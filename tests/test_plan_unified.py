"""The planner's side of CUDA Unified Memory: the memory plan accepting up to the oversubscribed
capacity with the rest "migrated", the per-layer paging model responding as the physics does
(more oversubscription: more bytes migrated and a slower step; a faster host link or cheaper
faults: a faster step; a step that fits: nothing migrates), and ``python -m meshpar.plan
--compare-out-of-core``."""

import dataclasses
import json

import pytest

from meshpar.backend import allocator
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import cost, report, topology
from meshpar.plan.out_of_core import comparison as out_of_core
from meshpar.plan.out_of_core import offload_cost, unified
from meshpar.step import parts

QUICKSTART = "experiments/quickstart.yaml"
MIB = 1 << 20
UM = ("offload.unified_memory=true", "offload.oversubscription=8")


def _machine(memory_bytes: int, bandwidth_scale: float = 1.0, fault_s: float | None = None):
    """h100-sxm-8 with a smaller device (so the quickstart oversubscribes it), its host link's
    bandwidth scaled, its fault cost replaced."""
    topo = topology.load("h100-sxm-8")
    link = dataclasses.replace(topo.host_link, bandwidth=topo.host_link.bandwidth * bandwidth_scale)
    return dataclasses.replace(topo, memory_bytes=memory_bytes, host_link=link,
                               fault_s=topo.fault_s if fault_s is None else fault_s)  # fmt: skip


@pytest.fixture(scope="module")
def prepared():
    """The quickstart under unified memory, planned once (the machine is what the tests vary)."""
    cfg = config.load(QUICKSTART, list(UM))
    step = parts.abstract_step(cfg)
    option = next(o for o in offload_cost.options(step) if o.kind == "unified")
    return offload_cost.prepare(step, option)


@pytest.fixture(scope="module")
def plain():
    """The quickstart without unified memory, planned once."""
    cfg = config.load(QUICKSTART)
    step = parts.abstract_step(cfg)
    return offload_cost.prepare(step, offload_cost.options(step)[0])


def test_a_step_that_fits_the_device_migrates_nothing_and_costs_what_it_costs_without(prepared, plain):
    big = _machine(80 << 30)
    um, none = offload_cost.price(prepared, big), offload_cost.price(plain, big)
    assert um.migrated_bytes == 0 and um.faults == 0 and um.migration.bytes_in == um.migration.bytes_out == 0
    assert um.device_bytes == none.device_bytes and um.step_s == pytest.approx(none.step_s)


@pytest.fixture(scope="module")
def compiled_need(prepared) -> int:
    """Bytes per device the quickstart's train step holds at its peak by XLA's own count of its
    compiled program (argument + output + temp - alias), not the planner's."""
    stats = prepared.step.lower().compile().memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)  # fmt: skip


def test_more_oversubscription_migrates_more_and_slows_the_step(prepared, compiled_need):
    # The same step on ever smaller devices: about 1.25x, 2x and 4x oversubscribed.
    devices = [int(compiled_need / r) for r in (1.25, 2.0, 4.0)]
    costs = [offload_cost.price(prepared, _machine(d)) for d in devices]
    migrated = [c.migrated_bytes for c in costs]
    moved = [c.migration.bytes_in for c in costs]
    steps = [c.step_s for c in costs]
    assert 0 < migrated[0] < migrated[1] < migrated[2]
    assert 0 < moved[0] < moved[1] < moved[2]
    assert steps[0] < steps[1] < steps[2]
    assert all(c.fits(0) for c in costs)  # 8x allowed: each runs, paged
    # What the step holds is on the device or migrated, whatever the device: the compiled
    # program's bytes, to within the planner's estimate of them.
    held = [c.device_bytes + c.migrated_bytes for c in costs]
    assert len(set(held)) == 1 and held[0] == pytest.approx(compiled_need, rel=0.05)
    # Every byte less of device memory is one more migrated (less the small share kept free).
    for i in range(2):
        assert 0.9 <= (migrated[i + 1] - migrated[i]) / (devices[i] - devices[i + 1]) <= 1.0


def test_bigger_batches_on_one_device_migrate_more_and_cost_more():
    topo = _machine(12 * MIB)
    rows = offload_cost.sweep(config.load(QUICKSTART, list(UM)), topo, [32, 64, 128], with_reference=False)
    um = [next(c for c in costs if c.option.kind == "unified") for _, costs in rows]
    assert [c.migrated_bytes for c in um] == sorted(c.migrated_bytes for c in um) and um[0].migrated_bytes > 0
    assert um[0].step_s < um[1].step_s < um[2].step_s
    # What paging adds to the step (beyond the same step without it) grows with the batch too.
    none = [costs[0] for _, costs in rows]
    added = [u.step_s - n.step_s for u, n in zip(um, none)]
    assert 0 < added[0] < added[1] < added[2]


def test_a_faster_host_link_or_cheaper_faults_make_the_paged_step_faster(prepared):
    need = prepared.plan.total
    device = int(need / 2 / 0.95)
    slow, fast = (offload_cost.price(prepared, _machine(device, s)) for s in (1.0, 4.0))
    assert fast.migrated_bytes == slow.migrated_bytes and fast.faults == slow.faults  # the same pages move
    assert fast.step_s < slow.step_s and fast.host_s < slow.host_s
    free_faults = offload_cost.price(prepared, _machine(device, fault_s=0.0))
    assert free_faults.step_s < slow.step_s


def test_the_paging_model_moves_what_the_step_touches_in_order():
    # 4 layers of 10 MiB weights and 20 MiB residuals, 40 MiB of optimizer state, a device of
    # 100 MiB room: the forward's residuals push the state out, the backward reads them back.
    b = unified.Blocks(layers=4, layer_weights=10 * MIB, other_weights=0, layer_grads=10 * MIB, other_grads=0,
                       layer_optimizer=10 * MIB, other_optimizer=0, before=0, per_layer=20 * MIB, after=0,
                       pinned=0)  # fmt: skip
    roomy = unified.migration(b, b.total)
    assert roomy.bytes_in == roomy.bytes_out == 0 and roomy.migrated_bytes == 0
    tight = unified.migration(b, 100 * MIB)
    assert tight.migrated_bytes == 4 * (10 + 10 + 10 + 20) * MIB - 100 * MIB  # the blocks above, beyond the room
    # Steady state: what goes out comes back in, or dies in host memory; every migration in is
    # whole pages faulted.
    assert tight.bytes_out >= tight.bytes_in > 0
    assert tight.faults >= tight.bytes_in // tight.page_bytes
    update = next(p for p in tight.phases if p.name == "update")
    assert update.bytes_in > 0  # the optimizer state, evicted during the passes, faults back for the update
    # Residuals that die on the device are never written back: with a roomier device the same
    # step pages less in both directions.
    roomier = unified.migration(b, 140 * MIB)
    assert roomier.bytes_in < tight.bytes_in


def test_the_memory_plan_accepts_up_to_the_oversubscribed_device_and_says_what_migrates(tmp_path, capsys):
    # The quickstart on a device of 16 MiB (hardware.memory_gib): it needs more, so without
    # unified memory it does not fit; with 8x oversubscription it does, the excess migrated.
    small = ["hardware.memory_gib=0.015625"]
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--config", QUICKSTART, "--topology", "h100-sxm-8", "--json", str(out), *small]) == 1
    capsys.readouterr()
    code = plan_cli.main(["--config", QUICKSTART, "--topology", "h100-sxm-8", "--json", str(out), *small, *UM])
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert code == 0, printed
    assert plan["capacity"]["device_bytes"] == 16 * MIB and plan["capacity"]["bytes"] == 8 * 16 * MIB
    # Migrated: what the compiled train step holds (XLA's figure, with the batches resident beside
    # it) beyond the 16 MiB device, less the share of it kept free.
    program = max(p["peak_bytes"] for p in plan["programs"])
    beyond = program - 16 * MIB * (1 - cost.HEADROOM_FRACTION)
    assert beyond > 0 and plan["migrated_bytes"] == pytest.approx(beyond, abs=0.05 * program)
    assert "migrated (unified memory)" in printed and "fits with unified memory" in printed


def test_capacity_under_unified_memory_follows_the_allocator_and_the_environment():
    cfg = config.load(QUICKSTART, ["offload.unified_memory=true", "offload.oversubscription=2"])
    h100 = topology.load("h100-sxm-8")
    c = cost.machine_capacity(cfg, h100)
    assert c.bytes == 2 * h100.memory_bytes and c.device_bytes == h100.memory_bytes
    # A fraction the user set wins, and under unified memory XLA takes at least the whole device.
    assert allocator.allocator_fraction({"XLA_CLIENT_MEM_FRACTION": "3"}, 2.0)[0] == 3.0
    assert allocator.allocator_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, 2.0)[0] == 1.0
    with pytest.raises(ConfigError, match="XLA_CLIENT_MEM_FRACTION"):
        allocator.allocator_fraction({"XLA_CLIENT_MEM_FRACTION": "3"})  # above 1 without unified memory
    # The backend's limit on a GPU is the device × the fraction in effect.
    gpu = cost.capacity_from([{"bytes_limit": 3 * (80 << 30)}], 0, "gpu", None, 3.0)
    assert gpu.device_bytes == 80 << 30 and gpu.usable_bytes > gpu.device_usable_bytes
    with pytest.raises(ConfigError, match="offload.unified_memory: needs a CUDA GPU"):
        cost.capacity_from([None], 0, "cpu", 1 << 34, 2.0)


def test_compare_out_of_core_lists_every_method_by_batch_size(tmp_path, capsys):
    out = tmp_path / "ooc.json"
    argv = ["--config", QUICKSTART, "--topology", "h100-sxm-8", "--compare-out-of-core", "--batch-sweep", "32,4096",
            "--layer", "--json", str(out), "hardware.memory_gib=0.25"]  # fmt: skip
    assert plan_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "out-of-core methods by global batch size" in printed and "one layer of the layer loop" in printed
    got = json.loads(out.read_text())
    kinds = {r["kind"] for r in got["rows"]}
    assert {"none", "swap", "unified", "remat", "microbatches", "fsdp"} <= kinds
    by = {(r["batch_size"], r["kind"], r["method"]): r for r in got["rows"]}
    small, big = (next(r for (b, k, _), r in by.items() if b == size and k == "unified") for size in (32, 4096))
    assert small["migrated_bytes"] == 0 and big["migrated_bytes"] > 0 and big["faults"] > 0
    none_big = next(r for (b, k, _), r in by.items() if b == 4096 and k == "none")
    assert not none_big["fits"] and big["step_s"] > none_big["step_s"]
    assert "offload.unified_memory=true" in big["overrides"]
    assert {r["batch_size"] for r in got["layer"]} == {32, 4096}
    layer = next(r for r in got["layer"] if r["batch_size"] == 4096 and r["kind"] == "unified")
    assert layer["migrated_bytes"] > 0 and layer["backward_s"] > 0


def test_compare_out_of_core_needs_a_machine_and_says_unified_memory_needs_a_gpu(capsys):
    assert plan_cli.main(["--config", QUICKSTART, "--compare-out-of-core"]) == 2
    assert "--topology" in capsys.readouterr().err
    assert plan_cli.main(["--config", QUICKSTART, "--layer"]) == 2
    assert "--layer: goes with --compare-out-of-core" in capsys.readouterr().err
    assert (
        plan_cli.main(["--config", QUICKSTART, "--topology", "cpu-sim", "--compare-out-of-core", "--batch-sweep", "32"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "skipped: unified memory: needs a CUDA GPU, and cpu-sim has none" in printed
    # Planning unified memory on this host's CPU devices (no machine named) is a one-line error.
    assert plan_cli.main(["--config", QUICKSTART, *UM]) == 2
    assert "config error: offload.unified_memory: needs a CUDA GPU" in capsys.readouterr().err


def test_out_of_core_batch_sizes_are_checked():
    cfg = config.load(QUICKSTART)
    assert out_of_core.batch_sizes(cfg, "") == [cfg.train.batch_size * f for f in out_of_core.BATCH_FACTORS]
    with pytest.raises(ConfigError, match="--batch-sweep"):
        out_of_core.batch_sizes(cfg, "32,x")
    assert report.fmt_bytes(0) == "0 B"


def test_the_search_charges_paging_to_layouts_beyond_the_device():
    # The quickstart's layouts on a 15 MiB device, 8x oversubscribed: those needing more than the
    # device's own memory fit the allocator, and page.
    from meshpar.plan.search import layouts as search_lib

    cfg = config.load(QUICKSTART, ["hardware.memory_gib=0.015", *UM])
    result = search_lib.search(cfg, topology.load("h100-sxm-8"), 8, 0)
    device = result.capacity.device_usable_bytes
    paged = [r for r in result.rows if r.fits and r.memory_bytes > device]
    resident = [r for r in result.rows if r.memory_bytes <= device]
    assert paged and all(r.estimate.paging_s > 0 for r in paged)
    assert all(r.estimate.paging_s == 0 for r in resident)
    # More to page, more paging: the estimate's stall grows with the bytes beyond the device.
    by_need = sorted(paged, key=lambda r: r.memory_bytes)
    assert by_need[0].estimate.paging_s < by_need[-1].estimate.paging_s


def test_a_topology_may_state_its_paging_and_a_bad_figure_is_named():
    spec = topology.yaml.safe_load((topology.DIR / "h100-sxm-8.yaml").read_text())
    topo = topology.from_dict({**spec, "unified_memory": {"page_mib": 0.0625, "fault_us": 5}})
    assert topo.page_bytes == 64 << 10 and topo.fault_s == pytest.approx(5e-6)
    prepared_cfg = config.load(QUICKSTART, list(UM))
    step = parts.abstract_step(prepared_cfg)
    option = next(o for o in offload_cost.options(step) if o.kind == "unified")
    small = dataclasses.replace(topo, memory_bytes=12 * MIB)
    fine = offload_cost.price(offload_cost.prepare(step, option), small)
    coarse = offload_cost.price(offload_cost.prepare(step, option), dataclasses.replace(small, page_bytes=2 << 20))
    assert fine.faults > coarse.faults > 0  # smaller pages: more faults for the same bytes
    with pytest.raises(ConfigError, match="unified_memory.fault_us"):
        topology.from_dict({**spec, "unified_memory": {"fault_us": "slow"}})
    with pytest.raises(ConfigError, match="unified_memory: expected a mapping"):
        topology.from_dict({**spec, "unified_memory": {"faults": 1}})

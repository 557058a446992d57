"""The planner with a stage axis (layers:stage): memory plan, time terms, search, pre-flight."""

import math
import pathlib

import pytest
import yaml

from meshpar import jaxprs
from meshpar.configuration import config
from meshpar.plan import cost, gpu_target, topology
from meshpar.plan.memory import analytic as memory
from meshpar.plan.memory import stage_axis as stages
from meshpar.plan.memory import trace
from meshpar.plan.search import candidates, estimates
from meshpar.plan.search import options as options_lib
from meshpar.step import aot, parts

CONFIG = "experiments/transformer_pipeline.yaml"
SMALL = ["train.progress=false", "model.d_model=64", "model.n_heads=2", "model.d_head=32", "model.d_ff=128",
         "data.length=32", "model.max_length=32", "train.batch_size=16"]  # fmt: skip


def _cfg(*overrides):
    return config.load(CONFIG, [*SMALL, *overrides])


def _planned(cfg, mesh, layout, stage):
    """`cfg` with `mesh` and `layout` as the search plans it: (config, abstract step, option)."""
    new = options_lib.with_layout(cfg, mesh, layout, "", stage)
    step = parts.abstract_step(new)
    sizes = dict(step.mesh.shape)
    batch = tuple(a for a in cost.batch_axes(new.layout))
    option = options_lib.Option(
        tuple(sizes.items()), batch, any(a == "model" for _, a in new.layout), False, None, stage
    )
    return new, step, option


def _estimate(cfg, topo, mesh, layout, stage):
    """The search's analytic estimate of `cfg` with `mesh` and `layout`, as the search plans it."""
    new, step, option = _planned(cfg, mesh, layout, stage)
    return estimates.estimate(step, option, memory.analytic(step), topo, options_lib.model_dims(new))


def _tick_loops(step) -> list[tuple[int, int, int]]:
    """The pipeline as jax traces the train step: (trips, permutes per trip, bytes of the array
    one permute hands on, as traced) of every loop whose body sends an array over the stage axis."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                sends = [e for e in eqn.params["jaxpr"].jaxpr.eqns if e.primitive.name == "ppermute"]
                if sends:
                    aval = sends[0].invars[0].aval
                    found.append((eqn.params["length"], len(sends), math.prod(aval.shape) * aval.dtype.itemsize))
            for inner in jaxprs.subjaxprs(eqn):
                walk(inner)

    walk(step.step.trace(*step.args).jaxpr.jaxpr)
    return found


def test_more_microbatches_lower_bubble_and_time():
    """The pipeline's time terms against the pipeline jax traces (its tick loops' trip counts and
    the arrays they hand over the stage axis), not against the schedule's own formula."""
    topo = topology.load("h100-sxm-8")
    compute, stretch = {}, {}
    for m in (2, 4, 8):
        cfg, step, option = _planned(_cfg(f"train.microbatches={m}", "train.batch_size=64"), "stage:2,data:4",
                                     "batch:data; layers:stage", True)  # fmt: skip
        (trips, sends, traced_bytes), backward = _tick_loops(step)
        assert backward == (trips, sends, traced_bytes) and sends == 1  # the forward's loop and its transpose
        sched = step.plan.schedule
        # Each stage works on one of the M microbatches per tick it is busy: idle the other T - M.
        assert sched.ticks == trips and sched.bubble == pytest.approx((trips - m) / trips)
        assert stages.bubble_factor(sched) == pytest.approx(trips / m)
        # One permute per trip of either loop, each of one microbatch's stack output; the traced
        # array is global over the data axis the batch is split on.
        t = stages.traffic(sched, rows=64 // 4, length=32, embed=64, itemsize=4)
        assert t.permutes == 2 * trips * sends and t.permute_bytes == traced_bytes / step.mesh.shape["data"]
        est = estimates.estimate(step, option, memory.analytic(step), topo, options_lib.model_dims(cfg))
        compute[m], stretch[m] = est.compute_s, trips / m
    assert compute[2] > compute[4] > compute[8]
    # The layers' compute is stretched by the traced ticks per microbatch, the rest (embedding,
    # head) is not: the compute term is affine in T/M (a stretch by the bubble fraction, or none,
    # is not).
    assert (compute[2] - compute[4]) / (compute[4] - compute[8]) == pytest.approx(
        (stretch[2] - stretch[4]) / (stretch[4] - stretch[8]), rel=1e-6
    )
    # The circular schedule: R groups per stage, a microbatch through every stage R times.
    cfg = _cfg("train.microbatches=4", "train.batch_size=64", "mesh=stage:2,data:4",
               "layout=batch:data; layers:stage", "pipeline.schedule=circular", "pipeline.repeats=2")  # fmt: skip
    step = parts.abstract_step(cfg)
    (trips, _, _), _ = _tick_loops(step)
    sched = step.plan.schedule
    assert sched.ticks == trips and stages.bubble_factor(sched) == pytest.approx(trips / (2 * 4))


def test_layer_params_per_device_fall_with_stages():
    per_device = {}
    for s in (1, 2, 4):
        mesh = f"stage:{s},data:{8 // s}" if s > 1 else "data:8"
        layout = "batch:data; layers:stage" if s > 1 else "batch:data"
        cfg = options_lib.with_layout(_cfg("model.n_layers=4", "train.microbatches=2"), mesh, layout, "", s > 1)
        step = parts.abstract_step(cfg)
        per_device[s] = memory.analytic(step).categories["params"]
    assert per_device[1] > per_device[2] > per_device[4]
    stack = (per_device[1] - per_device[2]) * 2  # the stack's bytes, half of which a stage drops
    assert per_device[4] == pytest.approx(per_device[1] - stack * 3 / 4, rel=1e-6)


def test_prediction_against_compiled_on_an_untuned_shape():
    # circular, 2 repeats, 4 stages, 8 layers (one layer per group), M=4, width 96: not a shape the model was built on
    cfg = _cfg("mesh=stage:4,data:2", "layout=batch:data; layers:stage", "model.n_layers=8", "model.d_model=96",
               "model.d_head=48", "train.microbatches=4", "pipeline.schedule=circular", "pipeline.repeats=2")  # fmt: skip
    step = parts.abstract_step(cfg)
    plan = memory.analytic(step)
    xla = aot.memory(step.lower().compile())
    total = plan.total - plan.categories["queued_inputs"]
    assert abs(total - xla["total_bytes"]) / xla["total_bytes"] < 0.10, (total, xla)
    # the fake (the non-pipelined model's one microbatch of residuals) would be far off
    assert plan.categories["activations"] > 3 * sum(r.total for r in trace.saved_activations(step))


@pytest.mark.gpu_target
def test_prediction_against_xla_gpu_with_the_head_and_the_tick_loop_in_view():
    # GPipe over 2 stages of 4 layers, M=2 microbatches of 8 rows, bfloat16 compute, full remat,
    # a 4096-token head: compiled for an H100 machine (deviceless). The step's peak is
    # the head's backward (the float32 cotangent of the whole batch's logits beside the tick
    # loop's residual stacks) or the backward tick loop (the stage's gradient accumulators and
    # one tick's gradient stacks); the old estimate (the stage's weights taken off residuals that
    # do not hold them, the whole group recomputed at once, the logits' cotangent in bfloat16)
    # was a third too high here
    cfg = _cfg("mesh=stage:2,data:4", "layout=batch:data; layers:stage", "model.n_layers=8", "model.d_model=256",
               "model.n_heads=4", "model.d_head=64", "model.d_ff=1024", "data.length=128", "model.max_length=128",
               "model.vocab_size=4096", "model.compute_dtype=bfloat16", "model.remat=full", "train.batch_size=64",
               "train.microbatches=2",
               # XLA's own defaults: under the GPU default flags XLA:GPU's program holds more (pipelined
               # all-reduce and while-loop double buffering, ~10 MB each here) than the model counts: -10.9%
               "xla.gpu_defaults=false")  # fmt: skip
    target = gpu_target.target(topology.load("h100-sxm-8"), cfg.mesh)
    step = parts.abstract_step(cfg, devices=target.devices)
    plan = memory.analytic(step)
    xla = aot.memory(step.lower().compile())["total_bytes"]
    total = plan.total - plan.categories["queued_inputs"]
    assert abs(total - xla) <= 0.10 * xla, (total, xla)
    assert plan.categories["activations"] > 0  # the tick loop's stacks and the residuals outside the stack


def _two_hosts(tmp_path) -> topology.Topology:
    """h100-sxm-2x8 cut to 2 hosts of 4 (this test's 8 devices), inter-host link as shipped."""
    raw = yaml.safe_load(
        pathlib.Path(topology.__file__).with_name("topologies").joinpath("h100-sxm-2x8.yaml").read_text()
    )
    raw.update(name="h100-2x4", num_devices=8, host_groups=[[i] for i in range(8)])
    raw["node_link"] = {**raw["node_link"], "gbps": 12.5}  # a 100 Gb/s NIC per GPU
    path = tmp_path / "h100-2x4.yaml"
    path.write_text(yaml.safe_dump(raw))
    return topology.load(str(path))


def test_stage_axis_wins_over_slow_links_and_not_by_much_on_one_node(tmp_path):
    cfg = _cfg("model.d_model=512", "model.n_heads=8", "model.d_head=64", "model.d_ff=2048", "model.n_layers=8",
               "train.microbatches=4", "train.batch_size=256")  # fmt: skip
    choices = {
        "stage": ("stage:2,data:4", "batch:data; layers:stage", True),
        "data": ("data:8", "batch:data", False),
        "data+model": ("data:2,model:4", "batch:data; d_ff:model; heads:model; vocab:model", False),
    }
    slow = {k: _estimate(cfg, _two_hosts(tmp_path), *v).total_s for k, v in choices.items()}
    # the pipeline sends one microbatch per tick over the network, data parallelism every gradient
    # (its rings through all four NICs of a host, as NCCL lays them: meshpar.plan.time.nccl)
    assert min(slow, key=slow.get) == "stage" and slow["data"] > 1.5 * slow["stage"], slow
    fast = {k: _estimate(cfg, topology.load("h100-sxm-8"), *v).total_s for k, v in choices.items()}
    # over NVLink the gradients cost little: the bubble and the stage's whole-batch head take back its lead
    assert fast["data"] < 1.10 * fast["stage"] and fast["data"] / fast["stage"] < slow["data"] / slow["stage"] / 1.5, (
        fast
    )


def test_search_enumerates_stage_axes_only_where_layers_divide():
    cfg = _cfg("model.n_layers=6")
    options = options_lib.enumerate_options(cfg, 8)
    sizes = {dict(o.mesh).get("stage", 1) for o in options if o.stage}
    assert sizes == {2}  # 6 layers: 2 divides both, 4 and 8 do not divide the layers
    assert all(o.stage == (dict(o.mesh).get("stage", 1) > 1) for o in options)
    mlp = config.load("experiments/mlp_data_parallel.yaml", ["train.progress=false"])
    assert not any(o.stage for o in options_lib.enumerate_options(mlp, 8))  # no layer stack, no stage axis


def test_preflight_proposes_a_stage_split_when_nothing_else_fits():
    # one head does not split over a model axis of 2, 4 or 8, a width of 196 not
    # over the 8 devices FSDP would split it over, and the optimizer state is on the host already
    cfg = _cfg("train.microbatches=1", "model.n_layers=8", "model.d_model=196", "model.d_ff=600", "model.n_heads=1",
               "model.d_head=196", "train.batch_size=8", "offload.optimizer=true")  # fmt: skip
    cfg = options_lib.with_layout(cfg, "data:8", "batch:data", "", False)
    step = parts.abstract_step(cfg)
    params = memory.analytic(step).categories["params"]
    found = candidates.search(step, int(params * 1.6))  # less than params + their gradients
    assert found.fit is not None, found
    changes = dict(found.fit.changes)
    assert "mesh" in changes, found
    assert changes["mesh"].startswith("stage:") and "layers:stage" in changes["layout"], found.fit
    assert found.needed <= params * 1.6

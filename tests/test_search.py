"""The layout search (meshpar.plan.search.layouts): what it enumerates, drops and writes."""

import pytest
import yaml

from meshpar.configuration import config as config_lib
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import topology
from meshpar.plan.memory import analytic as memory
from meshpar.plan.search import estimates, search_report
from meshpar.plan.search import layouts as search_lib
from meshpar.plan.search import options as options_lib
from meshpar.run import experiment
from meshpar.sharding import layout as layout_lib
from meshpar.step import parts

# Batch 6 and hidden 6 do not divide 4 ways, only 2: the traps the legality checks must catch.
SMALL = {
    "mesh": "data:4",
    "layout": "",  # replicated: the batch of 6 does not divide 4 ways
    "model": {"name": "mlp", "hidden": [6]},
    "data": {"num_examples": 64, "num_eval_examples": 0, "num_features": 16, "num_classes": 10},
    "train": {"steps": 2, "batch_size": 6, "progress": False},
}


def _cfg(raw=SMALL, **sections):
    return config_lib.from_dict({**raw, **sections})


@pytest.fixture(scope="module")
def small():
    # A shipped 4-device machine: no calibration, and the search compiles nothing here.
    return search_lib.search(_cfg(), topology.load("rtx4090-x4"), 4, top=0)


def test_four_devices_give_48_choices_17_distinct_8_legal(small):
    # data:4 → (data, model) meshes 1×4, 2×2, 4×1; batch on {}, data, model or both; hidden on
    # model or not; FSDP or not: 3 × 4 × 2 × 2 = 48. Distinct up to axis names, 1-sized axes and
    # axes that act as one: nothing split (1); one 4-way axis with the batch (±FSDP), with
    # hidden, with both (±FSDP) (5); on 2×2, hidden alone (1), the batch on data or on model,
    # with hidden or not, ±FSDP (8), the batch on both with hidden (2); the batch on both
    # without hidden is the 4-way batch.
    assert small.enumerated == 48 and small.duplicates == 31
    assert small.legal + sum(small.illegal.values()) == 17
    assert small.legal == 8
    chosen = {(r.cfg.mesh_str, r.cfg.layout_str, r.cfg.param_layout) for r in small.rows}
    assert len(chosen) == 8  # no two rows alike
    # The one fully replicated choice, on the config's own mesh of all the meshes it could be.
    assert [(r.cfg.mesh_str, r.cfg.layout_str) for r in small.rows if r.own] == [("data:4", "")]
    assert ("data:2,model:2", "batch:data; hidden:model", ()) in chosen


def test_choices_that_do_not_divide_are_dropped_by_the_key_they_fail(small):
    # Every 4-way batch split of 6 rows (4), hidden 6 on 4 devices and the batch and hidden on
    # one axis (layout, 2); FSDP over the batch's axes where hidden is on one of them already
    # (param_layout, 3: two of them 4-way batch splits too, found first).
    assert small.illegal == {"train.batch_size": 4, "layout": 2, "param_layout": 3}
    for row in small.rows:
        sizes = dict(row.cfg.mesh)
        ways = {sizes[a] for _, axes in row.cfg.layout for a in ((axes,) if isinstance(axes, str) else axes)}
        assert ways <= {2}, row.cfg.layout_str
        assert row.fits and row.predicted is None  # top=0: nothing compiled


def test_layouts_over_the_memory_cap_are_kept_out_of_the_ranking():
    # 1024 × 1024 float32 weights: 4 MiB, 16 MiB with gradients and Adam's moments, replicated.
    big = {**SMALL, "model": {"name": "mlp", "hidden": [1024]}, "train": {**SMALL["train"], "batch_size": 8}}
    cfg = _cfg(big, data={**SMALL["data"], "num_features": 1024}, hardware={"memory_gib": 0.01})
    result = search_lib.search(cfg, topology.load("rtx4090-x4"), 4, top=0)
    usable = result.capacity.usable_bytes
    assert result.capacity.source == "hardware.memory_gib=0.01"
    fitting = [r for r in result.rows if r.fits]
    assert fitting and result.fitting < result.legal
    assert all(r.memory_bytes <= usable for r in fitting)
    assert all(r.memory_bytes > usable for r in result.rows if not r.fits)
    assert result.rows[: len(fitting)] == fitting  # the ranking holds the fitting ones only, first
    by_choice = {(r.cfg.mesh_str, r.cfg.layout_str, r.cfg.param_layout): r for r in result.rows}
    assert not by_choice[("data:4", "batch:data", ())].fits  # pure data parallel: every weight whole
    assert result.best.cfg.param_layout or "hidden:model" in result.best.cfg.layout_str


def test_the_written_choice_loads_and_builds_with_the_memory_preflight(tmp_path):
    cfg = _cfg(train={**SMALL["train"], "batch_size": 8})
    result = search_lib.search(cfg, topology.load("rtx4090-x4"), 4, top=1)
    assert result.compiled == 1 and result.best.predicted is not None
    src = tmp_path / "small.yaml"
    src.write_text(yaml.safe_dump(SMALL))
    out = tmp_path / "chosen.yaml"
    command = "python -m meshpar.plan --search ..."
    out.write_text(search_report.experiment_yaml(result, str(src), ["train.batch_size=8"], command, str(out)))
    text = out.read_text()
    assert text.startswith(f"# python -m meshpar.train --config {out}\n")
    loaded = config_lib.load(out, [f"workdir={tmp_path / 'run'}"])
    best = result.best.cfg
    assert (loaded.mesh, loaded.layout, loaded.param_layout) == (best.mesh, best.layout, best.param_layout)
    assert loaded.train.batch_size == 8 and loaded.plan.check
    exp = experiment.build(loaded)  # the pre-flight compiles the step and checks its memory
    assert dict(exp.mesh.shape) == dict(best.mesh) and str(exp.layout) == best.layout_str


def test_write_without_search_is_one_config_error(tmp_path, capsys):
    src = tmp_path / "small.yaml"
    src.write_text(yaml.safe_dump(SMALL))
    assert plan_cli.main(["--config", str(src), "--write", str(tmp_path / "x.yaml")]) == 2
    assert capsys.readouterr().err.strip() == "config error: --write: goes with --search: add --search"
    assert not (tmp_path / "x.yaml").exists()


def test_the_family_says_what_a_model_split_costs():
    from meshpar.models import MODELS

    tf = config_lib.load("experiments/quickstart.yaml", []).model
    spec = {"tokens": ((129,), "uint8")}
    family = MODELS["transformer"]
    assert family.split_dims(tf) == ("heads", "d_ff", "vocab") and family.fsdp_dims(tf, spec) == ("embed",)
    rows, width = 8, 8 * 128 * tf.d_model  # [rows, length, embed]
    # Attention (heads) and the MLP (d_ff): output forward, input gradient backward, per layer;
    # the vocab-split output once; remat full repeats attention's forward sum (the MLP's
    # recomputed input reads its output), not the MLP's (nothing in the backward reads it): the
    # compiled step on data:2,model:4 has one more activation all-reduce per layer than none's;
    # dots keeps both outputs and repeats none.
    assert family.activation_all_reduces(tf, spec, rows, ("heads", "d_ff", "vocab")) == (4 * tf.n_layers + 1, width)
    assert family.activation_all_reduces(tf, spec, rows, ("d_ff",)) == (2 * tf.n_layers, width)
    full = tf.__class__(**{**tf.__dict__, "remat": "full"})
    assert family.activation_all_reduces(full, spec, rows, ("heads", "d_ff", "vocab"))[0] == 5 * tf.n_layers + 1
    dots = tf.__class__(**{**tf.__dict__, "remat": "dots"})
    assert family.activation_all_reduces(dots, spec, rows, ("heads", "d_ff", "vocab"))[0] == 4 * tf.n_layers + 1
    # The layers' FLOPs and the rest add up to the example's: the rest is the output projection.
    layers = family.layer_flops(tf, spec)
    assert len(layers) == family.num_layers(tf) == tf.n_layers
    assert family.flops_per_example(tf, spec) - sum(layers) == 6 * tf.d_model * tf.vocab_size * 128
    mlp = _cfg().model
    mspec = {"inputs": ((16,), "float32")}
    assert MODELS["mlp"].split_dims(mlp) == ("hidden",)
    assert MODELS["mlp"].activation_all_reduces(mlp, mspec, 3, ("hidden",)) == (1, 3 * 10)  # into the classes
    assert MODELS["mlp"].activation_all_reduces(mlp, mspec, 3, ()) == (0, 0)
    assert sum(MODELS["mlp"].layer_flops(mlp, mspec)) == 6 * 16 * 6  # the output layer is not a layer


def test_layer_flops_are_the_traced_layers():
    from meshpar.models import MODELS
    from meshpar.plan.out_of_core import offload_plan
    from meshpar.step import parts

    cfg = config_lib.load("experiments/transformer_data_parallel.yaml", ["model.attention=xla"])
    step = parts.abstract_step(cfg)
    spec = {k: (tuple(b.shape[1:]), b.dtype) for k, b in step.args[1].items()}
    prof = offload_plan.profile(step)  # one device's forward: 32 / 8 rows, weights whole
    family = MODELS["transformer"]
    assert prof.layers == family.num_layers(cfg.model)
    assert family.layer_flops(cfg.model, spec)[0] * 4 == pytest.approx(3 * prof.layer_flops)  # forward: a third


def test_each_layout_gets_the_fewest_microbatches_that_fit():
    # 1024 rows of 512 features: the activations outgrow a 12.5 MiB device unless split into
    # microbatches (train.microbatches); the weights (two 512-wide layers) do not.
    raw = {**SMALL, "model": {"name": "mlp", "hidden": [512, 512]}, "train": {**SMALL["train"], "batch_size": 1024}}
    cfg = _cfg(raw, data={**SMALL["data"], "num_examples": 2048, "num_features": 512}, hardware={"memory_gib": 0.0125})
    result = search_lib.search(cfg, topology.load("rtx4090-x4"), 4, top=0)
    usable = result.capacity.usable_bytes
    split = [r for r in result.rows if r.fits and r.cfg.train.microbatches > 1]
    assert split, [(r.cfg.mesh_str, r.cfg.layout_str, r.cfg.train.microbatches, r.memory_bytes) for r in result.rows]
    for row in split:  # half as many microbatches on the same layout does not fit
        k = row.cfg.train.microbatches
        fewer = options_lib.with_layout(row.cfg, row.cfg.mesh_str, row.cfg.layout_str,
                                        layout_lib.format_rules(row.cfg.param_layout), False, k // 2)  # fmt: skip
        assert memory.analytic(parts.abstract_step(fewer)).total > usable, (row.cfg.mesh_str, row.cfg.layout_str, k)
        assert f"train.microbatches={k}" in row.overrides  # the choice says how to run it
    assert all(r.cfg.train.microbatches == 1 for r in result.rows if r.fits and r not in split)
    js = search_lib.to_json(result)
    assert {r["microbatches"] for r in js["rows"] if r["fits"]} == {
        r.cfg.train.microbatches for r in result.rows if r.fits
    }


@pytest.mark.gpu_target
@pytest.mark.parametrize("microbatches", [1, 4])
def test_the_estimates_kernels_are_a_lower_bound_on_the_gpu_programs(microbatches):
    # The estimate's launches (the matmuls and reductions of jax.grad of the model's loss, once per
    # pass) against the kernels XLA:GPU's program of the same step launches (deviceless): never
    # more, and as many more again with each further pass; remat's recomputed forward adds matmuls.
    from meshpar.plan import gpu_target
    from meshpar.plan.time import timing
    from meshpar.step import parts

    cfg = config_lib.load("experiments/quickstart.yaml", [f"train.microbatches={microbatches}"])
    topo = topology.load("h100-sxm-8")
    target = gpu_target.target(topo, cfg.mesh)
    step = parts.abstract_step(cfg, devices=target.devices)
    kernels = estimates.pass_kernels(step)
    compiled = timing.predict(step, step.lower().compile(), topo, 0.0).kernels
    assert 0 < kernels * microbatches <= compiled
    remat = config_lib.load("experiments/quickstart.yaml", ["model.remat=full"])
    assert estimates.pass_kernels(parts.abstract_step(remat, devices=target.devices)) > kernels


def test_the_compiled_best_are_distinct_layouts_each_at_its_best_count():
    # A pipeline of the shipped 2-stage Transformer on 4 devices: each stage layout is planned at every
    # count of at least 2 microbatches, and each further microbatch launches every kernel of a pass
    # again. The K compiled are K layouts, each at the count its estimate ranks first.
    cfg = config_lib.load("experiments/transformer_pipeline.yaml", ["mesh=data:2,stage:2", "train.batch_size=8",
                                                                    "train.microbatches=2"])  # fmt: skip
    result = search_lib.search(cfg, topology.load("h100-sxm-8"), 4, top=2)
    compiled = [r for r in result.rows if r.predicted is not None]
    assert len(compiled) == 2
    assert len({r.option_key for r in compiled}) == 2
    for row in compiled:
        same = [r for r in result.rows if r.option_key == row.option_key and r.fits]
        assert row.estimate.total_s == min(r.estimate.total_s for r in same)
    staged = [r for r in result.rows if r.option.stage]
    counts: dict[tuple, list[int]] = {}
    for r in staged:
        counts.setdefault(r.option_key, []).append(r.cfg.train.microbatches)
    assert any(len(c) > 1 for c in counts.values())  # several counts planned for a stage layout
    for row in staged:  # the launches grow with the microbatches at a fixed layout
        more = [
            r
            for r in staged
            if r.option_key == row.option_key and r.cfg.train.microbatches > row.cfg.train.microbatches
        ]
        assert all(r.estimate.launch_s > row.estimate.launch_s for r in more)

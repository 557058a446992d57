"""Mesh TensorFlow's own strings, verbatim: its mesh_shape and layout separators, its default
transformer rules (dims and mesh axes a model may lack are left out and said once at start), and
the two experiments that show them (experiments/mtf_*.yaml)."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshpar import train
from meshpar.configuration import config as config_lib
from meshpar.plan import __main__ as plan_cli
from meshpar.run import experiment, loop
from meshpar.run.metrics import read_jsonl
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import aot, parts

# mesh_tensorflow/transformer utils.run's (and T5's MtfModel's) default layout_rules.
MTF_DEFAULT = "ensemble:ensemble,batch:batch,d_ff:model,heads:model,vocab:model,experts:batch"
SHORT = ["train.log_every=1", "train.eval_batches=1", "train.progress=false"]

MLP = {"name": "mlp", "hidden": [64, 32]}
MLP_SPEC = {"inputs": ((64,), np.float32), "targets": ((), np.int32)}
MLP_DIMS = {"batch", "pixels", "hidden", "hidden_2", "classes"}
TRANSFORMER = {
    "name": "transformer", "d_model": 32, "n_heads": 2, "d_head": 8, "d_ff": 64, "n_layers": 2, "max_length": 16
}  # fmt: skip
TRANSFORMER_SPEC = {"tokens": ((17,), np.int32)}
TRANSFORMER_DIMS = {"batch", "length", "embed", "heads", "kv", "d_ff", "vocab", "layers"}


def _specs_of_every_tensor(monkeypatch, raw: dict, element_spec: dict) -> tuple[list, object, str, object]:
    """Every (dims, PartitionSpec) the layout gives while the config's train step is planned and
    lowered (parameters, optimizer state, the batch, and every activation the model constrains,
    forward and backward, in order), the state's shardings, the lowered program, the plan."""
    seen = []
    sharding = layout_lib.Layout.sharding

    def recording(self, mesh, dims):
        out = sharding(self, mesh, dims)
        seen.append((tuple(dims), out.spec))
        return out

    cfg = config_lib.from_dict({**raw, "train": {"batch_size": 8}})
    mesh = parts.make_mesh(cfg)
    with monkeypatch.context() as m:
        m.setattr(layout_lib.Layout, "sharding", recording)
        step = parts.abstract_step(cfg, mesh, element_spec)
        text = step.lower().as_text()
    specs = jax.tree.map(lambda s: s.spec, step.plan.shardings)
    return seen, specs, text, step.plan


# (model, Mesh TensorFlow's strings, the same in meshpar's own syntax)
CASES = {
    "mlp-semicolons": (MLP, ("b1:4;b2:2", "batch:b1;hidden:b2"), ("b1:4,b2:2", {"batch": "b1", "hidden": "b2"})),
    "mlp-dots-spaces-absent-rules": (
        MLP, ("b1:4 b2:2", "ensemble:ensemble.batch:b1.hidden:b2.experts:b1"), ("b1:4,b2:2", "batch:b1; hidden:b2"),
    ),
    "mlp-mnist-mesh": (MLP, ("b1:2;b2:2", "row_blocks:b1;col_blocks:b2;pixels:b1"), ({"b1": 2, "b2": 2}, "pixels:b1")),
    "transformer-mtf-default": (
        TRANSFORMER, ("batch:4;model:2", MTF_DEFAULT),
        ("batch:4,model:2", "batch:batch; d_ff:model; heads:model; vocab:model"),
    ),
    "transformer-quickstart-as-issued": (
        TRANSFORMER, ("b1:4;b2:2", "batch:b1;d_ff:b2;heads:b2;vocab:b2"),
        ("b1:4,b2:2", {"batch": "b1", "d_ff": "b2", "heads": "b2", "vocab": "b2"}),
    ),
    "transformer-fsdp": (
        TRANSFORMER, ("batch:4.model:2", MTF_DEFAULT, "embed:batch;experts:batch"),
        ("batch:4,model:2", "batch:batch; d_ff:model; heads:model; vocab:model", "embed:batch"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_mtf_strings_and_meshpar_syntax_give_identical_partition_specs(monkeypatch, case):
    model, mtf, ours = CASES[case]
    spec = MLP_SPEC if model["name"] == "mlp" else TRANSFORMER_SPEC
    runs = []
    for mesh, layout, *params in (mtf, ours):
        raw = {"mesh": mesh, "layout": layout, "param_layout": params[0] if params else None, "model": model}
        runs.append(_specs_of_every_tensor(monkeypatch, raw, spec))
    (seen, specs, text, plan), (seen_ours, specs_ours, text_ours, _) = runs
    assert seen == seen_ours  # every tensor, in the order the layout was asked
    assert specs == specs_ours  # every parameter's and optimizer-state array's sharding
    assert text == text_ours  # the very same program
    # Not vacuous: every dim of the model was placed, parameters and activations, and split somewhere.
    expected = MLP_DIMS if model["name"] == "mlp" else TRANSFORMER_DIMS
    assert {d for dims, _ in seen for d in dims if d} == plan.dims == expected
    assert any(s != P(*([None] * len(s))) for _, s in seen)


@pytest.mark.parametrize(
    "mesh, layout",
    [("b1:4;b2:2", "batch:b1;hidden:b2"), ("b1:4.b2:2", "batch:b1.hidden:b2"), ("b1:4 b2:2", "batch:b1 hidden:b2"),
     ("b1 : 4 ; b2 : 2", "batch : b1 ; hidden : b2"), ("b1:4,b2:2", "batch:b1, hidden:b2")],
)  # fmt: skip
def test_config_file_and_overrides_read_mtf_strings(tmp_path, mesh, layout):
    in_file = tmp_path / "mtf.yaml"
    in_file.write_text(f'mesh: "{mesh}"\nlayout: "{layout}"\nmodel: {{name: mlp}}\n')
    plain = tmp_path / "plain.yaml"
    plain.write_text("model: {name: mlp}\n")
    # Overrides are YAML values: `b1 : 4 ; ...` would be a YAML mapping gone wrong, so quote it
    # (Mesh TensorFlow's strings never have spaces around a colon: its parser splits on them).
    quote = '"' if " : " in mesh else ""
    overrides = [f"mesh={quote}{mesh}{quote}", f"layout={quote}{layout}{quote}"]
    for cfg in (config_lib.load(in_file), config_lib.load(plain, overrides)):
        assert cfg.mesh == (("b1", 4), ("b2", 2)) and cfg.layout == (("batch", "b1"), ("hidden", "b2"))


TINY = """
mesh: "b1:4;b2:2"
layout: "ensemble:ensemble,batch:b1,hidden:b2,experts:b1"
param_layout: "pixels:b1;experts:b1"
model: {name: mlp, hidden: [64, 32]}
data: {num_examples: 1024, num_eval_examples: 64, num_features: 64}
train: {steps: 2, batch_size: 32, log_every: 1, progress: false}
"""
LAYOUT_LINE = "layout: unused rules (this model has no dim ensemble, experts; the mesh has no axis ensemble)"
PARAM_LINE = "param_layout: unused rules (this model's parameters have no dim experts)"


def _tiny(tmp_path) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return str(path)


def test_rules_that_cannot_apply_are_said_once_on_stderr_at_start(tmp_path, capsys):
    assert train.main(["--config", _tiny(tmp_path), f"workdir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err.count(LAYOUT_LINE) == 1 and err.count(PARAM_LINE) == 1, err
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    # The plan says it too, from the same model.
    assert plan_cli.main(["--config", _tiny(tmp_path)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err.count(LAYOUT_LINE) == 1 and err.count(PARAM_LINE) == 1, err
    # Rules that all apply: nothing said.
    quiet = ["layout=batch:b1;hidden:b2", "param_layout=pixels:b1", f"workdir={tmp_path / 'quiet'}"]
    assert train.main(["--config", _tiny(tmp_path), *quiet]) == 0
    assert "unused" not in capsys.readouterr().err


def test_unused_rules_names_dims_and_axes():
    cfg = config_lib.from_dict({
        "mesh": "batch:4;model:2", "layout": MTF_DEFAULT, "param_layout": "embed:(replica,batch)",
        "model": TRANSFORMER, "train": {"batch_size": 8},
    })  # fmt: skip
    step = parts.abstract_step(cfg, parts.make_mesh(cfg), TRANSFORMER_SPEC)
    assert parts.unused_rules(step) == [
        LAYOUT_LINE,
        "param_layout: unused rules (the mesh has no axis replica)",
    ]
    # What a layout can apply to: every parameter's dims and every activation's the model constrains.
    assert step.plan.dims == TRANSFORMER_DIMS
    # embed:(replica,batch) applies as embed:batch; experts:batch and ensemble:ensemble as nothing.
    assert step.layout.params.spec(("layers", "embed", "d_ff")) == P(None, "batch", "model")
    assert step.layout.spec(("batch", "length", "embed")) == P("batch", None, None)


@pytest.mark.parametrize(
    "param_layout, why",
    [
        (
            "nosuchdim:b1",
            "this model's parameters have no dim nosuchdim; the parameters' dims: classes, hidden, hidden_2, pixels)",
        ),
        ("batch:b1", "this model's parameters have no dim batch; "),  # an activation dim: no parameter has it
        ("hidden:rows; experts:b1", "this model's parameters have no dim experts; the mesh has no axis rows; "),
    ],
)
def test_a_param_layout_that_splits_no_parameter_is_a_config_error(tmp_path, capsys, param_layout, why):
    for main in (train.main, plan_cli.main):
        code = main(["--config", _tiny(tmp_path), f"param_layout={param_layout}", f"workdir={tmp_path / 'run'}"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(
            f"config error: param_layout: none of its rules applies to a parameter, so it would split nothing ({why}"
        ), err
    assert not (tmp_path / "run").exists()  # refused before anything was made


# --------------------------------------------------------------------------------------------
# The shipped experiments keep what their headers say.


def _header(path: pathlib.Path) -> str:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:])
    return "\n".join(lines)


def _losses_and_params(path: str, tmp_path, *overrides: str):
    cfg = config_lib.load(path, [*SHORT, "train.steps=3", "train.eval_every=0", f"workdir={tmp_path}", *overrides])
    exp = experiment.build(cfg)
    loop.train(exp)
    return [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")], exp


def test_mtf_transformer_is_the_quickstart_bit_for_bit_and_says_what_it_leaves_out(tmp_path, capsys):
    path = pathlib.Path("experiments/mtf_transformer.yaml")
    header = _header(path)
    cfg = config_lib.load(path)
    assert cfg.layout == layout_lib.parse_rules(MTF_DEFAULT) and cfg.mesh == (("batch", 4), ("model", 2))
    assert f"\n  {LAYOUT_LINE}\n" in header
    mtf, exp = _losses_and_params(str(path), tmp_path / "mtf")
    assert capsys.readouterr().err.splitlines().count(LAYOUT_LINE) == 1
    quickstart, reference = _losses_and_params("experiments/quickstart.yaml", tmp_path / "qs", "checkpoint.every=0")
    assert "unused" not in capsys.readouterr().err
    assert mtf == quickstart  # bit for bit
    for a, b in zip(jax.tree.leaves(exp.state.params), jax.tree.leaves(reference.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert str(a.sharding.spec) == str(b.sharding.spec).replace("'data'", "'batch'")  # its mesh axis renamed


def test_mtf_mnist_splits_every_image_as_its_header_says(tmp_path, monkeypatch):
    path = pathlib.Path("experiments/mtf_mnist.yaml")
    header = _header(path)
    assert '--mesh_shape "b1:2;b2:2" --layout "row_blocks:b1;col_blocks:b2"' in header
    cfg = config_lib.load(path)
    assert cfg.mesh == mesh_lib.parse_mesh("b1:2;b2:2") and 'mesh: "b1:2;b2:2"' in path.read_text()
    assert "196 of every image's 784 pixels" in header.replace("\n", " ") and "196x512" in header
    raw = {"mesh": cfg.mesh_str, "layout": cfg.layout_str, "model": {"name": "mlp", "hidden": [512, 512]}}
    spec = {"inputs": ((784,), np.float32), "targets": ((), np.int32)}
    seen, _, _, plan = _specs_of_every_tensor(monkeypatch, raw, spec)
    # Parameters (and their optimizer state): the first kernel split 4 ways along pixels, a
    # 196x512 quarter on each device; every other one whole.
    arrays = aot.state_bytes(parts.abstract_step(cfg).plan)
    kernel = arrays.pop("params/layers/0/kernel")
    assert kernel["shape"] == [784, 512] and kernel["per_device_bytes"] == 196 * 512 * 4
    assert len(arrays) > 10 and all(
        a["per_device_bytes"] == a["total_bytes"] for name, a in arrays.items() if "layers/0/kernel" not in name
    )
    # The image's pixels are split where the model computes with them; the batch never is.
    assert (("batch", "pixels"), P(None, ("b1", "b2"))) in seen
    assert all(s[0] is None for dims, s in seen if dims and dims[0] == "batch")
    assert plan.dims == MLP_DIMS
    # The same losses as the unsplit model, up to float reassociation.
    split, _ = _losses_and_params(str(path), tmp_path / "split")
    whole, _ = _losses_and_params(str(path), tmp_path / "whole", "layout=")
    np.testing.assert_allclose(split, whole, rtol=1e-5)

"""meshpar.configuration.config: YAML + overrides → validated Config; every mistake a one-line ConfigError."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config, ConfigError, from_dict, load
from meshpar.models.mlp import MLPConfig

MODEL = {"name": "mlp"}
EXPERIMENTS = sorted((pathlib.Path(__file__).resolve().parents[1] / "experiments").glob("*.yaml"))


def one_line(msg: str) -> str:
    assert msg and msg.splitlines() == [msg], f"not one line: {msg!r}"
    return msg


def expect(e: pytest.ExceptionInfo, key: str, *substrings: str) -> None:
    """The error is a ConfigError for `key`, one line ``<key>: ...``, containing `substrings`."""
    err = e.value
    assert isinstance(err, ConfigError)
    msg = one_line(str(err))
    assert err.key == key, (err.key, msg)
    shown = key if key.isprintable() else repr(key)  # odd keys are shown quoted
    assert msg.startswith(f"{shown}: "), msg
    for s in substrings:
        assert s in msg, (s, msg)


def cfg_with(**sections) -> dict:
    raw = {"model": dict(MODEL)}
    raw.update(sections)
    return raw


def write(tmp_path: pathlib.Path, text: str, name: str = "exp.yaml") -> pathlib.Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------
# Happy paths


def test_defaults():
    cfg = from_dict({"model": {"name": "mlp"}})
    assert isinstance(cfg, Config)
    assert cfg.mesh == (("data", -1),) and cfg.layout == (("batch", "data"),)
    assert cfg.model == MLPConfig()
    assert cfg.train.steps == 100 and cfg.feed.mode == "direct" and cfg.optimizer.name == "adamw"
    assert cfg.mesh_str == "data:-1" and cfg.layout_str == "batch:data"


def test_mesh_and_layout_forms():
    a = from_dict({"mesh": "data:4,model:2", "layout": "batch:data; hidden:model", "model": MODEL})
    b = from_dict({"mesh": {"data": 4, "model": 2}, "layout": {"batch": "data", "hidden": "model"}, "model": MODEL})
    c = from_dict({"mesh": "data:4,model:2", "layout": "batch:data,hidden:model", "model": MODEL})
    assert a == b == c
    assert a.mesh == (("data", 4), ("model", 2))
    assert a.layout == (("batch", "data"), ("hidden", "model"))
    assert a.mesh_str == "data:4,model:2" and a.layout_str == "batch:data; hidden:model"
    d = config_lib.to_dict(a)
    assert d["mesh"] == "data:4,model:2" and d["layout"] == "batch:data; hidden:model"
    assert d["model"]["hidden"] == (512,) and d["train"]["batch_size"] == 128


def test_empty_layout_replicates_everything():
    assert from_dict(cfg_with(layout="")).layout == ()


def test_float_field_accepts_int():
    cfg = from_dict(cfg_with(optimizer={"learning_rate": 1}))
    assert cfg.optimizer.learning_rate == 1.0 and type(cfg.optimizer.learning_rate) is float


def test_load_yaml_with_overrides(tmp_path):
    path = write(
        tmp_path,
        """
mesh: data:4,model:2
layout: batch:data; hidden:model
model:
  name: mlp
  hidden: [512]
train:
  steps: 10
  batch_size: 64
workdir: runs/x
""",
    )
    cfg = load(path)
    assert cfg.model.hidden == (512,) and cfg.train.steps == 10 and cfg.mesh == (("data", 4), ("model", 2))

    cfg = load(
        path,
        [
            "model.hidden=[64,32]",  # YAML-parsed: a list
            "train.steps=5",  # an int
            "train.progress=false",  # a bool
            "optimizer.learning_rate=0.01",  # a float
            "feed.mode=routed",
            "data.num_examples=256",  # a section absent from the file
            "data.fields={inputs: x, targets: y}",  # a mapping
            "layout=batch:data",  # mesh/layout replaced whole, as strings
            "mesh=data:8",
            "workdir=runs/y",
        ],
    )
    assert cfg.model.hidden == (64, 32)
    assert cfg.train.steps == 5 and cfg.train.batch_size == 64  # untouched keys kept
    assert cfg.train.progress is False
    assert cfg.optimizer.learning_rate == 0.01
    assert cfg.feed.mode == "routed"
    assert cfg.data.num_examples == 256 and cfg.data.fields == {"inputs": "x", "targets": "y"}
    assert cfg.layout == (("batch", "data"),) and cfg.mesh == (("data", 8),)
    assert cfg.workdir == "runs/y"


def test_overrides_later_wins_and_mapping_mesh(tmp_path):
    path = write(tmp_path, "model: {name: mlp}\n")
    cfg = load(path, ["train.steps=5", "train.steps=7", "mesh={data: 2, model: 4}", "layout=hidden: model"])
    assert cfg.train.steps == 7
    assert cfg.mesh == (("data", 2), ("model", 4))
    assert cfg.layout == (("hidden", "model"),)


def test_override_into_mesh_mapping(tmp_path):
    path = write(tmp_path, "mesh: {data: 4, model: 2}\nmodel: {name: mlp}\n")
    assert load(path, ["mesh.model=4", "mesh.data=2"]).mesh == (("data", 2), ("model", 4))


def test_load_does_not_mutate_on_override(tmp_path):
    raw = {"model": {"name": "mlp"}, "train": {"steps": 3}}
    out = config_lib.apply_overrides(raw, ["train.steps=4", "model.hidden=[8]"])
    assert raw == {"model": {"name": "mlp"}, "train": {"steps": 3}}
    assert out["train"]["steps"] == 4 and out["model"]["hidden"] == [8]


@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.name for p in EXPERIMENTS])
def test_shipped_experiments_load(path):
    assert isinstance(load(path), Config)


# --------------------------------------------------------------------------------------------
# Unknown keys


@pytest.mark.parametrize(
    "raw, key, substrings",
    [
        (cfg_with(trian={"steps": 1}), "trian", ["unknown key", "train"]),
        (cfg_with(steps=1), "steps", ["unknown key"]),
        (cfg_with(train={"stpes": 1}), "train.stpes", ["unknown key", "steps", "batch_size"]),
        (cfg_with(optimizer={"lr": 0.1}), "optimizer.lr", ["unknown key", "learning_rate"]),
        (cfg_with(feed={"mode": "direct", "prefech": 1}), "feed.prefech", ["unknown key", "prefetch"]),
        ({"model": {"name": "mlp", "hiden": [8]}}, "model.hiden", ["unknown key", "hidden"]),
        (cfg_with(**{"a\nb": 1}), "a\nb", ["unknown key"]),  # shown as repr: still one line
    ],
)
def test_unknown_keys(raw, key, substrings):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    expect(e, key, *substrings)


# --------------------------------------------------------------------------------------------
# Types


@pytest.mark.parametrize(
    "raw, key, substrings",
    [
        (cfg_with(train={"steps": "10"}), "train.steps", ["expected an integer", "'10' (str)"]),
        (cfg_with(train={"steps": True}), "train.steps", ["expected an integer", "True (bool)"]),
        (cfg_with(train={"steps": 1.5}), "train.steps", ["expected an integer", "1.5 (float)"]),
        (cfg_with(train={"batch_size": 64.0}), "train.batch_size", ["expected an integer", "(float)"]),
        (cfg_with(train={"steps": None}), "train.steps", ["expected an integer", "None"]),
        (cfg_with(train={"progress": 1}), "train.progress", ["expected true or false", "1 (int)"]),
        (cfg_with(train={"progress": "yes please"}), "train.progress", ["expected true or false"]),
        (cfg_with(workdir=["runs", "x"]), "workdir", ["expected a string", "(list)"]),
        (cfg_with(workdir=5), "workdir", ["expected a string", "5 (int)"]),
        (cfg_with(data={"name": ["mnist"]}), "data.name", ["expected a string", "(list)"]),
        (cfg_with(optimizer={"learning_rate": "fast"}), "optimizer.learning_rate", ["expected a number", "'fast'"]),
        (cfg_with(optimizer={"learning_rate": True}), "optimizer.learning_rate", ["expected a number", "True"]),
        ({"model": {"name": "mlp", "hidden": "64"}}, "model.hidden", ["expected a list", "'64' (str)"]),
        ({"model": {"name": "mlp", "hidden": 64}}, "model.hidden", ["expected a list", "64 (int)"]),
        ({"model": {"name": "mlp", "hidden": [64, "x"]}}, "model.hidden[1]", ["expected an integer", "'x'"]),
        ({"model": {"name": "mlp", "hidden": [64, True]}}, "model.hidden[1]", ["expected an integer", "True"]),
        (cfg_with(data={"fields": ["image", "label"]}), "data.fields", ["expected a mapping", "(list)"]),
        (cfg_with(data={"fields": {"inputs": 3}}), "data.fields.inputs", ["expected a string", "3 (int)"]),
        (cfg_with(train=5), "train", ["expected a mapping", "5 (int)"]),
        (cfg_with(train=["steps"]), "train", ["expected a mapping"]),
    ],
)
def test_wrong_types(raw, key, substrings):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    expect(e, key, *substrings)


def test_null_section_means_defaults():
    assert from_dict(cfg_with(train=None)).train == config_lib.TrainConfig()


# --------------------------------------------------------------------------------------------
# Minimums and choices


@pytest.mark.parametrize(
    "raw, key, substrings",
    [
        (cfg_with(train={"steps": 0}), "train.steps", ["must be >= 1", "got 0"]),
        (cfg_with(train={"batch_size": -1}), "train.batch_size", ["must be >= 1", "got -1"]),
        (cfg_with(train={"log_every": 0}), "train.log_every", ["must be >= 1"]),
        (cfg_with(train={"eval_every": -1}), "train.eval_every", ["must be >= 0"]),
        (cfg_with(data={"num_classes": 1}), "data.num_classes", ["must be >= 2", "got 1"]),
        (cfg_with(feed={"prefetch": -1}), "feed.prefetch", ["must be >= 0"]),
        (cfg_with(optimizer={"learning_rate": -0.1}), "optimizer.learning_rate", ["must be >= 0.0", "-0.1"]),
        (cfg_with(optimizer={"learning_rate": float("nan")}), "optimizer.learning_rate", ["nan", "not a finite"]),
        ({"model": {"name": "mlp", "num_classes": 1}}, "model.num_classes", ["must be >= 2"]),
    ],
)
def test_below_minimum(raw, key, substrings):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    expect(e, key, *substrings)


def test_at_minimum_is_fine():
    cfg = from_dict(cfg_with(train={"steps": 1, "batch_size": 8, "eval_every": 0}, optimizer={"learning_rate": 0}))
    assert cfg.train.steps == 1 and cfg.optimizer.learning_rate == 0.0


@pytest.mark.parametrize(
    "raw, key, substrings",
    [
        (cfg_with(feed={"mode": "sideways"}), "feed.mode", ["'sideways'", "not one of", "direct", "routed"]),
        (cfg_with(optimizer={"name": "sgdd"}), "optimizer.name", ["'sgdd'", "adam", "adamw", "sgd", "lion"]),
        (cfg_with(optimizer={"schedule": "linear"}), "optimizer.schedule", ["'linear'", "constant", "cosine"]),
        (cfg_with(data={"source": "mnist"}), "data.source", ["'mnist'", "synthetic", "tfds"]),
        ({"model": {"name": "mlp", "activation": "swish"}}, "model.activation", ["'swish'", "relu", "gelu", "tanh"]),
        (cfg_with(feed={"mode": ["direct"]}), "feed.mode", ["['direct']", "not one of"]),
    ],
)
def test_literal_choices(raw, key, substrings):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    expect(e, key, *substrings)


# --------------------------------------------------------------------------------------------
# Model section


@pytest.mark.parametrize(
    "raw, key, substrings",
    [
        ({"model": {"name": "gpt"}}, "model.name", ["'gpt'", "not a model", "mlp", "transformer"]),
        ({"model": {"hidden": [8]}}, "model.name", ["None", "mlp"]),
        ({"model": {"name": ["mlp"]}}, "model.name", ["['mlp']", "not a model"]),  # unhashable
        ({"model": {"name": {"a": 1}}}, "model.name", ["not a model"]),
        ({"model": "mlp"}, "model", ["expected a mapping", "'mlp' (str)"]),
        ({"model": None}, "model", ["expected a mapping"]),
        ({"train": {"steps": 5}}, "model", ["missing", "model.name"]),
        ({}, "model", ["missing"]),
    ],
)
def test_model_errors(raw, key, substrings):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    expect(e, key, *substrings)


def test_top_level_not_mapping():
    with pytest.raises(ConfigError) as e:
        from_dict(["model"])
    expect(e, "config", "expected a mapping", "(list)")


# --------------------------------------------------------------------------------------------
# Mesh / layout / cross-section checks


@pytest.mark.parametrize(
    "mesh, substrings",
    [
        ("data", ["'data'", "not 'name:size'"]),
        ("data:four", ["'four'", "not an integer"]),
        ("data:0", ["'data'", "size 0"]),
        ("data:-3", ["size -3"]),
        ("data:4,data:2", ["'data'", "appears twice"]),
        ("data:-1,model:-1", ["more than one axis is -1"]),
        ({"data": "x"}, ["'x'", "not an integer"]),
        ([4, 2], ["list"]),
        (8, ["int"]),
    ],
)
def test_mesh_errors_become_config_errors(mesh, substrings):
    with pytest.raises(ConfigError) as e:
        from_dict(cfg_with(mesh=mesh))
    expect(e, "mesh", *substrings)


@pytest.mark.parametrize(
    "mesh, layout, substrings",
    [
        ("data:4,model:2", "batch:data; batch:model", ["dim 'batch'", "mapped twice"]),
        ("data:4,model:2", "batch", ["'batch'", "not 'dim:axis'"]),
        ("data:4,model:2", "batch:", ["empty dim or axis"]),
        ("data:4,model:2", ["batch:data"], ["list"]),
        ("data:4,model:2", "a\nb:nope", ["rule 'a'", "not 'dim:axis'"]),  # a line break separates rules
        ("data:4,model:2", {"a\nb": "nope"}, ["dim name 'a\\nb'", "not an identifier"]),  # one line even so
    ],
)
def test_layout_errors_become_config_errors(mesh, layout, substrings):
    with pytest.raises(ConfigError) as e:
        from_dict(cfg_with(mesh=mesh, layout=layout))
    expect(e, "layout", *substrings)


def test_layout_may_name_axes_the_mesh_does_not_have():
    # As in Mesh TensorFlow, such rules are left out (meshpar.sharding.layout.Layout.create) and reported
    # at start (meshpar.step.parts.unused_rules), not refused: one rule string serves many meshes.
    assert from_dict(cfg_with(layout="hidden:model")).layout == (("hidden", "model"),)
    cfg = from_dict(cfg_with(mesh="b1:4;b2:2", layout="batch:(b0,b1);hidden:b2", train={"batch_size": 4}))
    assert cfg.mesh == (("b1", 4), ("b2", 2)) and cfg.layout == (("batch", ("b0", "b1")), ("hidden", "b2"))
    with pytest.raises(ConfigError) as e:  # the batch is split over the axes the mesh has
        from_dict(cfg_with(mesh="b1:4;b2:2", layout="batch:(b0,b1)", train={"batch_size": 6}))
    expect(e, "train.batch_size", "6", "mesh axis 'b1' of size 4")


@pytest.mark.parametrize(
    "mesh, batch_size, n",
    [("data:3", 128, 3), ("data:4,model:2", 30, 4), ("model:2,data:8", 100, 8)],
)
def test_batch_size_not_divisible_by_data_axis(mesh, batch_size, n):
    with pytest.raises(ConfigError) as e:
        from_dict(cfg_with(mesh=mesh, train={"batch_size": batch_size}))
    expect(e, "train.batch_size", str(batch_size), f"mesh axis 'data' of size {n}", "batch:data")


def test_batch_size_checked_on_the_axis_the_layout_names():
    # batch is split over `model` here: 6 divides by model=2 (not by data=4), so it is fine ...
    cfg = from_dict(cfg_with(mesh="data:4,model:2", layout="batch:model", train={"batch_size": 6}))
    assert cfg.train.batch_size == 6
    # ... and 5 is not.
    with pytest.raises(ConfigError) as e:
        from_dict(cfg_with(mesh="data:4,model:2", layout="batch:model", train={"batch_size": 5}))
    expect(e, "train.batch_size", "5", "'model' of size 2")


def test_batch_size_unchecked_when_not_knowable():
    # A -1 data axis is only known on the devices; an unsplit batch needs no check.
    assert from_dict(cfg_with(mesh="data:-1", train={"batch_size": 7})).train.batch_size == 7
    assert from_dict(cfg_with(mesh="data:4", layout="", train={"batch_size": 7})).train.batch_size == 7


def test_batch_size_checked_against_the_built_mesh():
    # Once the mesh is built, a -1 axis has its size: batch 12 on data:-1 over 8 devices was an
    # IndivisibleError traceback from the feeder.
    cfg = from_dict(cfg_with(mesh="data:-1,model:2", layout="batch:data", train={"batch_size": 12}))
    config_lib.check_batch_size(cfg, {"data": 3, "model": 2})
    with pytest.raises(ConfigError) as e:
        config_lib.check_batch_size(cfg, {"data": 8, "model": 2})
    expect(e, "train.batch_size", "12", "'data' of size 8")


@pytest.mark.parametrize(
    "data, key",
    [({"source": "tfds", "data_dir": "/x"}, "data.name"), ({"source": "tfds", "name": "mnist"}, "data.data_dir")],
)
def test_tfds_requires_name_and_data_dir(data, key):
    with pytest.raises(ConfigError) as e:
        from_dict(cfg_with(data=data))
    expect(e, key, "required when data.source is tfds")


# --------------------------------------------------------------------------------------------
# Files, YAML, overrides


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as e:
        load(path)
    expect(e, "config", "file not found", str(path))


def test_unreadable_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        load(tmp_path)  # a directory
    expect(e, "config", "cannot read", str(tmp_path))


@pytest.mark.parametrize(
    "text",
    [
        "model: [1, 2\n",
        "model:\n  name: mlp\n hidden: [1]\n",
        "a: b: c\n",
        "model: {name: mlp\ntrain:\n  steps: 3\n",
        "\tmodel: x\n",
    ],
)
def test_invalid_yaml(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load(path)
    expect(e, "config", "not valid YAML", str(path))


@pytest.mark.parametrize(
    "text",
    [
        "model: {name: mlp}\ntrain: {steps: " + "9" * 5000 + "}\n",  # over Python's int-digit limit
        "model: {name: mlp}\nworkdir: 2001-13-45\n",  # a timestamp out of range
        "model: {name: mlp}\ntrain: {steps: !!int ten}\n",
        "model: {name: mlp}\noptimizer: {learning_rate: !!float fast}\n",
    ],
)
def test_yaml_constructor_value_errors(tmp_path, text):
    # PyYAML raises plain ValueError (not YAMLError) for these.
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load(path)
    expect(e, "config", "not valid YAML")


def test_non_utf8_file(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00model: {name: mlp}\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    expect(e, "config", "cannot read", str(path))


@pytest.mark.parametrize(
    "template",
    [
        '!!python/object/apply:os.system ["touch {marker}"]\n',
        'model: !!python/object/apply:os.system ["touch {marker}"]\n',
        'model:\n  name: mlp\ntrain: !!python/object/new:subprocess.Popen [["touch", "{marker}"]]\n',
        "model: !!python/name:os.system\n",
    ],
)
def test_python_tags_rejected_not_executed(tmp_path, template):
    marker = tmp_path / "executed"
    path = write(tmp_path, template.format(marker=marker))
    with pytest.raises(ConfigError) as e:
        load(path)
    expect(e, "config", "not valid YAML", "python/")
    assert not marker.exists()


@pytest.mark.parametrize(
    "text, shown", [("[1, 2]\n", "(list)"), ("hello\n", "(str)"), ("0\n", "(int)"), ("- [model, x]\n", "(list)")]
)
def test_yaml_top_level_not_mapping(tmp_path, text, shown):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load(path, ["train.steps=3"])
    expect(e, "config", "expected a mapping", shown)


@pytest.mark.parametrize(
    "text, key, lines",
    [
        ("mesh: data:8\nmodel: {name: mlp}\nmesh: data:4,model:2\n", "mesh", (1, 3)),
        ("model: {name: mlp}\ntrain:\n  steps: 5\n  batch_size: 64\n  steps: 9\n", "train.steps", (3, 5)),
        ("model: {name: mlp, hidden: [8], name: mlp}\n", "model.name", (1, 1)),  # flow mapping, one line
        ("model: {name: mlp}\ndata:\n  fields: {inputs: a, 0x1: b, 1: c}\n", "data.fields.1", (3, 3)),  # YAML values
        ("model: {name: mlp}\ntrain: {steps: 3}\n'train': {steps: 4}\n", "train", (2, 3)),  # quoted or not
    ],
)
def test_duplicate_keys_refused(tmp_path, text, key, lines):
    """PyYAML's safe loader keeps the last of two equal keys without a word; meshpar refuses
    the file, naming the key and both lines."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load(path)
    expect(e, key, "appears twice", str(path), f"lines {lines[0]} and {lines[1]}")


def test_keys_compare_as_yaml_values_and_merges_may_override(tmp_path):
    # 1 and true are different keys (an int and a bool), though Python's 1 == True; 1 and 0x1
    # are one (the fields case above).
    config_lib.read(write(tmp_path, "a: {1: x, true: y, 1.0: z}\n"))
    # A merge key brings defaults that the mapping's own keys override: legal, the own key wins.
    text = "base: &base {steps: 5, batch_size: 64}\nmodel: {name: mlp}\ntrain:\n  <<: *base\n  steps: 7\n"
    raw = config_lib.read(write(tmp_path, text, "merge.yaml"))
    assert raw["train"] == {"steps": 7, "batch_size": 64}
    # ... but a key twice inside the merged mapping itself is still refused.
    text = "base: &base {steps: 5, steps: 6}\nmodel: {name: mlp}\ntrain: {<<: *base}\n"
    with pytest.raises(ConfigError) as e:
        config_lib.read(write(tmp_path, text, "merge2.yaml"))
    expect(e, "base.steps", "lines 1 and 1")


def test_duplicate_key_inside_an_override_value(tmp_path):
    path = write(tmp_path, "model: {name: mlp}\n")
    with pytest.raises(ConfigError) as e:
        load(path, ["data.fields={inputs: a, inputs: b}"])
    expect(e, "data.fields.inputs", "appears twice", "override")


def test_empty_file_is_empty_config(tmp_path):
    path = write(tmp_path, "# nothing here\n")
    with pytest.raises(ConfigError) as e:
        load(path)
    expect(e, "model", "missing")
    assert load(path, ["model.name=mlp"]).model == MLPConfig()


@pytest.mark.parametrize(
    "override, key, substrings",
    [
        ("train.steps", "train.steps", ["not 'section.key=value'"]),
        ("=5", "=5", ["not 'section.key=value'"]),
        ("model.hidden=[1,", "model.hidden", ["not valid YAML", "'[1,'"]),
        ("train.steps=0", "train.steps", ["must be >= 1"]),
        ("train.steps=ten", "train.steps", ["expected an integer", "'ten'"]),
        ("train.step=3", "train.step", ["unknown key"]),
        ("feed.mode=sideways", "feed.mode", ["'sideways'", "direct", "routed"]),
        ("mesh.data=4", "mesh.data", ["'mesh' is a single value", "mesh="]),
        ("layout.batch=model", "layout.batch", ["'layout' is a single value"]),
        ("mesh=data:0", "mesh", ["size 0"]),
        ("layout=hidden:(tensor,tensor)", "layout", ["'tensor' twice"]),
        ("model.name=rnn", "model.name", ["'rnn'"]),
        ("train.batch_size=63", "train.batch_size", ["63", "size 4"]),
        ("trian.steps=3", "trian", ["unknown key"]),
        ("a\nb=1", "a\nb", ["unknown key"]),  # a newline in the key: still one line
        ("train.steps=" + "9" * 5000, "train.steps", ["not valid YAML", "4300"]),
        ("workdir=2001-13-45", "workdir", ["not valid YAML", "month"]),
        ("train.steps=!!int ten", "train.steps", ["not valid YAML"]),
        ("model=!!python/object/apply:os.system [true]", "model", ["not valid YAML", "python/"]),
    ],
)
def test_override_errors(tmp_path, override, key, substrings):
    path = write(tmp_path, "mesh: data:4,model:2\nlayout: batch:data\nmodel: {name: mlp}\n")
    with pytest.raises(ConfigError) as e:
        load(path, [override])
    expect(e, key, *substrings)


def test_config_error_key_attribute_and_repr_of_odd_keys():
    e = ConfigError("train.steps", "must be >= 1, got 0")
    assert e.key == "train.steps" and str(e) == "train.steps: must be >= 1, got 0"
    odd = ConfigError("a\nb", "unknown key")
    assert odd.key == "a\nb" and str(odd) == "'a\\nb': unknown key"
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------------------------
# Property: malformed mesh / layout never escape as anything but a one-line ConfigError.

_NAMES = st.sampled_from(
    ["data", "model", "batch", "hidden", "x", "", " ", "1a", "da ta", "a\nb", "c\x85d", "é", "a:b", "-1"]
)
_SIZES = st.one_of(
    st.integers(-3, 17).map(str),
    st.sampled_from(["", " ", "x", "2.5", "1e3", "0x4", "+2", "٤", "1_0", "-", "--1", "9" * 5000, "\n"]),
)
_SEPS = st.sampled_from([",", ";", ", ", " ,", ",,", "", "\n"])
_COLONS = st.sampled_from([":", ":", ":", "", "::", " : ", "="])


@st.composite
def mesh_strings(draw):
    if draw(st.booleans()):
        return draw(st.text(alphabet="datmoel:,;-0123456789 \n\t_x", max_size=30))
    parts = [draw(_NAMES) + draw(_COLONS) + draw(_SIZES) for _ in range(draw(st.integers(0, 4)))]
    return draw(_SEPS).join(parts)


@st.composite
def layout_strings(draw):
    if draw(st.booleans()):
        return draw(st.text(alphabet="batchidenmol:,;_ \n\t\x85\u2028", max_size=30))
    parts = [draw(_NAMES) + draw(_COLONS) + draw(_NAMES) for _ in range(draw(st.integers(0, 4)))]
    return draw(_SEPS).join(parts)


_ANY_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-5, 20), st.floats(), st.text(max_size=8))
_ANY_VALUE = st.one_of(
    _ANY_SCALAR,
    mesh_strings(),
    st.lists(_ANY_SCALAR, max_size=3),
    st.dictionaries(st.one_of(_NAMES, st.text(max_size=6)), st.one_of(_ANY_SCALAR, _NAMES), max_size=3),
)


def _check_from_dict(raw: dict) -> None:
    try:
        cfg = from_dict(raw)
    except ConfigError as e:
        one_line(str(e))
        assert e.key in ("mesh", "layout", "train.batch_size"), str(e)
    else:
        assert isinstance(cfg, Config)
        assert all(n == -1 or n >= 1 for _, n in cfg.mesh)
        assert len({a for a, _ in cfg.mesh}) == len(cfg.mesh)
        assert all(isinstance(d, str) for d, _ in cfg.layout)  # axes the mesh lacks are allowed, as in Mesh TF


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Half the meshes are valid, so that the layout (checked after the mesh) is reached often.
@given(
    mesh=st.one_of(mesh_strings(), st.sampled_from(["data:4,model:2", "data:-1", "data:8", "data:3"])),
    layout=st.one_of(layout_strings(), st.sampled_from(["batch:data", "batch:data; hidden:model", ""])),
)
def test_random_mesh_and_layout_strings(mesh, layout):
    _check_from_dict({"mesh": mesh, "layout": layout, "model": {"name": "mlp"}})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mesh=_ANY_VALUE, layout=_ANY_VALUE)
def test_random_mesh_and_layout_values(mesh, layout):
    # Any YAML-ish value (None means "use the default").
    _check_from_dict({"mesh": mesh, "layout": layout, "model": {"name": "mlp"}})


@settings(max_examples=100, deadline=None)
@given(mesh=mesh_strings(), layout=layout_strings())
def test_random_strings_through_yaml_overrides(tmp_path_factory, mesh, layout):
    # The same strings given as CLI overrides (YAML-parsed first) on a loaded file.
    path = tmp_path_factory.getbasetemp() / "hyp.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "mlp"}}))
    try:
        cfg = load(path, [f"mesh={mesh}", f"layout={layout}"])
    except ConfigError as e:
        one_line(str(e))
    else:
        assert isinstance(cfg, Config)


# --------------------------------------------------------------------------------------------
# Extremes: every value that would overflow, wrap or crash further down is refused here


@pytest.mark.parametrize(
    "raw, key, substrings",
    [
        # integers beyond int64 reach numpy/jax/C++ only to overflow there
        (cfg_with(data={"num_examples": 2**63}), "data.num_examples", ["64-bit"]),
        (cfg_with(feed={"prefetch": -(2**63) - 1}), "feed.prefetch", ["64-bit"]),
        (cfg_with(data={"max_bytes": 10**5000}), "data.max_bytes", ["an integer of 16610 bits", "64-bit"]),
        ({"model": {"name": "mlp", "hidden": [16, 2**64]}}, "model.hidden[1]", ["64-bit"]),
        # model sizes and labels are int32 in jax (vocab_size=2**31 overflowed in the jitted loss)
        (
            {"model": {"name": "transformer", "vocab_size": 2**31}},
            "model.vocab_size",
            ["must be <= 2147483647", "int32"],
        ),
        ({"model": {"name": "mlp", "hidden": [16, 2**31]}}, "model.hidden[1]", ["must be <= 2147483647"]),
        (cfg_with(data={"num_classes": 2**31}), "data.num_classes", ["must be <= 2147483647"]),
        # int32 step counts
        (cfg_with(train={"steps": 2**31}), "train.steps", ["must be <= 2147483647"]),
        (cfg_with(optimizer={"warmup_steps": 2**31}), "optimizer.warmup_steps", ["must be <= 2147483647"]),
        (cfg_with(optimizer={"decay_steps": 2**40}), "optimizer.decay_steps", ["must be <= 2147483647"]),
        # seeds: 0 .. 2**32 - 1
        (cfg_with(train={"seed": -1}), "train.seed", ["must be >= 0"]),
        (cfg_with(train={"seed": 2**32}), "train.seed", ["must be <= 4294967295"]),
        # floats: finite and within float32
        (
            cfg_with(optimizer={"learning_rate": float("inf")}),
            "optimizer.learning_rate",
            ["inf", "not a finite float32"],
        ),
        (cfg_with(optimizer={"learning_rate": 1e39}), "optimizer.learning_rate", ["not a finite float32"]),
        (cfg_with(optimizer={"weight_decay": 10**400}), "optimizer.weight_decay", ["inf", "not a finite float32"]),
        (cfg_with(optimizer={"b2": "-1e308"}), "optimizer.b2", ["not a finite float32"]),
        (cfg_with(hardware={"peak_tflops": float("nan")}), "hardware.peak_tflops", ["nan"]),
        (cfg_with(data={"eval_fraction": 1.5}), "data.eval_fraction", ["must be <= 1.0"]),
        (cfg_with(optimizer={"b1": 1.0}), "optimizer.b1", ["must be in [0, 1)", "1.0"]),
        (cfg_with(optimizer={"b2": -0.1}), "optimizer.b2", ["must be in [0, 1)"]),
        # distributed
        (
            cfg_with(distributed={"num_processes": 2, "process_id": 2}),
            "distributed.process_id",
            ["2 is not below", "num_processes 2"],
        ),
        (cfg_with(distributed={"num_processes": 2**31}), "distributed.num_processes", ["must be <= 2147483647"]),
        (
            cfg_with(distributed={"heartbeat_timeout_seconds": 2**31}),
            "distributed.heartbeat_timeout_seconds",
            ["must be <= 604800"],
        ),
        (
            cfg_with(distributed={"coordinator": "localhost"}),
            "distributed.coordinator",
            ["'localhost'", "not 'host:port'"],
        ),
        (cfg_with(distributed={"coordinator": ":1234"}), "distributed.coordinator", ["not 'host:port'"]),
        (cfg_with(distributed={"coordinator": "h:65536"}), "distributed.coordinator", ["port '65536'"]),
        (cfg_with(distributed={"coordinator": "h:x"}), "distributed.coordinator", ["port 'x'"]),
        (cfg_with(distributed={"coordinator": "hôte:1234"}), "distributed.coordinator", ["ASCII"]),
        # paths
        (cfg_with(workdir=""), "workdir", ["must not be empty"]),
        (cfg_with(workdir="runs/a\0b"), "workdir", ["NUL"]),
        (cfg_with(workdir="runs/" + "é" * 128), "workdir", ["longer than 255 bytes"]),  # 256 bytes in UTF-8
        (cfg_with(workdir="/" + "a/" * 2048), "workdir", ["longer than 4095 bytes"]),
        (cfg_with(checkpoint={"dir": "x\0"}), "checkpoint.dir", ["NUL"]),
        (cfg_with(data={"data_dir": "d" * 256}), "data.data_dir", ["longer than 255 bytes"]),
        (cfg_with(data={"corpus_dir": "\0"}), "data.corpus_dir", ["NUL"]),
        (cfg_with(data={"source": "tfds", "name": "x", "data_dir": "/d", "split": ""}), "data.split", ["required"]),
    ],
)
def test_extreme_values(raw, key, substrings):
    with pytest.raises(ConfigError) as e:
        from_dict(raw)
    expect(e, key, *substrings)


def test_extremes_that_are_fine():
    cfg = from_dict(
        cfg_with(
            train={"seed": 2**32 - 1, "steps": 2**31 - 1},
            optimizer={"learning_rate": 1e30, "b1": 0.0, "b2": 0.999999},
            data={"eval_fraction": 1.0, "max_bytes": 2**63 - 1},
            distributed={"coordinator": "[::1]:65535", "num_processes": 4, "process_id": 3},
            workdir="runs/" + "é" * 127,
        )
    )
    assert cfg.train.seed == 2**32 - 1 and cfg.optimizer.learning_rate == 1e30  # 1e30: the NaN-loss tests' rate


@pytest.mark.parametrize("value", ["x" * 10**6, "é" * 10**5])
def test_huge_values_give_short_lines(value):
    # A megabyte-long value is named, cut short: the error stays one readable line.
    for raw in (cfg_with(feed={"mode": value}), cfg_with(train={"steps": value}), {"model": {"name": value}}):
        with pytest.raises(ConfigError) as e:
            from_dict(raw)
        assert len(one_line(str(e.value))) < 300


@pytest.mark.parametrize("value", ["abc", "0", "-3", "257", "1e3"])
def test_jax_num_cpu_devices_checked_with_the_config(monkeypatch, value):
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", value)
    with pytest.raises(ConfigError) as e:
        from_dict(cfg_with(mesh="data:4,model:2"))  # no -1 axis: jax would still read it
    expect(e, "mesh", f"JAX_NUM_CPU_DEVICES={value!r}", "256")
    monkeypatch.setenv("JAX_NUM_CPU_DEVICES", "16")
    assert from_dict(cfg_with(mesh="data:-1")).mesh == (("data", -1),)


@pytest.mark.parametrize(
    "mesh, layout, key, shown",
    [
        ("données:8", "batch:données", "mesh", "'données'"),
        ("data:8", "batch:data; modèle:data", "layout", "'modèle'"),
        ("data:8", "batch:data; pixels:ｄａｔａ", "layout", "'ｄａｔａ'"),
        ("a" * 65 + ":8", "batch:data", "mesh", "65 characters"),
    ],
)
def test_names_are_ascii_identifiers(mesh, layout, key, shown):
    with pytest.raises(ConfigError) as e:
        from_dict(cfg_with(mesh=mesh, layout=layout))
    expect(e, key, shown)

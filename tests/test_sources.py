"""The data-source registry: every value of data.source is a registered source, the config's
choices are the registry's names, and a source defined outside meshpar (here, in this module)
trains through the normal config path with one registration line, its checks one-line errors."""

import dataclasses
import json
import types

import numpy as np
import pytest

from meshpar import sources, train
from meshpar.configuration import config
from meshpar.configuration.config import ConfigError, DataConfig
from meshpar.run import loop
from meshpar.sources import Source
from meshpar.step import inputs, parts

BUILT_IN = ("synthetic", "tfds", "text", "tfds_text", "tokens")


# --- a source of its own, as a project would write it ------------------------------------------


class HalfspaceRows:
    """The host-side source: Gaussian rows labelled by the side of a fixed hyperplane they are on."""

    def __init__(self, num_examples: int, num_features: int, seed: int, split: str):
        rng = np.random.default_rng([seed, {"train": 11, "eval": 12}[split]])
        self.inputs = rng.standard_normal((num_examples, num_features), np.float32)
        normal = np.random.default_rng(seed).standard_normal(num_features).astype(np.float32)
        self.targets = (self.inputs @ normal > 0).astype(np.int32)
        self.num_classes = 2

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def element_spec(self):
        return {"inputs": (self.inputs.shape[1:], self.inputs.dtype), "targets": ((), self.targets.dtype)}

    def read(self, indices):
        return {"inputs": self.inputs[indices], "targets": self.targets[indices]}


class Halfspace(Source):
    name = "halfspace"
    fields = ("num_examples", "num_eval_examples", "num_features", "num_classes")
    required = (("num_examples", " (rows to train on)"),)
    eval_key = "num_eval_examples"

    def __init__(self):
        self.opened: list[str] = []  # the splits opened, in order: the run went through this object

    def check(self, data):
        super().check(data)
        if data.num_classes != 2:
            raise ConfigError("data.num_classes", f"{data.num_classes}, but a halfspace has two sides (use 2)")

    def open(self, data, split, seed, tokenizer, vocab_limit=None):
        n = data.num_examples if split == "train" else data.num_eval_examples
        self.opened.append(split)
        return HalfspaceRows(n, data.num_features, seed, split) if n else None


@pytest.fixture
def halfspace():
    source = sources.register(Halfspace())  # the one registration line
    yield source
    sources.unregister(source.name)


def _raw(tmp_path, **data):
    return {
        "mesh": "data:4,model:2",
        "layout": "batch:data; hidden:model",
        "model": {"name": "mlp", "hidden": [32], "num_classes": 2},
        "data": {"source": "halfspace", "num_examples": 512, "num_eval_examples": 64, "num_features": 16,
                 "num_classes": 2, **data},
        "optimizer": {"learning_rate": 0.05},
        "train": {"steps": 30, "batch_size": 32, "log_every": 5, "eval_every": 15, "eval_batches": 2,
                  "progress": False},
        "checkpoint": {"every": 0},
        "compile_cache": {"dir": ""},
        "workdir": str(tmp_path / "run"),
    }  # fmt: skip


# --- the registry --------------------------------------------------------------------------------


def test_built_in_sources_are_the_registry_and_own_every_data_key():
    assert sources.names() == BUILT_IN
    keys = {f.name for f in dataclasses.fields(DataConfig)}
    owned = set()
    for name in sources.names():
        source = sources.get(name)
        assert source.name == name
        assert set(source.fields) <= keys, (name, set(source.fields) - keys)
        assert {key for key, _ in source.required} <= set(source.fields), name
        assert source.eval_key in source.fields, name
        owned |= set(source.fields)
    assert keys - owned == {"source", "workers"}  # the two settings every source has
    assert [n for n in BUILT_IN if sources.get(n).token_windows] == ["text", "tfds_text", "tokens"]


def test_registry_refuses_a_second_source_of_a_name_and_names_an_unknown_one():
    with pytest.raises(ValueError, match="data source 'tfds' is registered already"):
        sources.register(sources.get("tfds"))
    with pytest.raises(ValueError, match="^unknown data source 'nope'$"):
        sources.get("nope")


def test_the_configs_choices_are_the_registrys_names(tmp_path, halfspace):
    with pytest.raises(ConfigError) as e:
        config.from_dict(_raw(tmp_path, source="nope"))
    assert str(e.value) == f"data.source: 'nope' is not one of: {', '.join(BUILT_IN)}, halfspace"
    assert config.from_dict(_raw(tmp_path)).data.source == "halfspace"
    sources.unregister("halfspace")
    try:
        with pytest.raises(ConfigError, match=f"^data.source: 'halfspace' is not one of: {', '.join(BUILT_IN)}$"):
            config.from_dict(_raw(tmp_path))
    finally:
        sources.register(halfspace)


# --- a source registered from a test module ----------------------------------------------------


def test_a_registered_source_trains_through_the_config_path(tmp_path, halfspace, capsys):
    path = tmp_path / "halfspace.yaml"
    path.write_text(json.dumps(_raw(tmp_path)))  # JSON is YAML
    cfg = config.load(path)
    assert inputs.element_spec(cfg.data, cfg.train.seed) == {
        "inputs": ((16,), np.dtype(np.float32)), "targets": ((), np.dtype(np.int32))
    }  # fmt: skip
    assert parts.source_element_spec(cfg) == inputs.element_spec(cfg.data, cfg.train.seed)
    halfspace.opened.clear()
    assert train.main(["--config", str(path)]) == 0
    assert halfspace.opened == ["train", "eval"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["config"]["data"]["source"] == "halfspace"
    assert summary["final_loss"] < 0.5 * summary["first_loss"]  # a halfspace is learnt in a few steps
    assert summary["final_eval_accuracy"] > 0.8


def test_a_registered_sources_checks_are_one_line_config_errors(tmp_path, halfspace, capsys):
    with pytest.raises(ConfigError) as e:
        config.from_dict(_raw(tmp_path, num_classes=3))
    assert str(e.value) == "data.num_classes: 3, but a halfspace has two sides (use 2)"
    path = tmp_path / "halfspace.yaml"
    path.write_text(json.dumps(_raw(tmp_path)))
    capsys.readouterr()
    assert train.main(["--config", str(path), "data.num_classes=5"]) == 2
    assert capsys.readouterr().err == "config error: data.num_classes: 5, but a halfspace has two sides (use 2)\n"
    # Its required settings, from the declaration alone.
    with pytest.raises(ConfigError) as e:
        config.from_dict(_raw(tmp_path, num_examples=0))
    assert str(e.value) == "data.num_examples: must be >= 1, got 0"  # DataConfig's own bound comes first
    with pytest.raises(ConfigError) as e:
        Halfspace().check(dataclasses.replace(config.from_dict(_raw(tmp_path)).data, num_examples=0))
    assert str(e.value) == "data.num_examples: required when data.source is halfspace (rows to train on)"


def test_a_registered_source_names_its_eval_setting_when_there_is_no_eval_split(tmp_path, halfspace):
    cfg = config.from_dict(_raw(tmp_path, num_eval_examples=0))
    assert inputs.make_source(cfg.data, "eval", 0) is None
    exp = types.SimpleNamespace(cfg=cfg, inputs=types.SimpleNamespace(eval=None))
    assert loop.notices(exp, 0) == [
        "eval: train.eval_every is 15 but there is no eval split (data.num_eval_examples is 0): no eval"
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"source": "tfds"}, "data.name: required when data.source is tfds"),
        ({"source": "tfds_text", "name": "x"}, "data.data_dir: required when data.source is tfds_text (data is read offline)"),
        ({"source": "tfds", "name": "x", "data_dir": "/x", "split": ""}, "data.split: required when data.source is tfds (the split to train on)"),
        ({"source": "tokens"}, "data.path: required when data.source is tokens (a folder written by python -m meshpar.data prepare)"),
        ({"source": "tokens", "path": "/x", "split": ""}, "data.split: required when data.source is tokens (the corpus's split to train on, e.g. train)"),
    ],
)  # fmt: skip
def test_built_in_sources_checks_keep_their_lines(tmp_path, overrides, message):
    raw = _raw(tmp_path)
    raw["data"] = overrides
    with pytest.raises(ConfigError) as e:
        config.from_dict(raw)
    assert str(e.value) == message

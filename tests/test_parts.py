"""meshpar.step.parts: the one builder of a config's parts, over this host's devices or given ones."""

import re

import jax
import pytest

from meshpar.configuration import config as config_lib
from meshpar.configuration.config import ConfigError
from meshpar.run import experiment
from meshpar.step import parts

TINY = {
    "mesh": "data:2,model:2",
    "layout": "batch:data; hidden:model",
    "model": {"name": "mlp", "hidden": [32]},
    "data": {"num_examples": 64, "num_eval_examples": 0, "num_features": 16, "num_classes": 10},
    "train": {"steps": 2, "batch_size": 8, "progress": False},
}


def test_parts_over_given_devices_use_those_devices_in_order():
    cfg = config_lib.from_dict(TINY)
    devices = jax.devices()[4:8]
    step = parts.abstract_step(cfg, devices=devices)
    assert list(step.mesh.devices.flat) == devices
    assert dict(step.mesh.shape) == {"data": 2, "model": 2}
    assert step.element_spec["inputs"][0] == (16,)
    assert step.lower().compile() is not None  # the program for those devices


def test_a_mesh_that_does_not_match_the_given_devices_is_one_config_error():
    cfg = config_lib.from_dict(TINY)
    with pytest.raises(ConfigError, match=r"^mesh: mesh data:2,model:2 has 4 devices but 3 were given"):
        parts.abstract_step(cfg, devices=jax.devices()[:3])


def test_a_minus_one_axis_takes_the_given_devices():
    cfg = config_lib.from_dict({**TINY, "mesh": "data:-1,model:2"})
    assert dict(parts.abstract_step(cfg, devices=jax.devices()[:8]).mesh.shape) == {"data": 4, "model": 2}


def test_the_run_calls_the_program_the_parts_lower(tmp_path):
    """experiment.build compiles the train step through the pre-flight from its parts; the
    planner's abstract step of the same config lowers the same program."""
    cfg = config_lib.from_dict({**TINY, "workdir": str(tmp_path)})
    exp = experiment.build(cfg)
    ran = _program(exp.train_step.compiled.as_text())
    assert ran == _program(parts.abstract_step(cfg).lower().compile().as_text())
    other = config_lib.from_dict({**TINY, "workdir": str(tmp_path), "layout": "batch:data"})
    assert ran != _program(parts.abstract_step(other).lower().compile().as_text())


def _program(hlo: str) -> str:
    """HLO text without source locations (file paths and lines differ between call sites)."""
    return re.sub(r",? metadata=\{[^}]*\}", "", hlo.split("\nFileNames")[0])

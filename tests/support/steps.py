"""Abstract train steps (mesh, layout, state plan) built once per config and input spec, for the
tests of a module that place many configs' parameters."""

from __future__ import annotations

import json

from meshpar.configuration import config
from meshpar.step import parts

_STEPS: dict[str, parts.AbstractStep] = {}


def abstract_step(cfg: config.Config, element_spec: dict) -> parts.AbstractStep:
    """``parts.abstract_step(cfg, element_spec=element_spec)``, built on the first call for the
    config and spec and reused after."""
    key = json.dumps([config.to_dict(cfg), repr(sorted(element_spec.items()))], sort_keys=True, default=str)
    if key not in _STEPS:
        _STEPS[key] = parts.abstract_step(cfg, element_spec=element_spec)
    return _STEPS[key]

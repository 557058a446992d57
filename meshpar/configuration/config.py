"""Experiment configs: YAML + ``section.key=value`` overrides → frozen dataclasses.

The one place the rest of the code imports a config's names from: the sections
(:mod:`meshpar.configuration.sections`), reading and validating a file
(:mod:`meshpar.configuration.loading`), and the checks across sections that need no device
(:mod:`meshpar.configuration.checks`). Every failure is a :class:`ConfigError` whose text is
``<key>: <what is wrong>``.
"""

from __future__ import annotations

from meshpar.configuration.checks import (
    NAME_MAX,
    PATH_MAX,
    PATHS,
    check,
    check_batch_size,
    check_context_parallel,
    check_pipeline,
)
from meshpar.configuration.loading import apply_overrides, from_dict, load, read, to_dict
from meshpar.configuration.schema import ConfigError, build
from meshpar.configuration.sections import (
    CheckpointConfig,
    CompileCacheConfig,
    Config,
    DataConfig,
    DistributedConfig,
    FeedConfig,
    HardwareConfig,
    OffloadConfig,
    OptimizerConfig,
    PipelineConfig,
    PlanConfig,
    ProfileConfig,
    TrainConfig,
    XlaConfig,
)

__all__ = [
    "NAME_MAX",
    "PATHS",
    "PATH_MAX",
    "CheckpointConfig",
    "CompileCacheConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "FeedConfig",
    "HardwareConfig",
    "OffloadConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "PlanConfig",
    "ProfileConfig",
    "TrainConfig",
    "XlaConfig",
    "apply_overrides",
    "build",
    "check",
    "check_batch_size",
    "check_context_parallel",
    "check_pipeline",
    "from_dict",
    "load",
    "read",
    "to_dict",
]

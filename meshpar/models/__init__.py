"""Model families, picked by ``model.name``: the family contract (:mod:`.contract`) and the
families by name (:mod:`.registry`). ``__all__`` is what a family written outside meshpar
imports (docs/custom-models.md, examples/custom_model), kept stable whatever moves behind it."""

from __future__ import annotations

from meshpar.configuration.schema import ConfigError
from meshpar.models.contract import Family, Traits, conventional_traits
from meshpar.models.registry import family, traits, with_settings
from meshpar.sharding.layout import constrain, use

# Also read by meshpar itself (the planner, the config checks, the step), not part of __all__.
from meshpar.models.registry import ACTIVATION_NAMES, MODELS, config_class, missing  # noqa: F401  # isort: skip

__all__ = [
    "ConfigError",
    "Family",
    "Traits",
    "constrain",
    "conventional_traits",
    "family",
    "traits",
    "use",
    "with_settings",
]

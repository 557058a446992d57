"""Model families, picked by ``model.name`` from a plain dict.

A family is its config dataclass (validated from the ``model`` section) and a ``build``
function ``(config, element_spec, rngs) -> nnx.Module``; ``element_spec`` maps each batch
field to its per-example ``(shape, dtype)``, so a model sizes its input from the data.
Every model has ``loss(batch, rngs) -> (scalar loss, dict of scalar metrics)``, which is
all the train step calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from meshpar.models import mlp


@dataclasses.dataclass(frozen=True)
class Family:
    config: type
    build: Callable[..., Any]


MODELS: dict[str, Family] = {
    "mlp": Family(mlp.MLPConfig, mlp.build),
}

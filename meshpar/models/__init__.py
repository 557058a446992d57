"""Model families, picked by ``model.name`` from a plain dict.

A family is its config dataclass (validated from the ``model`` section), a ``build`` function
``(config, element_spec, rngs) -> nnx.Module`` (``element_spec`` maps each batch field to its
per-example ``(shape, dtype)``, so a model sizes its input from the data), and the model
FLOPs and tokens of one training example, for throughput and MFU. Every model has
``loss(batch, rngs) -> (scalar loss, dict of scalar metrics)``, which is all the train step calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from meshpar.models import mlp, transformer


@dataclasses.dataclass(frozen=True)
class Family:
    config: type
    build: Callable[..., Any]
    flops_per_example: Callable[[Any, dict], float]  # training FLOPs (forward + backward)
    tokens_per_example: Callable[[Any, dict], int]
    # The batch fields the model reads: field → (rank per example or None for any, numpy dtype
    # kinds accepted: "f" float, "i"/"u" integer).
    fields: dict[str, tuple[int | None, str]]

    def check_data(self, element_spec: dict) -> str | None:
        """What is wrong with data of this `element_spec` for this model, or None."""
        for field, (rank, kinds) in self.fields.items():
            if field not in element_spec:
                return f"the data has no field {field!r} (fields: {', '.join(element_spec)})"
            shape, dtype = element_spec[field]
            if rank is not None and len(shape) != rank:
                return f"field {field!r} has per-example shape {tuple(shape)}; the model needs rank {rank}"
            if np.dtype(dtype).kind not in kinds:
                return f"field {field!r} has dtype {np.dtype(dtype)}; the model needs kind {'/'.join(kinds)}"
        return None


def _lm_flops(cfg: transformer.TransformerConfig, spec: dict) -> float:
    length = transformer.window_length(spec)
    return transformer.flops_per_token(cfg, length) * length


MODELS: dict[str, Family] = {
    "mlp": Family(
        mlp.MLPConfig, mlp.build, mlp.flops_per_example, lambda cfg, spec: 1, {"inputs": (None, "fiu"), "targets": (0, "iu")}
    ),
    "transformer": Family(
        transformer.TransformerConfig,
        transformer.build,
        _lm_flops,
        lambda cfg, spec: transformer.window_length(spec),  # predicted tokens: length, of length + 1
        {"tokens": (1, "iu")},  # [length + 1] token ids; the model cuts inputs and targets on device
    ),
}

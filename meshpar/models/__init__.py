"""Model families, picked by ``model.name`` from a plain dict.

A family is its config dataclass (validated from the ``model`` section), a ``build`` function
``(config, element_spec, rngs) -> nnx.Module`` (``element_spec`` maps each batch field to its
per-example ``(shape, dtype)``, so a model sizes its input from the data), and the model
FLOPs and tokens of one training example, for throughput and MFU. Every model has
``loss(batch, rngs) -> (scalar loss, dict of scalar metrics)``, which is all the train step calls.

A family also states what the planner (:mod:`meshpar.plan`) needs to know of it, so that the
planner holds no knowledge of any one model: the dims a model-axis split puts on the ``model``
axis, the dims FSDP may shard (preferred first), the activation all-reduces a model-axis split
adds per step, its layers and their FLOPs, and the values (``checkpoint_name`` tags) each
``offload.activations`` policy keeps in host memory. Each is computed from the config and the
element spec alone: nothing is traced or built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from meshpar.models import layers, llama, mlp, transformer


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    config: type
    build: Callable[..., Any]
    flops_per_example: Callable[[Any, dict], float]  # training FLOPs (forward + backward)
    tokens_per_example: Callable[[Any, dict], int]
    # The batch fields the model reads: field → (rank per example or None for any, numpy dtype
    # kinds accepted: "f" float, "i"/"u" integer).
    fields: dict[str, tuple[int | None, str]]
    # What the planner reads (see the module docstring). (config) → the dims a model-axis split
    # puts on the ``model`` axis when the config's layout names none there.
    split_dims: Callable[[Any], tuple[str, ...]]
    # (config, element spec) → the parameter dims FSDP (``param_layout`` over the batch axes)
    # may shard, preferred first; the planner takes them in this order, skipping one that does
    # not divide or that shares a parameter with a dim already on those axes.
    fsdp_dims: Callable[[Any, dict], tuple[str, ...]]
    # (config, element spec, batch rows per device, the dims split over ``model``) → (count,
    # elements each) of the all-reduces over the ``model`` axis that the split adds to one step.
    activation_all_reduces: Callable[[Any, dict, int, tuple[str, ...]], tuple[int, int]]
    num_layers: Callable[[Any], int]  # (config) → the layers of its layer loop
    # (config, element spec) → training FLOPs (forward + backward) of one example in each layer
    # of the layer loop; flops_per_example less their sum is the work outside the layers.
    layer_flops: Callable[[Any, dict], tuple[float, ...]]
    # offload.activations → the checkpoint_name tags whose values each layer keeps in host
    # memory under that policy (a policy the family does not list does not apply to it).
    activation_names: dict[str, tuple[str, ...]]
    # (config, layout rules on the mesh, mesh axis sizes) → the rules with those the family
    # derives from them added (a dim that follows another where it divides); by default none.
    layout_rules: Callable[[Any, tuple, dict[str, int]], tuple] = lambda cfg, rules, axis_sizes: rules

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


MODELS: dict[str, Family] = {
    "mlp": Family(
        config=mlp.MLPConfig,
        build=mlp.build,
        flops_per_example=mlp.flops_per_example,
        tokens_per_example=lambda cfg, spec: 1,
        fields={"inputs": (None, "fiu"), "targets": (0, "iu")},
        split_dims=mlp.split_dims,
        fsdp_dims=mlp.fsdp_dims,
        activation_all_reduces=mlp.activation_all_reduces,
        num_layers=mlp.num_layers,
        layer_flops=mlp.layer_flops,
        activation_names=mlp.ACTIVATION_NAMES,
    ),
    "transformer": Family(
        config=transformer.TransformerConfig,
        build=transformer.build,
        flops_per_example=transformer.flops_per_example,
        tokens_per_example=lambda cfg, spec: layers.window_length(spec),  # predicted tokens: length, of length + 1
        fields={"tokens": (1, "iu")},  # [length + 1] token ids; the model cuts inputs and targets on device
        split_dims=transformer.split_dims,
        fsdp_dims=transformer.fsdp_dims,
        activation_all_reduces=transformer.activation_all_reduces,
        num_layers=transformer.num_layers,
        layer_flops=transformer.layer_flops,
        activation_names=transformer.ACTIVATION_NAMES,
    ),
    "llama": Family(
        config=llama.LlamaConfig,
        build=llama.build,
        flops_per_example=llama.flops_per_example,
        tokens_per_example=lambda cfg, spec: layers.window_length(spec),
        fields={"tokens": (1, "iu")},  # [length + 1] token ids, as the transformer's
        split_dims=llama.split_dims,
        fsdp_dims=llama.fsdp_dims,
        activation_all_reduces=llama.activation_all_reduces,
        num_layers=llama.num_layers,
        layer_flops=llama.layer_flops,
        activation_names=llama.ACTIVATION_NAMES,
        layout_rules=llama.layout_rules,
    ),
}

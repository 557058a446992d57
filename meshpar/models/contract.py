"""The family contract: what a model family gives meshpar (:class:`Family`), and what code
outside the family reads of one model config (:class:`Traits`).

A family is its config dataclass (validated from the ``model`` section), a ``build`` function
``(config, element_spec, rngs) -> nnx.Module`` whose model has ``loss(batch, rngs) -> (scalar
loss, dict of scalar metrics)`` (all the train step calls), and the batch fields it reads.
Everything else is optional: the FLOPs and tokens of one example (throughput, MFU), and what
the planner (:mod:`meshpar.plan`) needs to know of it, so that the planner holds no knowledge of
any one model: the dims a model-axis split puts on the ``model`` axis, the dims FSDP may shard,
the activation all-reduces a model-axis split adds, its layers and their FLOPs, and the values
(``checkpoint_name`` tags) each ``offload.activations`` policy keeps in host memory. Each is
computed from the config and the element spec alone: nothing is traced or built. Without one,
the planner says which figure it cannot give (:data:`PARTS`).

Code outside a family reads a model's config only through its :class:`Traits`, never a config
field by its name, so a family may name its fields as it likes; one that gives no traits is read
by the built-ins' field names (:func:`conventional_traits`). The contract, for families written
outside meshpar: docs/custom-models.md. Families by name: :mod:`meshpar.models.registry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


def _one_per_example(cfg: Any, element_spec: dict) -> int:
    return 1


def _no_rules(cfg: Any, rules: tuple, axis_sizes: dict[str, int]) -> tuple:
    return rules


@dataclasses.dataclass(frozen=True, kw_only=True)
class Traits:
    """What code outside a family reads of one model config besides ``model.name``: the config
    checks, the run's throughput figures and the planner see the model's settings only through
    these (:func:`traits`), never by a config field's name. A family gives its own
    (:attr:`Family.traits`); one that gives none is read by the conventional field names
    (:func:`conventional_traits`). Each default is what a model without the concept has."""

    # The layers of the stacked layer loop (every layer parameter stacked along a leading
    # ``layers`` dim, run by meshpar.models.layers.run_layers): what a stage axis (layers:<axis>)
    # splits. None: no stack (the MLP's hidden layers each have dims of their own), so a stage
    # axis is refused and the search proposes none.
    stack_layers: int | None = None
    # Features of the activations between the stack's layers ([batch, length, embed]): what a
    # pipeline hands from stage to stage. 0: unknown (the search's estimate counts no such traffic).
    width: int = 0
    # The dtype the matmuls run in (the peak MFU and the time model are taken at) and the one the
    # parameters are stored in.
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    # Each layer's remat policy (a name of meshpar.models.remat.POLICIES: none, full, dots,
    # MaxText's and Paxml's names, custom). None: the model has no such setting, so the pre-flight
    # and the offload comparison propose no remat change.
    remat: str | None = None
    remat_save: tuple[str, ...] = ()  # remat custom: the tags each layer keeps (Family.checkpoint_names)
    dropout: float = 0.0  # rate; above 0 the memory model says the config is out of its scope
    # The longest token window the model takes (data.length may not exceed it). None: any.
    max_length: int | None = None
    # The attention core (meshpar.models.attention: auto | xla | blockwise | cudnn) and its key
    # block, which must divide data.length when smaller under blockwise and cudnn. None: no attention.
    attention: str | None = None
    attention_block: int | None = None
    # Query heads (their "heads" dim) and how attention runs under a length split
    # (meshpar.models.context_parallel: auto | all_gather | ring | ulysses; ulysses needs the
    # heads to divide by the length split times any heads split). None: not such a model.
    heads: int | None = None
    context_parallel: str | None = None
    # Token ids the model embeds (the tokenizer's and the corpus's may not exceed them). None: no vocabulary.
    vocab_size: int | None = None
    num_classes: int | None = None  # classes a classifier predicts (the data's must match); None: not one
    # How the stacked layer loop runs (run_layers): one lax.scan (True) or a Python loop (False).
    # None: the model has no such loop (offload.activations needs one).
    scan_layers: bool | None = None
    scan_unroll: int = 0  # layers per iteration of that scan (0: the backend's choice)
    # Experts of each mixture-of-experts layer (their weights' "experts" dim, which a layout may
    # split over a mesh axis it must divide by). 0: no experts.
    experts: int = 0
    # How tokens reach the experts (capacity | dropless): dropless dispatch's ragged dots have no
    # FP8 GEMM, so FP8 experts need capacity.
    expert_dispatch: str = "capacity"
    # The kinds of dot with FP8 operands (meshpar.models.fp8.KINDS); () = none: every matmul in
    # the compute dtype.
    fp8: tuple[str, ...] = ()
    fp8_scaling: str = "current"  # how FP8 operands are scaled: current | delayed
    # The config field behind each trait above, by the trait's name ({"stack_layers": "n_layers"}):
    # the key a one-line error names (:meth:`key`), and the field the planner sets to vary a
    # trait (remat, scan_unroll: :func:`with_settings`). A trait without one is never changed.
    keys: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def remat_on(self) -> bool:
        """Whether a remat policy wraps each layer in ``jax.checkpoint`` (any but none): the layer's
        input is kept, and what else the backward reads is its policy's (the planner traces it)."""
        return self.remat not in (None, "none")

    def key(self, trait: str) -> str:
        """The config key that sets `trait` (``model.<field>``), or ``model`` where the family names none."""
        field = self.keys.get(trait)
        return f"model.{field}" if field else "model"


# The field each trait is read from in a config whose family gives no traits: the built-in
# families' names (the contract's default, docs/custom-models.md).
CONVENTIONAL: dict[str, str] = {
    "stack_layers": "n_layers",
    "width": "d_model",
    "experts": "moe_experts",
    "expert_dispatch": "moe_dispatch",
    "heads": "n_heads",
    **{trait: trait for trait in ("compute_dtype", "param_dtype", "remat", "remat_save", "dropout", "max_length",
                                  "attention", "attention_block", "vocab_size", "num_classes", "scan_layers",
                                  "scan_unroll", "context_parallel", "fp8", "fp8_scaling")},
}  # fmt: skip


def conventional_traits(cfg: Any) -> Traits:
    """The default :attr:`Family.traits`: each trait read from its :data:`CONVENTIONAL` field where
    `cfg` has that field (which is then its key), else the trait's default."""
    keys = {trait: field for trait, field in CONVENTIONAL.items() if hasattr(cfg, field)}
    return Traits(keys=keys, **{trait: getattr(cfg, field) for trait, field in keys.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """A model family: what meshpar needs to validate, build, train and plan one model.

    Required: ``config``, ``build``, ``fields``. Everything else is optional; without it the
    run trains all the same and the planner names the figure it cannot give (:func:`meshpar.models.registry.missing`).

    * ``config`` — a frozen dataclass, validated from the YAML ``model`` section (unknown keys are
      errors; field types and ``metadata`` ``min``/``max`` bounds are checked by
      :func:`meshpar.configuration.schema.build`; an integer beyond int32 is refused). ``model.name`` is the
      family's key: a field ``name`` declared by the dataclass receives it as written (a built-in
      name, or the import path); a dataclass that declares none is given one (``name: str``).
    * ``build(config, element_spec, rngs) -> nnx.Module`` — the model; it has
      ``loss(batch, rngs) -> (scalar loss, dict of scalar metrics)``, names its parameters'
      dims (``nnx.Param(..., dims=(...))``) and its activations' (:func:`meshpar.sharding.layout.constrain`)
      in logical names only, and places a weight with :func:`meshpar.sharding.layout.use` where it is used.
    * ``fields`` — the batch fields the model reads (checked against the data before a run).
    * ``flops_per_example(config, element_spec) -> float`` — training FLOPs (forward + backward)
      of one example; None: no model TFLOP/s and no MFU (a run says MFU is unknown), no
      compute term in the layout search's estimate.
    * ``tokens_per_example(config, element_spec) -> int`` — for tokens/s; default 1.
    * The planner's parts (each None when not given): ``split_dims``, ``fsdp_dims``,
      ``activation_all_reduces``, ``num_layers``, ``layer_flops``, ``activation_names``,
      ``checkpoint_names`` and ``layout_rules`` (default: no derived rules). See each field's comment.
    * ``traits(config) -> Traits`` — the settings other code reads of a config, and the field
      behind each (:class:`Traits`); default: read by the conventional names (:func:`conventional_traits`).
    """

    config: type
    build: Callable[..., Any]
    # The batch fields the model reads: field → (rank per example or None for any, numpy dtype
    # kinds accepted: "f" float, "i"/"u" integer).
    fields: dict[str, tuple[int | None, str]]
    # (config, element spec) → training FLOPs (forward + backward) of one example. None: model
    # TFLOP/s and MFU are unknown, and the search's estimate has no compute term.
    flops_per_example: Callable[[Any, dict], float] | None = None
    # (config, element spec) → the tokens of one example, for tokens/s (default 1: an example
    # is one token's worth, as for a classifier).
    tokens_per_example: Callable[[Any, dict], int] = _one_per_example
    # What the planner reads (see the module docstring). (config) → the dims a model-axis split
    # puts on the ``model`` axis when the config's layout names none there. None: the layout
    # search and the pre-flight propose no model-axis split unless the config's layout names one.
    split_dims: Callable[[Any], tuple[str, ...]] | None = None
    # (config, element spec) → the parameter dims FSDP (``param_layout`` over the batch axes)
    # may shard, preferred first; the planner takes them in this order, skipping one that does
    # not divide or that shares a parameter with a dim already on those axes. None: every
    # parameter dim, by the bytes of the parameters it covers, most first.
    fsdp_dims: Callable[[Any, dict], tuple[str, ...]] | None = None
    # (config, element spec, batch rows per device, the dims split over ``model``) → (count,
    # elements each) of the all-reduces over the ``model`` axis that the split adds to one step.
    # None: the search's analytic estimate counts none (the compiled best K count them from HLO).
    activation_all_reduces: Callable[[Any, dict, int, tuple[str, ...]], tuple[int, int]] | None = None
    # (config) → the layers of its layer loop (each one checkpointed call under remat), stacked
    # or not (a stack's are also Traits.stack_layers). Read by no command today; tests check it
    # against the layers the planner traces.
    num_layers: Callable[[Any], int] | None = None
    # (config, element spec) → training FLOPs (forward + backward) of one example in each layer
    # of the layer loop; flops_per_example less their sum is the work outside the layers. The
    # search's estimate of a stage axis divides the layers' share over the stages (None: all
    # the work is divided; meshpar.plan.memory.stage_axis.layer_share); tests check it against the traced FLOPs.
    layer_flops: Callable[[Any, dict], tuple[float, ...]] | None = None
    # offload.activations → the checkpoint_name tags whose values each layer keeps in host
    # memory under that policy (a policy the family does not list does not apply to it). None:
    # offload.activations other than none is a config error, and the planner leaves it out.
    activation_names: dict[str, tuple[str, ...]] | None = None
    # (config) → the checkpoint_name tags its layers put on the values their backward may read:
    # the names model.remat: custom may keep (model.remat_save; another is a config error that
    # lists these), and the docs' list. None: the family names none (remat_save is refused).
    checkpoint_names: Callable[[Any], tuple[str, ...]] | None = None
    # (config, layout rules on the mesh, mesh axis sizes) → the rules with those the family
    # derives from them added (a dim that follows another where it divides); by default none.
    layout_rules: Callable[[Any, tuple, dict[str, int]], tuple] = _no_rules
    # (config) → what other code reads of it, and the field behind each (Traits). Default: read by
    # the built-ins' field names where the config has them (conventional_traits).
    traits: Callable[[Any], Traits] = conventional_traits

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

    def kept_activations(self, policy: str) -> tuple[str, ...]:
        """The ``checkpoint_name`` tags whose values each layer keeps in host memory under
        ``offload.activations`` `policy`: those :attr:`activation_names` lists for it, none where
        it lists none (the config refuses a policy other than ``none`` then)."""
        return tuple((self.activation_names or {}).get(policy, ()))


# (the part, the figure it gives, what the planner says without it): see :func:`meshpar.models.registry.missing`.
PARTS = (
    ("flops_per_example", "time",
     "gives no FLOPs: no model TFLOP/s, no MFU, no compute term in the search's estimate"),
    ("split_dims", "search",
     "names no split dims: no model-axis candidates unless the config's layout puts a dim on model"),
    ("fsdp_dims", "fsdp", "names no FSDP dims: FSDP takes parameter dims by the bytes they cover"),
    ("activation_all_reduces", "search",
     ("gives no activation all-reduces: the estimate of a model-axis split counts none "
      "(the compiled best K count them from HLO)")),
    ("activation_names", "offload.activations",
     "names no activations: offload.activations other than none does not apply"),
)  # fmt: skip

"""Model families, picked by ``model.name``: a built-in one (:data:`MODELS`) or any
:class:`Family` named by an import path ``package.module:ATTRIBUTE`` (:func:`family`).

A family is its config dataclass (validated from the ``model`` section), a ``build`` function
``(config, element_spec, rngs) -> nnx.Module`` (``element_spec`` maps each batch field to its
per-example ``(shape, dtype)``, so a model sizes its input from the data), the batch fields it
reads, and the model FLOPs and tokens of one training example, for throughput and MFU. Every
model has ``loss(batch, rngs) -> (scalar loss, dict of scalar metrics)``, which is all the
train step calls.

A family also states what the planner (:mod:`meshpar.plan`) needs to know of it, so that the
planner holds no knowledge of any one model: the dims a model-axis split puts on the ``model``
axis, the dims FSDP may shard (preferred first), the activation all-reduces a model-axis split
adds per step, its layers and their FLOPs, and the values (``checkpoint_name`` tags) each
``offload.activations`` policy keeps in host memory. Each is computed from the config and the
element spec alone: nothing is traced or built. Each is optional: the planner says which
figure it cannot give without it (:func:`missing`).

Code outside this package reads a model's config only through its family: besides ``name``, the
settings it checks, plans by or changes (the layer stack a stage axis splits, the compute dtype,
the remat policy, the vocabulary, …) are the family's :class:`Traits` (:func:`traits`), never a
config field read by its name, so a family may name its fields as it likes. One that gives no
traits is read by the built-ins' field names (:func:`conventional_traits`). The contract, for
families written outside meshpar, is in ``docs/custom-models.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from meshpar.configuration.schema import ConfigError, short
from meshpar.models import decoder_family, llama, mlp, transformer
from meshpar.sharding.layout import constrain, use

# What a family written outside meshpar imports (docs/custom-models.md, examples/custom_model):
# kept stable, whatever moves behind it.
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
    # Each layer's remat policy (meshpar.models.remat: none | full | dots). None: the model has no
    # such setting, so the pre-flight and the offload comparison propose no remat change.
    remat: str | None = None
    dropout: float = 0.0  # rate; above 0 the memory model says the config is out of its scope
    # The longest token window the model takes (data.length may not exceed it). None: any.
    max_length: int | None = None
    # The attention core (meshpar.models.attention: auto | xla | blockwise | cudnn) and its key
    # block, which must divide data.length when smaller under blockwise and cudnn. None: no attention.
    attention: str | None = None
    attention_block: int | None = None
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
    # The config field behind each trait above, by the trait's name ({"stack_layers": "n_layers"}):
    # the key a one-line error names (:meth:`key`), and the field the planner sets to vary a
    # trait (remat, scan_unroll: :func:`with_settings`). A trait without one is never changed.
    keys: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def remat_on(self) -> bool:
        """Whether a remat policy recomputes each layer in the backward pass."""
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
    **{trait: trait for trait in ("compute_dtype", "param_dtype", "remat", "dropout", "max_length", "attention",
                                  "attention_block", "vocab_size", "num_classes", "scan_layers", "scan_unroll")},
}  # fmt: skip


def conventional_traits(cfg: Any) -> Traits:
    """The default :attr:`Family.traits`: each trait read from its :data:`CONVENTIONAL` field where
    `cfg` has that field (which is then its key), else the trait's default."""
    keys = {trait: field for trait, field in CONVENTIONAL.items() if hasattr(cfg, field)}
    return Traits(keys=keys, **{trait: getattr(cfg, field) for trait, field in keys.items()})


def _traits(values: Callable[[Any], dict[str, Any]]) -> Callable[[Any], Traits]:
    """A built-in family's :attr:`Family.traits` from its module's keyword arguments of :class:`Traits`
    (the modules cannot import this package, which imports them)."""
    return lambda cfg: Traits(**values(cfg))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """A model family: what meshpar needs to validate, build, train and plan one model.

    Required: ``config``, ``build``, ``fields``. Everything else is optional; without it the
    run trains all the same and the planner names the figure it cannot give (:func:`missing`).

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
      ``activation_all_reduces``, ``num_layers``, ``layer_flops``, ``activation_names``, and
      ``layout_rules`` (default: no derived rules). See each field's comment.
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


# The built-in families, by model.name.
MODELS: dict[str, Family] = {
    "mlp": Family(
        config=mlp.MLPConfig,
        build=mlp.build,
        flops_per_example=mlp.flops_per_example,
        fields={"inputs": (None, "fiu"), "targets": (0, "iu")},
        split_dims=mlp.split_dims,
        fsdp_dims=mlp.fsdp_dims,
        activation_all_reduces=mlp.activation_all_reduces,
        num_layers=mlp.num_layers,
        layer_flops=mlp.layer_flops,
        activation_names=mlp.ACTIVATION_NAMES,
        traits=_traits(mlp.traits),
    ),
    # The language models: one decoder (meshpar.models.decoder), each family's config mapped
    # onto its switches.
    "transformer": Family(
        config=transformer.TransformerConfig, **decoder_family.family_parts(transformer.switches),
        traits=_traits(transformer.traits),
    ),
    "llama": Family(config=llama.LlamaConfig, **decoder_family.family_parts(llama.switches), traits=_traits(llama.traits)),
}  # fmt: skip


def traits(model_cfg: Any) -> Traits:
    """The :class:`Traits` of `model_cfg` (a validated ``model`` section), by its family."""
    return family(model_cfg.name).traits(model_cfg)


def with_settings(model_cfg: Any, **settings: Any) -> Any:
    """`model_cfg` with settings the planner varies set, by trait name (``remat="full"``,
    ``scan_unroll=1``), each in the field its family names for it (:attr:`Traits.keys`). A
    setting the family names no field for is left as it is; with none set, `model_cfg` itself."""
    keys = traits(model_cfg).keys
    changes = {keys[trait]: value for trait, value in settings.items() if trait in keys}
    return dataclasses.replace(model_cfg, **changes) if changes else model_cfg


# ---------------------------------------------------------------------------------------------
# Families by name: built-in, or an import path

_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def family(name: str) -> Family:
    """The family ``model.name`` names: a built-in one (a key of :data:`MODELS`), else the
    :class:`Family` at import path ``package.module:ATTRIBUTE`` (resolved once per process).
    The module is imported with the current working directory first on ``sys.path`` (as
    ``python -m`` puts it there), so a family beside the experiment imports from a library
    caller's working directory too. Raises ConfigError on ``model.name`` saying what is wrong."""
    if isinstance(name, str) and name in MODELS:
        return MODELS[name]
    if not isinstance(name, str) or not _PATH.match(name):
        raise ConfigError(
            "model.name",
            f"{short(name)} is not a model: a built-in family ({', '.join(MODELS)}) or an import path "
            "package.module:ATTRIBUTE naming a meshpar.models.Family",
        )
    return _imported(name)


@functools.cache  # only a family found is cached: an error is raised again
def _imported(name: str) -> Family:
    module_name, _, attribute = name.partition(":")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        message = " ".join(str(e).split())  # one line
        why = f"{type(e).__name__}: {message}"
        raise ConfigError("model.name", f"cannot import module {module_name!r} of {name!r} ({why})") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the module's own code failed (SyntaxError, NameError, ...)
        raise ConfigError("model.name", f"importing {module_name} failed: {_failure(e)}") from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ConfigError("model.name", f"module {module_name!r} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not isinstance(value, Family):
        raise ConfigError("model.name", f"{name} is a {type(value).__name__}, not a meshpar.models.Family")
    cls = value.config
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        raise ConfigError("model.name", f"the config of family {name} must be a frozen dataclass (got {short(cls)})")
    return value


def _failure(error: BaseException) -> str:
    """``Type: message (file:line)`` of an exception a family's module raised when imported, on
    one line: the file and line it was raised at (a SyntaxError's: the line that does not parse)."""
    if isinstance(error, SyntaxError):  # its str() names the file without its folder
        message, where = error.msg, error.filename and f"{error.filename}:{error.lineno}"
    else:
        message, where = str(error), None
        if error.__traceback__ is not None:
            frame = traceback.extract_tb(error.__traceback__)[-1]  # where it was raised, not importlib's frames
            where = f"{frame.filename}:{frame.lineno}"
    message = " ".join(str(message).split())  # one line
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return f"{text} ({where})" if where else text


def config_class(name: str) -> type:
    """The dataclass the ``model`` section of family `name` is validated into: the family's
    config when it declares a field ``name``, else that config with ``name: str`` added (its
    default `name`), so every config's ``model.name`` names its family. Raises ConfigError on
    ``model.name`` as :func:`family` does."""
    family(name)  # before the cache: a name that is no family (or not hashable) is refused here
    return _config_class(name)


@functools.cache
def _config_class(name: str) -> type:
    cls = family(name).config
    if "name" in {f.name for f in dataclasses.fields(cls)}:
        return cls
    return dataclasses.make_dataclass(
        cls.__name__, [("name", str, dataclasses.field(default=name))], bases=(cls,), frozen=True,
        namespace={"__doc__": cls.__doc__, "__module__": cls.__module__},
    )  # fmt: skip


# (the part, the figure it gives, what the planner says without it): see :func:`missing`.
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


def missing(name: str) -> list[dict[str, str]]:
    """What the planner cannot give for family `name`, one entry per part it does not give:
    ``{"part", "figure", "line"}``, the line saying which figure and why (e.g. ``time: family X
    gives no FLOPs: no model TFLOP/s, no MFU, ... (flops_per_example not given)``)."""
    fam = family(name)
    return [
        {"part": part, "figure": figure, "line": f"{figure}: family {name} {what} ({part} not given)"}
        for part, figure, what in PARTS
        if getattr(fam, part) is None
    ]

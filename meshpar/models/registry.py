"""Model families by ``model.name``: a built-in one (:data:`MODELS`) or any
:class:`~meshpar.models.contract.Family` named by an import path ``package.module:ATTRIBUTE``
(:func:`family`), and what is read of a config through its family (:func:`traits`,
:func:`with_settings`, :func:`missing`). The contract itself: :mod:`meshpar.models.contract`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys
import traceback
from typing import Any

from meshpar.configuration.schema import ConfigError, short
from meshpar.models import decoder_family, llama, mlp, transformer
from meshpar.models.contract import PARTS, Family, Traits

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
        traits=mlp.traits,
    ),
    # The language models: one decoder (meshpar.models.decoder), each family's config mapped
    # onto its switches.
    "transformer": Family(
        config=transformer.TransformerConfig, **decoder_family.family_parts(transformer.switches),
        traits=transformer.traits,
    ),
    "llama": Family(config=llama.LlamaConfig, **decoder_family.family_parts(llama.switches), traits=llama.traits),
}  # fmt: skip

# offload.activations → the names (checkpoint_name tags) each built-in family keeps in host
# memory (Family.kept_activations), together: a model tags only its own names, so a step that
# keeps them all keeps what its family lists.
ACTIVATION_NAMES: dict[str, tuple[str, ...]] = {}
for _family in MODELS.values():
    for _policy, _names in (_family.activation_names or {}).items():
        _known = ACTIVATION_NAMES.setdefault(_policy, ())
        ACTIVATION_NAMES[_policy] = _known + tuple(n for n in _names if n not in _known)


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

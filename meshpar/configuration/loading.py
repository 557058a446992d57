"""Reading a config: YAML (:func:`read`) and ``section.key=value`` overrides
(:func:`apply_overrides`) → a validated :class:`Config` (:func:`from_dict`, :func:`load`), the
model section by its family's own dataclass; and back to a plain dict (:func:`to_dict`). Unknown
keys are errors: a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

# mesh before anything that imports jax: it keeps a bad JAX_NUM_CPU_DEVICES from breaking
# `import jax` (see meshpar.sharding.mesh), so the value is reported here in one line.
from meshpar.sharding import mesh as mesh_lib  # isort: skip
from meshpar import models as models_lib
from meshpar.backend import xla_flags
from meshpar.configuration.checks import check
from meshpar.configuration.schema import INT32_MAX, ConfigError, build, describe, parse_yaml
from meshpar.configuration.sections import Config
from meshpar.sharding import layout as layout_lib


def _model(raw: Any) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError("model", f"expected a mapping with a 'name', got {describe(raw)}")
    name = raw.get("name")
    models_lib.family(name)  # a built-in name or an import path; else a ConfigError on model.name
    # The family's own dataclass validates the rest of the section (with a `name` field added
    # where it declares none: see meshpar.models.config_class).
    model = build(models_lib.config_class(name), raw, "model")
    # Model sizes stay within jax's default integer, int32: some become traced int32 values
    # (vocab_size=2**31 overflowed in the jitted loss with a traceback, whatever the memory), and
    # a dim of 2**31 (hidden, d_model, n_heads, ...) left the CLI stuck in init for minutes.
    for field in dataclasses.fields(model):
        value = getattr(model, field.name)
        items = value if isinstance(value, tuple) else (value,)
        for i, v in enumerate(items):
            if isinstance(v, int) and not isinstance(v, bool) and v > INT32_MAX:
                where = f"model.{field.name}" + (f"[{i}]" if isinstance(value, tuple) else "")
                raise ConfigError(where, f"must be <= {INT32_MAX} (jax's int32 limit), got {v}")
    return model


def from_dict(raw: Any) -> Config:
    """Validate a parsed YAML document into a :class:`Config`."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config", f"expected a mapping at the top level, got {describe(raw)}")
    raw = dict(raw)
    if "model" not in raw:
        raise ConfigError("model", "missing (set model.name)")
    special = {k: raw.pop(k, None) for k in ("mesh", "layout", "param_layout")}
    special["model"] = raw.pop("model")
    cfg = build(Config, raw, "")
    try:
        mesh = mesh_lib.parse_mesh(special["mesh"]) if special["mesh"] is not None else cfg.mesh
    except mesh_lib.MeshError as e:
        raise ConfigError("mesh", str(e)) from None
    try:
        layout = layout_lib.parse_rules(special["layout"]) if special["layout"] is not None else cfg.layout
        layout_lib.Layout.create(layout, {a: max(n, 1) for a, n in mesh})
    except layout_lib.LayoutError as e:
        raise ConfigError("layout", str(e)) from None
    try:
        param_layout = layout_lib.parse_rules(special["param_layout"])
        layout_lib.Layout.create(param_layout, {a: max(n, 1) for a, n in mesh})
    except layout_lib.LayoutError as e:
        raise ConfigError("param_layout", str(e)) from None
    cfg = dataclasses.replace(cfg, mesh=mesh, layout=layout, param_layout=param_layout, model=_model(special["model"]))
    check(cfg)
    xla_flags.check(cfg.xla.flags)  # asked of XLA itself, without starting jax's backends
    return cfg


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Apply ``section.key=value`` strings in order; values are parsed as YAML (``[512,256]``,
    ``true``). A key given twice takes its last value, as in every CLI (a duplicate inside a file
    is an error instead: see :func:`read`)."""
    raw = dict(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(item, "override is not 'section.key=value'")
        # ValueError too: PyYAML's constructors let it through for `2001-13-45`, `!!int x`, or an
        # integer over Python's 4300-digit limit.
        try:
            value = parse_yaml(text, f"the override {key.strip()}=...")
        except ConfigError as e:  # a key twice inside the value, {a: 1, a: 2}
            raise ConfigError(f"{key.strip()}.{e.key}", str(e).partition(": ")[2]) from None
        except (yaml.YAMLError, ValueError) as e:
            raise ConfigError(key, f"value {text!r} is not valid YAML ({str(e).splitlines()[0]})") from None
        node = raw
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None or not isinstance(child, Mapping):
                if child is not None and i == 0 and part in ("mesh", "layout", "param_layout"):
                    raise ConfigError(key, f"'{part}' is a single value; override it as {part}=...")
                child = {}
            node[part] = dict(child)
            node = node[part]
        node[parts[-1]] = value
    return raw


def read(path: str | pathlib.Path) -> dict:
    """The mapping a config file holds, before overrides and validation: YAML read with the safe
    loader (no Python objects), a key that appears twice in one mapping refused (see
    meshpar.configuration.schema.parse_yaml). An empty file is {}."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("config", f"file not found: {path}") from None
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # a ValueError, not an OSError: e.g. a binary file
        raise ConfigError(
            "config", f"cannot read {path}: not {e.encoding} text ({e.reason} at byte {e.start})"
        ) from None
    try:
        raw = parse_yaml(text, str(path))
    except ConfigError:  # a key twice in one mapping: already one line naming the key
        raise
    except (yaml.YAMLError, ValueError) as e:  # ValueError: see apply_overrides
        raise ConfigError("config", f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    # Only an empty file means {}: a top-level list or scalar must not reach apply_overrides'
    # dict(), which raises TypeError/ValueError for it (or turns a list of pairs into a mapping).
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError("config", f"expected a mapping at the top level of {path}, got {describe(raw)}")
    return dict(raw)


def load(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> Config:
    """Read the config file at `path` (:func:`read`), apply `overrides` in order (a key given
    twice takes its last value, as in every CLI), validate."""
    return from_dict(apply_overrides(read(path), overrides))


def to_dict(cfg: Config) -> dict:
    """Plain dict for summary.json (mesh and layout as their strings)."""
    out = dataclasses.asdict(cfg)
    out["mesh"], out["layout"] = cfg.mesh_str, cfg.layout_str
    out["param_layout"] = layout_lib.format_rules(cfg.param_layout)
    return out

"""A small type checker over dataclass annotations: parsed YAML → frozen dataclasses.

Every failure is a :class:`ConfigError` whose text is ``<dotted key>: <what is wrong>``, one
line. Unknown keys are errors; every value keeps the bounds of its type (below) and of its
field (``metadata`` ``min`` / ``max``, see :func:`at_least` and :func:`between`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config mistake: ``key`` is the dotted key, the message says what is wrong."""

    def __init__(self, key: str, message: str):
        # A key taken from YAML may hold a newline (`"a\nb": 1`): shown as repr, the message
        # stays one line. `self.key` keeps the key itself.
        super().__init__(f"{key if key.isprintable() else repr(key)}: {message}")
        self.key = key


def at_least(n: float) -> dict:
    return {"min": n}


def between(lo: float, hi: float) -> dict:
    return {"min": lo, "max": hi}


# Bounds that every value of a type must keep, whatever its field (checked in `_coerce`): the
# value ends up in a C integer or a float32 array (numpy, XLA, the train step), and beyond these
# it overflows there with a traceback or, worse, wraps silently.
INT64 = (-(2**63), 2**63 - 1)
FLOAT32_MAX = 3.4028234663852886e38
# Step counts run inside the jitted train step as int32 (the step counter, optax's schedule
# counts): 2**31 overflows while the step is traced.
INT32_MAX = 2**31 - 1
# jax keys hold 32 bits of seed: 2**32 would give the same key as seed 0.
SEED_MAX = 2**32 - 1
# The longest distributed.* timeout, in seconds (a week). jax.distributed's C++ API takes int32
# seconds and refuses 2**31 - 1 once its own margin is added; a wait of more than a week is a typo.
MAX_TIMEOUT_S = 7 * 24 * 3600


def is_number(value: Any, integer: bool = False) -> bool:
    """Whether `value`, read from YAML or JSON, is a number (an integer where `integer`): a bool is
    neither, although Python's True is the integer 1. Each caller checks the range it needs and
    names the key in its own one-line error."""
    return isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)


def describe(value: Any) -> str:
    return f"{short(value)} ({type(value).__name__})"


def short(value: Any, limit: int = 60) -> str:
    """repr of `value`, cut to about `limit` characters: a config value may be megabytes long."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's 4300-digit str() limit
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {describe(value)}")
        return value
    if tp is int:
        if not is_number(value, integer=True):
            raise ConfigError(key, f"expected an integer, got {describe(value)}")
        if not INT64[0] <= value <= INT64[1]:
            raise ConfigError(key, f"{short(value)} does not fit in a 64-bit integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if not is_number(value):
            raise ConfigError(key, f"expected a number, got {describe(value)}")
        try:
            value = float(value)
        except OverflowError:  # an integer beyond any float
            value = math.inf if value > 0 else -math.inf
        if not abs(value) <= FLOAT32_MAX:  # also NaN
            raise ConfigError(key, f"{value} is not a finite float32 number (at most {FLOAT32_MAX:.4g} in size)")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {describe(value)}")
        return value
    if origin is Literal:
        if value not in typing.get_args(tp):
            choices = ", ".join(str(c) for c in typing.get_args(tp))
            raise ConfigError(key, f"{short(value)} is not one of: {choices}")
        return value
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return _coerce(next(a for a in args if a is not type(None)), value, key)
    if origin is tuple:
        (item, _) = typing.get_args(tp)
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise ConfigError(key, f"expected a list, got {describe(value)}")
        return tuple(_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        kt, vt = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"expected a mapping, got {describe(value)}")
        return {_coerce(kt, k, key): _coerce(vt, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    raise TypeError(f"unsupported config type {tp} at {key}")


def build(cls: type, raw: Any, key: str) -> Any:
    """Validate mapping `raw` into dataclass `cls`; `key` is the dotted prefix for errors."""
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(key, f"expected a mapping, got {describe(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in raw:
        if name not in fields:
            known = ", ".join(fields)
            raise ConfigError(f"{key}.{name}" if key else str(name), f"unknown key (known: {known})")
    kwargs = {}
    for name, value in raw.items():
        sub = f"{key}.{name}" if key else name
        kwargs[name] = _coerce(hints[name], value, sub)
        lo, hi = fields[name].metadata.get("min"), fields[name].metadata.get("max")
        values = kwargs[name] if isinstance(kwargs[name], tuple) else (kwargs[name],)  # a bound applies per item
        for i, v in enumerate(values):
            where = f"{sub}[{i}]" if isinstance(kwargs[name], tuple) else sub
            # `not >=` rather than `<`: a NaN (YAML .nan) compares false both ways and must not pass.
            if lo is not None and not v >= lo:
                raise ConfigError(where, f"must be >= {lo}, got {v}")
            if hi is not None and not v <= hi:
                raise ConfigError(where, f"must be <= {hi}, got {v}")
    return cls(**kwargs)


# The tag PyYAML gives a merge key (`<<: *defaults`): the merged keys are defaults that the
# mapping's own keys may override, so they are no duplicates.
_MERGE_TAG = "tag:yaml.org,2002:merge"


def parse_yaml(text: str, where: str) -> Any:
    """`text` as YAML with PyYAML's safe loader (no Python objects), refusing a key that appears
    twice in one mapping, which the safe loader silently resolves to its last value (a second
    `mesh:` line would win without a word). `where` names the text in the error (a file).

    Keys compare as the values YAML reads them as: `1` and `0x1` are one key, `1` and `true`
    two (an int and a bool, although Python's 1 == True). Merge keys (`<<`) stay legal, and a
    key of the mapping itself may override one they bring. Raises ConfigError on the duplicate
    key (dotted) with both line numbers; yaml.YAMLError / ValueError for text that is not YAML.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_duplicates(loader, node, "", where, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_duplicates(loader: yaml.SafeLoader, node: yaml.Node, key: str, where: str, seen: set[int]) -> None:
    if id(node) in seen:  # an alias: checked where its anchor is (and no endless walk of `&a [*a]`)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_duplicates(loader, item, f"{key}[{i}]", where, seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[tuple[type, Any], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                _refuse_duplicates(loader, value_node, key, where, seen)
                continue
            name = loader.construct_object(key_node, deep=True)
            sub = f"{key}.{name}" if key else str(name)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get((type(name), name))
                lines[(type(name), name)] = line
            except TypeError:  # an unhashable key (a list): the loader itself refuses it
                first = None
            if first is not None:
                raise ConfigError(sub, f"appears twice in {where} (lines {first} and {line}); keep one")
            _refuse_duplicates(loader, value_node, sub, where, seen)

"""XLA's compiler flags for a config's programs: the ``xla:`` section's ``flags`` over a default
set for GPU compiles (:data:`GPU_DEFAULTS`), checked against the installed jaxlib, and passed to
every compile of the config's programs as jax's ``compiler_options`` (:func:`options`,
:func:`compile`) — the run's, the pre-flight's and the planner's alike, on a GPU or on XLA:GPU
compiled deviceless.

A flag is a field of XLA's ``DebugOptions`` (``--xla_gpu_foo=1`` in ``XLA_FLAGS`` is
``xla_gpu_foo: 1`` here). The fields exist on every backend, so a GPU flag is accepted on CPU
(and ignored by its compiler). Which fields the installed jaxlib has, and what each takes, is
asked of XLA itself (:func:`meshpar.jax_compat.xla_option_refusals`), once per name and value.
``XLA_FLAGS`` still applies: a compile option wins over the same flag there, flag by flag.
``parse_flag_string`` reads an ``XLA_FLAGS`` string (a published run's) into the mapping and
:func:`section` makes it a config's ``xla:`` section. docs/running.md lists the defaults and
their sources.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from typing import Any

from meshpar import jax_compat
from meshpar.configuration.schema import ConfigError, describe

Value = bool | int | float | str

# The flags NVIDIA's JAX-Toolbox recommends for LLM training on DGX H100 (8x H100 80 GB), as its
# MaxText guide lists them (docs/frameworks/maxtext/README.md, "XLA Flags";
# github.com/NVIDIA/JAX-Toolbox), each explained in its GPU performance guide
# (docs/GPU_performance.md, formerly rosetta/docs/GPU_performance.md). A flag the installed
# jaxlib does not have is left out (:func:`defaults`): jaxlib 0.12 has no pipelined_* flags.
GPU_DEFAULTS: dict[str, Value] = {
    # Overlap collectives with compute (GPU_performance.md, "Optimization level": O1 turns it on).
    "xla_gpu_enable_latency_hiding_scheduler": True,
    # CUDA graphs off: "" = no command buffers (MaxText README; GPU_performance.md, "CUDA graphs").
    "xla_gpu_enable_command_buffer": "",
    # Combine collectives up to these sizes (MaxText README; GPU_performance.md, "Flags to enable
    # optimizations for FSDP communication": at least one layer's weights / gradients).
    "xla_gpu_all_reduce_combine_threshold_bytes": 1073741824,
    "xla_gpu_all_gather_combine_threshold_bytes": 1073741824,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 134217728,
    # Collectives of a layer loop pipelined with the previous / next iteration (MaxText README;
    # GPU_performance.md, "Optimization level": collective pipelining).
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    # Loops unrolled by two so that their collectives can overlap (MaxText README;
    # Combine all-gathers and reduce-scatters whatever dimension they run along (MaxText README).
    "xla_gpu_enable_all_gather_combine_by_dim": False,
    "xla_gpu_enable_reduce_scatter_combine_by_dim": False,
    # No rematerialization by XLA: the model's own remat policy decides (MaxText README).
    "xla_disable_hlo_passes": "rematerialization",
}
# Not in the default set, though the same guide lists them: pipelined all-gather and all-reduce,
# and while-loop double buffering. Each adds buffers the memory plan does not count yet (about 10
# MB each on tests/test_plan_pipeline.py's GPipe step; on vTrain's tensor-parallel GPT step of 4
# microbatches, XLA:GPU's total 12.14 GB grows to 14.21 GB with pipelined all-gather alone, 17.6
# GB with all three), so the pre-flight would pass steps XLA:GPU then cannot fit. A run sets them
# in ``xla.flags``; the plan's compiled figure beside its analytic one then shows what it misses.
NOT_DEFAULT = ("xla_gpu_enable_pipelined_all_gather", "xla_gpu_enable_pipelined_all_reduce",
               "xla_gpu_enable_while_loop_double_buffering")  # fmt: skip

# What a value looks like to XLA; any other string is set as text (a string or enum field).
_TRUE, _FALSE = ("true", "1"), ("false", "0")
# A string no field of any kind but string takes: its refusal names the field's kind.
_KIND_PROBE = "\x01meshpar kind probe"
_KINDS: dict[str, str | None] = {}  # name -> the field's kind, None: no such field
_TAKEN: dict[tuple, str | None] = {}  # (name, type, value) -> XLA's refusal, None: taken


def kinds(names) -> dict[str, str | None]:
    """The kind of value each DebugOptions field of `names` takes in the installed jaxlib
    (``bool``, ``int32``, ``int64``, ``float``, ``double``, ``string``, ``enum``, ``other``), None for a name
    it has no field of. Asked of XLA once per name per process."""
    new = [n for n in dict.fromkeys(names) if n not in _KINDS]
    if new:
        for name, refusal in jax_compat.xla_option_refusals({n: _KIND_PROBE for n in new}).items():
            _KINDS[name] = "string" if refusal is None else (refusal.expects or "other") if refusal.known else None
    return {n: _KINDS[n] for n in names}


def _refusals(flags: Mapping[str, Any]) -> dict[str, str | None]:
    """XLA's refusal of each flag's value (None: taken), cached per name and value."""
    key = {n: (n, type(v), v) for n, v in flags.items()}
    new = {n: v for n, v in flags.items() if key[n] not in _TAKEN}
    if new:
        for name, refusal in jax_compat.xla_option_refusals(new).items():
            _TAKEN[key[name]] = None if refusal is None else refusal.text
    return {n: _TAKEN[key[n]] for n in flags}


def problem(name: Any, value: Any) -> str | None:
    """What is wrong with setting flag `name` to `value` (one line, without the key), or None."""
    return problems({name: value}).get(name)


def problems(flags: Mapping[str, Any]) -> dict[str, str]:
    """What is wrong with each flag of `flags` that XLA would refuse, by name (one line each)."""
    out: dict[str, str] = {}
    for name, value in flags.items():
        if not isinstance(name, str) or not name.startswith("xla_"):
            out[name] = "not an XLA flag (a DebugOptions field: xla_..., as in --xla_... without the dashes)"
        elif not isinstance(value, (bool, int, float, str)):
            out[name] = f"expected true or false, a number or a string, got {describe(value)}"
    named = [n for n in flags if n not in out]
    found = kinds(named)
    for name in named:
        kind, value = found[name], flags[name]
        if kind is None:
            out[name] = f"not an XLA flag (jaxlib's DebugOptions has no field {name})"
        elif (wrong := _wrong_type(kind, value)) is not None:
            out[name] = wrong
    refused = _refusals({n: _coerce(found[n], flags[n]) for n in named if n not in out})
    out.update({n: f"XLA refuses {describe(flags[n])}: {text}" for n, text in refused.items() if text})
    return out


def _wrong_type(kind: str, value: Any) -> str | None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    expected = {
        "bool": ("true or false", isinstance(value, bool)),
        "int32": ("an integer", number and isinstance(value, int)),
        "int64": ("an integer", number and isinstance(value, int)),
        "float": ("a number", number),
        "double": ("a number", number),
        "string": ("a string", isinstance(value, str)),
        "enum": ("a string (the value's name)", isinstance(value, str)),
    }
    if kind not in expected or expected[kind][1]:  # a kind not listed: XLA's own check decides
        return None
    return f"expected {expected[kind][0]} (XLA's {kind} flag), got {describe(value)}"


def _coerce(kind: str | None, value: Any) -> Any:
    """`value` as XLA takes it for a field of `kind`: an integer given for a float field as a float."""
    return float(value) if kind in ("float", "double") and not isinstance(value, bool) else value


def check(flags: Mapping[str, Any], key: str = "xla.flags") -> None:
    """Raise ConfigError on ``<key>.<name>`` for the first flag XLA would refuse."""
    found = problems(flags)
    for name in flags:
        if name in found:
            raise ConfigError(f"{key}.{name}", found[name])


def defaults(platform: str) -> dict[str, Value]:
    """The default flags for compiles on `platform` (``gpu``: :data:`GPU_DEFAULTS` less those the
    installed jaxlib has no field of, or refuses; others: none)."""
    if platform != "gpu":
        return {}
    found = kinds(list(GPU_DEFAULTS))
    refused = _refusals({n: v for n, v in GPU_DEFAULTS.items() if found[n] is not None})
    return {n: v for n, v in GPU_DEFAULTS.items() if found[n] is not None and not refused[n]}


# FP8 dots on a GPU: XLA's Triton GEMM emitter off, unless xla.flags sets it. With it on (XLA's
# default), jaxlib 0.10.2's XLA:GPU fuses an FP8 dot's dequantizing multiplies into a bf16 Triton
# GEMM and no FP8 GEMM is emitted (tests/test_fp8_plan.py shows both); with it off the GEMM
# rewriter makes each one cuBLASLt FP8 GEMM, as MaxText's FP8 runs have it (their recipes set
# --xla_gpu_enable_triton_gemm=false: NVIDIA/dgxc-benchmarking maxtext/README_70b.md).
FP8_GEMMS = {"xla_gpu_enable_triton_gemm": False}


def options(flags: Mapping[str, Any], gpu_defaults: bool, platform: str, fp8: bool = False) -> dict[str, Value]:
    """The ``compiler_options`` for a program compiled for `platform` (a device's ``platform``:
    ``cpu``, ``gpu``, ...): :func:`defaults` where `gpu_defaults`, and :data:`FP8_GEMMS` where the
    model has `fp8` dots on a GPU, with `flags` over them key by key. `flags` are a config's,
    checked already (:func:`check`)."""
    out = dict(defaults(platform)) if gpu_defaults else {}
    if fp8 and platform == "gpu":
        out.update(FP8_GEMMS)
    found = kinds(list(flags))
    out.update({n: _coerce(found[n], v) for n, v in flags.items()})
    return out


def compile(lowered, compiler_options: Mapping[str, Any]):
    """`lowered` (a ``jax.stages.Lowered``) compiled with `compiler_options` (:func:`options`):
    the one way a config's programs are compiled."""
    return lowered.compile(compiler_options=dict(compiler_options) or None)


def parse_flag_string(text: str) -> dict[str, Value]:
    """An ``XLA_FLAGS``-style string (``--xla_a=true --xla_b=1073741824 --xla_c``) as the mapping
    an ``xla.flags`` section holds: each value typed by its field's kind in the installed jaxlib
    (``true``/``false`` and a bare ``--flag`` for a bool, an integer, a number, text), or, for a
    name the jaxlib does not know, by how it reads (true/false, an integer, a number, else text).
    Enum values are written as XLA_FLAGS takes them (``fusion,custom_call``) and given as the
    option takes them (upper case). A later flag wins over an earlier one of the same name.
    ValueError names a token that is not ``--xla_name[=value]``."""
    pairs = []
    for token in shlex.split(text):
        name, sep, raw = token.removeprefix("--").partition("=")
        if not token.startswith("--xla_") or not name.isidentifier():
            raise ValueError(f"{token!r} is not an XLA flag (--xla_name=value)")
        pairs.append((name, raw if sep else None))
    found = kinds([n for n, _ in pairs])
    return {name: _typed(found[name], raw) for name, raw in pairs}


def _typed(kind: str | None, raw: str | None) -> Value:
    if raw is None:  # a bare --flag: true, as XLA_FLAGS reads it
        return True
    low = raw.strip().lower()
    if kind == "bool" or (kind is None and low in ("true", "false")):
        if low not in (*_TRUE, *_FALSE):
            raise ValueError(f"{raw!r} is not true or false")
        return low in _TRUE
    if kind in ("int32", "int64") or (kind is None and _is_int(raw)):
        return int(raw)
    if kind in ("float", "double") or (kind is None and _is_float(raw)):
        return float(raw)
    return raw.upper() if kind == "enum" else raw


def _is_int(text: str) -> bool:
    return text.strip().lstrip("+-").isdigit()


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def format_flag_string(flags: Mapping[str, Any]) -> str:
    """`flags` as an ``XLA_FLAGS`` string (``--xla_a=true --xla_b=1``), in their order."""
    return " ".join(f"--{n}={str(v).lower() if isinstance(v, bool) else v}" for n, v in flags.items())


def section(flags: Mapping[str, Any], gpu_defaults: bool = False) -> dict:
    """A config's ``xla:`` section holding `flags` (e.g. :func:`parse_flag_string`'s), as plain
    data for a config mapping (``raw["xla"] = section(...)``) before it is validated. The
    default ``gpu_defaults`` false reproduces a run that set exactly these flags."""
    return {"flags": dict(flags), "gpu_defaults": gpu_defaults}


def known(flags: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the flags of `flags` the installed jaxlib has a field of, the names of the others): a
    published run's flags may name fields a later XLA removed."""
    found = kinds(list(flags))
    return {n: v for n, v in flags.items() if found[n] is not None}, [n for n in flags if found[n] is None]

"""CUDA Unified Memory for a run (``offload.unified_memory``): the environment that turns it on,
set before jax's backend starts, and a check, after it started, that it took effect.

jax reaches Unified Memory through XLA's GPU allocator, configured by environment variables
(``TF_FORCE_UNIFIED_MEMORY``, the allocator fraction of :mod:`meshpar.backend.allocator`,
``XLA_PYTHON_CLIENT_PREALLOCATE``) that jaxlib reads once, when its GPU backend starts: so
:func:`set_up` is the first thing :func:`meshpar.run.experiment.build` does. Whether a CUDA
backend will start is decided without starting one; variables the user set win, those that
would turn Unified Memory off are config errors. :func:`environment` makes these decisions from
the config and an environment passed in, so they are tested as such; :func:`check` verifies,
once the backend has started, that XLA's allocator limit exceeds each device's physical memory.
What the variables do on a GPU is checked by ``scripts/device_check.sh``. The spec:
docs/offload.md, "Unified memory".
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from collections.abc import Mapping

import jax

from meshpar import jax_compat
from meshpar.backend import quiet
from meshpar.backend.allocator import FRACTION_VARIABLES, allocator_fraction
from meshpar.configuration.schema import ConfigError

GIB = 1 << 30
KEY = "offload.unified_memory"
FORCE = "TF_FORCE_UNIFIED_MEMORY"
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
# XLA reads TF_FORCE_UNIFIED_MEMORY as a boolean, case aside; jaxlib reads any preallocate value
# but these as true.
_TRUE = ("1", "true")
_FALSE = ("0", "false")
_NO_PREALLOCATE = ("false", "False", "0")
_BFC = ("default", "bfc")  # jaxlib lowercases the allocator's name


@dataclasses.dataclass(frozen=True)
class Environment:
    """What Unified Memory needs from the environment, decided before the backend starts."""

    sets: dict[str, str]  # the variables meshpar sets
    kept: dict[str, str]  # the relevant variables the user had set already (they win)
    fraction: float  # the allocator fraction in effect: max(1, the value set)
    lines: tuple[str, ...]  # what to report at start, one line each


def _cuda_problem(environ: Mapping[str, str], cuda_plugin_installed: bool) -> str | None:
    """Why no CUDA backend will start, or None when one will (jax reads an empty JAX_PLATFORMS
    as unset: then it takes CUDA wherever the plugin is installed)."""
    platforms = environ.get("JAX_PLATFORMS", "")
    first = platforms.split(",")[0].strip()
    if platforms and first not in ("cuda", "gpu"):
        return f"JAX_PLATFORMS={platforms} starts jax's {first} backend"
    if cuda_plugin_installed:
        return None
    return "no jax CUDA plugin is installed (jax[cuda12]): " + (
        f"JAX_PLATFORMS={platforms} cannot start" if platforms else "this process runs on cpu"
    )


def _fraction(environ: Mapping[str, str], oversubscription: float) -> tuple[float, dict[str, str], dict[str, str], str]:
    """(fraction in effect, sets, kept, what a kept value means) for the allocator fraction."""
    given = [name for name in FRACTION_VARIABLES if environ.get(name)]  # jaxlib ignores an empty one
    if len(given) > 1:
        raise ConfigError(KEY, f"{' and '.join(given)} are both set, which jaxlib refuses: unset {given[-1]}")
    fraction = allocator_fraction(environ, oversubscription)[0]  # a value set checked there
    if not given:
        return fraction, {FRACTION_VARIABLES[0]: f"{oversubscription:g}"}, {}, ""
    name, text = given[0], environ[given[0]]
    value = float(text)
    below = "below 1, which means 1 under unified memory; " if value < 1 else ""
    if fraction == oversubscription:
        meaning = f"({below}= offload.oversubscription)"
    else:
        meaning = (
            f"({below}the environment wins: the allocator may take {fraction:g}x the device's memory, "
            f"not offload.oversubscription={oversubscription:g}x)"
        )
    return fraction, {}, {name: text}, meaning


def environment(offload, environ: Mapping[str, str], cuda_plugin_installed: bool) -> Environment | None:
    """The variables Unified Memory needs, given the variables in `environ` and whether jax's
    CUDA plugin is installed; None when ``offload.unified_memory`` is off. Pure: reads nothing
    else. A CUDA backend that will not start, or a variable that keeps Unified Memory from
    working, is a ConfigError (see the module docstring)."""
    if not offload.unified_memory:
        return None
    problem = _cuda_problem(environ, cuda_plugin_installed)
    if problem:
        raise ConfigError(KEY, f"needs a CUDA GPU, and {problem}")
    sets: dict[str, str] = {}
    kept: dict[str, str] = {}
    meanings: dict[str, str] = {}

    force = environ.get(FORCE)
    if not force:
        sets[FORCE] = "1"
    elif force.lower() in _TRUE:
        kept[FORCE], meanings[FORCE] = force, "(unified memory on)"
    elif force.lower() in _FALSE:
        raise ConfigError(
            KEY, f"{FORCE}={force} turns unified memory off: unset it, or set offload.unified_memory false"
        )
    else:
        raise ConfigError(FORCE, f"is {force!r}: XLA reads 1 or true (unified memory on), 0 or false (off)")

    fraction, fraction_sets, fraction_kept, meaning = _fraction(environ, offload.oversubscription)
    sets.update(fraction_sets)
    kept.update(fraction_kept)
    meanings.update(dict.fromkeys(fraction_kept, meaning))

    preallocate = environ.get(PREALLOCATE)
    if not preallocate:
        sets[PREALLOCATE] = "false"
    else:
        kept[PREALLOCATE] = preallocate
        meanings[PREALLOCATE] = (
            "(the allocator grows as the step needs)" if preallocate in _NO_PREALLOCATE
            else f"(the allocator reserves {fraction:g}x the device's memory, managed, at start)"
        )  # fmt: skip

    allocator = environ.get(ALLOCATOR)
    if allocator:
        if allocator.lower() not in _BFC:
            raise ConfigError(
                KEY, f"{ALLOCATOR}={allocator} bypasses XLA's BFC allocator, the only one that reads {FORCE}: unset it"
            )
        kept[ALLOCATOR], meanings[ALLOCATOR] = allocator, f"(XLA's BFC allocator, which reads {FORCE})"

    lines = []
    if sets:
        lines.append("unified memory: set " + " ".join(f"{k}={v}" for k, v in sets.items()))
    if kept:
        said = "; ".join(f"{k}={v} {meanings[k]}" for k, v in kept.items())
        lines.append(f"unified memory: kept from the environment: {said}")
    return Environment(sets, kept, fraction, tuple(lines))


def set_up(offload) -> Environment | None:
    """Set the variables Unified Memory needs (`offload`: the config's ``offload`` section) in this process's environment, and say so on stderr
    (every process: which one is process 0 is known only once the backend has started); None
    when ``offload.unified_memory`` is off. Call it before jax's backend starts: where it has
    started already, the variables are set all the same, too late, and :func:`check` reports it.
    JAX_PLATFORMS is jax's setting where code set it through ``jax.config``."""
    environ = dict(os.environ)
    if jax.config.jax_platforms:
        environ["JAX_PLATFORMS"] = jax.config.jax_platforms
    env = environment(offload, environ, quiet.cuda_plugin_installed())
    if env is None:
        return None
    os.environ.update(env.sets)
    lines = list(env.lines)
    if jax_compat.backends_started():
        lines.append("unified memory: jax's backend had started before these were set: they come too late for it")
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)
    return env


def physical_memory_bytes(device: jax.Device) -> int | None:
    """The GPU's total memory from the CUDA driver API (the ordinal being the device's
    ``local_hardware_id``); None when `device` is not a GPU, or the driver cannot be loaded or
    a call fails. Never raises."""
    if device.platform != "gpu":
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        cuda.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        cuda.cuDeviceTotalMem_v2.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        handle, total = ctypes.c_int(), ctypes.c_size_t()  # CUdevice, bytes
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(handle), int(device.local_hardware_id)):
            return None
        if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), handle):
            return None
    except (OSError, AttributeError, TypeError, ValueError, ctypes.ArgumentError):
        return None
    return int(total.value)


def problem(env: Environment, platform: str, bytes_limit: int | None, physical_bytes: int | None) -> str | None:
    """What did not take effect on a device, once the backend has started, in one line; None when
    nothing is seen wrong. With `physical_bytes` unknown, or a fraction of 1 (a limit that looks
    the same without Unified Memory), the limit is not compared: :func:`check` says so."""
    if platform != "gpu":
        return f"the backend that started is {platform}, not CUDA"
    if not bytes_limit:
        return (
            "XLA's allocator reports no memory limit (memory_stats() has no bytes_limit): cannot tell if it took effect"
        )
    if physical_bytes is None or env.fraction <= 1 or bytes_limit > physical_bytes:
        return None
    return (
        f"XLA's allocator limit is {bytes_limit / GIB:.1f} GiB, not above the device's {physical_bytes / GIB:.1f} GiB: "
        "the unified-memory variables did not take effect (was jax's backend started before meshpar.train set them?)"
    )


def check(env: Environment, mesh: jax.sharding.Mesh) -> None:
    """Check that Unified Memory took effect on each of this process's devices of `mesh`
    (:func:`problem`): a ConfigError on the first that it did not; else one line on stderr."""
    seen = []  # (bytes_limit, physical bytes) per device
    for device in mesh.local_devices:
        stats = device.memory_stats() or {}
        limit, physical = stats.get("bytes_limit"), physical_memory_bytes(device)
        line = problem(env, device.platform, limit, physical)
        if line:
            raise ConfigError(KEY, line)
        seen.append((int(limit), physical))
    limit, physical = min(seen, key=lambda s: s[0])
    said = f"unified memory: XLA's allocator may take {limit / GIB:.1f} GiB per device"
    if physical is None:
        said += "; the device's memory could not be read from the CUDA driver: the limit was not checked against it"
    elif env.fraction <= 1:
        said += f", the device's {physical / GIB:.1f} GiB (fraction 1: the same without unified memory, not checked)"
    else:
        said += f", {limit / physical:.3g}x the device's {physical / GIB:.1f} GiB"
    print(said, file=sys.stderr, flush=True)

"""Device mesh from ``"data:4,model:2"`` (or Mesh TensorFlow's ``"data:4;model:2"``).

Axis types: every mesh axis is ``AxisType.Auto``. jax 0.10's ``jax.make_mesh`` defaults to
Explicit axes, where sharding is part of each array's type and every op whose output sharding
is ambiguous (a matmul contracting a split dim, say) must be told its ``out_sharding`` — that
would put mesh knowledge into model code. meshpar's contract is the Mesh TensorFlow one:
models speak logical names, the layout turns them into in/out shardings and
``with_sharding_constraint`` hints, and XLA's partitioner inserts the collectives.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

from meshpar.backend import jax_import

# jax's first import hides a JAX_NUM_CPU_DEVICES that is not an integer (meshpar.backend.jax_import),
# which `cpu_devices_from_env` then reports in one line. meshpar.configuration and
# meshpar.sharding.layout import this module before anything imports jax.
CPU_DEVICES_ENV = jax_import.CPU_DEVICES_ENV
jax = jax_import.import_jax()
from jax.sharding import AxisType, Mesh  # noqa: E402 - jax is imported above, with the env var set

# A `-1` axis on a host with only CPUs fills this many simulated devices, unless
# JAX_NUM_CPU_DEVICES says otherwise.
DEFAULT_CPU_DEVICES = 8

# The most simulated CPU devices one process may create for a mesh (a CPU-only host; on
# accelerators the mesh is the real devices, however many). Resident memory grows by about
# 11 MiB per simulated device, and every collective waits at XLA's rendezvous for all of them,
# which aborts the process when they take too long. Measured on a 2-core, 23 GiB host with the
# CLI (mlp, `mesh=data:N`, 2-20 steps; jax 0.10.2 and 0.12): 8 devices start and train in 8 s
# with 0.4 GiB resident, 128 in 18 s / 1.5 GiB, 256 in 20-30 s / 2.9 GiB (also data:32,model:8
# with the MLP and the transformer); 384 and 512 abort (exit 134) after 100-160 s, when XLA's
# CPU all-reduce rendezvous times out. Beyond 2048 no computation runs at all ("Multiprocess
# computations aren't implemented on the CPU backend"); 16384 devices take 8.5 s and 1.9 GiB
# just to start the backend and over 3 minutes to shut it down; 65536 pass 8 GiB before the
# backend is up, and `mesh=data:100000` held 19 GiB after 5 minutes without starting.
MAX_CPU_DEVICES = 256

# The longest mesh axis or layout dim name. Names appear in every sharding annotation XLA
# compiles and in every error line; real ones are short (`data`, `hidden_2`). Long names do not
# crash, they only cost: a 10-million-character axis name trained, with 0.9 GiB more memory and
# 20 s longer start-up, and printed itself in every line that names the mesh.
MAX_NAME_LENGTH = 64

# The most axes a mesh may have: jax.make_mesh fails with a traceback beyond 32 ("this function
# only supports up to 32 dimensions", numpy's limit for the device array it reshapes; past 64
# numpy refuses the array itself). Real meshes have two to five.
MAX_AXES = 32


class MeshError(ValueError):
    """A mesh that cannot be built: one line naming the axis or the device counts."""


def name_problem(name: str) -> str | None:
    """What is wrong with `name` as a mesh axis or layout dim name, or None.

    Names are ASCII identifiers: jax 0.10's XLA aborts the process (exit 134, in its
    partitioner's string unescaping) on a mesh axis named, say, ``données``, which Python's
    ``str.isidentifier`` accepts; ASCII also keeps two names from meaning one identifier
    after Unicode normalisation (``ｄａｔａ`` and ``data``).
    """
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if not (name.isascii() and name.isidentifier()):
        return "is not an identifier of ASCII letters, digits and '_' (not starting with a digit)"
    if len(name) > MAX_NAME_LENGTH:
        return f"is {len(name)} characters long; names have at most {MAX_NAME_LENGTH}"
    return None


def show_name(name: str, limit: int = 40) -> str:
    """`name` quoted with repr (one line, whatever it holds), cut to about `limit` characters."""
    if not isinstance(name, str) or len(name) <= limit:
        return repr(name)
    return f"{name[:limit]!r}... ({len(name)} characters)"


def split_pairs(text: str) -> list[str]:
    """A mesh or layout string cut into its ``name:value`` pairs: ``"b1:4;b2:2"`` → ``["b1:4", "b2:2"]``.

    Pairs are separated by ``;``, ``,``, ``.`` or whitespace, as Mesh TensorFlow separates them
    (``mesh_tensorflow/ops.py``, ``_parse_string_to_list_of_pairs``), so its ``mesh_shape`` and
    ``layout`` strings are read verbatim. Whitespace separates complete pairs only: around a
    pair's colon it belongs to the pair (``data : 4`` is one pair, as meshpar always read it).
    Between parentheses (a layout's ``batch:(replica, data)``) nothing separates pairs. A ``.``
    between two digits is a decimal point, kept in its pair, so that ``data:2.5`` is refused as
    a size that is not an integer rather than read as ``data:2`` and ``5``. Empty pairs are
    skipped (``"data:4,"``). Raises ValueError naming unbalanced parentheses.
    """
    text = re.sub(r"\s*:\s*", ":", text)
    pairs, current, depth = [], [], 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError("unbalanced or nested parentheses")
        point = ch == "." and text[i - 1 : i].isdigit() and text[i + 1 : i + 2].isdigit()
        if depth == 0 and (ch in ";," or ch.isspace() or (ch == "." and not point)):
            pairs.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ValueError("an unclosed parenthesis")
    return [p for p in (*pairs, "".join(current)) if p]


def parse_mesh(spec: str | Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """``"data:4,model:2"`` or ``{"data": 4, "model": 2}`` → ``(("data", 4), ("model", 2))``.

    Mesh TensorFlow's ``mesh_shape`` strings are read as they are: ``"b1:4;b2:2"``, ``"b1:4.b2:2"``
    and ``"b1:4 b2:2"`` are ``"b1:4,b2:2"`` (see :func:`split_pairs`). One axis may be ``-1``: it
    takes the devices the other axes leave.
    """
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        try:
            parts = split_pairs(spec)
        except ValueError as e:
            raise MeshError(f"mesh {show_name(spec)} has {e}") from None
        for part in parts:
            name, sep, size = part.partition(":")
            if not sep:
                raise MeshError(
                    f"axis {show_name(part)} is not 'name:size' (axes are separated by ';', ',', '.' or spaces)"
                )
            items.append((name, size))
    else:
        raise MeshError(f"expected a string like 'data:4,model:2' or a mapping, got {type(spec).__name__}")
    axes: list[tuple[str, int]] = []
    for name, size in items:
        name = str(name).strip()
        problem = name_problem(name)
        if problem:
            raise MeshError(f"axis name {show_name(name)} {problem}")
        if name in dict(axes):
            raise MeshError(f"axis '{name}' appears twice")
        try:
            n = int(str(size).strip())
        except ValueError:
            raise MeshError(f"axis '{name}' has size {str(size).strip()!r}, not an integer") from None
        if n == 0 or n < -1:
            raise MeshError(f"axis '{name}' has size {n}; sizes are positive, or -1 for the remaining devices")
        axes.append((name, n))
    if not axes:
        raise MeshError("mesh has no axes")
    if len(axes) > MAX_AXES:
        raise MeshError(f"mesh has {len(axes)} axes; at most {MAX_AXES} are supported")
    if sum(n == -1 for _, n in axes) > 1:
        raise MeshError("more than one axis is -1")
    return tuple(axes)


def resolve(axes: tuple[tuple[str, int], ...], num_devices: int) -> tuple[tuple[str, int], ...]:
    """Fill a `-1` axis so that the mesh uses `num_devices` devices."""
    fixed = math.prod(n for _, n in axes if n != -1)
    if all(n != -1 for _, n in axes):
        return axes
    fill = next(name for name, n in axes if n == -1)
    if num_devices % fixed:
        raise MeshError(f"axis '{fill}' = -1: {num_devices} devices do not divide by the other axes' {fixed}")
    return tuple((name, num_devices // fixed if n == -1 else n) for name, n in axes)


def cpu_devices_from_env(value: str | None = None) -> int | None:
    """The simulated CPU devices JAX_NUM_CPU_DEVICES asks for (`value`, default the environment's),
    or None when it is unset. Raises MeshError unless it is an integer from 1 to MAX_CPU_DEVICES.

    jax reads the variable too, for every CPU client it starts (accelerator hosts have one as
    well), so a bad value is refused wherever it is set, not only where a -1 axis would use it.
    """
    if value is None:
        value = os.environ.get(CPU_DEVICES_ENV)
        if value is None:
            return None
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or not 1 <= n <= MAX_CPU_DEVICES:
        what = "not an integer" if n is None else "out of range"
        raise MeshError(
            f"{CPU_DEVICES_ENV}={show_name(value)} is {what}: it is the number of simulated CPU devices, "
            f"1 to {MAX_CPU_DEVICES} (meshpar.sharding.mesh.MAX_CPU_DEVICES); set it in that range or unset it"
        )
    return n


def cpu_device_count(axes: tuple[tuple[str, int], ...]) -> int:
    """Simulated CPU devices a CPU-only host needs for this mesh (all processes together)."""
    if all(n != -1 for _, n in axes):
        return math.prod(n for _, n in axes)
    return cpu_devices_from_env() or DEFAULT_CPU_DEVICES


def request_cpu_devices(count: int) -> None:
    """Ask for `count` simulated CPU devices. Must run before the JAX backend starts.

    It only shapes the CPU client, so it is harmless on a host with accelerators. A count above
    MAX_CPU_DEVICES is not requested: an accelerator host does not need those devices, and on a
    CPU-only host :func:`build_mesh` refuses such a mesh in one line instead.
    """
    if count <= MAX_CPU_DEVICES and jax.config.jax_num_cpu_devices < count:
        jax.config.update("jax_num_cpu_devices", count)


def select_devices(num_needed: int | None) -> list[jax.Device]:
    """Devices for the mesh: every accelerator, or the first `num_needed` (simulated) CPUs."""
    devices = jax.devices()
    if devices[0].platform != "cpu" or num_needed is None:
        return devices
    if len(devices) < num_needed:
        raise MeshError(f"mesh needs {num_needed} devices but the CPU backend has {len(devices)}")
    return devices[:num_needed]


def plan_devices(
    axes: tuple[tuple[str, int], ...], platform: str, num_devices: int, processes: int = 1
) -> tuple[tuple[tuple[str, int], ...], int]:
    """(the axes with a -1 filled, how many devices the mesh takes) on a host whose backend is
    `platform` with `num_devices` devices over `processes` processes. No device is touched.

    Accelerators: the mesh takes every device, so a -1 axis is sized from `num_devices` (the
    real count, all processes), and a mesh of another size is an error. CPU: the devices are
    simulated, as many as the mesh names (a -1 axis fills JAX_NUM_CPU_DEVICES, default
    DEFAULT_CPU_DEVICES), at most MAX_CPU_DEVICES per process.
    """
    shape = ",".join(f"{a}:{n}" for a, n in axes)
    if platform == "cpu":
        needed = cpu_device_count(axes)
        if -(-needed // processes) > MAX_CPU_DEVICES:
            per = "" if processes == 1 else f" ({-(-needed // processes)} per process)"
            raise MeshError(
                f"mesh {shape} needs {needed} simulated CPU devices{per}; a CPU-only host simulates at most "
                f"{MAX_CPU_DEVICES} per process (meshpar.sharding.mesh.MAX_CPU_DEVICES: more time out in XLA's CPU "
                f"collectives and abort); use a smaller mesh (a -1 axis fills {CPU_DEVICES_ENV}, default {DEFAULT_CPU_DEVICES})"
            )
        if needed > num_devices:
            raise MeshError(f"mesh {shape} needs {needed} devices but the CPU backend has {num_devices}")
        num_devices = needed
    resolved = resolve(axes, num_devices)
    size = math.prod(n for _, n in resolved)
    if size != num_devices:
        shape = ",".join(f"{a}:{n}" for a, n in resolved)
        raise MeshError(f"mesh {shape} has {size} devices but this host has {num_devices} {platform} devices")
    return resolved, num_devices


def build_mesh(spec: str | Mapping[str, int] | tuple[tuple[str, int], ...], devices=None) -> Mesh:
    """A ``jax.sharding.Mesh`` with Auto axes (see module docstring) over this host's devices,
    or over `devices` when given (a compile target's, or some of this host's): the mesh then
    takes every one of them, in order, whatever their platform.

    On accelerators the mesh must use every device; on a CPU-only host it takes the first
    devices of the simulated CPU backend (start the backend via :func:`request_cpu_devices`).
    See :func:`plan_devices` for the rule.
    """
    axes = spec if isinstance(spec, tuple) else parse_mesh(spec)
    if devices is not None:
        devices = list(devices)
        axes = resolve(axes, len(devices))
        size = math.prod(n for _, n in axes)
        if size != len(devices):
            shape = ",".join(f"{a}:{n}" for a, n in axes)
            raise MeshError(f"mesh {shape} has {size} devices but {len(devices)} were given")
    else:
        cpu_devices_from_env()  # before the backend starts: jax sizes its CPU client from it
        devices = jax.devices()
        axes, count = plan_devices(axes, devices[0].platform, len(devices), jax.process_count())
        devices = select_devices(count if devices[0].platform == "cpu" else None)
    names = tuple(a for a, _ in axes)
    shape = tuple(n for _, n in axes)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def describe(mesh: Mesh) -> str:
    """``"data:4,model:2"``."""
    return ",".join(f"{a}:{n}" for a, n in mesh.shape.items())

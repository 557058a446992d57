"""Device mesh from ``"data:4,model:2"``.

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
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# A `-1` axis on a host with only CPUs fills this many simulated devices, unless
# JAX_NUM_CPU_DEVICES says otherwise.
DEFAULT_CPU_DEVICES = 8


class MeshError(ValueError):
    """A mesh that cannot be built: one line naming the axis or the device counts."""


def parse_mesh(spec: str | Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """``"data:4,model:2"`` or ``{"data": 4, "model": 2}`` → ``(("data", 4), ("model", 2))``.

    One axis may be ``-1``: it takes the devices the other axes leave.
    """
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in spec.split(","):
            name, sep, size = part.partition(":")
            if not sep:
                raise MeshError(f"axis {part.strip()!r} is not 'name:size'")
            items.append((name, size))
    else:
        raise MeshError(f"expected a string like 'data:4,model:2' or a mapping, got {type(spec).__name__}")
    axes: list[tuple[str, int]] = []
    for name, size in items:
        name = str(name).strip()
        if not name.isidentifier():
            raise MeshError(f"axis name {name!r} is not an identifier")
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


def cpu_device_count(axes: tuple[tuple[str, int], ...]) -> int:
    """Simulated CPU devices a CPU-only host needs for this mesh."""
    if all(n != -1 for _, n in axes):
        return math.prod(n for _, n in axes)
    return int(os.environ.get("JAX_NUM_CPU_DEVICES") or DEFAULT_CPU_DEVICES)


def request_cpu_devices(count: int) -> None:
    """Ask for `count` simulated CPU devices. Must run before the JAX backend starts.

    It only shapes the CPU client, so it is harmless on a host with accelerators.
    """
    if jax.config.jax_num_cpu_devices < count:
        jax.config.update("jax_num_cpu_devices", count)


def join_processes(coordinator: str, num_processes: int, process_id: int) -> None:
    """Connect this process to the others of a multi-process run (before the backend starts).

    CPU devices of different processes exchange collectives over gloo; accelerators use their
    own (NCCL on GPU), so the setting is harmless there.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator or None, num_processes, None if process_id < 0 else process_id)


def select_devices(num_needed: int | None) -> list[jax.Device]:
    """Devices for the mesh: every accelerator, or the first `num_needed` (simulated) CPUs."""
    devices = jax.devices()
    if devices[0].platform != "cpu" or num_needed is None:
        return devices
    if len(devices) < num_needed:
        raise MeshError(f"mesh needs {num_needed} devices but the CPU backend has {len(devices)}")
    return devices[:num_needed]


def build_mesh(spec: str | Mapping[str, int] | tuple[tuple[str, int], ...]) -> Mesh:
    """A ``jax.sharding.Mesh`` with Auto axes (see module docstring) over this host's devices.

    On accelerators the mesh must use every device; on a CPU-only host it takes the first
    devices of the simulated CPU backend (start the backend via :func:`request_cpu_devices`).
    """
    axes = spec if isinstance(spec, tuple) else parse_mesh(spec)
    on_cpu = jax.devices()[0].platform == "cpu"
    devices = select_devices(cpu_device_count(axes) if on_cpu else None)
    axes = resolve(axes, len(devices))
    size = math.prod(n for _, n in axes)
    if size != len(devices):
        shape = ",".join(f"{a}:{n}" for a, n in axes)
        raise MeshError(f"mesh {shape} has {size} devices but this host has {len(devices)} {devices[0].platform} devices")
    names = tuple(a for a, _ in axes)
    shape = tuple(n for _, n in axes)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def describe(mesh: Mesh) -> str:
    """``"data:4,model:2"``."""
    return ",".join(f"{a}:{n}" for a, n in mesh.shape.items())


def first_device(mesh: Mesh) -> jax.Device:
    """The relay device of routed feeding: the mesh's first device."""
    return np.asarray(mesh.devices).flat[0]

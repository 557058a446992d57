"""How many bytes one device of a mesh can hold, and where that figure comes from.

In order: the backend's own limit where it reports one (on GPU ``memory_stats()['bytes_limit']``,
the limit of XLA's allocator: by default 75% of the device's memory, because XLA preallocates
that fraction, ``XLA_PYTHON_CLIENT_MEM_FRACTION``); ``hardware.memory_gib`` when set (never above
the backend's limit: a smaller device can be planned for, not a larger one); else, on CPU, the
host's RAM (or its cgroup's limit, when lower) divided by this process's simulated devices, which
all share it.

A stated headroom comes off the top: :data:`HEADROOM_FRACTION` of the capacity. Neither the
analytic model nor XLA's figures for one compiled step count allocator fragmentation or the
small buffers that live outside the step (metrics fetched a step late, stop flags, the eval step
and checkpoint programs), so a plan that needs every last byte is not called a fit.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

GIB = 1 << 30
# Share of the capacity kept free (see the module docstring): a fraction, not a fixed amount,
# because fragmentation grows with the size of the buffers, from a 1 GiB CPU share to a 141 GB GPU.
HEADROOM_FRACTION = 0.05


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Per-device memory: ``bytes`` in all, where the figure came from, and the headroom kept."""

    bytes: int
    source: str
    headroom_bytes: int

    @property
    def usable_bytes(self) -> int:
        """What a plan may use: the capacity less its headroom."""
        return self.bytes - self.headroom_bytes


def _with_headroom(total: int, source: str) -> Capacity:
    return Capacity(total, source, int(total * HEADROOM_FRACTION))


def host_memory_bytes() -> int | None:
    """This host's RAM in bytes, or its cgroup's memory limit when that is lower (a container);
    None when neither can be read."""
    found = []
    try:
        found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        found.append(int(line.split()[1]) * 1024)  # reported in kB
        except (OSError, ValueError, IndexError):
            pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            found.append(int(text))  # "max" (v2) means no limit; v1 reports a huge number then
    found = [n for n in found if n > 0]
    return min(found) if found else None


def capacity_from(
    memory_stats: Sequence[Mapping[str, int] | None],
    memory_gib: float,
    platform: str,
    host_bytes: int | None,
) -> Capacity:
    """The per-device capacity from what each of this process's mesh devices reports
    (``device.memory_stats()``, None where it reports nothing), ``hardware.memory_gib``
    (0 = unset), the platform and the host's RAM. Pure: the inputs are passed in."""
    limits = [int(s["bytes_limit"]) for s in memory_stats if s and s.get("bytes_limit")]
    backend = None
    if limits and len(limits) == len(memory_stats):
        backend = min(limits)  # the smallest device bounds every device of the layout
        fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75 by default")
        backend_source = f"{platform} bytes_limit (XLA's allocator; preallocated fraction {fraction})"
    if memory_gib > 0:
        wanted = int(memory_gib * GIB)
        if backend is not None and backend < wanted:
            return _with_headroom(backend, f"{backend_source}, below hardware.memory_gib={memory_gib:g}")
        return _with_headroom(wanted, f"hardware.memory_gib={memory_gib:g}")
    if backend is not None:
        return _with_headroom(backend, backend_source)
    n = len(memory_stats)
    if platform == "cpu" and host_bytes and n:
        return _with_headroom(host_bytes // n, f"host RAM {host_bytes / GIB:.1f} GiB / {n} simulated cpu devices")
    raise ValueError(f"the {platform} backend reports no memory limit: set hardware.memory_gib")


def device_capacity(cfg, mesh) -> Capacity:
    """The capacity of each device of `mesh` in this process, for `cfg` (see the module docstring).

    A backend that reports no limit on a platform other than CPU, with ``hardware.memory_gib``
    unset, is a :class:`~meshpar.config.ConfigError` on that key."""
    from meshpar.config import ConfigError

    devices = list(mesh.local_devices)
    stats = [d.memory_stats() for d in devices]  # None on CPU (jax 0.10 and 0.12)
    try:
        return capacity_from(stats, cfg.hardware.memory_gib, devices[0].platform, host_memory_bytes())
    except ValueError as e:
        raise ConfigError("hardware.memory_gib", str(e)) from None

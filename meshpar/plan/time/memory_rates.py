"""How fast one device's ops move bytes in device memory while every device of the step is busy:
an accelerator's bandwidth, or a simulated CPU device's share of the host's measured rates
(faster for an op whose data fits in the host's last-level cache).

The spec: docs/time-model.md.
"""

from __future__ import annotations

import dataclasses
import pathlib


@dataclasses.dataclass(frozen=True)
class Memory:
    """How fast one device's ops move bytes (read + written) while every device is busy."""

    rate: float  # bytes/s (0: no memory term)
    cached_rate: float = 0.0  # bytes/s for an op whose bytes, on every device at once, fit in
    cache_bytes: int = 0  # this cache (0: none modelled)
    devices: int = 1

    def seconds(self, size: float) -> float:
        if self.cache_bytes and size * self.devices <= self.cache_bytes:
            return size / self.cached_rate
        return size / self.rate if self.rate else 0.0


def host_cache_bytes() -> int:
    """This host's last-level CPU cache in bytes (Linux sysfs; 0 where it cannot be read)."""
    best = (0, 0)
    for index in pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, (level, int(digits) * scale))
    return best[1]


def memory(topology, num_devices: int) -> Memory:
    """How fast one device's ops move bytes (read + written) while all `num_devices` of the step
    are busy.

    An accelerator: its memory bandwidth (the datasheet's figure counts reads and writes).
    Simulated CPU devices (device links of kind ``memcpy``: their memory is the host's): the
    host's measured copy rate (``device_memory_bandwidth``: bytes copied per second), shared by
    the devices. A copy reads and writes each byte, so a streaming copy's traffic is twice that
    rate; an op whose bytes on every device at once fit in the host's last-level cache moves
    them at that traffic rate, a larger one at the copy rate alone (XLA:CPU's fused loops over
    DRAM-sized data — strided reads, transposes, reductions — reach about half a streaming
    copy's traffic). 0 where the topology states no bandwidth: no memory term then."""
    bandwidth = float(getattr(topology, "device_memory_bandwidth", 0.0) or 0.0)
    if getattr(topology.device_link, "kind", "") != "memcpy":
        return Memory(bandwidth)
    share = bandwidth / max(num_devices, 1)
    return Memory(share, 2 * share, host_cache_bytes(), max(num_devices, 1))

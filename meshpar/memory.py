"""Per-device memory accounting for input batches.

Two sources, always labelled:
- ``live_buffers``: every backend. The feeder keeps a weak reference to every array it makes
  (placed batches, routed staging); the bytes of those still alive, per device, are the input
  held there (the batch in use, prefetched ones, the relay's staging copy). On CPU a
  "device" buffer may alias host memory (see input_pipeline.feeding), so these are the
  arrays' sizes, not the process's resident memory.
- ``memory_stats``: where the backend reports it (GPU): ``peak_bytes_in_use`` per device,
  which covers everything the device held (state, activations, inputs), since process start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax


def memory_stats_peak(devices: Iterable[jax.Device]) -> dict[int, int] | None:
    """``peak_bytes_in_use`` per device id, or None where the backend does not report it."""
    peaks = {}
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks[device.id] = int(stats["peak_bytes_in_use"])
    return peaks


class PeakTracker:
    """Running per-device peak of live input bytes (``live_bytes()`` of a feeder) over samples."""

    def __init__(self, devices: Iterable[jax.Device], live_bytes: Callable[[], dict[int, int]]):
        self.devices = list(devices)
        self.live_bytes = live_bytes
        self.peak = {d.id: 0 for d in self.devices}

    def sample(self) -> None:
        for device_id, nbytes in self.live_bytes().items():
            if device_id in self.peak:
                self.peak[device_id] = max(self.peak[device_id], nbytes)

    def report(self) -> dict:
        out = {"source": "live_buffers", "peak_input_bytes": {str(k): v for k, v in self.peak.items()}}
        stats = memory_stats_peak(self.devices)
        if stats is not None:
            out["memory_stats_peak_bytes_in_use"] = {str(k): v for k, v in stats.items()}
        return out

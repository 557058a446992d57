"""Throughput figures: tokens/s, model TFLOP/s per device, and MFU against a peak.

Model FLOPs are the model's own count (``flops_per_example`` of its family: 6·N per token plus
the attention term for the Transformer, 6·N per example for the MLP) — the work the model
needs, not what XLA happens to execute (no rematerialisation, no padding). MFU divides the
achieved model FLOP/s per device by the device's peak:

- ``hardware.peak_tflops`` from the config when set (> 0);
- else a built-in dense bf16 figure for known accelerators (H100/H200 SXM 989, A100 312);
- else, on CPU, a figure measured at start: a float32 matmul sharded over all mesh devices at
  once, so that simulated devices sharing the host's cores each get their real share.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Dense bf16 tensor-core peaks, TFLOP/s per device (vendor datasheets, SXM parts, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def known_peak(device: jax.Device) -> float | None:
    kind = device.device_kind.upper()
    return next((peak for name, peak in PEAK_TFLOPS.items() if name in kind), None)


def measure_peak_tflops(mesh: Mesh, size: int = 768, repeats: int = 7) -> float:
    """Per-device float32 matmul TFLOP/s with every mesh device busy at once.

    The best of `repeats` runs: a peak is what the hardware can do, and on a shared machine
    slower runs measure the neighbours, not the chip.
    """
    n = mesh.devices.size
    sharding = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    a = jax.device_put(jnp.ones((n, size, size), jnp.float32), sharding)
    matmul = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), in_shardings=sharding, out_shardings=sharding)
    matmul(a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times) / 1e12


def peak_tflops(mesh: Mesh, configured: float) -> tuple[float, str]:
    """(peak TFLOP/s per device, where the figure came from)."""
    if configured > 0:
        return configured, "config"
    device = mesh.devices.flat[0]
    peak = known_peak(device)
    if peak is not None:
        return peak, f"built-in bf16 peak for {device.device_kind}"
    return _measured(tuple(d.id for d in mesh.devices.flat)), f"measured at start ({device.platform} float32 matmul, all devices busy)"


@functools.cache
def _measured(device_ids: tuple[int, ...]) -> float:
    """Measured once per process and set of devices (it takes about a second)."""
    devices = {d.id: d for d in jax.devices()}
    mesh = Mesh(np.array([devices[i] for i in device_ids]), ("devices",))
    return measure_peak_tflops(mesh)


def rates(flops_per_example: float, tokens_per_example: int, batch_size: int, step_time_s: float, num_devices: int, peak: float) -> dict[str, float]:
    """Throughput of one step of `batch_size` examples taking `step_time_s`."""
    tflops_per_device = flops_per_example * batch_size / step_time_s / num_devices / 1e12
    return {
        "tokens_per_s": tokens_per_example * batch_size / step_time_s,
        "tflops_per_device": tflops_per_device,
        "mfu": tflops_per_device / peak,
    }

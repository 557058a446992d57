"""Throughput figures: tokens/s, model TFLOP/s per device, and MFU against a peak.

Model FLOPs are the model's own count (``flops_per_example`` of its family: 6·N per token plus
the attention term for the Transformer, 6·N per example for the MLP) — the work the model
needs, not what XLA happens to execute (no rematerialisation, no padding). MFU divides the
achieved model FLOP/s per device by the device's peak *for the arithmetic the matmuls use*:

- ``hardware.peak_tflops`` from the config when set (> 0);
- else, on a known GPU, the vendor's dense (no 2:4 sparsity) datasheet peak for the model's
  compute dtype: bfloat16 → the bf16 tensor-core peak; float32 → what XLA actually runs a
  float32 matmul as under ``jax_default_matmul_precision`` (TF32 tensor cores by default,
  plain FP32 under "highest"/"float32");
- else, on CPU, a figure measured at start: a float32 matmul sharded over all mesh devices at
  once, so that simulated devices sharing the host's cores each get their real share.

An accelerator that is not in the table, or a precision setting the table has no figure for,
is a one-line config error naming ``hardware.peak_tflops`` (no silent guess: a measured CPU-
style figure on a GPU would make MFU look good for the wrong reason).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshpar import models


@dataclasses.dataclass(frozen=True)
class GpuPeak:
    part: str
    bfloat16: float  # dense bf16 tensor-core TFLOP/s
    tf32: float  # dense TF32 tensor-core TFLOP/s (float32 matmuls at JAX's default precision)
    float32: float  # plain FP32 (CUDA cores, no tensor cores) TFLOP/s
    source: str


def _datasheet(part: str, bf16_sparse: float, tf32_sparse: float, fp32: float, source: str) -> GpuPeak:
    """NVIDIA's datasheets print tensor-core figures *with* 2:4 structured sparsity (marked
    "*"); the dense peak a model can reach is half. FP32 is printed dense."""
    return GpuPeak(part, bf16_sparse / 2, tf32_sparse / 2, fp32, source)


_H100 = "NVIDIA H100 datasheet, nvidia.com/en-us/data-center/h100"
_H200 = "NVIDIA H200 datasheet, nvidia.com/en-us/data-center/h200"
_A100 = "NVIDIA A100 datasheet, nvidia.com/en-us/data-center/a100"
# Matched against `device.device_kind`, most specific first: "GH200" contains "H200", and the
# H100 SXM reports no form factor ("NVIDIA H100 80GB HBM3"), so plain "H100" comes last.
GPU_PEAKS: list[tuple[re.Pattern, GpuPeak]] = [
    # GH200 datasheet: FP32 67, TF32 tensor core 989*, BF16 tensor core 1,979* TFLOPS.
    (
        re.compile(r"\bGH200\b"),
        _datasheet(
            "GH200", 1979, 989, 67.0, "NVIDIA GH200 datasheet, nvidia.com/en-us/data-center/grace-hopper-superchip"
        ),
    ),
    # H200 NVL column: FP32 60, TF32 835*, BF16 1,671*.
    (re.compile(r"\bH200 NVL\b", re.I), _datasheet("H200 NVL", 1671, 835, 60.0, _H200)),
    # H200 SXM column: FP32 67, TF32 989*, BF16 1,979*.
    (re.compile(r"\bH200\b"), _datasheet("H200 SXM", 1979, 989, 67.0, _H200)),
    # H100 NVL column: FP32 60, TF32 835*, BF16 1,671*.
    (re.compile(r"\bH100 NVL\b", re.I), _datasheet("H100 NVL", 1671, 835, 60.0, _H100)),
    # H100 PCIe column: FP32 51, TF32 756*, BF16 1,513*.
    (re.compile(r"\bH100 PCIe\b", re.I), _datasheet("H100 PCIe", 1513, 756, 51.0, _H100)),
    # H100 SXM column: FP32 67, TF32 989*, BF16 1,979*.
    (re.compile(r"\bH100\b"), _datasheet("H100 SXM", 1979, 989, 67.0, _H100)),
    # A100 datasheet, the same for 40/80 GB PCIe and SXM4: FP32 19.5, TF32 312*, BF16 624*.
    (re.compile(r"\bA100\b"), _datasheet("A100", 624, 312, 19.5, _A100)),
]

# What a float32 matmul runs as on an NVIDIA GPU, per `jax_default_matmul_precision`:
# (column of GpuPeak, passes per product, label). JAX's default (None, i.e. Precision.DEFAULT)
# on GPU "uses tensorfloat32 if available (e.g. on A100 and H100 GPUs)" and HIGH does too;
# HIGHEST "uses float32" (jax.lax.Precision docstring; docs.jax.dev "Matmul precision": "by
# default ... float32 dot products may be computed with ... TF32 on recent GPUs"). The
# multi-pass algorithms do 3/6/9 products per product, so their peak is divided accordingly.
FLOAT32_MATMUL: dict[str, tuple[str, int, str]] = {
    "default": ("tf32", 1, "TF32 tensor-core"),
    "high": ("tf32", 1, "TF32 tensor-core"),
    "tensorfloat32": ("tf32", 1, "TF32 tensor-core"),
    "TF32_TF32_F32": ("tf32", 1, "TF32 tensor-core"),
    "TF32_TF32_F32_X3": ("tf32", 3, "TF32 tensor-core, 3 passes"),
    "highest": ("float32", 1, "FP32 (no tensor cores)"),
    "float32": ("float32", 1, "FP32 (no tensor cores)"),
    "F32_F32_F32": ("float32", 1, "FP32 (no tensor cores)"),
    "bfloat16": ("bfloat16", 1, "bf16 tensor-core"),
    "BF16_BF16_F32": ("bfloat16", 1, "bf16 tensor-core"),
    "BF16_BF16_F32_X3": ("bfloat16", 3, "bf16 tensor-core, 3 passes"),
    "BF16_BF16_F32_X6": ("bfloat16", 6, "bf16 tensor-core, 6 passes"),
    "BF16_BF16_F32_X9": ("bfloat16", 9, "bf16 tensor-core, 9 passes"),
}


def compute_dtype(model_cfg) -> str:
    """The dtype the model's matmuls run in, as its family reads its config (:class:`meshpar.models.Traits`:
    ``model.compute_dtype`` for the built-ins); "float32" for a model without the option."""
    return models.traits(model_cfg).compute_dtype


def matmul_precision() -> str:
    """``jax_default_matmul_precision`` as a name ("default" when unset)."""
    value = jax.config.jax_default_matmul_precision
    return "default" if value is None else str(value)


def builtin_peak(device, dtype: str, precision: str | None = None) -> tuple[float | None, str]:
    """Dense datasheet peak TFLOP/s of `device` (anything with ``device_kind`` and ``platform``)
    for matmuls in `dtype` at `precision` (default: the current ``jax_default_matmul_precision``),
    and a source text that says which arithmetic the figure is for.

    No figure (None) for hardware or arithmetic outside the table: MFU is then not reported
    (the source says to set ``hardware.peak_tflops``) rather than guessed — a measured rate on
    a GPU would not be the peak of the arithmetic used — and the run still trains."""
    kind = device.device_kind
    gpu = next((peak for pattern, peak in GPU_PEAKS if pattern.search(kind)), None)
    if gpu is None or device.platform != "gpu":
        return (
            None,
            f"no built-in peak for {device.platform} device {kind!r}: set hardware.peak_tflops (dense {dtype} TFLOP/s per device) for MFU",
        )
    if dtype == "bfloat16":  # the precision setting applies to 32-bit inputs only
        column, passes, label, setting = "bfloat16", 1, "bf16 tensor-core", ""
    elif dtype == "float32":
        precision = precision or matmul_precision()
        if precision not in FLOAT32_MATMUL:
            return None, (
                f"no built-in peak for float32 matmuls at jax_default_matmul_precision={precision!r} "
                f"on {kind!r}: set hardware.peak_tflops for MFU"
            )
        column, passes, label = FLOAT32_MATMUL[precision]
        setting = f", jax_default_matmul_precision={precision}"
    else:
        return None, f"no built-in peak for {dtype} matmuls on {kind!r}: set hardware.peak_tflops for MFU"
    peak = getattr(gpu, column) / passes
    return peak, f"built-in dense {label} peak of {gpu.part} ({kind}) for {dtype} matmuls{setting}; {gpu.source}"


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


def peak_tflops(mesh: Mesh, configured: float, dtype: str) -> tuple[float | None, str]:
    """(peak TFLOP/s per device for matmuls in `dtype`, where the figure came from)."""
    if configured > 0:
        return configured, "config"
    device = mesh.devices.flat[0]
    if device.platform == "cpu":
        # CPU matmuls have no tensor-core modes; the float32 rate measured here is the figure
        # whatever the model's dtype (the source says so).
        note = "" if dtype == "float32" else f"; the model computes in {dtype}"
        peak = _measured(tuple(d.id for d in mesh.devices.flat))
        return peak, f"measured at start: cpu float32 matmul, all devices busy{note}"
    return builtin_peak(device, dtype)


@functools.cache
def _measured(device_ids: tuple[int, ...]) -> float:
    """Measured once per process and set of devices (it takes about a second)."""
    devices = {d.id: d for d in jax.devices()}
    mesh = Mesh(np.array([devices[i] for i in device_ids]), ("devices",))
    return measure_peak_tflops(mesh)


def rates(
    flops_per_example: float | None,
    tokens_per_example: int,
    batch_size: int,
    step_time_s: float,
    num_devices: int,
    peak: float | None,
) -> dict[str, float | None]:
    """Throughput of one step of `batch_size` examples taking `step_time_s` (MFU None without a
    peak; TFLOP/s and MFU None without the model's FLOPs, `flops_per_example` None)."""
    if flops_per_example is None:
        return {"tokens_per_s": tokens_per_example * batch_size / step_time_s, "tflops_per_device": None, "mfu": None}
    tflops_per_device = flops_per_example * batch_size / step_time_s / num_devices / 1e12
    return {
        "tokens_per_s": tokens_per_example * batch_size / step_time_s,
        "tflops_per_device": tflops_per_device,
        "mfu": tflops_per_device / peak if peak else None,
    }

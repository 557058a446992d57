"""The peak MFU divides by: the datasheet figure for the arithmetic the matmuls actually use."""

import dataclasses

import jax
import pytest

from meshpar.models.mlp import MLPConfig
from meshpar.models.transformer import TransformerConfig
from meshpar.sharding.mesh import build_mesh
from meshpar.step import throughput


@dataclasses.dataclass
class FakeDevice:  # what the table looks at: the strings a real jax.Device reports
    device_kind: str
    platform: str = "gpu"


def peak(kind, dtype="bfloat16", precision="default", platform="gpu"):
    return throughput.builtin_peak(FakeDevice(kind, platform), dtype, precision)


@pytest.mark.parametrize(
    "kind, part",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
    ],
)
def test_device_kinds_map_to_their_part(kind, part):
    _, source = peak(kind)
    assert f"of {part} ({kind})" in source


def test_form_factors_and_dtypes_have_their_own_figures():
    sxm, pcie, nvl = (peak(k)[0] for k in ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL"))
    assert (sxm, pcie, nvl) == (1979 / 2, 1513 / 2, 1671 / 2)  # dense: half the datasheet's sparse figure
    assert peak("NVIDIA GH200 480GB")[0] == peak("NVIDIA H200")[0] == sxm != peak("NVIDIA H200 NVL")[0]
    # float32: TF32 tensor cores at JAX's default precision, plain FP32 under "highest".
    tf32, tf32_source = peak("NVIDIA H100 80GB HBM3", "float32", "default")
    fp32, fp32_source = peak("NVIDIA H100 80GB HBM3", "float32", "highest")
    assert (tf32, fp32) == (989 / 2, 67.0)
    assert "TF32 tensor-core" in tf32_source and "jax_default_matmul_precision=default" in tf32_source
    assert "FP32 (no tensor cores)" in fp32_source and "float32 matmuls" in fp32_source
    assert peak("NVIDIA A100-SXM4-80GB", "float32", "float32")[0] == 19.5
    assert peak("NVIDIA A100-SXM4-80GB", "float32", "BF16_BF16_F32_X3")[0] == 312 / 3  # three bf16 passes
    assert "bf16 tensor-core" in peak("NVIDIA A100 80GB PCIe")[1]


def test_float32_follows_the_global_matmul_precision():
    with jax.default_matmul_precision("highest"):
        assert throughput.builtin_peak(FakeDevice("NVIDIA H200"), "float32")[0] == 67.0
    assert throughput.builtin_peak(FakeDevice("NVIDIA H200"), "float32")[0] == 989 / 2  # unset: TF32


@pytest.mark.parametrize(
    "kind, platform, dtype, precision, message",
    [
        (
            "NVIDIA GeForce RTX 4090",
            "gpu",
            "bfloat16",
            "default",
            "no built-in peak for gpu device 'NVIDIA GeForce RTX 4090'",
        ),
        ("TPU v4", "tpu", "bfloat16", "default", "no built-in peak for tpu device 'TPU v4'"),
        ("NVIDIA H100 80GB HBM3", "gpu", "float32", "F64_F64_F64", "jax_default_matmul_precision='F64_F64_F64'"),
    ],
)
def test_unknown_hardware_has_no_peak_and_says_which_key_to_set(kind, platform, dtype, precision, message):
    # The chosen behaviour for an unknown accelerator: no MFU rather than a guess (a measured
    # fallback on a GPU would not be the arithmetic's peak); the run still trains.
    value, source = peak(kind, dtype, precision, platform)
    assert value is None and message in source and "set hardware.peak_tflops" in source
    assert throughput.rates(1e9, 1, 8, 0.5, 8, value)["mfu"] is None


def test_compute_dtype_and_cpu_fallback():
    assert throughput.compute_dtype(MLPConfig()) == "float32"  # the default compute dtype
    assert throughput.compute_dtype(TransformerConfig(compute_dtype="bfloat16")) == "bfloat16"
    mesh = build_mesh("data:8")
    assert throughput.peak_tflops(mesh, 3.0, "bfloat16") == (3.0, "config")
    value, source = throughput.peak_tflops(mesh, 0.0, "bfloat16")
    assert value > 0 and source.startswith("measured at start: cpu float32 matmul") and "bfloat16" in source

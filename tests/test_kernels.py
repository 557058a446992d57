"""The GPU time model's components (meshpar.plan.time.kernels) and how the step is scheduled from
them (meshpar.plan.time.timing): GEMMs by shape, measured collective curves, async collectives hidden
behind the compute scheduled beside them, and one-line errors for a malformed topology."""

import dataclasses
import gzip
import pathlib

import pytest
import yaml

from meshpar.configuration.config import ConfigError
from meshpar.plan import hlo, topology
from meshpar.plan.time import kernels, timing

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "gpu_hlo"


def achieved(g: kernels.Gemm, topo) -> float:
    """FLOP/s a GEMM reaches on `topo` (its arithmetic alone)."""
    peak = topo.peak(kernels.peak_dtype(g.dtype))
    return 2 * g.batch * g.m * g.n * g.k / kernels.gemm_seconds(g, peak, topo.gpu.sm_count, topo.kernels)


@pytest.mark.parametrize("name", ["a100-sxm-8", "h100-sxm-8"])
def test_large_gemms_run_near_the_library_rate_and_thin_ones_far_below(name):
    topo = topology.load(name)
    peak = topo.peak("bfloat16")
    big = achieved(kernels.Gemm(1, 16384, 16384, 8192, "bf16"), topo)
    assert 0.95 * topo.kernels.gemm_fraction * peak <= big <= topo.kernels.gemm_fraction * peak
    # A tensor-parallel projection of few tokens: too few output tiles to fill the SMs once.
    thin = achieved(kernels.Gemm(1, 1024, 384, 1024, "bf16"), topo)
    assert thin < 0.25 * big
    # float32 operands run at the TF32 peak, half of bf16's.
    f32 = achieved(kernels.Gemm(1, 16384, 16384, 8192, "f32"), topo)
    assert f32 == pytest.approx(big * topo.peak("float32") / peak)


def test_one_tile_past_a_full_wave_costs_a_second_wave():
    topo = topology.load("a100-sxm-8")
    tm, tn = topo.kernels.gemm_tile
    sms = topo.gpu.sm_count
    full = kernels.Gemm(sms, tm, tn, 4096, "bf16")  # one tile per SM
    over = dataclasses.replace(full, batch=sms + 1)
    peak = topo.peak("bfloat16")
    t_full, t_over = (kernels.gemm_seconds(g, peak, sms, topo.kernels) for g in (full, over))
    assert t_over == pytest.approx(2 * t_full)
    # Padding inside a tile costs as a full tile: one row more than a tile is two tiles' rows.
    padded = kernels.Gemm(1, tm + 1, tn, 4096, "bf16")
    assert kernels.gemm_seconds(padded, peak, sms, topo.kernels) == pytest.approx(t_full)


@pytest.mark.parametrize("lowering", ["triton", "cublas"])
def test_every_gemm_of_a_gpu_program_has_its_dims(lowering):
    text = gzip.decompress((FIXTURES / f"lm_rolled.{lowering}.hlo.gz").read_bytes()).decode()
    module = hlo.parse(text)
    flops_of = hlo.flops_of(module)
    found = 0
    for op in timing.op_costs(text):
        if not op.kind.startswith(("__cublas$", "__triton_gemm", "__triton_nested_gemm_fusion")):
            continue
        the_op = module.ops[op.computation][op.name]
        g = kernels.gemm(module, op.computation, the_op)
        assert g is not None, op.name
        # The dims multiply out to the matrix FLOPs XLA's rules count for the op (a Triton
        # fusion's also counts its fused elementwise prologue and epilogue).
        matmul = 2 * g.batch * g.m * g.n * g.k
        counted = hlo.op_flops(module, op.computation, the_op, flops_of)
        assert matmul == counted if lowering == "cublas" else matmul <= counted <= 1.5 * matmul, op.name
        found += 1
    assert found >= 16


def test_the_a100_curve_is_vtrains_measurement_and_carries_past_it():
    curve = topology.load("a100-sxm-8").device_link.curve
    mib = 1 << 20
    # vTrain's nccl-tests: 8 A100s, 256 MiB in 2162.3 µs; 2 A100s, 1 GiB in 5442.8 µs.
    assert curve.allreduce(256 * mib, 8) == pytest.approx(2162.3e-6)
    assert curve.allreduce(1024 * mib, 2) == pytest.approx(5442.8e-6)
    # Between two measured sizes: between their times; past the largest: at its bus bandwidth.
    assert 2162.3e-6 < curve.allreduce(384 * mib, 8) < 4191.5e-6
    assert curve.allreduce(2048 * mib, 8) == pytest.approx(2 * 8193.0e-6)
    # Below the smallest: a fixed cost remains (NCCL's latency), the time never below zero.
    assert 0 < curve.allreduce(4096, 8) < curve.allreduce(mib, 8)
    # More devices on the same bytes cost more at small sizes (more ring steps).
    assert curve.allreduce(mib, 8) > curve.allreduce(mib, 2)


ASYNC = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: f32[4096,4096]) -> f32[4096,4096] {
  %p = f32[4096,4096]{1,0} parameter(0)
  ROOT %m = f32[4096,4096]{1,0} multiply(%p, %p)
}

ENTRY %main (g: f32[8388608], x: f32[4096,4096]) -> (f32[8388608], f32[4096,4096]) {
  %g = f32[8388608]{0} parameter(0)
  %x = f32[4096,4096]{1,0} parameter(1)
  %ar = f32[8388608]{0} all-reduce-start(%g), replica_groups=[1,8]<=[8], to_apply=%add
  %f1 = f32[4096,4096]{1,0} fusion(%x), kind=kLoop, calls=%body
  %f2 = f32[4096,4096]{1,0} fusion(%f1), kind=kLoop, calls=%body
  %done = f32[8388608]{0} all-reduce-done(%ar)
  ROOT %t = (f32[8388608]{0}, f32[4096,4096]{1,0}) tuple(%done, %f2)
}
"""


def test_an_async_collective_hides_behind_the_compute_scheduled_beside_it():
    topo = topology.load("h100-sxm-8")
    mesh = {"data": 8}
    overlapped = timing.predict_program(ASYNC, mesh, "bfloat16", 2, topo)
    # The same program with the two fusions after the all-reduce's -done: nothing to hide behind.
    lines = ASYNC.splitlines()
    done = next(i for i, line in enumerate(lines) if "all-reduce-done" in line)
    first = next(i for i, line in enumerate(lines) if "%f1 =" in line)
    serial_text = "\n".join(lines[:first] + [lines[done]] + lines[first:done] + lines[done + 1 :])
    serial = timing.predict_program(serial_text, mesh, "bfloat16", 2, topo)
    assert serial.collective_s == overlapped.collective_s > 0
    assert serial.compute_s == overlapped.compute_s > 0
    assert serial.hidden_s == 0
    assert serial.total_s == pytest.approx(serial.compute_s + serial.collective_s)
    hidden = min(overlapped.compute_s, overlapped.collective_s)
    assert overlapped.hidden_s == pytest.approx(hidden)
    assert overlapped.total_s == pytest.approx(max(overlapped.compute_s, overlapped.collective_s))
    assert "vTrain" not in overlapped.basis and "h100-sxm-8" in overlapped.basis
    assert set(overlapped.components) == {"memory-bound"} and overlapped.kernels == 2


def _topology_file(tmp_path, edit) -> str:
    spec = yaml.safe_load((topology.DIR / "a100-sxm-8.yaml").read_text())
    edit(spec)
    path = tmp_path / "machine.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.mark.parametrize(
    "edit,named",
    [
        (lambda s: s.pop("kernels"), "kernels"),
        (lambda s: s["kernels"].update(gemm_fraction=1.5), "kernels.gemm_fraction"),
        (lambda s: s["kernels"].pop("launch_us"), "kernels.launch_us"),
        (lambda s: s["kernels"].update(gemm_tile=[128]), "kernels.gemm_tile"),
        (lambda s: s["device_link"]["allreduce_us"].update({8: [1.0, 2.0]}), "allreduce_us.8"),
        (lambda s: s["device_link"]["allreduce_us"].update(sizes_mib=[4, 2]), "allreduce_us.sizes_mib"),
        (lambda s: s["device_link"]["allreduce_us"].update({"eight": [1.0]}), "'eight' is not a group size"),
    ],
)
def test_a_malformed_calibration_is_one_line_naming_the_field(tmp_path, edit, named):
    with pytest.raises(ConfigError) as e:
        topology.load(_topology_file(tmp_path, edit))
    assert named in str(e.value) and "\n" not in str(e.value)

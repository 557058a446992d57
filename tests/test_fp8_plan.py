"""FP8 dots in the plan (meshpar.plan.fp8_check): each dot meant to be FP8 found in the compiled
step and checked for an FP8 GEMM (deviceless XLA:GPU for an H100, tests marked ``gpu_target``),
a fallback named, an A100 refused, XLA:CPU emulated; FP8 GEMMs priced at the FP8 rate."""

from __future__ import annotations

import json

import pytest

from meshpar.configuration import config as config_lib
from meshpar.plan import __main__ as plan_cli
from meshpar.plan import fp8_check, gpu_target, hlo, topology
from meshpar.plan.time import kernels, timing
from meshpar.step import parts

TINY = "experiments/llama_tiny.yaml"
DENSE = {"attention_wq", "attention_wk", "attention_wv", "attention_wo", "mlp_w_gate", "mlp_w_up", "mlp_w_down"}
EXPERTS = {"experts_experts_gate", "experts_experts_up", "experts_experts_down"}


def _compiled(config: str, overrides: list[str], machine: str = "h100-sxm-8"):
    """The built step of `config` for `machine`'s GPUs (deviceless) and its compiled train step."""
    cfg = config_lib.load(config, overrides)
    target = gpu_target.target(topology.load(machine), cfg.mesh)
    step = parts.abstract_step(cfg, devices=target.devices)
    return step, step.lower().compile()


def _by_dot(check: fp8_check.Check) -> dict[str, tuple[int, int]]:
    """Dot label -> (forward GEMMs, backward GEMMs)."""
    out: dict[str, list[int]] = {}
    for d in check.dots:
        out.setdefault(d.name, [0, 0])[d.direction == "backward"] += 1
    return {k: tuple(v) for k, v in out.items()}


def test_fp8_element_types_are_one_byte_and_run_at_the_fp8_rate():
    assert hlo.shape_bytes("f8e4m3fn[1024,128]{1,0}") == 1024 * 128
    assert hlo.shape_bytes("(f8e5m2[64]{0}, f32[])") == 64 + 4
    assert {kernels.peak_dtype(t) for t in ("f8e4m3fn", "f8e5m2", "f8e4m3")} == {"float8"}
    assert kernels.peak_dtype("bf16") == "bfloat16"


def test_a_gpu_without_fp8_tensor_cores_is_refused(capsys):
    code = plan_cli.main(["--config", TINY, "--topology", "a100-sxm-8", "model.fp8=[mlp]"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == ("config error: model.fp8: NVIDIA A100-SXM4-80GB (compute capability 8.0) has no FP8 tensor "
                   "cores (8.9 or later: H100, H200)\n")  # fmt: skip


def test_without_fp8_dots_nothing_is_refused_or_reported():
    cfg = config_lib.load(TINY, [])
    fp8_check.refuse_machine(cfg, topology.load("a100-sxm-8"))  # no FP8 dots: nothing to refuse
    assert fp8_check.check((), "", "gpu", "x") is None


def test_cpu_plan_says_emulated(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_cli.main(["--config", TINY, "model.fp8=[mlp,attention]", "--json", str(out)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FP8 dot")]
    assert len(lines) == 1 and lines[0].startswith("FP8 dots: emulated on cpu: operands rounded to FP8")
    plan = json.loads(out.read_text())["fp8"]
    assert plan["mode"] == "emulated" and plan["emitted"] == 0
    # XLA:CPU unrolls the 2 layers: each dot's forward product and two backward products, per layer
    assert _by_dot(fp8_check.Check((), "", "", tuple(fp8_check.Dot(**d) for d in plan["dots"]))) == {
        name: (2, 4) for name in DENSE
    }


# ---- with XLA's GPU compiler (the gpu-plan extra) --------------------------------------------


@pytest.mark.gpu_target
def test_h100_plan_emits_every_fp8_dot(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = ["--config", TINY, "--topology", "h100-sxm-8", "model.fp8=[mlp,attention]", "model.compute_dtype=bfloat16"]
    assert plan_cli.main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "FP8 dots: 21 of 21 emitted as FP8 GEMMs (forward 7, backward 14; __cublas$lt$matmul$f8)" in printed
    assert "fell back" not in printed
    plan = json.loads(out.read_text())
    dots = plan["fp8"]["dots"]
    assert plan["fp8"]["mode"] == "checked" and plan["fp8"]["kinds"] == ["mlp", "attention"]
    assert {d["name"] for d in dots} == DENSE and all(d["emitted"] for d in dots)
    # forward: e4m3 × e4m3; backward: the e5m2 output gradient against an e4m3 operand
    assert {tuple(d["operands"]) for d in dots if d["direction"] == "forward"} == {("f8e4m3fn", "f8e4m3fn")}
    assert all("f8e5m2" in d["operands"] for d in dots if d["direction"] == "backward")
    assert plan["time"]["step"]["components"]["gemm"] > 0


@pytest.mark.gpu_target
def test_h100_emits_fp8_experts():
    step, compiled = _compiled("experiments/moe_tiny.yaml", ["model.fp8=[experts]", "model.compute_dtype=bfloat16"])
    check = fp8_check.check(step.traits.fp8, compiled, "gpu", "h100")
    # the layer loop runs as a loop on the GPU: its body's GEMMs, once each
    assert _by_dot(check) == {name: (1, 2) for name in EXPERTS}
    assert check.emitted == len(check.dots) == 9
    assert {d.kernel for d in check.dots} == {fp8_check.CUBLAS_F8}


@pytest.mark.gpu_target
def test_triton_gemms_fall_back_and_are_named():
    """With Triton's GEMM emitter on, XLA fuses the dequantize into a bf16 Triton GEMM: the check
    names every dot as fallen back (what the default off-switch for FP8 models prevents)."""
    overrides = ["model.fp8=[mlp]", "model.compute_dtype=bfloat16", "xla.flags={xla_gpu_enable_triton_gemm: true}"]
    step, compiled = _compiled(TINY, overrides)
    check = fp8_check.check(step.traits.fp8, compiled, "gpu", "h100")
    assert _by_dot(check) == {name: (1, 2) for name in DENSE if name.startswith("mlp")}
    assert check.emitted == 0 and len(check.fallen_back) == 9
    assert all(d.operands == ("bf16", "bf16") and "triton" in d.kernel for d in check.fallen_back)
    lines = check.lines()
    assert lines[0].startswith("FP8 dots: 0 of 9 emitted as FP8 GEMMs (forward 3, backward 6")
    assert len(lines) == 10 and lines[1].startswith("FP8 dot mlp_w_down (forward) fell back: __triton")


@pytest.mark.gpu_target
def test_fp8_gemms_are_priced_at_the_fp8_rate():
    """A model whose bf16 step is mostly GEMMs: its FP8 GEMMs are predicted at about half the
    time (the H100's FP8 peak is twice its bf16 peak), the quantize and amax work adds
    memory-bound kernels."""
    wide = ["model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8", "model.d_head=128", "model.d_ff=16384",
            "model.n_layers=1", "model.max_length=256", "data.length=256", "train.batch_size=64",
            "model.compute_dtype=bfloat16"]  # fmt: skip
    topo = topology.load("h100-sxm-8")
    times = {}
    for kinds in ("[mlp,attention]", "[]"):
        step, compiled = _compiled(TINY, [*wide, f"model.fp8={kinds}"])
        times[kinds] = timing.predict(step, compiled, topo).components
        module = hlo.parse(compiled.as_text())
        fp8 = [(c, op) for c, ops in module.computations.items() for op in ops if hlo.target(op) == fp8_check.CUBLAS_F8]
        assert bool(fp8) == (kinds != "[]")
        for c, op in fp8:  # read through the scale operands cuBLASLt's FP8 call takes
            gemm = kernels.gemm(module, c, op)
            assert gemm.dtype.startswith("f8") and kernels.peak_dtype(gemm.dtype) == "float8"
    fp8, bf16 = times["[mlp,attention]"], times["[]"]
    assert bf16["gemm"] > 0.5 * sum(bf16.values())  # GEMMs dominate the bf16 step
    assert fp8["gemm"] < 0.6 * bf16["gemm"]
    assert fp8["memory-bound"] > bf16["memory-bound"]

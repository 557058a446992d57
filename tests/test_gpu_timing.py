"""The step-time model on programs XLA's GPU compiler made (tests/fixtures/gpu_hlo/, written by
scripts/make_gpu_hlo_fixtures.py): GEMMs under both lowerings, cuDNN calls, async collectives,
and the bytes of a rolled layer loop. The texts are read as they are: no GPU plugin needed."""

import functools
import gzip
import json
import math
import pathlib
import re

import pytest

from meshpar import models
from meshpar.configuration import config
from meshpar.plan import hlo, topology
from meshpar.plan.time import timing
from meshpar.step import parts

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "gpu_hlo"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
LOWERINGS = ("triton", "cublas")
LMS = ("lm_rolled", "lm_unrolled", "lm8_rolled")
GEMM_KINDS = ("__cublas$", "__triton_gemm", "__triton_nested_gemm_fusion")


@functools.cache
def text(name: str) -> str:
    path = FIXTURES / name
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def lm(name: str, lowering: str) -> str:
    return text(f"{name}.{lowering}.hlo.gz")


@functools.cache
def costs(name: str) -> tuple[timing.OpCost, ...]:
    return tuple(timing.op_costs(text(name)))


@functools.cache
def parsed(name: str) -> hlo.Module:
    return hlo.parse(text(name))


@functools.cache
def lm_config(name: str):
    entry = MANIFEST[name]
    return config.load(entry["config"], entry["overrides"])


def model_flops_per_device(name: str) -> float:
    """The model's own count (6·N per token + attention; models.transformer), per device."""
    cfg = lm_config(name)
    devices = math.prod(MANIFEST[name]["mesh"].values())
    spec = parts.source_element_spec(cfg)
    return models.MODELS["transformer"].flops_per_example(cfg.model, spec) * cfg.train.batch_size / devices


def output_elements(name: str, op: timing.OpCost) -> int:
    return hlo.elements(parsed(name).ops[op.computation][op.name].shape, first=True)


# ---------------------------------------------------------------------------------------------
# GEMMs


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("name", LMS)
def test_matrix_products_count_the_models_flops_under_either_lowering(name, lowering):
    program = lm(name, lowering)
    kinds = {o.kind for o in costs(f"{name}.{lowering}.hlo.gz")}
    # The lowering is the one named: cuBLAS custom-calls, or Triton GEMM fusions and no cuBLAS.
    assert any(k.startswith("__cublas$") for k in kinds) == (lowering == "cublas")
    assert any(k.startswith("__triton") and "gemm" in k for k in kinds) == (lowering == "triton")
    # Every matmul of this model is one of its weight matrices or attention's two contractions,
    # none recomputed (no remat): the formula's count, on every device alike.
    assert timing.matmul_flops(program) == pytest.approx(model_flops_per_device(name), rel=1e-6)
    # All of XLA's count: the products plus elementwise ops, norms and the optimizer's update.
    assert 1.0 < timing.hlo_flops(program) / timing.matmul_flops(program) < 1.3


@pytest.mark.parametrize("name", LMS)
def test_both_lowerings_count_the_same_flops(name):
    triton, cublas = (lm(name, lowering) for lowering in LOWERINGS)
    assert timing.matmul_flops(triton) == timing.matmul_flops(cublas)
    # The elementwise ops fused around the GEMMs differ a little between the two programs.
    assert timing.hlo_flops(triton) == pytest.approx(timing.hlo_flops(cublas), rel=0.03)


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_every_gemm_is_priced_from_its_shapes(lowering):
    name = f"lm_rolled.{lowering}.hlo.gz"
    cfg = lm_config("lm_rolled")
    mesh = MANIFEST["lm_rolled"]["mesh"]
    m, tokens = cfg.model, cfg.train.batch_size // mesh["data"] * cfg.data.length
    # Each GEMM contracts one of these (per device: heads, d_ff and vocab split over model): the
    # embedding width, the d_ff or heads × kv shard, a head, the sequence (attention's values),
    # the device's tokens (weight gradients) or the vocab shard (the output's input gradient).
    widths = {m.d_model, m.d_ff // mesh["model"], m.n_heads * m.d_head // mesh["model"], m.d_head,
              cfg.data.length, tokens, m.vocab_size // mesh["model"]}  # fmt: skip
    gemms = [o for o in costs(name) if o.kind.startswith(GEMM_KINDS)]
    # Each layer's projections, attention's two products and the MLP's two, and their gradients
    # (a rolled loop's body once per trip).
    assert sum(op.executions for op in gemms) >= 4 * 4 * m.n_layers
    for op in gemms:
        out = output_elements(name, op)
        assert op.flops > 0, op.name
        if lowering == "cublas":  # a GEMM alone: 2 × M × N × K exactly
            assert op.flops / (2 * out) in widths, op.name
        else:  # the dot and its fused prologue/epilogue
            assert op.flops >= 2 * out * min(widths), op.name
    # A cuBLAS call's 4 MiB scratch workspace is no output bytes of it.
    if lowering == "cublas":
        assert all(op.bytes < 1 << 20 for op in gemms)


def test_cudnn_convolutions_and_fused_attention_are_priced_from_their_shapes():
    shapes = MANIFEST["library"]
    (n, h, w, c_in), (kh, kw, _, c_out) = shapes["conv"]["x"], shapes["conv"]["w"]
    conv = 2 * n * h * w * c_out * kh * kw * c_in  # SAME padding: the output is H × W
    batch, length, heads, dim = shapes["attention"]
    full = 4 * batch * heads * length * length * dim  # QKᵀ and PV
    found = {}
    for op in costs("library.hlo"):
        found.setdefault(op.kind, []).append(op.flops)
    # Forward, input gradient and filter gradient each cost the forward convolution.
    for kind in ("__cudnn$convForward", "__cudnn$convBackwardInput", "__cudnn$convBackwardFilter"):
        assert found[kind] == [conv]
    # A causal call computes half the scores; the backward pass 2.5× its forward (5 matmuls).
    assert sorted(found["__cudnn$fmhaSoftmax"]) == [full / 2, full]
    assert sorted(found["__cudnn$fmhaSoftmaxBackward"]) == [2.5 * full / 2, 2.5 * full]
    assert timing.matmul_flops(text("library.hlo")) == 3 * conv + (1 + 2.5) * (full / 2 + full)


# ---------------------------------------------------------------------------------------------
# Bytes of a rolled layer loop


def loop_bytes_per_trip(name: str) -> float:
    looped = [o for o in costs(name) if o.executions > 1]
    trips = max(o.executions for o in looped)
    return sum(o.bytes * o.executions for o in looped) / trips


def total_bytes(name: str) -> float:
    return sum(o.bytes * o.executions for o in costs(name))


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_a_rolled_layer_loop_moves_one_layer_per_trip_not_the_stack(lowering):
    four, eight = (f"{n}.{lowering}.hlo.gz" for n in ("lm_rolled", "lm8_rolled"))
    # Twice the stacked weights, the same bytes per trip: each trip reads its own layer's
    # slice. Billed the whole stack, each trip would move twice as much at 8 layers.
    assert loop_bytes_per_trip(eight) == pytest.approx(loop_bytes_per_trip(four), rel=0.01)
    # And the step's bytes near the unrolled program's (the rolled loop copies each layer's
    # weight slices and saves them per trip; the unrolled one reads them in place).
    ratio = total_bytes(four) / total_bytes(f"lm_unrolled.{lowering}.hlo.gz")
    assert 1.0 <= ratio < 1.5
    # Each slice or update of a stacked [4, ...] buffer moves one layer's part of it.
    module = parsed(four)
    sliced = 0
    for op in costs(four):
        body = hlo.called(module.ops[op.computation][op.name])
        root = module.root(body[0]) if op.opcode == "fusion" and body else None
        while root is not None and root.opcode in ("copy", "bitcast"):
            root = module.ops[body[0]][root.operands[0]]
        if op.executions > 1 and root is not None and root.opcode == "dynamic-slice":
            sliced += 1
            assert op.bytes <= 2 * hlo.shape_bytes(root.shape) + 64, op.name  # read + write the slice
        if op.executions > 1 and root is not None and root.opcode == "dynamic-update-slice":
            # In place: its other inputs read, its update written; the stacked buffer neither.
            fusion = module.ops[op.computation][op.name]
            shapes = [module.operand_shape(op.computation, fusion, i) for i in range(1, len(fusion.operands))]
            inputs = sum(hlo.shape_bytes(shape) for shape in shapes)
            update = hlo.shape_bytes(module.operand_shape(body[0], root, 1))
            assert op.bytes <= inputs + update, op.name
    assert sliced >= 4


SLICES = """HloModule m

%slice_one (p0: f32[8,1024], p1: s32[]) -> f32[1,1024] {
  %p0 = f32[8,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,1024]{1,0} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={1,1024}
  ROOT %n = f32[1,1024]{1,0} negate(%ds)
}

%update_one (b: f32[8,1024], u: f32[1,1024], i: s32[]) -> f32[8,1024] {
  %b = f32[8,1024]{1,0} parameter(0)
  %u = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %e = f32[1,1024]{1,0} exponential(%u)
  ROOT %dus = f32[8,1024]{1,0} dynamic-update-slice(%b, %e, %i, %z)
}

%first_rows (s: f32[8,1024]) -> f32[2,1024] {
  %s = f32[8,1024]{1,0} parameter(0)
  %v = f32[8,2,512]{2,1,0} bitcast(%s)
  %sl = f32[2,2,512]{2,1,0} slice(%v), slice={[0:2], [0:2], [0:512]}
  ROOT %r = f32[2,1024]{1,0} bitcast(%sl)
}

%whole (w: f32[8,1024], j: s32[]) -> (f32[8,1024], f32[1,1024]) {
  %w = f32[8,1024]{1,0} parameter(0)
  %j = s32[] parameter(1)
  %z = s32[] constant(0)
  %neg = f32[8,1024]{1,0} negate(%w)
  %row = f32[1,1024]{1,0} dynamic-slice(%w, %j, %z), dynamic_slice_sizes={1,1024}
  ROOT %t = (f32[8,1024]{1,0}, f32[1,1024]{1,0}) tuple(%neg, %row)
}

ENTRY %main (w: f32[8,1024], i: s32[]) -> f32[8,1024] {
  %w = f32[8,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  %a = f32[1,1024]{1,0} fusion(%w, %i), kind=kLoop, calls=%slice_one
  %b = f32[8,1024]{1,0} fusion(%w, %a, %i), kind=kLoop, calls=%update_one
  %c = f32[2,1024]{1,0} fusion(%b), kind=kLoop, calls=%first_rows
  %d = (f32[8,1024]{1,0}, f32[1,1024]{1,0}) fusion(%w, %i), kind=kLoop, calls=%whole
  %e = f32[1,1024]{1,0} dynamic-slice(%w, %i, %z), dynamic_slice_sizes={1,1024}
  ROOT %f = f32[8,1024]{1,0} dynamic-update-slice(%b, %e, %i, %z)
}
"""


def test_a_fusion_moves_what_its_body_reads_of_each_parameter_and_writes_of_its_root():
    row, rows, table = 1024 * 4, 2 * 1024 * 4, 8 * 1024 * 4
    billed = {o.name: o.bytes for o in timing.op_costs(SLICES)}
    assert billed == {
        "a": row + 4 + row,  # reads one row through a dynamic-slice (and its index), writes it
        "b": row + 4 + row,  # updates one row in place: reads its update, writes it; the table is neither
        "c": rows + rows,  # reads two rows through a bitcast and a slice
        "d": table + 4 + table + row,  # a parameter also read whole is read whole, once
        "e": row + 4 + 4 + row,  # a bare dynamic-slice: the slice, not its operand
        "f": row + 4 + 4 + row,  # a bare in-place update: the update
    }


# ---------------------------------------------------------------------------------------------
# Async collectives


@pytest.mark.parametrize("lowering", LOWERINGS)
def test_async_collectives_are_counted_once_with_their_bytes(lowering):
    program = text(f"collectives.{lowering}.hlo")
    assert re.search(r"all-to-all-start|reduce-scatter-start|all-gather-start|collective-permute-start", program)
    # all-to-all and collective-permute of a [256, 16] float32 block, a reduce-scatter of the
    # [256, 64] product (its input), an all-gather to [256, 64] (its gathered result).
    assert timing.collectives(program, MANIFEST["collectives"]["mesh"]) == [
        ("all-to-all", 256 * 16 * 4, "x"),
        ("collective-permute", 256 * 16 * 4, "x"),
        ("reduce-scatter", 256 * 64 * 4, "x"),
        ("all-gather", 256 * 64 * 4, "x"),
    ]
    # The one GEMM's FLOPs and nothing else: a reduce-scatter's reducer is no compute counted.
    assert timing.hlo_flops(program) == 2 * 256 * 16 * 64
    lm = lm_config("lm_rolled")
    predicted = timing.predict_program(program, MANIFEST["collectives"]["mesh"], lm.model.compute_dtype,
                                       lm.feed.prefetch, topology.load(MANIFEST["topology"]))  # fmt: skip
    assert {c.kind for c in predicted.collectives} == {
        "all-to-all",
        "collective-permute",
        "reduce-scatter",
        "all-gather",
    }


def test_the_parser_reads_the_text_with_or_without_metadata_and_header_blocks():
    program = text("collectives.triton.hlo")
    assert "metadata={" in program and "\nFileNames\n" in program
    stripped = re.sub(r",? metadata=\{[^}]*\}", "", program)
    stripped = re.sub(r"\nFileNames\n.*?\nStackFrames\n(?:\d+ \{[^\n]*\}\n)*", "\n", stripped, flags=re.DOTALL)
    assert "metadata={" not in stripped and "FileNames" not in stripped
    assert timing.op_costs(stripped) == timing.op_costs(program)
    mesh = MANIFEST["collectives"]["mesh"]
    assert timing.collectives(stripped, mesh) == timing.collectives(program, mesh)


WRAPPED = """HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%scatter_rows (p: f32[64,32]) -> f32[16,32] {
  %p = f32[64,32]{1,0} parameter(0)
  ROOT %r = f32[16,32]{1,0} reduce-scatter(%p), replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

%sum_all (q: f32[64,32]) -> f32[64,32] {
  %q = f32[64,32]{1,0} parameter(0)
  ROOT %r = f32[64,32]{1,0} all-reduce(%q), replica_groups=[1,4]<=[4], to_apply=%add
}

ENTRY %main (x: f32[64,32]) -> (f32[16,32], f32[64,32]) {
  %x = f32[64,32]{1,0} parameter(0)
  %rs-start = ((f32[64,32]{1,0}), f32[16,32]{1,0}, s32[]) async-start(%x), calls=%scatter_rows
  %rs-update = ((f32[64,32]{1,0}), f32[16,32]{1,0}, s32[]) async-update(%rs-start), calls=%scatter_rows
  %rs-done = f32[16,32]{1,0} async-done(%rs-update), calls=%scatter_rows
  %ar-start = ((f32[64,32]{1,0}), f32[64,32]{1,0}, s32[]) async-start(%x), calls=%sum_all
  %ar-done = f32[64,32]{1,0} async-done(%ar-start), calls=%sum_all
  ROOT %t = (f32[16,32]{1,0}, f32[64,32]{1,0}) tuple(%rs-done, %ar-done)
}
"""


def test_a_collective_wrapped_in_async_start_update_done_is_counted_once():
    found = timing.collectives(WRAPPED, {"x": 4})
    assert found == [("reduce-scatter", 64 * 32 * 4, "x"), ("all-reduce", 64 * 32 * 4, "x")]
    # The all-reduce's additions once (XLA's rule: one per element), the reduce-scatter's none.
    assert timing.hlo_flops(WRAPPED) == 64 * 32
    assert timing.op_costs(WRAPPED) == []  # nothing but the two collectives runs

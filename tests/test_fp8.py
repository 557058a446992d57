"""FP8 dots (meshpar.models.fp8) on this machine: quantize → dequantize within each format's own
rounding error, saturating at its largest value; the FP8 dot's product and both gradients equal
an independent one (numpy, ml_dtypes' rounding, float32 dots); the train step's jaxpr runs every
dot meant to be FP8 on dequantized FP8 operands (and the embedding, logits, router and attention
scores on none); a small Llama trained with FP8 dots tracks its loss curve without FP8 (float32,
and bfloat16) under tensor, stage and expert parallelism, microbatches, a remat policy and
activation offload, and trains bit-identically data parallel, over FSDP with and without
fp8_gather and fed routed; generation runs its FP8 dots; bad settings are one config error line."""

from __future__ import annotations

import functools
import re
import tempfile
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from meshpar import jaxprs, train
from meshpar.configuration import config
from meshpar.models import fp8
from meshpar.run import decoding, experiment, loop
from meshpar.run.metrics import read_jsonl
from meshpar.step import parts
from tests.support.cli import refuses_in_one_line

# -------------------------------------------------------------------------------------------
# The formats

# OCP 8-bit floating point: (jnp dtype, ml_dtypes dtype, mantissa bits, largest finite value,
# smallest normal). e4m3fn: bias 7, no infinities, only S.1111.111 is NaN, so the largest is
# 1.110b x 2^8 = 448; e5m2: bias 15, IEEE-like (exponent 11111 is inf/NaN), largest 1.11b x 2^15.
FORMATS = {
    "e4m3": (fp8.E4M3, ml_dtypes.float8_e4m3fn, 3, 448.0, 2.0**-6),
    "e5m2": (fp8.E5M2, ml_dtypes.float8_e5m2, 2, 57344.0, 2.0**-14),
}


def _bound(mantissa: int) -> float:
    """Round to nearest: at most half a unit in the last place, 2^-mantissa of the leading power
    of two, so at most 2^-(mantissa + 1) of a normal number's value."""
    return 2.0 ** -(mantissa + 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_formats_are_the_ones_named(fmt):
    dtype, ml, mantissa, largest, normal = FORMATS[fmt]
    info = ml_dtypes.finfo(ml)
    assert (info.nmant, float(info.max), float(info.smallest_normal)) == (mantissa, largest, normal)
    assert float(jnp.finfo(dtype).max) == largest


def _wide(n: int = 20000, seed: int = 0) -> np.ndarray:
    """Signed float32 values over 2^-32 .. 2^4: the scaled ones cover each format's normal range
    down into its subnormals, and a few exact zeros."""
    rng = np.random.default_rng(seed)
    x = np.exp2(rng.uniform(-32, 4, n)) * rng.choice([-1.0, 1.0], n)
    x[:5] = 0.0
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_dequantize_round_trips_within_the_formats_own_error(fmt):
    dtype, ml, mantissa, largest, normal = FORMATS[fmt]
    x = _wide()
    s = fp8.scale(jnp.asarray(x), dtype)
    amax = np.abs(x).max()
    assert float(s) == pytest.approx(largest / amax, rel=1e-7)  # the amax lands on the largest value
    q = fp8.quantize(jnp.asarray(x), dtype, s)
    assert q.dtype == dtype
    # the rounding is ml_dtypes' round-to-nearest-even of the scaled values: an independent cast
    expected = np.clip(x * np.float32(s), -largest, largest).astype(ml)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), expected.view(np.uint8))
    back = np.asarray(fp8.dequantize(q, s, jnp.float32))
    err, scaled = np.abs(back - x), np.abs(x) * float(s)
    is_normal = scaled >= normal
    rel = err[is_normal] / np.abs(x[is_normal])
    slack = 2.0**-20  # float32's own rounding of x·s and of q·(1/s)
    assert rel.max() <= _bound(mantissa) + slack, rel.max()
    # relative to the leading power of two (where the bound comes from) the error reaches it: real
    # rounding to `mantissa` bits, neither a float32 pass-through nor a coarser format
    lead = np.exp2(np.floor(np.log2(scaled[is_normal])))
    of_lead = err[is_normal] * float(s) / lead
    assert _bound(mantissa) * 0.95 < of_lead.max() <= _bound(mantissa) + slack, of_lead.max()
    # below the normal range the spacing is the smallest subnormal's: half of it, absolute
    sub = ~is_normal & (x != 0)
    assert (
        sub.any() and (err[sub] <= 0.5 * float(ml_dtypes.finfo(ml).smallest_subnormal) / float(s) * (1 + slack)).all()
    )
    assert back[np.argmax(np.abs(x))] == pytest.approx(x[np.argmax(np.abs(x))], rel=1e-6)  # the amax itself is exact
    np.testing.assert_array_equal(back[x == 0], 0.0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_saturates_at_the_largest_value_and_keeps_zeros(fmt):
    dtype, ml, _, largest, _ = FORMATS[fmt]
    x = jnp.asarray([2 * largest, -3 * largest, largest, 1e30, -1e30, 0.0, -0.0], jnp.float32)
    q = np.asarray(fp8.quantize(x, dtype, jnp.float32(1.0))).astype(np.float32)
    np.testing.assert_array_equal(q, [largest, -largest, largest, largest, -largest, 0.0, 0.0])
    # the saturation is the quantize's own: a plain cast overflows (NaN in e4m3fn, inf in e5m2)
    assert not np.isfinite(np.float32(2 * largest).astype(ml).astype(np.float32))
    # a scale from a smaller tensor: what lies beyond its amax saturates
    s = fp8.scale(jnp.asarray([1.0, -2.0]), dtype)
    q = np.asarray(fp8.dequantize(fp8.quantize(jnp.asarray([4.0, -2.0, 1.0]), dtype, s), s, jnp.float32))
    np.testing.assert_array_equal(q, [2.0, -2.0, 1.0])


def test_an_all_zero_tensor_scales_by_one_and_its_fp8_dot_is_zero_with_finite_gradients():
    zeros = jnp.zeros((4, 8), jnp.float32)
    for dtype, *_ in FORMATS.values():
        s = fp8.scale(zeros, dtype)
        assert float(s) == 1.0
        np.testing.assert_array_equal(np.asarray(fp8.dequantize(fp8.quantize(zeros, dtype, s), s, jnp.float32)), 0.0)
    w = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: fp8.einsum("rk,kn->rn", x, w, jnp.float32), zeros, w)
    dx, dw = vjp(jnp.ones_like(y))
    np.testing.assert_array_equal(np.asarray(y), 0.0)
    np.testing.assert_array_equal(np.asarray(dw), 0.0)
    assert np.isfinite(np.asarray(dx)).all() and np.abs(np.asarray(dx)).max() > 0
    _, vjp = jax.vjp(lambda x, w: fp8.einsum("rk,kn->rn", x, w, jnp.float32), w.T, w)
    for grad in vjp(jnp.zeros((3, 3), jnp.float32)):  # a zero output gradient: zero gradients, no NaN
        np.testing.assert_array_equal(np.asarray(grad), 0.0)


# -------------------------------------------------------------------------------------------
# The FP8 dot against an independent computation


def _through(a: np.ndarray, fmt: str) -> np.ndarray:
    """`a` (float32) scaled by its own amax onto the format's largest value, rounded by ml_dtypes,
    and scaled back: what an FP8 operand stands for."""
    _, ml, _, largest, _ = FORMATS[fmt]
    s = np.float32(largest) / np.abs(a).max()
    return np.clip(a * s, -largest, largest).astype(ml).astype(np.float32) * (np.float32(1.0) / s)


# (spec, x's shape, w's shape, how the model calls it)
DOTS = {
    "dense": ("bli,io->blo", (2, 6, 16), (16, 24)),  # an MLP's or a projection's (fp8.dense, n=1)
    "out-projection": ("blhk,hko->blo", (2, 6, 4, 8), (4, 8, 16)),  # attention's output (fp8.dense, n=2)
    "experts": ("gecm,emf->gecf", (2, 4, 3, 16), (4, 16, 24)),  # each expert its own weight (fp8.einsum)
}


def _fp8_call(name: str, x, w):
    spec = DOTS[name][0]
    if name == "experts":
        return fp8.einsum(spec, x, w, jnp.float32)
    return fp8.dense(x, w, jnp.float32, n=2 if name == "out-projection" else 1)


@pytest.mark.parametrize("name", DOTS)
def test_the_fp8_dot_and_both_gradients_equal_an_independent_computation(name):
    spec, xs, ws = DOTS[name]
    rng = np.random.default_rng(1)
    x = rng.normal(size=xs).astype(np.float32) * 3
    w = rng.normal(size=ws).astype(np.float32) * 0.1
    y, vjp = jax.vjp(functools.partial(_fp8_call, name), jnp.asarray(x), jnp.asarray(w))
    g = rng.normal(size=y.shape).astype(np.float32) * 1e-3
    dx, dw = vjp(jnp.asarray(g))
    # e4m3 operands forward; the output gradient in e5m2 against the forward's e4m3 operands
    qx, qw, qg = _through(x, "e4m3"), _through(w, "e4m3"), _through(g, "e5m2")
    lhs, rhs, out = re.match(r"(\w+),(\w+)->(\w+)", spec).groups()
    expected = {
        "y": np.einsum(spec, qx, qw),
        "dx": np.einsum(f"{out},{rhs}->{lhs}", qg, qw),
        "dw": np.einsum(f"{lhs},{out}->{rhs}", qx, qg),
    }
    exact = {"y": np.einsum(spec, x, w), "dx": np.einsum(f"{out},{rhs}->{lhs}", g, w),
             "dw": np.einsum(f"{lhs},{out}->{rhs}", x, g)}  # fmt: skip
    for key, got in (("y", y), ("dx", dx), ("dw", dw)):
        got = np.asarray(got)
        assert got.shape == expected[key].shape and got.dtype == np.float32
        size = np.abs(expected[key]).max()
        np.testing.assert_allclose(got, expected[key], rtol=1e-5, atol=1e-6 * size, err_msg=key)
        # and the FP8 rounding is there: the float32 product is measurably elsewhere
        assert np.abs(got - exact[key]).max() > 1e-3 * size, key


# -------------------------------------------------------------------------------------------
# The train step's dots, read from its jaxpr

LLAMA = "experiments/llama_tiny.yaml"
# A small Llama (2 layers, 4 query heads sharing 2 key/value heads, SwiGLU) on the tokenized
# Python standard library, 16 windows of 32 tokens a step.
TINY = [
    "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_head=16", "model.d_ff=128",
    "model.n_layers=2", "model.max_length=32", "data.length=32", "data.max_bytes=200000", "train.batch_size=16",
    "train.eval_every=0", "checkpoint.every=0", "train.progress=false", "optimizer.warmup_steps=5",
    "plan.check=false",  # the memory pre-flight (most of a build's time here) is the planner's tests' concern
]  # fmt: skip
LAYERS, VOCAB = 2, 2048  # the tokenizer's vocabulary
FP8 = "model.fp8=[mlp,attention]"
MTF = "batch:data; heads:model; d_ff:model; vocab:model"  # Mesh TensorFlow's data + model layout
FP8_FORMATS = {jnp.dtype(fp8.E4M3): "e4m3", jnp.dtype(fp8.E5M2): "e5m2"}
# Capacity-dispatched experts, split 4 ways over `expert`: layer 0 dense, layer 1 an MoE layer.
MOE = [
    "model.moe_experts=4", "model.moe_top_k=2", "model.moe_every=2", "model.moe_dispatch=capacity",
    "model.moe_group_size=32", "mesh=data:2,expert:4", "layout=batch:(data,expert); experts:expert",
]  # fmt: skip


def _cfg(*overrides: str) -> config.Config:
    return config.load(LLAMA, [*TINY, *overrides])


def _fp8_origin(var, producer: dict) -> str | None:
    """The FP8 format `var` was dequantized from (through relabellings, transposes, a convert and
    a multiply by a scalar scale), or None: a dot operand that any other op made is not FP8."""
    while True:
        fmt = FP8_FORMATS.get(jnp.dtype(var.aval.dtype))
        if fmt is not None:
            return fmt
        eqn = None if jaxprs.is_literal(var) else producer.get(var)
        if eqn is None:
            return None
        if jaxprs.is_relabel(eqn) or jaxprs.op(eqn) in ("transpose", "convert_element_type"):
            var = eqn.invars[0]
        elif jaxprs.is_mul(eqn) and any(v.aval.shape == () for v in eqn.invars):
            var = max(eqn.invars, key=lambda v: len(v.aval.shape))
        else:
            return None


def _dots(jaxpr, copies: int = 1, found: list | None = None) -> list[tuple[tuple, tuple, bool, int]]:
    """Every dot_general of `jaxpr` and the jaxprs nested in it: (its operands' FP8 formats, its
    operands' shapes, whether it has batch dims, how many times it runs)."""
    found = [] if found is None else found
    inner = next(jaxprs.nested(jaxpr))  # the open jaxpr
    producer = {v: e for e in inner.eqns for v in e.outvars}
    for eqn in inner.eqns:
        if jaxprs.op(eqn) == "dot_general":
            formats = tuple(_fp8_origin(v, producer) for v in eqn.invars)
            _, batch = jaxprs.matmul_flops(eqn)
            found.append((formats, tuple(v.aval.shape for v in eqn.invars), batch, copies))
        runs = copies * jaxprs.scan_length(eqn) if jaxprs.is_scan(eqn) else copies
        for sub in jaxprs.subjaxprs(eqn):
            _dots(sub, runs, found)
    return found


def _step_jaxpr(*overrides: str):
    """The jaxpr of the train step (loss, gradients, update) of the tiny Llama under `overrides`."""
    cfg = _cfg(*overrides)
    step = parts.abstract_step(cfg, element_spec=parts.source_element_spec(cfg))
    return step.step.trace(*step.args).jaxpr


def _step_dots(*overrides: str) -> list:
    return _dots(_step_jaxpr(*overrides))


def _fp8_placed(jaxpr) -> int:
    """How many times the step places an FP8 value (a sharding constraint on float8 bytes)."""
    return sum(
        n for eqn, n, _ in jaxprs.walk(jaxpr)
        if jaxprs.constraint(eqn) is not None and jnp.dtype(eqn.invars[0].aval.dtype) in FP8_FORMATS
    )  # fmt: skip


def _tally(dots: list) -> Counter:
    """Dots by their operands: fwd (two e4m3), bwd (an e5m2 output gradient and an e4m3 operand),
    mixed (one FP8 operand only: a half-quantized dot), plain (none)."""
    kinds = Counter()
    for formats, _, _, n in dots:
        key = {("e4m3", "e4m3"): "fwd", ("e4m3", "e5m2"): "bwd", ("e5m2", "e4m3"): "bwd", (None, None): "plain"}
        kinds[key.get(formats, "mixed")] += n
    return kinds


@pytest.mark.parametrize(
    "layout",
    [["mesh=data:4,model:2", f"layout={MTF}"],
     ["mesh=data:8", "layout=batch:data", "param_layout=embed:data", "model.fp8_gather=true"]],
    ids=["tensor-parallel", "fsdp-fp8-gather"],
)  # fmt: skip
def test_every_dot_meant_to_be_fp8_runs_on_fp8_operands_in_the_train_step(layout):
    # Per layer 7 FP8 products forward (query, key, value, output projections; gate, up, down)
    # and 14 backward (each one's input and weight gradients); the logits (1 forward, 2
    # backward) and attention's scores and values (2 forward, 4 backward a layer) in float32.
    jaxpr = _step_jaxpr(*layout, FP8)
    dots = _dots(jaxpr)
    assert _tally(dots) == {"fwd": 7 * LAYERS, "bwd": 14 * LAYERS, "plain": 3 + 6 * LAYERS}
    # fp8_gather places the 7 weights of each layer as FP8 bytes (the all-gather moves those)
    assert _fp8_placed(jaxpr) == (7 * LAYERS if "model.fp8_gather=true" in layout else 0)
    for formats, shapes, batch, n in dots:
        if any(VOCAB in s for s in shapes):  # the logits (the embedding is a gather: no dot)
            assert formats == (None, None)
        if batch:  # attention's scores and values: the only dots with batch dims here
            assert formats == (None, None)
    # the same step without FP8: no dot on FP8 operands at all
    assert set(_tally(_step_dots(*layout))) == {"plain"}


def test_the_router_stays_out_of_fp8_experts():
    # Layer 0 dense (its MLP's 3 dots FP8 as mlp), layer 1 MoE (its experts' 3 as experts), both
    # layers' 4 projections as attention: 14 forward, 28 backward.
    dots = _step_dots(*MOE, "model.fp8=[mlp,experts,attention]")
    kinds = _tally(dots)
    assert kinds["fwd"] == 14 and kinds["bwd"] == 28 and kinds["mixed"] == 0
    router = [f for f, shapes, _, _ in dots if (64, 4) in shapes]  # [embed, experts]: the router's weight
    assert router and all(f == (None, None) for f in router)
    # experts only: the dense layer's MLP stays in float32
    assert _tally(_step_dots(*MOE, "model.fp8=[experts]"))["fwd"] == 3


# -------------------------------------------------------------------------------------------
# Training tracks the loss curve without FP8 under each layout

STEPS = 30
DATA = ["mesh=data:8", "layout=batch:data"]
FSDP = [*DATA, "param_layout=embed:data"]
BF16 = "model.compute_dtype=bfloat16"
# Each layout's FP8 run and the run it is compared with: the same model without FP8, data
# parallel (every layout here trains the same curve without FP8 to float rounding:
# tests/test_pipeline.py, test_microbatches.py, test_remat_policies.py, test_offload.py,
# test_moe_train.py). In float32, and once in bfloat16 (the FP8 dots then dequantize to bfloat16).
LAYOUTS = {
    "tensor": (["mesh=data:4,model:2", f"layout={MTF}", FP8], DATA),
    "stage": (["mesh=data:2,stage:2,model:2", f"layout=layers:stage; {MTF}", "train.microbatches=4", FP8], DATA),
    "microbatches": ([*DATA, "train.microbatches=2", FP8], DATA),
    "remat": (["mesh=data:4,model:2", f"layout={MTF}", "model.remat=minimal", FP8], DATA),
    "offload": ([*DATA, "offload.activations=dots", FP8], DATA),
    "experts": ([*MOE, "model.fp8=[mlp,experts,attention]"], MOE),
    "bfloat16": ([*DATA, BF16, FP8], [*DATA, BF16]),
}


@functools.cache
def _losses(*overrides: str) -> tuple[float, ...]:
    """The loss of each of STEPS steps of the tiny Llama trained by the train loop under `overrides`."""
    with tempfile.TemporaryDirectory(prefix="meshpar-test-fp8-") as workdir:
        cfg = _cfg(*overrides, f"train.steps={STEPS}", "train.log_every=1", f"workdir={workdir}")
        loop.train(experiment.build(cfg))
        return tuple(r["loss"] for r in read_jsonl(Path(workdir) / "metrics.jsonl"))


def _tracks(got: tuple[float, ...], ref: tuple[float, ...]) -> None:
    """The FP8 curve `got` tracks `ref`, the same model's without FP8: both fall by more than a
    nat (8.2 → 6.4 on jax 0.10, 8.1 → 6.7 from jax 0.12's initial draws), at most 0.04 apart at
    any of the STEPS steps (observed 0.007-0.013), and apart from the first step on (observed
    5e-4 to 4e-3 there): FP8 rounding is on."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert len(got) == len(ref) == STEPS
    assert ref[0] - ref[-1] > 1.0 and got[0] - got[-1] > 1.0, (ref, got)
    gap = np.abs(got - ref)
    assert gap.max() < 0.04 and 1e-4 < gap[0] < 0.01, gap


# Kept out of the default suite (pytest -m slow runs them): tensor parallelism and microbatches,
# whose FP8 amaxes tests/test_fp8_delayed.py checks in the default suite, and bfloat16 compute.
SLOW = {"tensor", "microbatches", "bfloat16"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in LAYOUTS])
def test_fp8_training_tracks_the_loss_curve_without_fp8(name):
    fp8_run, reference = LAYOUTS[name]
    _tracks(_losses(*fp8_run), _losses(*reference))


def test_fsdp_with_and_without_fp8_gather_and_routed_feeding_train_fp8_bit_identically():
    # The scales are the whole tensors' amaxes, whatever splits them, and quantizing is
    # elementwise: quantizing the weight shards where they are stored and gathering the bytes
    # (fp8_gather) is quantizing the gathered weight. Exact float equality, step for step, and
    # routed feeding is direct's. FSDP against data parallelism sums the gradients in another
    # order (a reduce-scatter): bit-identical on jax 0.10's XLA; on jax 0.12's a last-bit
    # difference from step 14 on, which FP8's rounding carries into the losses (at most 0.0037
    # apart over 30 steps, a tenth of FP8's own distance from the float32 curve).
    data = _losses(*DATA, FP8)
    _tracks(data, _losses(*DATA))
    fsdp = _losses(*FSDP, FP8)
    assert np.abs(np.asarray(fsdp) - np.asarray(data)).max() < 0.01
    assert _losses(*FSDP, FP8, "model.fp8_gather=true") == fsdp
    assert _losses(*DATA, FP8, "feed.mode=routed") == data


# -------------------------------------------------------------------------------------------
# Generation

TRAINED = Path(__file__).parent / "fixtures" / "hf" / "trained"


@pytest.mark.skipif(not TRAINED.is_dir(), reason="tests/fixtures/hf/trained is made by scripts/make_hf_fixture.py")
def test_generation_runs_its_fp8_dots():
    """The briefly trained fixture Llama (2 layers) decoded greedily with FP8 MLP and attention
    dots: its compiled decode step quantizes the 28 operands of its 2 x 7 FP8 dots to e4m3 (no
    e5m2: nothing runs backward), and it continues each prompt as the float32 model begins to."""
    ref = np.load(TRAINED / "reference.npz")
    gen = decoding.open_generator(decoding.hf_run_config(TRAINED, [FP8]), hf_dir=TRAINED)
    prompts = decoding.encode(gen, [str(p) for p in ref["generate_prompts"]])
    out = decoding.generate(gen, prompts, 16, stop_at_eos=False)
    (_, later), = gen.programs.values()  # fmt: skip
    text = later.as_text()
    assert len(re.findall(r"= f8e4m3fn\[[\d,]*\]\{?[\d,]*\}? convert\(", text)) == 2 * 7 * 2, text.count("f8e4m3fn")
    assert "f8e5m2" not in text
    tokens = np.asarray([t.tolist() for t in out.tokens])
    expected = ref["generate_tokens"][:, :16]
    # FP8 rounding moves the logits by a few percent; the fixture's top-2 margins are small, so
    # the continuations part after a while (observed, of 32: at new token 2, 18, 18 and 5)
    assert (tokens[:, 0] == expected[:, 0]).all()
    assert (tokens == expected).mean() > 0.3 and len(set(tokens.ravel().tolist())) >= 8


# -------------------------------------------------------------------------------------------
# Bad settings


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.fp8=[mlp,bogus]"], r"config error: model\.fp8: unknown kind of dot 'bogus' \(FP8 kinds: mlp, experts, attention\)$"),
        (["model.fp8=[logits]"], r"config error: model\.fp8: 'logits' dots stay in the compute dtype"),
        (["model.fp8=[router]"], r"config error: model\.fp8: 'router' dots stay in the compute dtype"),
        (["model.fp8=[mlp,mlp]"], r"config error: model\.fp8: lists a kind twice"),
        (["model.fp8=[experts]", "model.moe_experts=4", "model.moe_dispatch=dropless"],
         r"config error: model\.fp8: .*dropless"),
        (["model.fp8=[experts]"], r"config error: model\.fp8: lists experts, and model llama has none \(model\.moe_experts 0\)$"),
    ],
    ids=["unknown", "logits", "router", "twice", "dropless-experts", "experts-without-experts"],
)  # fmt: skip
def test_bad_fp8_settings_are_one_config_error_line(tmp_path, capsys, overrides, expected):
    argv = ["--config", LLAMA, *overrides, f"workdir={tmp_path}"]
    refuses_in_one_line(train.main, argv, capsys, expected)
    assert not (tmp_path / "metrics.jsonl").exists()

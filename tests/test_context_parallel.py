"""Context parallelism (meshpar.models.context_parallel): under a length split each strategy's
attention and its gradients equal unsplit attention (causal, GQA, splits of 2, 4 and 8, with a
batch split and heads:model), its compiled program moves what the strategy says (so a silent
fallback to XLA's partitioner fails), a tiny Llama trains to the unsplit losses under each, routed
and direct feeding train bit-identically with a length split, and bad input is one config line."""

from __future__ import annotations

import functools
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar import train
from meshpar.configuration import config
from meshpar.models import attention as attention_lib
from meshpar.models import context_parallel
from meshpar.processes import stop
from meshpar.run import experiment
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from tests.support.cli import refuses_in_one_line

B, T, D = 2, 32, 8
STRATEGIES = ("all_gather", "ring", "ulysses")
# (mesh, layout, query heads, key/value heads, length ways, key/value heads per device)
CASES = {
    "8-way GQA": ("seq:8", "length:seq", 8, 2, 8, 2),
    "4-way GQA, batch split": ("data:2,seq:4", "batch:data; length:seq", 8, 2, 4, 2),
    "2-way GQA, batch and heads split": (
        "data:2,seq:2,model:2", "batch:data; length:seq; heads:model; kv_heads:model", 8, 4, 2, 2,
    ),
    "4-way MHA, heads split": ("seq:4,model:2", "length:seq; heads:model", 8, 8, 4, 4),
}  # fmt: skip
Q_DIMS = ("batch", "length", "heads", "kv")


def _counts(hlo: str) -> dict[str, int]:
    ops = ("all-gather", "collective-permute", "all-to-all", "reduce-scatter", "conditional")
    return {op: len(re.findall(rf"\s{op}(-start)?\(", hlo)) for op in ops}


@functools.cache
def _inputs(heads: int, kv_heads: int):
    rng = np.random.default_rng(heads * 10 + kv_heads)
    q, k, v, g = (rng.normal(size=s).astype(np.float32) for s in
                  ((B, T, heads, D), (B, T, kv_heads, D), (B, T, kv_heads, D), (B, T, heads, D)))  # fmt: skip
    reference = functools.partial(attention_lib.attention, implementation="xla")
    out, pullback = jax.vjp(reference, q, k, v)
    return (q, k, v, g), (out, *pullback(g))


def _under(case: str, strategy: str):
    mesh_text, rules, heads, kv_heads, _, _ = CASES[case]
    mesh = mesh_lib.build_mesh(mesh_text)
    layout = layout_lib.Layout.create(rules, dict(mesh.shape))
    kv_dims = ("batch", "length", "heads" if heads == kv_heads else "kv_heads", "kv")
    (q, k, v, g), want = _inputs(heads, kv_heads)

    def f(q, k, v):
        q, k, v = layout_lib.constrain(q, Q_DIMS), layout_lib.constrain(k, kv_dims), layout_lib.constrain(v, kv_dims)
        return layout_lib.constrain(context_parallel.attention(q, k, v, "xla", 512, strategy), Q_DIMS)

    def grads(q, k, v, g):
        return jax.vjp(f, q, k, v)[1](g)

    with layout_lib.activate(layout, mesh):
        forward, backward = jax.jit(f).lower(q, k, v).compile(), jax.jit(grads).lower(q, k, v, g).compile()
    return (forward(q, k, v), *backward(q, k, v, g)), want, forward.as_text(), backward.as_text()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES)
def test_each_strategy_equals_unsplit_attention_and_moves_what_it_says(case, strategy):
    got, want, forward, backward = _under(case, strategy)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5, err_msg=name)
    _, _, heads, kv_heads, ways, kv_local = CASES[case]
    ops, back = _counts(forward), _counts(backward)
    if strategy == "all_gather":  # K and V, their key/value heads only, each gathered once; dK, dV scattered back
        assert ops == {**ops, "all-gather": 2, "collective-permute": 0, "all-to-all": 0}, ops
        shapes = re.findall(r"= f32\[(\d+),(\d+),(\d+),(\d+)\]\S* all-gather(?:-start)?\(", forward)
        assert len(shapes) == 2 and all(int(s[1]) == T and int(s[2]) == kv_local for s in shapes), shapes
        assert back["reduce-scatter"] == 2, back
    elif strategy == "ring":  # K and V passed on n − 1 times; each later step behind a real branch
        assert ops == {**ops, "collective-permute": 2 * (ways - 1), "conditional": ways - 1, "all-gather": 0}, ops
        assert back["collective-permute"] == 4 * (ways - 1), back
    else:  # q, k, v to the heads split and the output back
        assert ops == {**ops, "all-to-all": 4, "all-gather": 0, "collective-permute": 0}, ops
        assert back["all-to-all"] >= 7, back


def test_without_a_length_split_attention_is_the_core_as_before():
    mesh = mesh_lib.build_mesh("data:2,model:4")
    layout = layout_lib.Layout.create("batch:data; heads:model", dict(mesh.shape))
    (q, k, v, _), (want, *_) = _inputs(8, 8)
    with layout_lib.activate(layout, mesh):
        assert context_parallel.split() is None
        fn = jax.jit(lambda q, k, v: context_parallel.attention(q, k, v, "xla", 512, "ring"))
        out, hlo = fn(q, k, v), fn.lower(q, k, v).compile().as_text()
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6, atol=1e-6)
    assert _counts(hlo)["collective-permute"] == 0


def test_ulysses_refuses_heads_that_do_not_divide():
    assert context_parallel.problem("ring", 6, 4, 1) is None and context_parallel.problem("ulysses", 8, 4, 2) is None
    assert "6 does not divide by 4" in context_parallel.problem("ulysses", 6, 4, 1)
    mesh = mesh_lib.build_mesh("seq:4,model:2")
    layout = layout_lib.Layout.create("length:seq; heads:model", dict(mesh.shape))
    x = jnp.zeros((B, T, 4, D))
    with layout_lib.activate(layout, mesh), pytest.raises(ValueError, match="4 does not divide by 8"):
        jax.eval_shape(lambda x: context_parallel.attention(x, x, x, "xla", 512, "ulysses"), x)


# A tiny Llama through the real train step: 5 steps of AdamW on the text source.
TINY = (
    "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_head=8", "model.d_ff=64",
    "model.vocab_size=256", "data.tokenizer=byte", "data.length=32", "data.max_bytes=100000", "train.batch_size=8",
    "train.progress=false", "checkpoint.every=0", "plan.check=false", "optimizer.warmup_steps=0",
)  # fmt: skip
STEPS = 5


@functools.cache
def _losses(*overrides: str) -> tuple[list[float], list[np.ndarray], dict[str, int]]:
    """STEPS train steps under `overrides`: the losses, the final parameters, and the collectives
    the train step's program names before XLA partitions it (the ones written out, none of the
    partitioner's)."""
    workdir = tempfile.mkdtemp(prefix="meshpar-cp-")
    exp = experiment.build(config.load("experiments/llama_tiny.yaml", [*TINY, f"workdir={workdir}", *overrides]))
    flags = stop.make_flags(exp.mesh, 0)
    state, losses, written = exp.state, [], {}
    for i in range(STEPS):
        batch, _ = exp.inputs.feeder.place(exp.inputs.train.batch(i))
        if i == 0:
            text = exp.train_step.lower(state, batch, flags).as_text()
            written = {op: text.count(f"stablehlo.{op}") for op in ("all_gather", "collective_permute", "all_to_all")}
        state, metrics = exp.train_step(state, batch, flags)
        losses.append(float(metrics["loss"]))
    return losses, [np.asarray(x) for x in jax.tree.leaves(state.params)], written


MESH = "mesh=data:2,seq:4"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_tiny_llama_trains_to_the_unsplit_losses_under_each_strategy(strategy):
    unsplit, _, none = _losses(MESH, "layout=batch:data")
    split, _, written = _losses(MESH, "layout=batch:data; length:seq", f"model.context_parallel={strategy}")
    np.testing.assert_allclose(split, unsplit, rtol=1e-5)
    assert split[-1] < split[0]
    assert set(none.values()) == {0}, none
    own = {"all_gather": "all_gather", "ring": "collective_permute", "ulysses": "all_to_all"}[strategy]
    assert written[own] > 0 and sum(written.values()) == written[own], written


def test_routed_and_direct_feeding_train_bit_identically_with_a_length_split():
    layout = (MESH, "layout=batch:data; length:seq", "model.context_parallel=ring")
    direct, direct_params, _ = _losses(*layout)
    routed, routed_params, _ = _losses(*layout, "feed.mode=routed")
    assert routed == direct
    for a, b in zip(direct_params, routed_params, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("layout=batch:data; length:model", "data.length=127"),
         r"config error: data\.length: 127 is not divisible by the 2 ways layout length:model"),
        (("mesh=data:2,seq:2,model:2", "layout=batch:data; length:seq; heads:model", "model.n_heads=2",
          "model.context_parallel=ulysses"),
         r"config error: model\.context_parallel: ulysses splits the 2 query heads 2 ways .*4"),
        (("model.context_parallel=zigzag",), r"config error: model\.context_parallel: 'zigzag' is not one of"),
        (("layout=batch:data; layers:model; length:model",),
         r"config error: layout: length:model uses the stage axis 'model'"),
    ],
    ids=["length", "ulysses-heads", "strategy", "stage-axis"],
)  # fmt: skip
def test_bad_input_is_one_config_line(overrides, expected, capsys, tmp_path):
    argv = ["--config", "experiments/llama_tiny.yaml", *overrides, f"workdir={tmp_path}", "train.progress=false"]
    refuses_in_one_line(train.main, argv, capsys, expected)

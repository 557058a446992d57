"""The one decoder behind the transformer and llama families (meshpar.models.decoder): both build
the same class, each maps its config onto the switches, and each switch changes its own part of
the model only."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshpar.configuration import config
from meshpar.models import MODELS, decoder, decoder_family, llama, transformer
from meshpar.plan.time import timing
from meshpar.step import parts

LENGTH = 8
SPEC = {"tokens": ((LENGTH + 1,), np.dtype(np.int32))}
BASE = decoder.DecoderConfig(
    d_model=16, n_heads=4, d_head=4, d_ff=24, n_layers=2, vocab_size=32, max_length=LENGTH,
    mlp="gelu", positions="learned", n_kv_heads=None, norm_eps=1e-6, tie_embeddings="none",
)  # fmt: skip
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, LENGTH)), jnp.int32)


def _tree(cfg: decoder.DecoderConfig) -> dict[str, tuple]:
    """Parameter path → (shape, dims), from shapes only."""
    model = nnx.eval_shape(lambda: decoder.Decoder(cfg, LENGTH, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, path)): (tuple(v.get_value().shape), v.dims) for path, v in flat}


def _changed(a: dict, b: dict) -> set[str]:
    return {path for path in a.keys() | b.keys() if a.get(path) != b.get(path)}


def _with(cfg, **changes):
    return dataclasses.replace(cfg, **changes)


def test_both_families_build_the_one_decoder_from_their_switches():
    for name, family in (("transformer", transformer), ("llama", llama)):
        cfg = MODELS[name].config(d_model=16, n_heads=4, d_head=4, d_ff=24, n_layers=2, vocab_size=32, max_length=16)
        model = nnx.eval_shape(lambda cfg=cfg, name=name: MODELS[name].build(cfg, SPEC, nnx.Rngs(0)))
        assert type(model) is decoder.Decoder and model.cfg == family.switches(cfg), name
    t = transformer.switches(transformer.TransformerConfig())
    assert (t.mlp, t.n_kv_heads, t.norm_eps, t.positions, t.tie_embeddings) == ("gelu", None, 1e-6, "learned", "none")
    assert transformer.switches(transformer.TransformerConfig(tie_embeddings=True)).tie_embeddings == "scaled_logits"
    lcfg = llama.LlamaConfig(n_kv_heads=2, rms_eps=1e-6, tie_embeddings=True, remat="dots")
    sw = llama.switches(lcfg)
    assert (sw.mlp, sw.n_kv_heads, sw.norm_eps, sw.positions) == ("swiglu", 2, 1e-6, "rotary")
    assert (sw.tie_embeddings, sw.dropout, sw.remat) == ("scaled_init", 0.0, "dots")
    assert sw.rope == tuple(float(f) for f in llama.rope_frequencies(lcfg))


def test_the_mlp_switch_changes_the_mlp_parameters_only():
    gelu, swiglu = _tree(BASE), _tree(_with(BASE, mlp="swiglu"))
    names = {"blocks/w_in", "blocks/w_out", "blocks/w_gate", "blocks/w_up", "blocks/w_down"}
    assert _changed(gelu, swiglu) == names
    assert swiglu["blocks/w_gate"] == swiglu["blocks/w_up"] == ((2, 16, 24), ("layers", "embed", "d_ff"))
    assert swiglu["blocks/w_down"] == gelu["blocks/w_out"] == ((2, 24, 16), ("layers", "d_ff", "embed"))


def test_the_positions_switch_changes_the_position_table_only():
    assert _changed(_tree(BASE), _tree(_with(BASE, positions="rotary", rope=(1.0, 0.1)))) == {"pos"}
    assert _tree(BASE)["pos"] == ((LENGTH, 16), ("length", "embed"))


def test_the_key_value_heads_switch_changes_key_and_value_only():
    mha, gqa = _tree(BASE), _tree(_with(BASE, n_kv_heads=2))
    assert _changed(mha, gqa) == {"blocks/wk", "blocks/wv"}
    assert gqa["blocks/wk"] == ((2, 16, 2, 4), ("layers", "embed", "kv_heads", "kv"))
    assert mha["blocks/wk"] == ((2, 16, 4, 4), ("layers", "embed", "heads", "kv"))
    # As many grouped heads as query heads: the same weights (same draws) under another dim
    # name, and the same model.
    same = _with(BASE, n_kv_heads=4)
    a, b = decoder.Decoder(BASE, LENGTH, rngs=nnx.Rngs(0)), decoder.Decoder(same, LENGTH, rngs=nnx.Rngs(0))
    assert _changed(mha, _tree(same)) == {"blocks/wk", "blocks/wv"}
    np.testing.assert_array_equal(a.blocks.wk[...], b.blocks.wk[...])
    np.testing.assert_allclose(a(TOKENS), b(TOKENS), rtol=1e-6, atol=1e-6)
    assert a.init_cache(2, 4, jnp.zeros(2)).heads == "heads"
    cache = decoder.Decoder(_with(BASE, n_kv_heads=2), LENGTH, rngs=nnx.Rngs(0)).init_cache(2, 4, jnp.zeros(2))
    assert (cache.heads, cache.k.shape) == ("kv_heads", (2, 2, 4, 2, 4))


def test_the_tie_switch_changes_the_output_projection_and_scales():
    untied, tied = _tree(BASE), _tree(_with(BASE, tie_embeddings="scaled_logits"))
    assert _changed(untied, tied) == {"unembed"}
    assert _tree(_with(BASE, tie_embeddings="scaled_init")) == tied
    logits_scaled = decoder.Decoder(_with(BASE, tie_embeddings="scaled_logits"), LENGTH, rngs=nnx.Rngs(0))
    init_scaled = decoder.Decoder(_with(BASE, tie_embeddings="scaled_init"), LENGTH, rngs=nnx.Rngs(0))
    # scaled_init draws the embedding with std d_model ** -0.5 instead of 1 (the same draw).
    np.testing.assert_allclose(init_scaled.embed[...], logits_scaled.embed[...] * 16**-0.5, rtol=1e-6)
    # With the same embedding, the two differ by the logits' scale alone.
    init_scaled.embed[...] = logits_scaled.embed[...]
    init_scaled.pos[...] = logits_scaled.pos[...]
    np.testing.assert_allclose(logits_scaled(TOKENS), init_scaled(TOKENS) * 16**-0.5, rtol=1e-5, atol=1e-6)


def test_norm_eps_and_dropout_change_no_parameter():
    assert _tree(BASE) == _tree(_with(BASE, norm_eps=1e-2)) == _tree(_with(BASE, dropout=0.5))
    a = decoder.Decoder(BASE, LENGTH, rngs=nnx.Rngs(0))
    b = decoder.Decoder(_with(BASE, norm_eps=10.0), LENGTH, rngs=nnx.Rngs(0))
    assert not np.allclose(a(TOKENS), b(TOKENS))
    c = decoder.Decoder(_with(BASE, dropout=0.5), LENGTH, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(a(TOKENS), c(TOKENS))  # no rngs: no dropout
    assert not np.allclose(a(TOKENS), c(TOKENS, nnx.Rngs(dropout=1)))


# Each family's model with the switches that change its FLOPs: GELU and multi-head attention
# (transformer), SwiGLU and grouped key/value heads (llama); vocab 256, the byte tokenizer's.
FLOP_MODELS = {
    "transformer": {"name": "transformer", "d_model": 16, "n_heads": 4, "d_head": 4, "d_ff": 24, "n_layers": 2},
    "llama": {"name": "llama", "d_model": 16, "n_heads": 4, "n_kv_heads": 2, "d_head": 4, "d_ff": 24, "n_layers": 2},
}


@pytest.mark.parametrize("name", FLOP_MODELS)
def test_flops_per_example_are_the_matmul_flops_xla_counts_in_the_compiled_step(name):
    batch = 4
    cfg = config.from_dict({
        "mesh": "data:1", "layout": "batch:data", "model": {**FLOP_MODELS[name], "vocab_size": 256, "max_length": LENGTH},
        "data": {"source": "text", "length": LENGTH}, "train": {"batch_size": batch}, "optimizer": {"name": "sgd"},
    })  # fmt: skip
    # The whole train step on one device: XLA's figures are the whole batch's.
    compiled = parts.abstract_step(cfg, element_spec=SPEC, devices=jax.devices()[:1]).lower().compile()
    model = MODELS[name].flops_per_example(cfg.model, SPEC) * batch
    # The formula counts matrix products only, so the dots of the compiled program (2·M·N·K
    # each, from their HLO shapes, loops × their trip counts) are exactly it.
    assert timing.matmul_flops(compiled) == pytest.approx(model, rel=1e-6)
    # XLA's own count adds what the formula leaves out, all of it elementwise, growing with
    # tokens × (d_model + vocab) and with the parameters, not with d_model²: softmax, norms,
    # GELU/SwiGLU gates, residual adds, rotary rotations, the loss, and SGD's update. For a
    # d_model of 16 and a vocab of 256 that is ~20% on top (a larger model's share is smaller);
    # below the formula would mean XLA runs fewer matmuls than it claims.
    cost = compiled.cost_analysis()
    xla = float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])
    assert 1.0 < xla / model < 1.3, xla / model


def test_num_params_count_every_parameter():
    cfg = _with(BASE, mlp="swiglu", n_kv_heads=2)
    params = jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: decoder.Decoder(cfg, LENGTH, rngs=nnx.Rngs(0)))))
    assert decoder_family.num_params(cfg) == sum(int(np.prod(p.shape)) for p in params)

"""Llama-family decoder: the architecture of Llama 2 and 3 (and of Hugging Face's
``LlamaForCausalLM``), in logical dims.

It is the decoder of :mod:`meshpar.models.decoder` with a SwiGLU MLP, grouped-query attention,
rotary positions, RMSNorm, no dropout. This module is its config and the
mapping of that config onto the decoder's switches (:func:`switches`).

``inputs [batch, length] → embed → n_layers × (RMSNorm → grouped-query attention with rotary
positions → residual; RMSNorm → SwiGLU MLP → residual) → RMSNorm → logits [batch, length, vocab]``.
No biases, no dropout; RMSNorm's epsilon is ``rms_eps``; rotary positions use base
``rope_theta``, optionally with Llama 3.1's frequency scaling (``rope_scaling: llama3``), the
frequencies computed as Hugging Face computes them (:func:`rope_frequencies`); the output
projection is its own matrix or the input embedding (``tie_embeddings``, unscaled, as Llama 3.2
1B/3B do; the embedding then starts with std ``d_model ** -0.5``, so the logits start near unit
scale).

Logical dims: ``batch, length, embed, heads, kv_heads, kv, d_ff, vocab, layers``. Parameters,
every block parameter stacked along a leading ``layers`` dim (as :mod:`meshpar.hf` maps them to
and from Hugging Face's names): embedding ``embed (vocab, embed)``; ``blocks/attn_norm,
mlp_norm (layers, embed)``; ``blocks/wq (layers, embed, heads, kv)``; ``blocks/wk, wv (layers,
embed, kv_heads, kv)``; ``blocks/wo (layers, heads, kv, embed)``; ``blocks/w_gate, w_up (layers,
embed, d_ff)``; ``blocks/w_down (layers, d_ff, embed)``; ``final_norm (embed,)``; untied output
``unembed (embed, vocab)``.

Grouped-query attention: ``n_kv_heads`` key/value heads, each shared by ``n_heads /
n_kv_heads`` consecutive query heads (``n_kv_heads = n_heads`` is multi-head attention, 1 is
multi-query), in a dim of their own, ``kv_heads`` (even when ``n_kv_heads = n_heads``). A layout
that splits ``heads`` and names no rule for ``kv_heads`` splits ``kv_heads`` over the same axes
where ``n_kv_heads`` divides by their size, and otherwise keeps the key/value heads whole on every
device (each device then computes all of them and uses its own query heads' share:
:func:`layout_rules`). A rule for ``kv_heads`` in the layout wins; one whose split does not divide
``n_kv_heads`` is a one-line layout error, as for any dim.

The layer loop, ``remat``, ``attention``, initialisation and the ``checkpoint_name`` tags are the
decoder's, the transformer's too (``mlp_hidden`` is ``silu(gate) · up``, ``[batch, length,
d_ff]``), so the same remat and activation-offload policies apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from flax import nnx

from meshpar.models import decoder, decoder_family, layers, moe_config


@dataclasses.dataclass(frozen=True)
class _LlamaFields:
    name: Literal["llama"] = "llama"  # the family: a Llama-style decoder (GQA, rotary, SwiGLU, RMSNorm)
    d_model: int = dataclasses.field(default=256, metadata={"min": 1})  # "embed"
    n_heads: int = dataclasses.field(default=4, metadata={"min": 1})  # query heads, "heads"
    # Key/value heads, "kv_heads"; must divide n_heads (= n_heads: multi-head, 1: multi-query).
    n_kv_heads: int = dataclasses.field(default=2, metadata={"min": 1})
    d_head: int = dataclasses.field(default=64, metadata={"min": 1})  # "kv"; even (rotary)
    d_ff: int = dataclasses.field(default=768, metadata={"min": 1})  # SwiGLU hidden width, "d_ff"
    n_layers: int = dataclasses.field(default=4, metadata={"min": 1})  # "layers"
    vocab_size: int = dataclasses.field(default=256, metadata={"min": 2})  # "vocab"
    # Longest sequence the model is meant for (rotary positions have no table: a check only).
    max_length: int = dataclasses.field(default=2048, metadata={"min": 1})
    rms_eps: float = dataclasses.field(default=1e-5, metadata={"min": 0.0})  # RMSNorm's epsilon
    rope_theta: float = dataclasses.field(default=10000.0, metadata={"min": 1.0})  # rotary base (Llama 3: 500000)
    # Rotary frequency scaling: none, or llama3 = Llama 3.1's (long wavelengths stretched by
    # rope_factor, short ones kept, smooth between; the wavelength bands are
    # rope_original_max_length / rope_low_freq_factor and / rope_high_freq_factor).
    rope_scaling: Literal["none", "llama3"] = "none"
    rope_factor: float = dataclasses.field(default=8.0, metadata={"min": 1.0})
    rope_low_freq_factor: float = dataclasses.field(default=1.0, metadata={"min": 0.0})
    rope_high_freq_factor: float = dataclasses.field(default=4.0, metadata={"min": 0.0})
    rope_original_max_length: int = dataclasses.field(default=8192, metadata={"min": 1})
    tie_embeddings: bool = False  # logits use the input embedding (unscaled)
    # Dtype the parameters are stored (and the optimizer's moments kept) in, and the dtype the
    # layers compute in. The loss (softmax cross-entropy) is float32 regardless.
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = True  # run the stacked layers with lax.scan (True) or unrolled (False)
    # What each layer keeps for the backward pass (meshpar.models.remat): none = everything;
    # full = only its input, recomputing the layer; dots = its weight matmuls' outputs.
    remat: Literal["none", "full", "dots"] = "none"
    # Attention core (meshpar.models.attention): auto | xla | blockwise | cudnn, as the transformer's.
    attention: Literal["auto", "xla", "blockwise", "cudnn"] = "auto"
    # Key/value positions per block of blockwise attention; must divide the length when smaller.
    attention_block: int = dataclasses.field(default=512, metadata={"min": 1})
    # Layers per iteration of the layer scan; 0 = by backend, as the transformer's.
    scan_unroll: int = dataclasses.field(default=0, metadata={"min": 0})


@dataclasses.dataclass(frozen=True)
class LlamaConfig(moe_config.MoEFields, _LlamaFields):
    """A Llama's ``model`` section: its own fields, then the mixture-of-experts ones."""


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """The rotary angular frequencies ``[d_head / 2]`` of `cfg` (float32, as Hugging Face computes them)."""
    llama3 = None
    if cfg.rope_scaling == "llama3":
        llama3 = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_length)
    return layers.rope_frequencies(cfg.d_head, cfg.rope_theta, llama3)


def switches(cfg: LlamaConfig) -> decoder.DecoderConfig:
    """The decoder a Llama of `cfg` is (its sizes, ``n_kv_heads`` and run settings: the fields of
    the same names)."""
    return decoder.configure(
        cfg,
        mlp="swiglu",
        positions="rotary",
        rope=tuple(float(f) for f in rope_frequencies(cfg)),
        norm_eps=cfg.rms_eps,
        tie_embeddings="scaled_init" if cfg.tie_embeddings else "none",
        dropout=0.0,
    )


def build(cfg: LlamaConfig, element_spec: dict, rngs: nnx.Rngs) -> decoder.Decoder:
    return decoder.build(switches(cfg), element_spec, rngs)


def traits(cfg: LlamaConfig) -> dict[str, Any]:
    """What other code reads of `cfg` (:class:`meshpar.models.Traits`'s keyword arguments): its
    decoder's, each set by the field of the same name (:func:`meshpar.models.decoder_family.traits`)."""
    return decoder_family.traits(switches(cfg), cfg)


def num_params(cfg: LlamaConfig) -> int:
    """Every parameter: embedding, layers, final norm, untied output."""
    return decoder_family.num_params(switches(cfg))


def flops_per_token(cfg: LlamaConfig, length: int) -> float:
    """Training FLOPs per token (:func:`meshpar.models.decoder_family.flops_per_token`) with
    grouped-query attention: ``6 * N + 12 * n_layers * n_heads * d_head * length``, N =
    ``n_layers * (2 * d_model * (n_heads + n_kv_heads) * d_head + 3 * d_model * d_ff) + d_model *
    vocab_size``."""
    return decoder_family.flops_per_token(switches(cfg), length)


def layout_rules(cfg: LlamaConfig, rules: tuple, axis_sizes: Mapping[str, int]) -> tuple:
    """`rules` with ``kv_heads`` following ``heads`` (:func:`meshpar.models.decoder_family.layout_rules`)."""
    return decoder_family.layout_rules(switches(cfg), rules, axis_sizes)

"""Llama-family decoder: the architecture of Llama 2 and 3 (and of Hugging Face's
``LlamaForCausalLM``), in logical dims.

It is the decoder of :mod:`meshpar.models.decoder` with a SwiGLU MLP, grouped-query attention,
rotary positions, RMSNorm, no biases and no dropout. This module is its config and the mapping
of that config onto the decoder's switches (:func:`switches`), its rotary frequencies as Hugging
Face computes them (:func:`rope_frequencies`), and where the key/value heads go under a layout
(:func:`layout_rules`). The architecture, its logical dims and parameters: docs/models.md,
"Llama".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import numpy as np
from flax import nnx

from meshpar.models import contract, decoder, decoder_family, layers, moe_config, run_settings


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


@dataclasses.dataclass(frozen=True)
class LlamaConfig(moe_config.MoEFields, run_settings.RunSettings, _LlamaFields):
    """A Llama's ``model`` section: its own fields, the run settings, then the mixture-of-experts ones."""


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


def traits(cfg: LlamaConfig) -> contract.Traits:
    """What other code reads of `cfg` (:class:`meshpar.models.Traits`): its decoder's, each set
    by the field of the same name (:func:`meshpar.models.decoder_family.traits`)."""
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

"""Decoder-only Transformer language model, after Mesh TensorFlow's ``transformer`` example.

The decoder of :mod:`meshpar.models.decoder` with a GELU MLP (``w_in``, ``w_out``), multi-head
attention, learned or rotary (base 10000) positions, RMSNorm with epsilon 1e-6 (scale only, as
in T5 / Mesh TensorFlow's ``layer_norm`` without bias), dropout, and the output optionally tied to
the input embedding (logits scaled by ``d_model ** -0.5``). This module is its config and the
mapping of that config onto the decoder's switches (:func:`switches`).

Logical dims, one vocabulary for parameters and activations:
``batch, length, embed, heads, kv, d_ff, vocab, layers``. Parameters: embedding
``(vocab, embed)``, learned positions ``(length, embed)``, q/k/v ``(layers, embed, heads, kv)``,
attention output ``(layers, heads, kv, embed)``, MLP ``(layers, embed, d_ff)`` /
``(layers, d_ff, embed)``, norms ``(layers, embed)`` / ``(embed,)``, untied output ``(embed, vocab)``.
The layer loop (``scan_layers``, ``scan_unroll``), ``remat``, the attention core and the
``checkpoint_name`` tags are the decoder's.

Layouts (mesh ``data:4,model:2``), all valid for every tensor of this model:
  * ``batch:data; d_ff:model; heads:model; vocab:model`` — Mesh TensorFlow's data + model;
  * ``batch:data`` — pure data parallel;  ``d_ff:model; heads:model; vocab:model`` — pure model;
  * ``batch:data; embed:model`` — 2-D with ``embed`` split: activations ``[batch, length, embed]``
    split on both mesh axes, every weight split along ``embed``;
  * ``d_ff:model; heads:model; vocab:model; embed:data`` — 2-D weights (each matrix split 8
    ways), batch replicated.
``batch`` and ``embed`` may never share an axis (both are dims of ``[batch, length, embed]``), so
``batch:data; …; embed:data`` raises LayoutError; likewise ``embed`` with ``d_ff``/``heads``/
``vocab`` (they share weight matrices).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
from flax import nnx

from meshpar.models import contract, decoder, decoder_family, moe_config, run_settings

ROPE_BASE = 10000.0  # rotary positions' base (Mesh TensorFlow's)


@dataclasses.dataclass(frozen=True)
class _TransformerFields:
    name: Literal["transformer"] = "transformer"  # the family: a decoder-only Transformer language model
    d_model: int = dataclasses.field(default=256, metadata={"min": 1})  # "embed"
    n_heads: int = dataclasses.field(default=4, metadata={"min": 1})  # "heads"
    d_head: int = dataclasses.field(default=64, metadata={"min": 1})  # "kv"
    d_ff: int = dataclasses.field(default=1024, metadata={"min": 1})  # "d_ff"
    n_layers: int = dataclasses.field(default=4, metadata={"min": 1})  # "layers"
    vocab_size: int = dataclasses.field(default=256, metadata={"min": 2})  # "vocab" (256: bytes)
    # Longest sequence: size of the learned position table; data length must not exceed it.
    max_length: int = dataclasses.field(default=512, metadata={"min": 1})
    # Dropout rate on the embeddings and on each residual branch (training only).
    dropout: float = dataclasses.field(default=0.0, metadata={"min": 0.0})
    # Where positions come in: learned = a table added to the embeddings (max_length rows);
    # rotary = rotations of query and key in every layer (needs an even d_head, no parameters).
    positions: Literal["learned", "rotary"] = "learned"
    tie_embeddings: bool = False  # logits use the input embedding (scaled by d_model**-0.5)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(moe_config.MoEFields, run_settings.RunSettings, _TransformerFields):
    """A transformer's ``model`` section: its own fields, the run settings, then the mixture-of-experts ones."""


def switches(cfg: TransformerConfig) -> decoder.DecoderConfig:
    """The decoder a transformer of `cfg` is (its sizes and run settings: the fields of the same names)."""
    half = cfg.d_head // 2  # rotary frequencies 10000 ** (-i / half), i < half, in float32
    rope = np.float32(ROPE_BASE) ** (-np.arange(half, dtype=np.float32) / np.float32(half))
    return decoder.configure(
        cfg,
        mlp="gelu",
        n_kv_heads=None,
        norm_eps=1e-6,
        rope=tuple(float(f) for f in rope) if cfg.positions == "rotary" else (),
        tie_embeddings="scaled_logits" if cfg.tie_embeddings else "none",
    )


def build(cfg: TransformerConfig, element_spec: dict, rngs: nnx.Rngs) -> decoder.Decoder:
    return decoder.build(switches(cfg), element_spec, rngs)


def traits(cfg: TransformerConfig) -> contract.Traits:
    """What other code reads of `cfg` (:class:`meshpar.models.Traits`): its decoder's, each set
    by the field of the same name (:func:`meshpar.models.decoder_family.traits`)."""
    return decoder_family.traits(switches(cfg), cfg)


def num_params(cfg: TransformerConfig) -> int:
    """Every parameter (:func:`meshpar.models.decoder_family.num_params`)."""
    return decoder_family.num_params(switches(cfg))


def flops_per_token(cfg: TransformerConfig, length: int) -> float:
    """Training FLOPs per token (:func:`meshpar.models.decoder_family.flops_per_token`): ``6 * N + 12 *
    n_layers * n_heads * d_head * length``, N = ``n_layers * (4 * d_model * n_heads * d_head + 2
    * d_model * d_ff) + d_model * vocab_size``."""
    return decoder_family.flops_per_token(switches(cfg), length)

"""What a family built on the decoder (:mod:`meshpar.models.decoder`) shows other code through
its :class:`meshpar.models.Family`: the decoder's sizes and training FLOPs (:func:`num_params`,
:func:`flops_per_token`, :func:`layer_flops`), the dims a layout splits (:func:`split_dims`,
:func:`fsdp_dims`) and the rules it derives (:func:`layout_rules`), its traits (:func:`traits`),
and the family's fields put together (:func:`family_parts`). Each reads a
:class:`meshpar.models.decoder.DecoderConfig`; the transformer and llama families map their
configs onto one and call these.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from meshpar import jaxprs
from meshpar.models import decoder, layers, remat
from meshpar.models.contract import Traits
from meshpar.models.decoder import MLP_PARAMS, DecoderConfig, moe_layers
from meshpar.sharding import layout as layout_lib

# ---------------------------------------------------------------------------------------------
# Sizes and FLOPs


def _layer_weights(cfg: DecoderConfig, moe_layer: bool = False) -> int:
    """The weights one token meets in one layer's matmuls: q and the output (``n_heads`` heads),
    k and v (the key/value heads), the MLP's two or three matrices; in an MoE layer those of
    the ``moe_top_k`` experts it is routed to, and the router."""
    attn = 2 * cfg.d_model * (cfg.n_heads + cfg.kv_heads) * cfg.d_head
    mlp = len(MLP_PARAMS[cfg.mlp]) * cfg.d_model * cfg.d_ff
    return attn + (cfg.moe_top_k * mlp + cfg.d_model * cfg.moe_experts if moe_layer else mlp)


def _moe_flags(cfg: DecoderConfig) -> tuple[bool, ...]:
    """Whether each layer of the stack is an MoE layer (the last of each group of ``moe_every``)."""
    return tuple(bool(cfg.moe_experts) and (i + 1) % cfg.moe_every == 0 for i in range(cfg.n_layers))


def num_params(cfg: DecoderConfig) -> int:
    """Every parameter: embedding, positions (learned: max_length × d_model), layers (every
    expert of an MoE layer, and its router), norms, output."""
    d, v = cfg.d_model, cfg.vocab_size
    pos = cfg.max_length * d if cfg.positions == "learned" else 0
    untied = d * v if cfg.tie_embeddings == "none" else 0
    moe = moe_layers(cfg)
    experts = moe * (cfg.moe_experts - cfg.moe_top_k) * len(MLP_PARAMS[cfg.mlp]) * d * cfg.d_ff  # the idle ones
    weights = sum(_layer_weights(cfg, flag) for flag in _moe_flags(cfg)) + experts
    return v * d + pos + weights + cfg.n_layers * 2 * d + d + untied


def flops_per_token(cfg: DecoderConfig, length: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM (Chowdhery et al. 2022, App. B)
    count::

        6 * N + 12 * n_layers * (n_heads * d_head) * length
        N = n_layers * (2 * d_model * (n_heads + kv_heads) * d_head + m * d_model * d_ff) + d_model * vocab_size

    N counts the weights used in matmuls: q and the output (``n_heads`` heads), k and v (the
    key/value heads: ``n_heads`` of them for multi-head attention), the MLP's ``m`` matrices (2
    for GELU, 3 for SwiGLU), and the output projection (tied or not); the embedding lookup,
    position table and norms do no matmul FLOPs. Attention's QKᵀ and AV (2 matmuls × 2 FLOPs × 3
    for backward) run per *query* head over the full ``length`` (not halved for the causal
    mask), so grouped key/value heads do not shrink them. An MoE layer counts the ``moe_top_k``
    experts a token is routed to (``moe_top_k * m * d_model * d_ff``) and the router
    (``d_model * moe_experts``), not the idle experts nor the capacity's padding.
    """
    n = sum(_layer_weights(cfg, flag) for flag in _moe_flags(cfg)) + cfg.d_model * cfg.vocab_size
    return float(6 * n + 12 * cfg.n_layers * cfg.n_heads * cfg.d_head * length)


def flops_per_example(cfg: DecoderConfig, element_spec: dict) -> float:
    """Training FLOPs of one window: :func:`flops_per_token` × its length."""
    length = layers.window_length(element_spec)
    return flops_per_token(cfg, length) * length


# ---------------------------------------------------------------------------------------------
# What the planner reads (meshpar.models.Family)

# Megatron's split, Mesh TensorFlow's model-parallel layout: attention by (query) heads, with
# grouped key/value heads following where they divide (layout_rules), the MLP by d_ff, the
# output by vocab; embed stays whole, so activations need no gather.
SPLIT_DIMS = ("heads", "d_ff", "vocab")
# Every parameter has an embed dim (norms, projections, embedding, output): FSDP along it alone
# shards every weight once.
FSDP_DIMS = ("embed",)


def split_dims(cfg: DecoderConfig) -> tuple[str, ...]:
    return SPLIT_DIMS


def fsdp_dims(cfg: DecoderConfig, element_spec: dict) -> tuple[str, ...]:
    return FSDP_DIMS


def num_layers(cfg: DecoderConfig) -> int:
    return cfg.n_layers


def layer_flops(cfg: DecoderConfig, element_spec: dict) -> tuple[float, ...]:
    """Training FLOPs of one window in each layer: :func:`flops_per_token`'s per-layer terms
    (the layer's matmul weights and attention's two contractions) × the length."""
    length = layers.window_length(element_spec)
    attention = 12 * cfg.n_heads * cfg.d_head * length
    return tuple(float((6 * _layer_weights(cfg, flag) + attention) * length) for flag in _moe_flags(cfg))


@functools.cache
def recomputed(cfg: DecoderConfig) -> frozenset[str]:
    """The ``checkpoint_name`` tags whose values the backward pass of one layer of `cfg` makes
    again under its remat policy: those its gradient makes more often than without the policy,
    traced on abstract weights and a row of two positions (a dense layer: the experts' MLP
    carries the same tags)."""
    if not remat.policy(cfg.remat).checkpoint:
        return frozenset()
    one = dataclasses.replace(cfg, moe_experts=0, n_layers=1, dropout=0.0)
    sizes = {"embed": cfg.d_model, "heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "kv": cfg.d_head, "d_ff": cfg.d_ff}
    p = {name: jax.ShapeDtypeStruct(tuple(sizes[d] for d in dims), jnp.float32)
         for name, dims in decoder.block_dims(one).items()}  # fmt: skip
    x = jax.ShapeDtypeStruct((1, 2, cfg.d_model), jnp.float32)

    def made(fn: Callable) -> dict[str, int]:  # tag -> how often the gradient computes its value
        jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: fn(p, x, None).sum()))(p, x)
        return jaxprs.tags_made(jaxpr)

    plain = functools.partial(decoder.block, one)
    again = made(remat.checkpointed(plain, cfg.remat, in_scan=True, save=cfg.remat_save))
    once = made(plain)
    return frozenset(t for t, n in again.items() if n > once.get(t, 0))


# Each split sublayer's output, summed over the model axis (Megatron): attention's (heads), the MLP's (d_ff).
SUMMED = {"heads": "out_proj", "d_ff": "mlpwo"}


def activation_all_reduces(cfg: DecoderConfig, element_spec: dict, rows: int, dims: tuple[str, ...]) -> tuple[int, int]:
    """(count, elements each) of the all-reduces over the model axis per step, for `rows` batch
    rows per device with `dims` split over it (Megatron): each split sublayer (attention by
    ``heads``, the MLP by ``d_ff``) sums its output forward and its input's gradient backward,
    and its output once more where the remat policy's backward makes that output again
    (:func:`recomputed`: under ``full`` attention's, which the MLP's recomputed input reads, and
    not the MLP's, which nothing in the backward reads); the ``vocab``-split output sums the
    gradient of its input once. Each is ``[rows, length, embed]``."""
    again = recomputed(cfg)
    split = [d for d in SUMMED if d in dims]
    per_layer = 2 * len(split) + sum(SUMMED[d] in again for d in split)
    count = per_layer * cfg.n_layers + ("vocab" in dims)
    return count, rows * layers.window_length(element_spec) * cfg.d_model


# The decoder's field behind each trait other code reads (meshpar.models.Traits).
TRAIT_FIELDS = {
    "stack_layers": "n_layers", "width": "d_model", "compute_dtype": "compute_dtype", "param_dtype": "param_dtype",
    "remat": "remat", "remat_save": "remat_save", "dropout": "dropout", "max_length": "max_length", "attention": "attention",
    "attention_block": "attention_block", "vocab_size": "vocab_size", "scan_layers": "scan_layers",
    "scan_unroll": "scan_unroll", "experts": "moe_experts", "expert_dispatch": "moe_dispatch",
    "fp8": "fp8", "fp8_scaling": "fp8_scaling", "heads": "n_heads", "context_parallel": "context_parallel",
}  # fmt: skip


def traits(cfg: DecoderConfig, family_cfg: Any) -> Traits:
    """The :class:`meshpar.models.contract.Traits` of decoder `cfg`, made from the family config
    `family_cfg`: each trait the decoder's field of :data:`TRAIT_FIELDS` (the whole stack's
    layers, the embedding's width), set by the family's field of the same name where it has one
    (Llama has no ``dropout``: its decoder's is 0)."""
    keys = {trait: field for trait, field in TRAIT_FIELDS.items() if hasattr(family_cfg, field)}
    return Traits(keys=keys, **{trait: getattr(cfg, field) for trait, field in TRAIT_FIELDS.items()})


def layout_rules(cfg: DecoderConfig, rules: tuple, axis_sizes: Mapping[str, int]) -> tuple:
    """`rules` with ``kv_heads`` (grouped key/value heads) following ``heads`` where the layout
    splits ``heads``, names no rule for ``kv_heads``, and ``n_kv_heads`` divides by the split;
    otherwise the key/value heads stay whole on every device. With experts, also
    ``expert_groups`` (the token groups while they sit with their experts,
    :mod:`meshpar.models.moe`) over the batch's mesh axes less those of ``experts``, unless the
    layout names a rule of its own for it."""
    named = dict(rules)
    if cfg.moe_experts and "expert_groups" not in named and "batch" in named:
        experts = set(layout_lib.mesh_axes(named.get("experts")))
        left = tuple(a for a in layout_lib.mesh_axes(named["batch"]) if a not in experts)
        if left:
            rules = (*rules, ("expert_groups", left[0] if len(left) == 1 else left))
    if cfg.n_kv_heads is None or "kv_heads" in named or "heads" not in named:
        return rules
    axes = named["heads"]
    ways = 1
    for axis in (axes,) if isinstance(axes, str) else axes:
        ways *= axis_sizes.get(axis, 1)
    return (*rules, ("kv_heads", axes)) if cfg.n_kv_heads % ways == 0 else rules


def family_parts(switches: Callable[[Any], DecoderConfig]) -> dict[str, Any]:
    """The fields of a :class:`meshpar.models.Family` (all but ``config`` and ``traits``, see
    :func:`traits`) of a family whose config `switches` maps onto a :class:`DecoderConfig`: the
    model is a :class:`meshpar.models.decoder.Decoder`, every figure the planner reads is this
    module's."""

    def of(fn: Callable) -> Callable:
        return lambda cfg, *args: fn(switches(cfg), *args)

    return {
        "build": of(decoder.build),
        "fields": {"tokens": (1, "iu")},  # [length + 1] token ids; the model cuts inputs and targets on device
        "flops_per_example": of(flops_per_example),
        "tokens_per_example": lambda cfg, spec: layers.window_length(spec),  # predicted tokens: length, of length + 1
        "split_dims": of(split_dims),
        "fsdp_dims": of(fsdp_dims),
        "activation_all_reduces": of(activation_all_reduces),
        "num_layers": of(num_layers),
        "layer_flops": of(layer_flops),
        "activation_names": layers.ACTIVATION_NAMES,
        "checkpoint_names": of(decoder.checkpoint_names),
        "layout_rules": of(layout_rules),
    }

"""The decoder-only language model behind both LM families, :mod:`meshpar.models.transformer`
and :mod:`meshpar.models.llama`: each maps its config onto a :class:`DecoderConfig` (sizes, a
few architecture switches, how to run) and is this module's model from there on.

``inputs [batch, length] → embed (+ learned positions) → n_layers × (RMSNorm → causal
attention → residual; RMSNorm → MLP → residual) → RMSNorm → logits [batch, length, vocab]``.
The switches (``mlp``, ``positions``, ``n_kv_heads``, ``norm_eps``, ``tie_embeddings``,
``dropout``), the parameters and their draws, the layer loop and the ``checkpoint_name`` tags
each layer puts on the values its backward pass reads (what ``remat`` and
``offload.activations`` keep by name) are described in docs/models.md, "The decoder".

Layers are always *stored* stacked (:func:`block_dims`, a leading ``layers`` dim), and
``scan_layers`` only chooses how they are *run* (:func:`meshpar.models.layers.run_layers`). The
attention core is :mod:`meshpar.models.attention`'s (under a length split,
:mod:`meshpar.models.context_parallel`'s); the projections run as 2-D matmuls over
``batch·length`` rows (:func:`meshpar.models.layers.dense`). Generation:
:meth:`Decoder.init_cache` and :meth:`Decoder.decode` (:mod:`meshpar.models.kv_cache`; with
experts :func:`decode_block` and :func:`decode_config`).

Its sizes, FLOPs, layout rules and traits, what the planner reads through a family, are
:mod:`meshpar.models.decoder_family`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from meshpar.models import attention as attention_lib
from meshpar.models import context_parallel, fp8, kv_cache, layers, moe_stats
from meshpar.models import moe as moe_lib
from meshpar.models.layers import DTYPES, dense, ones, param, rms_norm, tag
from meshpar.sharding.layout import constrain, use

EMBED = ("batch", "length", "embed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """One decoder: its sizes, its architecture switches (see the module docstring) and how it runs."""

    d_model: int  # "embed"
    n_heads: int  # query heads, "heads"
    d_head: int  # "kv"
    d_ff: int  # the MLP's hidden width, "d_ff"
    n_layers: int  # "layers"
    vocab_size: int  # "vocab"
    max_length: int  # longest sequence (learned positions: the table's rows)
    mlp: Literal["gelu", "swiglu"]
    positions: Literal["learned", "rotary"]
    rope: tuple[float, ...] = ()  # rotary: the angular frequencies [d_head / 2]
    n_kv_heads: int | None = None  # None: multi-head ("heads"); a number: grouped ("kv_heads")
    norm_eps: float
    tie_embeddings: Literal["none", "scaled_logits", "scaled_init"]
    dropout: float = 0.0
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = True
    remat: str = "none"  # a name of meshpar.models.remat.POLICIES
    remat_save: tuple[str, ...] = ()  # remat custom: the tags kept (checkpoint_names)
    attention: Literal["auto", "xla", "blockwise", "cudnn"] = "auto"
    attention_block: int = 512
    context_parallel: Literal["auto", "all_gather", "ring", "ulysses"] = "auto"  # under a length split
    scan_unroll: int = 0
    fp8: tuple[str, ...] = ()  # the kinds of dot with FP8 operands (meshpar.models.fp8.KINDS)
    fp8_gather: bool = False  # FP8 dots' weights gathered (FSDP) in FP8
    fp8_scaling: Literal["current", "delayed"] = "current"
    fp8_history: int = 1024  # delayed scaling: steps of amax each history keeps
    # Mixture of experts (meshpar.models.moe); 0 experts: every MLP dense.
    moe_experts: int = 0  # "experts" per MoE layer
    moe_top_k: int = 2  # experts each token is routed to
    moe_every: int = 1  # every moe_every-th layer is an MoE layer (the last of each group)
    moe_capacity_factor: float = 1.25  # capacity dispatch: slots per expert over an even share
    moe_group_size: int = 1024  # capacity dispatch: tokens per routing group (at most)
    moe_dispatch: Literal["capacity", "dropless"] = "capacity"
    moe_aux_coef: float = 0.01  # weight of the load-balancing loss in the training loss
    moe_z_coef: float = 0.001  # weight of the router z-loss

    @property
    def kv_dim(self) -> str:
        """The dim of the key/value heads."""
        return "heads" if self.n_kv_heads is None else "kv_heads"

    @property
    def kv_heads(self) -> int:
        """How many key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads


def configure(cfg: Any, **switches: Any) -> DecoderConfig:
    """A :class:`DecoderConfig` of `switches`, its other fields (sizes, how to run) read from the
    fields of family config `cfg` of the same names (a switch given wins over a field of `cfg`)."""
    own = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DecoderConfig) if hasattr(cfg, f.name)}
    return DecoderConfig(**{**own, **switches})


# The tags a layer puts on its values (the names a remat policy may keep, model.remat_save), in
# the order it makes them; MaxText's and Paxml's names on the equivalent values (docs/models.md,
# "Remat policies"). The attention projections' outputs before rotary carry MaxText's fused
# qkv_proj and Paxml's combined_qkv_proj too: the fused projection, run as three matmuls.
QKV_PROJ = ("qkv_proj", "combined_qkv_proj")
ATTENTION_TAGS = ("iteration_input", "decoder_layer_input", "layer_in", "attn_in", *QKV_PROJ, "query_proj",
                  "key_proj", "value_proj", "query", "key", "value", "context", "out_proj", "attn_out",
                  "attn_residual", "mlp_in")  # fmt: skip
MLP_TAGS = {"gelu": ("mlpwi", "mlp_hidden", "mlpwo"), "swiglu": ("mlpwi_0", "mlpwi_1", "mlp_hidden", "mlpwo")}


def checkpoint_names(cfg: DecoderConfig) -> tuple[str, ...]:
    """The ``checkpoint_name`` tags each layer of `cfg` puts on its values (an MoE layer's experts
    tag the dense MLP's names: :mod:`meshpar.models.moe`)."""
    return (*ATTENTION_TAGS, *MLP_TAGS[cfg.mlp])


MLP_PARAMS = {"gelu": ("w_in", "w_out"), "swiglu": ("w_gate", "w_up", "w_down")}
ATTN_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm")  # every layer's, with the MLP's norm


def moe_layers(cfg: DecoderConfig) -> int:
    """The MoE layers: the last of each group of ``moe_every`` (0 for a dense model)."""
    return cfg.n_layers // cfg.moe_every if cfg.moe_experts else 0


def block_params(cfg: DecoderConfig) -> tuple[str, ...]:
    """The names of a layer's parameters (``blocks/<name>``), in the order they are drawn: with
    experts, the dense layers' MLP (when any) and then the MoE layers' (:mod:`meshpar.models.moe`)."""
    dense = MLP_PARAMS[cfg.mlp] if cfg.n_layers > moe_layers(cfg) else ()
    return (*ATTN_PARAMS, *dense, *(moe_lib.param_names(cfg.mlp) if cfg.moe_experts else ()))


def fp8_weights(cfg: DecoderConfig) -> tuple[str, ...]:
    """The block parameters whose dots run in FP8 (``fp8``'s kinds), in :func:`block_params`' order."""
    kinds = {**dict.fromkeys(("wq", "wk", "wv", "wo"), "attention"), **dict.fromkeys(MLP_PARAMS[cfg.mlp], "mlp"),
             **dict.fromkeys(moe_lib.PARAMS[cfg.mlp], "experts")}  # fmt: skip
    return tuple(name for name in block_params(cfg) if kinds.get(name) in cfg.fp8)


def histories(cfg: DecoderConfig) -> tuple[str, ...]:
    """Delayed scaling's amax histories (:class:`meshpar.models.fp8.History`), ``fp8_<weight>``
    for each FP8 weight, stacked as the weight is; none under current scaling."""
    return tuple(fp8.HISTORY_PREFIX + name for name in fp8_weights(cfg)) if cfg.fp8_scaling == "delayed" else ()


def _weight(name: str) -> str:
    """The block parameter a stacked entry belongs to: itself, or a history's weight."""
    return name.removeprefix(fp8.HISTORY_PREFIX)


def stack_size(cfg: DecoderConfig, name: str) -> int:
    """The leading ``layers`` dim of block parameter `name`: every layer's attention, the dense
    layers' MLP, the MoE layers' experts and router."""
    name = _weight(name)
    if name in moe_lib.DIMS:
        return moe_layers(cfg)
    if name in ATTN_PARAMS:
        return cfg.n_layers
    return cfg.n_layers - moe_layers(cfg)


def block_dims(cfg: DecoderConfig) -> dict[str, tuple[str, ...]]:
    """Each block parameter's dims, without the leading ``layers`` of its stack."""
    kv = ("embed", cfg.kv_dim, "kv")
    dims = {
        "attn_norm": ("embed",), "wq": ("embed", "heads", "kv"), "wk": kv, "wv": kv, "wo": ("heads", "kv", "embed"),
        "mlp_norm": ("embed",),
        "w_in": ("embed", "d_ff"), "w_out": ("d_ff", "embed"),
        "w_gate": ("embed", "d_ff"), "w_up": ("embed", "d_ff"), "w_down": ("d_ff", "embed"),
        **moe_lib.DIMS,
    }  # fmt: skip
    return {name: dims[name] for name in block_params(cfg)}


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def block(cfg: DecoderConfig, p: dict[str, jax.Array], x: jax.Array,
          key: jax.Array | None) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:  # fmt: skip
    """One layer on ``x [batch, length, embed]`` in training; `p` holds this layer's (unstacked)
    weights, `key` its dropout key (None: no dropout). With experts, one group of ``moe_every``
    layers (:meth:`Blocks.stacked`), the last an MoE layer, and that layer's statistics
    (:func:`meshpar.models.moe.moe`) besides x."""

    def attend(q, k, v):  # context-parallel where the layout splits length
        return context_parallel.attention(q, k, v, cfg.attention, cfg.attention_block, cfg.context_parallel), None

    if not cfg.moe_experts:
        return layer(cfg, p, x, attend, None, key)[0]
    n = cfg.moe_every
    keys = [None] * n if key is None else list(jax.random.split(key, n))
    stats = None
    for own, k in zip(group_params(cfg, p), keys):  # the group's dense layers, then its MoE layer
        x, _, stats = _layer(cfg, own, x, attend, None, k)
    return x, stats


def group_params(cfg: DecoderConfig, p: dict[str, jax.Array]) -> list[dict[str, jax.Array]]:
    """Each layer's own weights in a group of ``moe_every`` layers whose weights `p` are one
    group's slice of :meth:`Blocks.stacked`: the dense layers' (attention and MLP, ``[i]`` of
    the group), then the MoE layer's (its attention, the router and the experts)."""
    n = cfg.moe_every

    def held(names) -> list[str]:  # the names with their histories, those `p` holds
        return [name for name in (*names, *(f"fp8_{x}" for x in names)) if name in p]

    own = [{name: p[name][i] for name in held((*ATTN_PARAMS, *MLP_PARAMS[cfg.mlp]))} for i in range(n - 1)]
    moe = {
        **{name: p[name][n - 1] for name in held(ATTN_PARAMS)},
        **{name: p[name] for name in held(moe_lib.param_names(cfg.mlp))},
    }
    return [*own, moe]


def decode_block(cfg: DecoderConfig, p: dict[str, jax.Array], x: jax.Array, attends: Sequence[kv_cache.Attend],
                 positions: jax.Array) -> tuple[jax.Array, list[object]]:  # fmt: skip
    """One step of the layer loop in decoding (:func:`meshpar.models.kv_cache.run_layers`): the
    new tokens ``x [batch, steps, embed]`` at `positions` through one layer, or with experts
    through a group of ``moe_every`` layers (:func:`group_params`), layer i attending with
    ``attends[i]``; x and each layer's cache. An MoE layer's statistics are training's (its
    losses and dropped share) and are dropped here."""
    if not cfg.moe_experts:
        x, cache = layer(cfg, p, x, attends[0], positions)
        return x, [cache]
    caches = []
    for own, attend in zip(group_params(cfg, p), attends):
        x, cache, _ = _layer(cfg, own, x, attend, positions, None)
        caches.append(cache)
    return x, caches


def decode_config(cfg: DecoderConfig, steps: int) -> DecoderConfig:
    """`cfg` for a decoding call of `steps` new tokens per row: capacity dispatch routes each
    row's tokens in groups of their own (the largest divisor of `steps` not above
    ``moe_group_size``), so that a row's continuation never depends on the other rows of the
    batch — the padding rows a generator adds among them — and the groups split as the batch
    does. A step of one token is a group of one, which no capacity drops from."""
    if not cfg.moe_experts or cfg.moe_dispatch != "capacity":
        return cfg
    return dataclasses.replace(cfg, moe_group_size=moe_lib.group_size(cfg, steps))


def layer(cfg: DecoderConfig, p: dict[str, jax.Array], x: jax.Array, attend: kv_cache.Attend,
          positions: jax.Array | None = None, key: jax.Array | None = None) -> tuple[jax.Array, object]:  # fmt: skip
    """One layer with its attention core `attend(q, k, v) -> (context, cache)`: the whole window
    in training (:func:`block`, dropout keyed by `key`), the new tokens against the key/value
    cache in decoding, the tokens at `positions` ``[batch, length]`` (None: ``0 .. length - 1``)."""
    return _layer(cfg, p, x, attend, positions, key)[:2]


def _layer(cfg: DecoderConfig, p: dict[str, jax.Array], x: jax.Array, attend: kv_cache.Attend,
           positions: jax.Array | None, key: jax.Array | None) -> tuple[jax.Array, object, dict | None]:  # fmt: skip
    """:func:`layer`, and an MoE layer's statistics as the layer loop carries them (None for a
    dense one; :func:`meshpar.models.moe_stats.factors`): an MoE layer is one whose `p` holds a router."""
    dt, eps, dims = DTYPES[cfg.compute_dtype], cfg.norm_eps, block_dims(cfg)
    k_attn, k_mlp = jax.random.split(key) if key is not None else (None, None)

    def w(name: str, dtype=None) -> jax.Array:  # placed for compute by meshpar.sharding.layout.use
        return use(p[name], dims[name], dtype)

    def mm(h: jax.Array, name: str, kind: str, n: int = 1) -> jax.Array:  # h times weight `name`, a `kind` of dot
        if kind not in cfg.fp8:
            return dense(h, w(name, dt), n)
        history = p.get(f"fp8_{name}")  # delayed scaling's, [3, history]
        history = None if history is None else use(history, fp8.HISTORY_DIMS[1:])
        if cfg.fp8_gather:  # the weight as stored: the FP8 dot gathers its FP8 form
            place = functools.partial(use, dims=dims[name])
            return fp8.dense(h, p[name], dt, n, place, f"{kind}_{name}", history)
        return fp8.dense(h, w(name, dt), dt, n, name=f"{kind}_{name}", history=history)

    heads, kv_heads = ("batch", "length", "heads", "kv"), ("batch", "length", cfg.kv_dim, "kv")
    x = tag(x, "iteration_input", "decoder_layer_input", "layer_in")
    h = checkpoint_name(rms_norm(x, w("attn_norm"), eps), "attn_in")  # [batch, length, embed]
    q = tag(constrain(mm(h, "wq", "attention"), heads), *QKV_PROJ, "query_proj")  # [batch, length, heads, kv]
    k, v = (tag(constrain(mm(h, name, "attention"), kv_heads), *QKV_PROJ, own)
            for name, own in (("wk", "key_proj"), ("wv", "value_proj")))  # fmt: skip
    if cfg.positions == "rotary":
        inv_freq = jnp.asarray(cfg.rope, jnp.float32)  # [kv/2]
        q, k = layers.rotary(q, inv_freq, positions), layers.rotary(k, inv_freq, positions)
    q, k, v = checkpoint_name(q, "query"), checkpoint_name(k, "key"), checkpoint_name(v, "value")
    o, cache = attend(q, k, v)
    o = checkpoint_name(constrain(o, heads), "context")
    attn = tag(mm(o, "wo", "attention", 2), "out_proj", "attn_out")  # [batch, length, embed]
    x = checkpoint_name(constrain(x + dropout(attn, cfg.dropout, k_attn), EMBED), "attn_residual")
    h = checkpoint_name(rms_norm(x, w("mlp_norm"), eps), "mlp_in")
    stats = None
    if "router" in p:
        mlp, stats = moe_lib.moe(cfg, p, h)  # [batch, length, embed]
        stats = moe_stats.factors(stats)
    else:
        if cfg.mlp == "swiglu":
            gate, up = (checkpoint_name(mm(h, n, "mlp"), t) for n, t in (("w_gate", "mlpwi_0"), ("w_up", "mlpwi_1")))
            f, out = jax.nn.silu(gate) * up, "w_down"
        else:
            f, out = jax.nn.gelu(checkpoint_name(mm(h, "w_in", "mlp"), "mlpwi")), "w_out"
        f = checkpoint_name(constrain(f, ("batch", "length", "d_ff")), "mlp_hidden")
        mlp = checkpoint_name(mm(f, out, "mlp"), "mlpwo")  # [batch, length, embed]
    return constrain(x + dropout(mlp, cfg.dropout, k_mlp), EMBED), cache, stats


class Blocks(nnx.Module):
    """All `n_layers` layers, every parameter stacked along a leading ``layers`` dim."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        d, f, pd = cfg.d_model, cfg.d_ff, DTYPES[cfg.param_dtype]
        self.cfg = cfg
        sizes = {"embed": d, "heads": cfg.n_heads, "kv_heads": cfg.kv_heads, "kv": cfg.d_head, "d_ff": f,
                 "experts": cfg.moe_experts}  # fmt: skip
        fan_in = {"wq": d, "wk": d, "wv": d, "wo": cfg.n_heads * cfg.d_head, "w_in": d, "w_out": f,
                  "w_gate": d, "w_up": d, "w_down": f, "router": d, "experts_gate": d, "experts_up": d,
                  "experts_down": f, "experts_in": d, "experts_out": f}  # fmt: skip
        for name, dims in block_dims(cfg).items():
            shape = (stack_size(cfg, name), *(sizes[dim] for dim in dims))
            if name in fan_in:
                setattr(self, name, param(rngs, shape, ("layers", *dims), fan_in[name] ** -0.5, pd))
            else:  # a norm's scale
                setattr(self, name, ones(shape, ("layers", *dims), pd))
        for name in histories(cfg):  # empty histories: scale 1 until the first step's amaxes
            shape = (stack_size(cfg, name), 3, cfg.fp8_history)
            setattr(self, name, fp8.History(jnp.zeros(shape, jnp.float32), dims=fp8.HISTORY_DIMS))

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The stack on ``x [batch, length, embed]``: its output and each MoE layer's statistics,
        each ``[moe layers]`` (none for a dense model; :func:`meshpar.models.moe_stats.finish`),
        the same under a stage axis as without."""
        cfg = self.cfg
        run = functools.partial(layers.run_layers, cfg, functools.partial(block, cfg), self.stacked(), x, key,
                                maxed=histories(cfg))  # fmt: skip
        if not cfg.moe_experts:
            return run(), {}
        moe_stats.check(cfg, x)
        x, values = run(aux=True)
        return x, moe_stats.finish(values)

    def decode(self, x: jax.Array, cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
        """The new tokens ``x [batch, steps, embed]`` through the stack against `cache`
        (:mod:`meshpar.models.kv_cache`): the loop runs over the groups of :meth:`stacked`."""
        cfg = decode_config(self.cfg, x.shape[1])
        group = cfg.moe_every if cfg.moe_experts else 1
        run = functools.partial(decode_block, cfg)
        return kv_cache.run_layers(run, self.stacked(), x, cache, layers.scan_unroll(cfg), group)

    def stacked(self) -> dict[str, jax.Array]:
        """Each block parameter stacked along a leading dim the layer loop runs over: ``[layers,
        ...]``; with experts ``[groups, ...]``, a group of ``moe_every`` layers: attention
        ``[groups, moe_every, ...]``, the dense MLPs ``[groups, moe_every - 1, ...]``, the MoE
        layer's ``[groups, ...]`` (free reshapes of the stored stacks, which a stage axis splits
        into whole groups: the MoE layers' stacks split as the layout's rule for ``layers`` says)."""
        cfg = self.cfg
        stacked = {name: getattr(self, name)[...] for name in (*block_params(cfg), *histories(cfg))}
        if not cfg.moe_experts:
            return stacked  # each [layers, ...]
        groups, n = stacked["router"].shape[0], cfg.moe_every  # the stack's, or one stage's slice of it (traced alone)
        for name, w in stacked.items():
            if _weight(name) not in moe_lib.DIMS:
                stacked[name] = w.reshape(groups, n if _weight(name) in ATTN_PARAMS else n - 1, *w.shape[1:])
        return stacked


def check(cfg: DecoderConfig, length: int) -> str | None:
    """What makes `cfg` unable to run sequences of `length`, or None."""
    if cfg.n_kv_heads is not None and cfg.n_heads % cfg.n_kv_heads:
        return f"n_kv_heads {cfg.n_kv_heads} does not divide n_heads {cfg.n_heads}"
    if cfg.positions == "rotary" and cfg.d_head % 2:
        return f"rotary positions need an even d_head, got {cfg.d_head}"
    if length > cfg.max_length:
        return f"sequence length {length} exceeds max_length {cfg.max_length}"
    if cfg.attention in ("blockwise", "cudnn") and attention_lib.check_block(length, cfg.attention_block):
        return f"attention_block {cfg.attention_block} does not divide the sequence length {length}"
    if not 0.0 <= cfg.dropout < 1.0:
        return f"dropout must be in [0, 1), got {cfg.dropout}"
    problem = fp8.check(cfg.fp8)
    if problem:
        return f"fp8: {problem}"
    return check_moe(cfg)


def check_moe(cfg: DecoderConfig) -> str | None:
    """What makes `cfg`'s experts unable to run (top-k, capacity factor, the MoE layers' spacing), or None."""
    if not cfg.moe_experts:
        return None
    if not 1 <= cfg.moe_top_k <= cfg.moe_experts:
        return f"moe_top_k {cfg.moe_top_k} must be in [1, moe_experts {cfg.moe_experts}]"
    if not cfg.moe_capacity_factor > 0:
        return f"moe_capacity_factor must be > 0, got {cfg.moe_capacity_factor}"
    if cfg.moe_every < 1 or cfg.n_layers % cfg.moe_every:
        return f"moe_every {cfg.moe_every} does not divide n_layers {cfg.n_layers}"
    if "experts" in cfg.fp8 and cfg.moe_dispatch == "dropless":
        return "fp8 experts need moe_dispatch capacity: dropless dispatch's ragged_dot has no FP8 GEMM in XLA"
    return None


class Decoder(nnx.Module):
    """The model of both LM families, for sequences of up to `length` tokens."""

    def __init__(self, cfg: DecoderConfig, length: int, *, rngs: nnx.Rngs):
        problem = check(cfg, length)
        if problem:
            raise ValueError(problem)
        d, v, pd = cfg.d_model, cfg.vocab_size, DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.embed = param(
            rngs, (v, d), ("vocab", "embed"), d**-0.5 if cfg.tie_embeddings == "scaled_init" else 1.0, pd
        )
        if cfg.positions == "learned":
            self.pos = param(rngs, (cfg.max_length, d), ("length", "embed"), 1.0, pd)
        self.blocks = Blocks(cfg, rngs=rngs)
        self.final_norm = ones((d,), ("embed",), pd)
        if cfg.tie_embeddings == "none":
            self.unembed = param(rngs, (d, v), ("embed", "vocab"), d**-0.5, pd)

    def __call__(self, inputs: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """``inputs`` int [batch, length] → logits float32 [batch, length, vocab] (dropout keyed
        by `rngs`, when given)."""
        return self.forward(inputs, rngs)[0]

    def forward(self, inputs: jax.Array, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """:meth:`__call__`'s logits and each MoE layer's statistics (:meth:`Blocks.__call__`)."""
        cfg = self.cfg
        train = rngs is not None and cfg.dropout > 0.0
        k_embed, k_blocks = jax.random.split(rngs.dropout()) if train else (None, None)
        x = self.embedded(inputs)
        if k_embed is not None:
            x = constrain(dropout(x, cfg.dropout, k_embed), EMBED)
        x, stats = self.blocks(x, k_blocks)
        return self.logits(x), stats

    def embedded(self, inputs: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """``inputs`` int [batch, length] (at `positions` [batch, length], or ``0 .. length - 1``)
        → ``[batch, length, embed]`` in the compute dtype, learned positions added."""
        cfg, dt = self.cfg, DTYPES[self.cfg.compute_dtype]
        inputs = constrain(inputs, ("batch", "length"))
        x = jnp.take(use(self.embed[...], ("vocab", "embed"), dt), inputs, axis=0)  # [batch, length, embed]
        if cfg.positions == "learned":
            table = use(self.pos[...], ("length", "embed"), dt)  # [max_length, embed]
            x = x + (table[: inputs.shape[1]][None] if positions is None else jnp.take(table, positions, axis=0))
        return constrain(x, EMBED)

    def logits(self, x: jax.Array) -> jax.Array:
        """The last layer's output ``[batch, length, embed]`` → float32 ``[batch, length, vocab]``."""
        cfg, dt = self.cfg, DTYPES[self.cfg.compute_dtype]
        x = rms_norm(x, use(self.final_norm[...], ("embed",)), cfg.norm_eps)
        if cfg.tie_embeddings == "none":
            logits = x @ use(self.unembed[...], ("embed", "vocab"), dt)
        else:
            logits = jnp.einsum("ble,ve->blv", x, use(self.embed[...], ("vocab", "embed"), dt))
            if cfg.tie_embeddings == "scaled_logits":
                logits = logits * cfg.d_model**-0.5
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))  # [batch, length, vocab]

    def init_cache(self, batch: int, slots: int, start: jax.Array) -> kv_cache.KVCache:
        """An empty key/value cache of `slots` positions (:mod:`meshpar.models.kv_cache`)."""
        cfg = self.cfg
        dt = DTYPES[cfg.compute_dtype]
        return kv_cache.create(cfg.n_layers, batch, slots, cfg.kv_heads, cfg.d_head, dt, start, cfg.kv_dim)

    def decode(self, inputs: jax.Array, cache: kv_cache.KVCache) -> tuple[jax.Array, kv_cache.KVCache]:
        """``inputs`` int [batch, steps] written into `cache` → the next token's logits float32
        ``[batch, vocab]`` and the cache (:mod:`meshpar.models.kv_cache`); no dropout."""
        learned = self.cfg.positions == "learned"
        x = self.embedded(inputs, kv_cache.positions(cache, inputs.shape[1]) if learned else None)
        x, cache = self.blocks.decode(x, cache)
        return self.logits(x[:, -1:])[:, 0], cache

    def loss(self, batch: dict[str, jax.Array], rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy and accuracy (:func:`meshpar.models.layers.next_token_loss`);
        with experts, plus each MoE layer's load-balancing and z-losses times their coefficients,
        and per MoE layer ``moe<layer>_balance``, ``_z`` and ``_dropped`` (and ``cross_entropy``)
        in the metrics."""
        stats: dict[str, jax.Array] = {}

        def logits(inputs: jax.Array) -> jax.Array:
            out, layer_stats = self.forward(inputs, rngs)
            stats.update(layer_stats)
            return out

        loss, metrics = layers.next_token_loss(logits, batch)
        if not self.cfg.moe_experts:
            return loss, metrics
        cfg = self.cfg
        total = loss + cfg.moe_aux_coef * jnp.sum(stats["balance"]) + cfg.moe_z_coef * jnp.sum(stats["z"])
        for i in range(moe_layers(cfg)):
            at = (i + 1) * cfg.moe_every - 1  # the layer's index in the stack
            metrics.update({f"moe{at}_{name}": values[i] for name, values in stats.items()})
        return total, {**metrics, "cross_entropy": loss}


def build(cfg: DecoderConfig, element_spec: dict, rngs: nnx.Rngs) -> Decoder:
    return Decoder(cfg, layers.window_length(element_spec), rngs=rngs)

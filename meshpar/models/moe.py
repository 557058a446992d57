"""The mixture-of-experts MLP of the decoder (:mod:`meshpar.models.decoder`): Mesh TensorFlow's
``moe`` layer, GShard and Switch Transformer with capacity, Mixtral's top-k routing, in logical
dims only.

``h [batch, length, embed]`` → router logits ``[batch, length, experts]`` (float32, weights
``router (embed, experts)``) → softmax over the experts → each token's top ``k`` experts, their
probabilities renormalised over the k (Mixtral); with ``k = 1`` the probability is kept as it
is (Switch), as renormalised it would always be 1 and the router would get no gradient from
the loss → each chosen expert's MLP (SwiGLU: ``experts_gate``, ``experts_up`` ``(experts,
embed, d_ff)``, ``experts_down`` ``(experts, d_ff, embed)``; GELU: ``experts_in``,
``experts_out``) → the outputs summed with those weights.

Dispatch (``moe_dispatch``): ``capacity`` moves tokens by one-hot einsums into ``[groups,
experts, capacity, embed]`` (groups over ``expert_groups``, a rule
:func:`meshpar.models.decoder_family.layout_rules` derives, so XLA moves them by all-to-all
where the experts are split), dropping what exceeds an expert's capacity; ``dropless`` sorts
the assignments by expert and runs each expert's as one ``jax.lax.ragged_dot``, written per
device (a ``shard_map``) where the layout splits ``experts``. Per layer (:func:`moe`): the
Switch load-balancing loss, the ST-MoE router z-loss and the share of assignments dropped.
The rules, the costs and the reports: docs/moe.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from meshpar.models import fp8
from meshpar.models.layers import DTYPES
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import tracing
from meshpar.sharding.layout import constrain, use

# An MoE layer's parameters by MLP kind (besides the router), and every one's dims without the
# leading ``layers`` of its stack.
PARAMS = {"swiglu": ("experts_gate", "experts_up", "experts_down"), "gelu": ("experts_in", "experts_out")}
DIMS = {
    "router": ("embed", "experts"),
    "experts_gate": ("experts", "embed", "d_ff"), "experts_up": ("experts", "embed", "d_ff"),
    "experts_down": ("experts", "d_ff", "embed"),
    "experts_in": ("experts", "embed", "d_ff"), "experts_out": ("experts", "d_ff", "embed"),
}  # fmt: skip

TOKENS = ("batch", None, "embed")  # [groups, group, embed]: groups follow the batch's split
BY_GROUP = ("batch", None, None, "embed")  # [groups, experts, capacity, embed], where the tokens are
BY_EXPERT = ("expert_groups", "experts", None, "embed")  # the same, where the experts are


def param_names(mlp: str) -> tuple[str, ...]:
    """An MoE layer's parameters, in the order they are drawn."""
    return ("router", *PARAMS[mlp])


def capacity(cfg: Any, group: int) -> int:
    """Each expert's slots per group of `group` tokens: ``ceil(capacity_factor · group · k / experts)``."""
    return max(1, math.ceil(cfg.moe_capacity_factor * group * cfg.moe_top_k / cfg.moe_experts))


def _split(dim: str) -> int:
    """How many ways the step's layout splits `dim` where the model is traced at one device's
    shapes (:mod:`meshpar.plan.memory`, whose shapes are already divided by it); 1 otherwise."""
    splits = tracing.current().splits
    return 1 if splits is None else max(splits.get(dim, 1), 1)


def _whole(router: jax.Array) -> jax.Array:
    """The router's weights ``[embed, experts]`` whole, as :func:`use` gathers them: at one
    device's shapes (:func:`_split`) this device's experts' columns stand for every device's."""
    ways = _split("experts")
    return router if ways == 1 else jnp.tile(router, (1, ways))


def _sizes(cfg: Any, router: jax.Array) -> tuple[int, int]:
    """(experts, k) as the whole router's weights ``[embed, experts]`` (:func:`_whole`) give them."""
    experts = router.shape[-1]
    return experts, min(cfg.moe_top_k, experts)


def _to_experts(x: jax.Array) -> jax.Array:
    """At one device's shapes (:func:`_split`), the routed tokens ``[groups, experts, capacity,
    embed]`` placed by the batch's rule (:data:`BY_GROUP`) → this device's share where the
    experts are (:data:`BY_EXPERT`), which the constraint alone gives at global shapes: its
    experts, of the groups of every device that shares the experts' axes with the batch (an
    all-to-all over those axes, a slice over the others)."""
    ways, shared = _split("experts"), max(_split("batch") // _split("expert_groups"), 1)
    if ways == 1:
        return x
    groups, experts, slots, d = x.shape
    x = x.reshape(groups, ways, experts // ways, slots, d)[:, : min(shared, ways)]
    return x.transpose(1, 0, 2, 3, 4).reshape(-1, experts // ways, slots, d)


def _to_groups(x: jax.Array) -> jax.Array:
    """:func:`_to_experts` backwards: this device's experts' outputs → every expert's output of
    this device's groups (an all-to-all over the shared axes, an all-gather over the others)."""
    ways, shared = _split("experts"), max(_split("batch") // _split("expert_groups"), 1)
    if ways == 1:
        return x
    shared = min(shared, ways)
    rows, local, slots, d = x.shape
    x = x.reshape(shared, rows // shared, local, slots, d).transpose(1, 0, 2, 3, 4)
    if ways > shared:
        x = jnp.concatenate([x] * (ways // shared), axis=1)
    return x.reshape(rows // shared, ways * local, slots, d)


def group_size(cfg: Any, tokens: int) -> int:
    """The tokens of one group: the largest divisor of `tokens` not above ``moe_group_size``."""
    size = min(cfg.moe_group_size, tokens)
    while tokens % size:
        size -= 1
    return size


def route(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router logits ``[..., experts]`` (float32) → (probabilities ``[..., experts]``, the top-k
    experts ``[..., k]``, their weights ``[..., k]``: renormalised over the k for k > 1)."""
    probs = jax.nn.softmax(logits, axis=-1)
    top, idx = jax.lax.top_k(probs, k)
    weights = top if k == 1 else top / jnp.sum(top, axis=-1, keepdims=True)
    return probs, idx, weights


def _expert_mlp(cfg: Any, w: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """Each expert's MLP on its own tokens ``x [expert_groups, experts, capacity, embed]``."""
    hidden = ("expert_groups", "experts", None, "d_ff")

    def dot(spec: str, a: jax.Array, name: str) -> jax.Array:
        if "experts" not in cfg.fp8:
            return jnp.einsum(spec, a, w[name])
        place = functools.partial(use, dims=DIMS[name]) if cfg.fp8_gather else fp8.unplaced
        return fp8.einsum(spec, a, w[name], DTYPES[cfg.compute_dtype], place, f"experts_{name}", w.get(f"fp8_{name}"))

    if cfg.mlp == "swiglu":
        gate = checkpoint_name(dot("gecm,emf->gecf", x, "experts_gate"), "mlpwi_0")
        f = jax.nn.silu(gate) * checkpoint_name(dot("gecm,emf->gecf", x, "experts_up"), "mlpwi_1")
        out = "experts_down"
    else:
        f = jax.nn.gelu(checkpoint_name(dot("gecm,emf->gecf", x, "experts_in"), "mlpwi"))
        out = "experts_out"
    f = checkpoint_name(constrain(f, hidden), "mlp_hidden")
    return constrain(checkpoint_name(dot("gecf,efm->gecm", f, out), "mlpwo"), BY_EXPERT)


def dispatch_masks(experts: int, idx: jax.Array, weights: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """The one-hot dispatch ``[groups, group, experts, capacity]`` (1 where a token takes a slot)
    and the combine weights of the same shape, of the top-k experts ``idx`` and their
    ``weights`` ``[groups, group, k]``: every token's first choice is placed before any second
    choice (GShard), each in token order; an assignment past the expert's `slots` is dropped."""
    groups, group, k = idx.shape
    chosen = jax.nn.one_hot(idx, experts, dtype=jnp.int32)  # [groups, group, k, experts]
    by_choice = chosen.transpose(0, 2, 1, 3).reshape(groups, k * group, experts)
    # 0-based arrival order of each assignment at its expert
    order = (jnp.cumsum(by_choice, axis=1) - 1) * by_choice
    order = order.reshape(groups, k, group, experts).transpose(0, 2, 1, 3)
    slot = jnp.sum(order, axis=-1)  # [groups, group, k]: the slot it would take
    in_slot = jax.nn.one_hot(slot, slots, dtype=jnp.float32)  # all zero past the capacity: dropped
    dispatch = jnp.einsum("gske,gskc->gsec", chosen.astype(jnp.float32), in_slot)
    combine = jnp.einsum("gske,gskc,gsk->gsec", chosen.astype(jnp.float32), in_slot, weights)
    return dispatch, combine


def _capacity_mlp(cfg: Any, w: dict[str, jax.Array], h: jax.Array, idx: jax.Array,
                  weights: jax.Array) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Capacity dispatch of ``h [batch, length, embed]``: the output and the share of the
    ``tokens · k`` assignments dropped."""
    batch, length, d = h.shape
    tokens = batch * length
    group = group_size(cfg, tokens * _split("batch"))  # the whole batch's groups (one device's, traced alone)
    group = group if tokens % group == 0 else group_size(cfg, tokens)
    groups, k = tokens // group, idx.shape[-1]
    x = constrain(h.reshape(groups, group, d), TOKENS)  # [groups, group, embed]
    dispatch, combine = dispatch_masks(w["router"].shape[-1], idx.reshape(groups, group, k), weights.reshape(groups, group, k),
                                       capacity(cfg, group))  # fmt: skip
    dispatch = constrain(dispatch, ("batch", None, None, None))  # [groups, group, experts, capacity]
    combine = constrain(combine, ("batch", None, None, None))
    expert_in = constrain(jnp.einsum("gsec,gsm->gecm", dispatch.astype(h.dtype), x), BY_GROUP)
    expert_out = _expert_mlp(cfg, w, _to_experts(constrain(expert_in, BY_EXPERT)))  # all-to-all in and out
    y = jnp.einsum("gsec,gecm->gsm", combine.astype(h.dtype), constrain(_to_groups(expert_out), BY_GROUP))
    dropped = 1.0 - jnp.sum(dispatch) / (tokens * k)
    return constrain(y, TOKENS).reshape(batch, length, d), dropped


def _ragged_dot(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, sizes)``; traced at one device's shapes (the planner's memory
    model, :func:`_split`) as jax lowers it on XLA:CPU and XLA:GPU (``_ragged_dot_general_impl``):
    ``x [m, k]`` copied once per group with the other groups' rows zeroed, ``[groups, m, k]``,
    and one dot over the groups, so that the trace keeps what the compiled program keeps."""
    if tracing.current().splits is None:
        return jax.lax.ragged_dot(x, w, sizes)
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(x.shape[0])
    mask = ((ends - sizes)[:, None] <= rows) & (rows < ends[:, None])  # [groups, m]
    return jnp.einsum("gmk,gkn->mn", jnp.where(mask[..., None], x[None], 0), w)


def _ragged_mlp(cfg: Any, w: dict[str, jax.Array], rows: jax.Array, sizes: jax.Array) -> jax.Array:
    """The experts' MLPs on ``rows [n, embed]`` sorted by expert, ``sizes[e]`` rows each (rows past
    their sum give zeros): one ragged_dot per matrix."""
    if cfg.mlp == "swiglu":
        gate = checkpoint_name(_ragged_dot(rows, w["experts_gate"], sizes), "mlpwi_0")
        f = jax.nn.silu(gate) * checkpoint_name(_ragged_dot(rows, w["experts_up"], sizes), "mlpwi_1")
        out = w["experts_down"]
    else:
        f, out = jax.nn.gelu(checkpoint_name(_ragged_dot(rows, w["experts_in"], sizes), "mlpwi")), w["experts_out"]
    f = checkpoint_name(f, "mlp_hidden")
    return checkpoint_name(_ragged_dot(f, out, sizes), "mlpwo")


def _dropless_block(cfg: Any, w: dict[str, jax.Array], h: jax.Array, idx: jax.Array, weights: jax.Array,
                    experts: int, first: jax.Array | int) -> jax.Array:  # fmt: skip
    """Every assignment of the tokens ``h [tokens, embed]`` (top-k ``idx``, ``weights`` ``[tokens,
    k]``, of `experts` experts) that goes to the experts ``first .. first + E_w − 1`` whose weights
    `w` holds (``E_w`` of them), run and combined: the tokens' outputs from those experts alone.
    Sorted by expert, those experts' assignments are one contiguous run, rolled to the front."""
    k, local = idx.shape[-1], w[PARAMS[cfg.mlp][0]].shape[0]
    flat = idx.reshape(-1)  # [tokens·k] each assignment's expert
    order = jnp.argsort(flat, stable=True)  # assignments by expert, each expert's in token order
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)  # [experts]
    rows = jnp.take(h, order // k, axis=0)  # [tokens·k, embed]
    if local == experts:
        y_sorted = _ragged_mlp(cfg, w, rows, sizes)
    else:
        before = jnp.sum(jnp.where(jnp.arange(experts) < first, sizes, 0))  # the assignments ahead of the run
        mine = jax.lax.dynamic_slice_in_dim(sizes, first, local)
        y_sorted = jnp.roll(_ragged_mlp(cfg, w, jnp.roll(rows, -before, axis=0), mine), before, axis=0)
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(-1, k, h.shape[-1])
    return jnp.einsum("tkm,tk->tm", y, weights.reshape(-1, k).astype(y.dtype))


def _dropless_mlp(cfg: Any, w: dict[str, jax.Array], h: jax.Array, idx: jax.Array, weights: jax.Array) -> jax.Array:
    """Every assignment of ``h [batch, length, embed]`` run: sorted by expert, one ragged_dot per
    matrix. With the experts split (:func:`_dropless_split`), each device runs its own experts."""
    batch, length, d = h.shape
    experts = w["router"].shape[-1]
    layout, mesh = layout_lib.active_layout(), layout_lib.active_mesh()
    staged = bool(jax.sharding.get_abstract_mesh().manual_axes)  # inside a pipeline stage
    at_step = tracing.current().splits is None  # not traced at one device's shapes
    if at_step and layout is not None and mesh is not None and (layout.axis("experts") is not None or not staged):
        return _dropless_split(cfg, w, h, idx, weights, layout, mesh)
    # Traced at one device's shapes with the experts split (meshpar.plan.memory): this device's
    # experts on the tokens it gathers (the experts' axes the batch is split over), its own share back.
    ways, shared = _split("experts"), max(_split("batch") // _split("expert_groups"), 1)
    gathered = min(shared, ways) if ways > 1 else 1
    h, idx, weights = (jnp.concatenate([a] * gathered) for a in (h, idx, weights))
    y = _dropless_block(cfg, w, h.reshape(-1, d), idx, weights, experts, 0)
    return y.reshape(gathered, batch, length, d)[0]


def _dropless_split(cfg: Any, w: dict[str, jax.Array], h: jax.Array, idx: jax.Array, weights: jax.Array,
                    layout: layout_lib.Layout, mesh: jax.sharding.Mesh) -> jax.Array:  # fmt: skip
    """Dropless dispatch per device, in a ``shard_map`` over the mesh, with the experts split over
    the mesh axes X of the layout's ``experts`` rule (none: replicated): each device all-gathers
    the tokens of the devices it shares a batch shard with but for X (the axes of X the batch is
    split over), runs every assignment to its own experts (:func:`_dropless_block`), and the
    devices along X sum their partial outputs, each getting its own tokens' back (a
    reduce-scatter over the gathered axes, an all-reduce over the others). With the experts
    replicated each device sorts and runs its own tokens alone (XLA's partitioner would gather
    the whole batch to sort it). No token is dropped; the outputs are the replicated experts'
    but for the order of the sum over the experts. The weights enter split by ``experts`` only
    (another split of theirs, such as ``d_ff:model``, is gathered at the region's edge)."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        raise layout_lib.LayoutError(
            "model.moe_dispatch dropless with the experts split cannot run inside a pipeline stage (layers:<axis>); "
            "use moe_dispatch capacity there, or replicate the experts"
        )
    experts_axes = layout_lib.mesh_axes(layout.axis("experts"))
    batch_axes = layout_lib.mesh_axes(layout.axis("batch"))
    gathered = tuple(a for a in experts_axes if a in batch_axes)
    summed = tuple(a for a in experts_axes if a not in batch_axes)
    experts, d = w["router"].shape[-1], h.shape[-1]
    names = PARAMS[cfg.mlp]
    tokens = layout.spec(("batch", None, None))
    expert_spec = layout.spec(("experts", None, None))

    def body(h, idx, weights, *ws):
        if gathered:
            h, idx, weights = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (h, idx, weights))
        local = dict(zip(names, ws))
        first = jax.lax.axis_index(experts_axes) * local[names[0]].shape[0] if experts_axes else 0
        y = _dropless_block(cfg, local, h.reshape(-1, d), idx, weights, experts, first).reshape(h.shape)
        if gathered:
            y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
        return jax.lax.psum(y, summed) if summed else y

    return jax.shard_map(
        body, mesh=mesh, in_specs=(tokens, tokens, tokens, *(expert_spec for _ in names)), out_specs=tokens,
    )(h, idx, weights, *(w[name] for name in names))  # fmt: skip


def moe(cfg: Any, p: dict[str, jax.Array], h: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One MoE MLP on the normed ``h [batch, length, embed]`` with this layer's weights `p`
    (:data:`DIMS`): the output ``[batch, length, embed]`` and the layer's ``balance`` (Switch
    load-balancing loss), ``z`` (router z-loss) and ``dropped`` (share of assignments), scalars,
    and the balance loss's factors ``share`` (f_e) and ``probs`` (p_e), ``[experts]`` each."""
    dt = DTYPES[cfg.compute_dtype]
    # The router's weights whole on every device: top-k needs every expert's logit.
    router = _whole(use(p["router"], ("embed", None), jnp.float32))
    logits = constrain(jnp.einsum("blm,me->ble", h.astype(jnp.float32), router), ("batch", "length", None))
    experts, k = _sizes(cfg, router)
    probs, idx, weights = route(logits, k)
    # FP8 experts with fp8_gather: the weights as stored; the FP8 dot gathers their FP8 form.
    gathered_fp8 = "experts" in cfg.fp8 and cfg.fp8_gather
    w = {
        "router": router,
        **{name: p[name] if gathered_fp8 else use(p[name], DIMS[name], dt) for name in PARAMS[cfg.mlp]},
    }
    # Delayed scaling's amax histories of the experts' FP8 dots (meshpar.models.fp8.History), [3, history] each.
    w.update({h: use(p[h], fp8.HISTORY_DIMS[1:]) for h in (f"fp8_{name}" for name in PARAMS[cfg.mlp]) if h in p})
    if cfg.moe_dispatch == "dropless":
        y, dropped = _dropless_mlp(cfg, w, h, idx, weights.astype(dt)), jnp.zeros((), jnp.float32)
    else:
        y, dropped = _capacity_mlp(cfg, w, h, idx, weights)
    share = jnp.mean(jnp.sum(jax.nn.one_hot(idx, experts, dtype=jnp.float32), axis=-2), axis=(0, 1)) / k
    mean_probs = jnp.mean(probs, axis=(0, 1))
    balance = experts * jnp.sum(share * mean_probs)  # f_e carries no gradient: counts
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    stats = {"balance": balance, "z": z, "dropped": dropped, "share": share, "probs": mean_probs}
    return constrain(y.astype(h.dtype), ("batch", "length", "embed")), stats

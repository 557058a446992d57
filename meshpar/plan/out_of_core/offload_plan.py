"""What host offload (the ``offload`` section, :mod:`meshpar.sharding.offload`) moves off the devices,
from the abstract train state and the model's own forward pass at per-device shapes.

* :func:`placement` — which of the state's trees live in pinned host memory: the state
  plan's shardings where they carry ``memory_kind="pinned_host"``, else the config's flags
  (the two must agree).
* :func:`profile` — the model's forward pass traced at one device's shapes of one microbatch
  (every layer under ``jax.checkpoint``, so a layer is one checkpointed call whether the layers
  run in a scan or unrolled): the number of layers, each layer's matmul FLOPs, the FLOPs
  outside the layers, and the bytes of every value a layer tags with ``checkpoint_name``.
* :func:`weights` — one layer's weights (a slice of the stacked ``layers`` parameters) and the
  weights outside the layers, per device, in the parameter layout and in the compute layout.
* :func:`largest_moments` — the optimizer-state leaves of the parameter whose state is largest.

The memory plan (:mod:`meshpar.plan.memory.analytic`) and the cost model (:mod:`meshpar.plan.out_of_core.offload_cost`)
read these; nothing is compiled or allocated.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
from flax import nnx

from meshpar import jaxprs, models
from meshpar.configuration.config import Config, ConfigError
from meshpar.plan import shapes
from meshpar.sharding import offload
from meshpar.step import aot, parts, trainer

# offload.activations → the checkpoint_name tags whose values are saved in host memory (every
# other value of the layer is recomputed in the backward pass), for the built-in families; any
# family's: meshpar.models.Family.kept_activations.
OFFLOADED_NAMES = models.ACTIVATION_NAMES


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the state's trees live between steps, and where activation offload sends residuals."""

    optimizer: bool  # opt_state in pinned host memory
    params: bool  # params in pinned host memory
    activations: str  # offload.activations
    from_shardings: bool  # the state plan's shardings say so (else the config alone)

    @property
    def any(self) -> bool:
        return self.optimizer or self.params or self.activations != "none"


def _on_host(shardings) -> bool | None:
    """True when every leaf's sharding is ``pinned_host``, False when none is, None when the tree is empty."""
    kinds = {getattr(s, "memory_kind", None) for s in jax.tree.leaves(shardings)}
    if not kinds:
        return None
    if kinds == {offload.HOST}:
        return True
    if offload.HOST in kinds:
        raise ConfigError(
            "offload", f"the state plan puts part of a tree in {offload.HOST} and part in {kinds - {offload.HOST}}"
        )
    return False


def placement(cfg: Config, plan: trainer.StatePlan) -> Placement:
    """Where `plan`'s trees live (see the module docstring). A tree whose shardings are
    ``pinned_host`` while its ``offload`` flag is false is a ConfigError: they must agree."""
    offload = getattr(cfg, "offload", None)
    flags = {k: bool(getattr(offload, k, False)) for k in ("optimizer", "params")}
    marked = {"optimizer": _on_host(plan.shardings.opt_state), "params": _on_host(plan.shardings.params)}
    for key, host in marked.items():
        if host and not flags[key]:
            raise ConfigError(f"offload.{key}", f"is false but the state plan places {key} in {offload.HOST}")
    return Placement(
        flags["optimizer"], flags["params"], getattr(offload, "activations", "none"),
        any(marked.values()),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Profile:
    """One device's forward pass of one microbatch (see the module docstring)."""

    layers: int  # checkpointed layer calls, loop trip counts multiplied
    layer_flops: float  # matmul FLOPs of one layer's forward pass
    batched_flops: float  # of which contractions with batch dims (attention's scores and context)
    other_flops: float  # matmul FLOPs outside the layers (embedding lookups are gathers: none)
    named: dict[str, int]  # tag → bytes of that value in one layer
    # each tagged value of the layers: (its tags, its bytes in all layers); a value tagged with
    # several names (meshpar.models.layers.tag) is one value
    values: tuple[tuple[frozenset[str], int], ...] = ()

    def named_bytes(self, names) -> int:
        """Bytes of the values tagged with any of `names`, in one layer (each value once)."""
        if not self.values:
            return sum(self.named.get(n, 0) for n in names)
        return sum(b for tags, b in self.values if tags & set(names)) // max(self.layers, 1)


def profile(step: parts.AbstractStep) -> Profile:
    """The model's forward pass at one device's shapes of one microbatch (see the module docstring)."""
    cfg = step.cfg
    state, batch, _ = step.args
    params = shapes.local_params(state.params, step.layout, step.mesh)
    local = shapes.device_batch(step)
    spec = {k: (tuple(b.shape[1:]), b.dtype) for k, b in batch.items()}
    # Every layer one checkpointed call (a model without a remat setting is traced as it is).
    model = models.with_settings(cfg.model, remat="full")
    graphdef, _ = trainer.abstract_model(functools.partial(step.family.build, model, spec))

    def forward(params, batch):
        return nnx.merge(graphdef, params).loss(batch, rngs=nnx.Rngs(dropout=jax.random.key(0)))[0]

    acc = {"layer": 0.0, "other": 0.0, "batched": 0.0, "layers": 0, "named": collections.Counter()}
    root: dict = {}  # a tag's output -> the value first tagged (a name of a name is one value)
    values: dict = {}  # that value -> [its tags, its bytes × copies]
    for eqn, copies, in_layer in jaxprs.walk(jax.make_jaxpr(forward)(params, local)):
        flops, batched = jaxprs.matmul_flops(eqn)
        acc["layer" if in_layer else "other"] += flops * copies
        acc["batched"] += flops * copies if in_layer and batched else 0
        tag = jaxprs.tag_of(eqn)
        if tag is not None and in_layer:
            acc["named"][tag] += jaxprs.nbytes(eqn.invars[0]) * copies
            first = root[eqn.outvars[0]] = root.get(eqn.invars[0], eqn.invars[0])
            values.setdefault(first, [set(), jaxprs.nbytes(eqn.invars[0]) * copies])[0].add(tag)
        acc["layers"] += copies if jaxprs.is_layer_call(eqn) else 0
    n = max(acc["layers"], 1)
    named = {k: v // n for k, v in acc["named"].items()}
    tagged = tuple((frozenset(tags), b) for tags, b in values.values())
    return Profile(acc["layers"], acc["layer"] / n, acc["batched"] / n, acc["other"], named, tagged)


@dataclasses.dataclass(frozen=True)
class Weights:
    """Per-device weight bytes: one layer's, and those outside the layers; in the parameter
    layout (where they are stored) and in the compute layout (where the layer uses them)."""

    layer: int
    other: int
    layer_compute: int
    other_compute: int


def weights(plan: trainer.StatePlan, layout, mesh) -> Weights:
    """One layer's slice of every stacked parameter (leading dim ``layers``) and the other
    parameters, per device (see :class:`Weights`)."""
    acts = shapes.act_shardings(plan.abstract.params, layout, mesh)
    sums = {"layer": 0.0, "other": 0.0, "layer_compute": 0.0, "other_compute": 0.0}
    variables = jax.tree.leaves(plan.abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for var, own, act in zip(variables, jax.tree.leaves(plan.shardings.params), acts):
        a, dims = var.get_value(), var.get_metadata().get("dims") or ()
        item = a.dtype.itemsize
        stored, used = math.prod(own.shard_shape(a.shape)) * item, math.prod(act.shard_shape(a.shape)) * item
        if dims and dims[0] == "layers":
            sums["layer"] += stored / a.shape[0]
            sums["layer_compute"] += used / a.shape[0]
        else:
            sums["other"] += stored
            sums["other_compute"] += used
    return Weights(**{k: int(v) for k, v in sums.items()})


def largest_moments(plan: trainer.StatePlan) -> int:
    """Per-device bytes of the optimizer-state leaves of one parameter (AdamW: its two moments),
    for the parameter whose state is largest: what an update done leaf by leaf needs on the
    device at once, at least."""

    def paths(tree, shardings):
        leaves = jax.tree_util.tree_leaves_with_path(tree)
        return [
            (jax.tree_util.keystr(p, simple=True, separator="/").removesuffix("/value"), aot.shard_bytes(a, [s]))
            for (p, a), s in zip(leaves, jax.tree.leaves(shardings))
        ]

    params = [p for p, _ in paths(plan.abstract.params, plan.shardings.params)]
    opt = paths(plan.abstract.opt_state, plan.shardings.opt_state)
    per_param = [sum(n for q, n in opt if q.endswith("/" + p)) for p in params]
    return max(per_param, default=0)


def largest_param(plan: trainer.StatePlan) -> int:
    """Per-device bytes of the largest parameter leaf (in the parameter layout)."""
    leaves = jax.tree.leaves(plan.abstract.params)
    return max((aot.shard_bytes(a, [s]) for a, s in zip(leaves, jax.tree.leaves(plan.shardings.params))), default=0)

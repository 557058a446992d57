"""The fixed list of changes the pre-flight tries when a config does not fit, and the search.

A config that does not fit is offered the first change from this list that fits, by the
analytic memory model (:mod:`meshpar.plan.memory`, the same check the config failed):

* ``train.microbatches`` — 2, 4 or 8 times the configured number (each device's rows must
  divide): the saved activations of one microbatch instead of the whole batch;
* ``model.remat=full`` — each layer keeps only its input and is recomputed backwards;
* ``offload.optimizer=true`` — the optimizer state lives in pinned host memory between steps
  and comes to the devices for the update (:mod:`meshpar.offload`);
* ``param_layout`` FSDP — parameters and optimizer state also split over the batch axes of the
  mesh, along the model's embed-like dims: the dims that cover the most parameter bytes, chosen
  greedily from the parameters' own logical dims (the Transformer's ``embed``; the MLP's
  ``pixels``, or ``hidden`` when the layout does not split it), never a dim the layout already
  splits, never two dims of one parameter, never the stacked ``layers``;
* more model-axis splitting — the same devices, with a factor of 2, 4 or 8 moved from the
  (last) batch axis of the mesh to its ``model`` axis (added when the mesh has none), and
  layout rules for the model's split dims: the config's own when they name the model axis, else
  the model family's standard ones (:data:`MODEL_DIMS`).

Every combination of these is a candidate. They are tried in a fixed order: fewer changes
first; among as many changes, the least disruptive, in the order microbatches (no extra
FLOPs, no communication), remat (a third more FLOPs), optimizer offload, ``param_layout``
(weights gathered every step), model-axis splitting (activations communicated every layer),
smaller factors first. Optimizer offload comes after remat and before ``param_layout``: like
microbatches and remat it leaves the layout and the arithmetic as they are (losses are
bit-identical), but it moves the whole optimizer state over the host link and back once per
step, a cost that does not shrink with the batch and that nothing overlaps (the state comes in
after the backward pass, see :mod:`meshpar.plan.offload_cost`); it frees exactly what the other
two cannot touch, the optimizer state. ``param_layout`` frees it too, by gathering weights over
device links every layer of every step and changing the layout every program sees. Parameter
and activation offload are not candidates: their transfers run every layer of every step.
A candidate whose parameters and optimizer state alone (exact, from the shardings) exceed the
usable bytes is passed over without tracing the model, so even an absurd size is settled in
seconds; the others get the full analytic check, and the first that fits is proposed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shlex

import jax
from flax import nnx

from input_pipeline.errors import DataError
from meshpar import aot, trainer
from meshpar import config as config_lib
from meshpar import layout as layout_lib
from meshpar import mesh as mesh_lib
from meshpar.config import Config, ConfigError
from meshpar.plan import memory

# The dims each model family splits over the model axis when the config's layout names none
# (Mesh TensorFlow's Transformer layout; the MLP's Megatron column/row split).
MODEL_DIMS = {"transformer": ("heads", "d_ff", "vocab"), "mlp": ("hidden",)}
MODEL_AXIS = "model"
FACTORS = (2, 4, 8)  # microbatches and model-axis splitting: times the configured amount
# Stacked layers are scanned over: splitting the stack would move whole layers between devices.
NEVER_SPLIT = frozenset({"layers"})
# The config key a kind of change names, most disruptive first: a fix names its first key here.
KEYS = ("mesh", "param_layout", "offload.optimizer", "model.remat", "train.microbatches")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One change to a config: its overrides (``key=value``, in the CLI's form) and the config."""

    changes: tuple[tuple[str, str], ...]  # (key, value) in the order they are applied
    cfg: Config

    @property
    def overrides(self) -> list[str]:
        """The changes as shell-quoted ``key=value`` arguments of ``python -m meshpar.train``."""
        return [shlex.quote(f"{k}={v}") for k, v in self.changes]

    @property
    def key(self) -> str:
        """The config key this change is mainly about (the most disruptive one it makes)."""
        keys = {k for k, _ in self.changes}
        return next(k for k in KEYS if k in keys)

    def __str__(self) -> str:
        return " ".join(self.overrides)


@dataclasses.dataclass(frozen=True)
class Found:
    """The search's outcome: the first candidate that fits (None when none does) with what it
    needs, else the closest one tried and what it needs at least."""

    fit: Candidate | None
    needed: int  # the fit's analytic total; else the closest candidate's
    closest: Candidate | None = None
    at_least: bool = False  # `needed` is a lower bound (parameters + optimizer state only)
    tried: int = 0


def _batch_axes(cfg: Config) -> tuple[str, ...]:
    axes = dict(cfg.layout).get("batch")
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _mesh_str(shape: dict[str, int]) -> str:
    return ",".join(f"{a}:{n}" for a, n in shape.items())


def _model_meshes(cfg: Config, shape: dict[str, int]) -> list[tuple[int, dict[str, int], str]]:
    """(factor, mesh shape, layout rules) for each valid model-axis splitting of `shape`."""
    family = getattr(cfg.model, "name", None)
    donors = [a for a in _batch_axes(cfg) if a != MODEL_AXIS and a in shape]
    if not donors:
        return []
    rules = list(cfg.layout)
    if not any(axes == MODEL_AXIS or (isinstance(axes, tuple) and MODEL_AXIS in axes) for _, axes in rules):
        if family not in MODEL_DIMS:
            return []
        named = {d for d, _ in rules}
        rules += [(d, MODEL_AXIS) for d in MODEL_DIMS[family] if d not in named]
    out = []
    for factor in FACTORS:
        donor = next((a for a in reversed(donors) if shape[a] % factor == 0), None)
        if donor is None:
            continue
        new = dict(shape)
        new[donor] //= factor
        new[MODEL_AXIS] = new.get(MODEL_AXIS, 1) * factor
        out.append((factor, new, layout_lib.format_rules(tuple(rules))))
    return out


def param_dims(abstract_params: nnx.State) -> list[tuple[tuple, tuple, int]]:
    """(dims, shape, bytes) of every parameter that has logical dims."""
    out = []
    for _, var in nnx.to_flat_state(abstract_params):
        dims, a = var.get_metadata().get("dims"), var.get_value()
        if dims is not None:
            out.append((tuple(dims), tuple(a.shape), math.prod(a.shape) * a.dtype.itemsize))
    return out


def fsdp_dims(params: list[tuple[tuple, tuple, int]], split: set[str], ways: int) -> list[str]:
    """The embed-like dims to split parameters over `ways` devices of the batch axes: greedily,
    the dim covering the most bytes of parameters that no chosen dim covers yet, among dims that
    no rule in `split` names, that divide by `ways` wherever they occur, and that share no
    parameter with a dim chosen before."""
    usable = {}
    for dims, shape, _ in params:
        for d, size in zip(dims, shape):
            if d is not None and d not in split and d not in NEVER_SPLIT:
                usable[d] = usable.get(d, True) and size % ways == 0
    chosen: list[str] = []
    while True:
        score: dict[str, int] = {}
        for dims, _, n in params:
            if set(dims) & set(chosen):
                continue
            for d in dims:
                if usable.get(d) and not any(d in other and set(other) & set(chosen) for other, _, _ in params):
                    score[d] = score.get(d, 0) + n
        if not score:
            return chosen
        chosen.append(max(score, key=score.get))  # ties: the first dim met, in parameter order


def candidates(cfg: Config, mesh: jax.sharding.Mesh, abstract_params: nnx.State) -> list[Candidate]:
    """Every candidate change of `cfg` (run on `mesh`), in the order they are tried."""
    shape = dict(mesh.shape)
    batch_axes = _batch_axes(cfg)
    params = param_dims(abstract_params)
    k0 = cfg.train.microbatches
    micro = [None, *(k0 * f for f in FACTORS)]
    remat = [None, *(["full"] if getattr(cfg.model, "remat", "full") != "full" else [])]
    offload = [False, *([True] if not getattr(getattr(cfg, "offload", None), "optimizer", True) else [])]
    meshes = [(1, shape, None), *_model_meshes(cfg, shape)]
    raw = config_lib.to_dict(cfg)
    out = []
    for (factor, mesh_shape, rules), fsdp, off, r, k in itertools.product(meshes, (False, True), offload, remat, micro):
        n = (factor > 1) + fsdp + off + (r is not None) + (k is not None)
        if not n:
            continue
        changes = []
        if factor > 1:
            changes += [("mesh", _mesh_str(mesh_shape))]
            if rules != cfg.layout_str:
                changes += [("layout", rules)]
        if fsdp:
            ways = math.prod(mesh_shape[a] for a in batch_axes if a in mesh_shape)
            split = {d for d, _ in layout_lib.parse_rules(rules or cfg.layout)} | {d for d, _ in cfg.param_layout}
            dims = fsdp_dims(params, split, ways) if ways > 1 else []
            if not dims:
                continue
            axes = batch_axes[0] if len(batch_axes) == 1 else batch_axes
            changes += [("param_layout", layout_lib.format_rules((*cfg.param_layout, *((d, axes) for d in dims))))]
        if off:
            changes += [("offload.optimizer", "true")]
        if r is not None:
            changes += [("model.remat", r)]
        if k is not None:
            changes += [("train.microbatches", str(k))]
        try:
            new = config_lib.from_dict(config_lib.apply_overrides(raw, [f"{a}={b}" for a, b in changes]))
            config_lib.check_batch_size(new, mesh_shape)
        except ConfigError:
            continue  # e.g. microbatches that do not divide each device's rows
        rank = (n, factor, fsdp, off, r is not None, k or 0)
        out.append((rank, Candidate(tuple(changes), new)))
    return [c for _, c in sorted(out, key=lambda x: x[0])]


def _state_bytes(cfg: Config, mesh: jax.sharding.Mesh, abstract_state) -> int:
    """Parameters + optimizer state (+ step, RNG key) on one device under `cfg`'s layout: exact,
    from the shardings alone (optimizer state offloaded to host memory not counted). Raises
    LayoutError when a parameter's split dims do not divide."""
    layout = layout_lib.Layout.create(cfg.layout, dict(mesh.shape), params=cfg.param_layout)
    params_layout = layout.params
    trainer.check_params(abstract_state.params, params_layout)
    shardings = trainer.tree_shardings(abstract_state, params_layout, mesh)
    if getattr(getattr(cfg, "offload", None), "optimizer", False):  # in host memory: not the device's
        abstract_state, shardings = abstract_state.replace(opt_state=()), shardings.replace(opt_state=())
    return sum(
        math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
        for a, s in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(shardings))
    )


def search(cfg: Config, step: aot.AbstractStep, element_spec: dict, usable: int, scale: float = 1.0) -> Found:
    """The first candidate whose analytic total, times `scale`, fits in `usable` bytes per device.

    `step` is the config's own abstract step; `scale` (>= 1) corrects the analytic totals where
    XLA's figures for the config came out higher than the analytic model's."""
    meshes: dict[str, jax.sharding.Mesh] = {}
    best: tuple[int, Candidate, bool] | None = None
    tried = 0
    for cand in candidates(cfg, step.mesh, step.plan.abstract.params):
        tried += 1
        key = cand.cfg.mesh_str
        try:
            mesh = meshes.get(key) or meshes.setdefault(key, mesh_lib.build_mesh(cand.cfg.mesh))
            state = _state_bytes(cand.cfg, mesh, step.plan.abstract)
        except (layout_lib.LayoutError, mesh_lib.MeshError, ConfigError):
            continue
        if state * scale > usable:
            if best is None or state < best[0]:
                best = (state, cand, True)
            continue
        try:
            total = memory.analytic(cand.cfg, aot.abstract_step(cand.cfg, mesh, element_spec)).total
        except (layout_lib.LayoutError, ConfigError, DataError):
            continue
        if total * scale <= usable:
            return Found(cand, int(total * scale), tried=tried)
        if best is None or total < best[0]:
            best = (total, cand, False)
    if best is None:
        return Found(None, 0, tried=tried)
    return Found(None, int(best[0] * scale), best[1], best[2], tried)

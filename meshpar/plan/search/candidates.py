"""The fixed list of changes the pre-flight tries when a config does not fit, and the search.

A config that does not fit is offered the first change from this list that fits, by the
analytic memory model (:mod:`meshpar.plan.memory.analytic`, the same check the config failed):
more microbatches, ``model.remat=full``, ``offload.optimizer=true``, an FSDP ``param_layout``
(:func:`fsdp_param_layout`), more model-axis splitting, and only when nothing else fits a stage
split; their combinations too, fewest changes and least disruptive first. A change that does
not apply to the config is skipped, and recorded with why (:attr:`Found.skipped`).
The spec: docs/search-model.md ("The pre-flight's candidates").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shlex

import jax
from flax import nnx

from input_pipeline.errors import DataError
from meshpar import models
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config, ConfigError
from meshpar.plan import cost
from meshpar.plan.memory import analytic as memory
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import inputs as inputs_lib
from meshpar.step import parts, trainer

# A change that does not apply: the errors building its config and its plan may raise.
ILLEGAL = (ConfigError, layout_lib.LayoutError, mesh_lib.MeshError, DataError)
MODEL_AXIS = "model"
STAGE_AXIS = "stage"  # the mesh axis a proposed pipeline splits the layer stack over (layers:stage)
FACTORS = (2, 4, 8)  # microbatches and model-axis splitting: times the configured amount
# Stacked layers are scanned over: splitting the stack would move whole layers between devices.
NEVER_SPLIT = frozenset({"layers"})
# The config key a kind of change names, most disruptive first: a fix names its first key here.
# The one model change is the remat policy, under the field its family names (model.remat here).
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
        keys: dict[str, str] = {}
        for k, _ in self.changes:  # a model change's first key (the remat policy's, not remat_save's after it)
            keys.setdefault("model.remat" if k.startswith("model.") else k, k)
        return keys[next(k for k in KEYS if k in keys)]

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
    skipped: tuple[tuple[str, str], ...] = ()  # (change, why it does not apply) of each one skipped


def _mesh_str(shape: dict[str, int]) -> str:
    return ",".join(f"{a}:{n}" for a, n in shape.items())


def _model_meshes(cfg: Config, shape: dict[str, int]) -> list[tuple[int, dict[str, int], str]]:
    """(factor, mesh shape, layout rules) for each valid model-axis splitting of `shape`."""
    donors = [a for a in cost.batch_axes(cfg.layout) if a != MODEL_AXIS and a in shape]
    if not donors:
        return []
    rules = list(cfg.layout)
    if not any(axes == MODEL_AXIS or (isinstance(axes, tuple) and MODEL_AXIS in axes) for _, axes in rules):
        family = models.family(cfg.model.name)
        split = family.split_dims(cfg.model) if family.split_dims is not None else ()
        if not split:  # the family names none (or gives no split_dims): no model-axis split to propose
            return []
        named = {d for d, _ in rules}
        rules += [(d, MODEL_AXIS) for d in split if d not in named]
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


def _stage_meshes(cfg: Config, shape: dict[str, int]) -> list[tuple[int, dict[str, int], str]]:
    """(factor, mesh shape, layout rules) for each stage split of `shape` (see docs/search-model.md)."""
    donors = [a for a in cost.batch_axes(cfg.layout) if a in shape and a != STAGE_AXIS]
    layers = models.traits(cfg.model).stack_layers
    if not donors or not layers or STAGE_AXIS in shape:
        return []
    out = []
    for factor in FACTORS:
        donor = next((a for a in reversed(donors) if shape[a] % factor == 0), None)
        if donor is None or layers % factor:
            continue
        new = {STAGE_AXIS: factor, **shape}
        new[donor] //= factor
        out.append((factor, new, layout_lib.format_rules((*cfg.layout, ("layers", STAGE_AXIS)))))
    return out


def param_dims(abstract_params: nnx.State) -> list[tuple[tuple, tuple, int]]:
    """(dims, shape, bytes) of every parameter that has logical dims."""
    out = []
    for _, var in nnx.to_flat_state(abstract_params):
        dims, a = var.get_metadata().get("dims"), var.get_value()
        if dims is not None:
            out.append((tuple(dims), tuple(a.shape), math.prod(a.shape) * a.dtype.itemsize))
    return out


def fsdp_dims(
    params: list[tuple[tuple, tuple, int]],
    split: set[str],
    ways: int,
    order: tuple[str, ...] | None = None,
    busy: set[str] = frozenset(),
) -> list[str]:
    """The dims to split parameters along over `ways` devices of the batch axes: in `order` (a
    family's :attr:`~meshpar.models.Family.fsdp_dims`; None: every parameter dim, by the bytes of
    the parameters it covers, most first, ties in parameter order), each dim that no rule in
    `split` names, that divides by `ways` wherever it occurs, that shares no parameter with a
    dim taken before, and none of whose parameters has a dim in `busy` (dims on those axes
    already). By bytes, this is the greedy choice of the dim covering the most bytes not yet
    covered: a dim that shares no parameter with those taken covers only uncovered ones."""
    usable: dict[str, bool] = {}
    for dims, shape, _ in params:
        for d, size in zip(dims, shape):
            if d is not None and d not in split and d not in NEVER_SPLIT:
                usable[d] = usable.get(d, True) and size % ways == 0 and not (set(dims) - {d}) & set(busy)
    if order is None:
        covered: dict[str, int] = {}
        for dims, _, n in params:
            for d in dict.fromkeys(dims):
                if d is not None:
                    covered[d] = covered.get(d, 0) + n
        order = tuple(sorted(covered, key=lambda d: -covered[d]))  # stable: ties in parameter order
    chosen: list[str] = []
    for d in order:
        if usable.get(d) and not any(d in dims and set(dims) & set(chosen) for dims, _, _ in params):
            chosen.append(d)
    return chosen


def _axis_names(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def fsdp_param_layout(
    cfg: Config,
    element_spec: dict,
    params: list[tuple[tuple, tuple, int]],
    axes: tuple[str, ...],
    sizes: dict[str, int],
    layout=None,
    param_layout=None,
) -> str:
    """The ``param_layout`` rules that add FSDP over mesh `axes` (of a mesh of `sizes`) to
    `param_layout` (default: the config's own) under the activation rules `layout` (default:
    the config's): the family's FSDP dims (:attr:`meshpar.models.Family.fsdp_dims`) taken by
    :func:`fsdp_dims`, a dim whose parameters already have a dim on one of `axes` (by either
    rule set; ``param_layout`` overlays ``layout``) left out. Raises ConfigError on
    ``param_layout`` saying why when no dim can be taken."""
    layout = layout_lib.parse_rules(cfg.layout if layout is None else layout)
    own = layout_lib.parse_rules(cfg.param_layout if param_layout is None else param_layout)
    ways = math.prod(sizes.get(a, 1) for a in axes)
    where = f"over {layout_lib.format_axes(axes[0] if len(axes) == 1 else axes)}" if axes else "without batch axes"
    if ways <= 1:
        raise ConfigError("param_layout", f"FSDP {where}: the batch is split over no axis of more than one device")
    placed = {**dict(layout), **dict(own)}  # a parameter's placement: param_layout over layout
    busy = {d for d, a in placed.items() if set(_axis_names(a)) & set(axes)}
    family = models.family(cfg.model.name)
    order = family.fsdp_dims(cfg.model, element_spec) if family.fsdp_dims is not None else None  # None: by bytes
    dims = fsdp_dims(params, set(placed), ways, order, busy)
    if order is None:  # the order fsdp_dims took, for the reasons below
        order = tuple(dict.fromkeys(d for dims_, _, _ in params for d in dims_ if d is not None))
    if not dims:
        raise ConfigError(
            "param_layout", f"FSDP {where}: {_why_none(params, dict(layout), dict(own), busy, ways, order)}"
        )
    rule = axes[0] if len(axes) == 1 else tuple(axes)
    return layout_lib.format_rules((*own, *((d, rule) for d in dims)))


def _why_none(params, layout: dict, own: dict, busy: set[str], ways: int, order: tuple[str, ...]) -> str:
    """Why none of the family's FSDP dims `order` can be taken, one reason per dim."""
    reasons = []
    for d in order:
        holders = [(dims, shape) for dims, shape, _ in params if d in dims]
        if not holders:
            continue
        if d in own:
            reasons.append(f"{d} is split by param_layout already ({d}:{layout_lib.format_axes(own[d])})")
        elif d in layout:
            reasons.append(f"{d} is split by the layout already ({d}:{layout_lib.format_axes(layout[d])})")
        elif d in NEVER_SPLIT:
            reasons.append(f"{d} is never split")
        elif sharing := sorted({o for dims, _ in holders for o in dims if o in busy and o != d}):
            reasons.append(f"{d} shares parameters with {', '.join(sharing)}, on those axes already")
        else:
            sizes = sorted({s for dims, shape in holders for o, s in zip(dims, shape) if o == d and s % ways})
            reasons.append(f"{d} (size {', '.join(map(str, sizes))}) does not divide {ways} ways")
    if not reasons:
        return f"the model has no parameter dim FSDP may shard (its family's: {', '.join(order) or 'none'})"
    return "; ".join(reasons)


def _combinations(cfg: Config, shape: dict[str, int]) -> itertools.product:
    """Every combination of the changes tried on `cfg` with a mesh of `shape`: (mesh change:
    (factor, mesh shape, layout rules, stage split), FSDP, optimizer offload, the remat policy or
    None, the microbatches or None); the unchanged one among them (see docs/search-model.md)."""
    model = models.traits(cfg.model)  # a remat change: to full, in the field the family names for it
    remat = [None, *(["full"] if model.remat not in (None, "full") and "remat" in model.keys else [])]
    offload = [False, *([True] if not getattr(getattr(cfg, "offload", None), "optimizer", True) else [])]
    micro = [None, *(cfg.train.microbatches * f for f in FACTORS)]
    meshes = [(1, shape, None, False), *((*m, False) for m in _model_meshes(cfg, shape))]
    meshes += [(*m, True) for m in _stage_meshes(cfg, shape)]
    return itertools.product(meshes, (False, True), offload, remat, micro)


def candidates(
    cfg: Config,
    mesh: jax.sharding.Mesh,
    abstract_params: nnx.State,
    element_spec: dict | None = None,
    skipped: list[tuple[str, str]] | None = None,
) -> list[Candidate]:
    """Every candidate change of `cfg` (run on `mesh`), in the order they are tried.
    `element_spec`: the train data's (else from the config); `skipped`: where each change that
    does not apply is recorded as (change, why)."""
    shape = dict(mesh.shape)
    batch_axes = cost.batch_axes(cfg.layout)
    params = param_dims(abstract_params)
    spec = (
        inputs_lib.element_spec(cfg.data, cfg.train.seed, cfg.checkpoint.init_from)
        if element_spec is None
        else element_spec
    )
    skip = skipped.append if skipped is not None else (lambda item: None)
    model = models.traits(cfg.model)
    raw, remat_key = config_lib.to_dict(cfg), model.key("remat")
    unsave = [(model.key("remat_save"), "[]")] if model.remat_save else []  # custom's names go with custom only
    out = []
    for (factor, mesh_shape, rules, staged), fsdp, off, r, k in _combinations(cfg, shape):
        n = (factor > 1) + fsdp + off + (r is not None) + (k is not None)
        if not n or (staged and fsdp):
            continue
        changes = []
        if factor > 1:
            changes += [("mesh", _mesh_str(mesh_shape))]
            if rules != cfg.layout_str:
                changes += [("layout", rules)]
        if fsdp:
            axes = tuple(a for a in batch_axes if a in mesh_shape)
            try:
                changes += [
                    ("param_layout", fsdp_param_layout(cfg, spec, params, axes, mesh_shape, rules or cfg.layout))
                ]
            except ConfigError as e:
                skip((" ".join(f"{a}={b}" for a, b in changes + [("param_layout", "FSDP")]), str(e)))
                continue
        if off:
            changes += [("offload.optimizer", "true")]
        if r is not None:
            changes += [(remat_key, r), *unsave]
        if k is not None:
            changes += [("train.microbatches", str(k))]
        try:
            new = config_lib.from_dict(config_lib.apply_overrides(raw, [f"{a}={b}" for a, b in changes]))
            config_lib.check_batch_size(new, mesh_shape)
        except ConfigError as e:  # e.g. microbatches that do not divide each device's rows
            skip((" ".join(f"{a}={b}" for a, b in changes), str(e)))
            continue
        rank = (staged, n, factor, fsdp, off, r is not None, k or 0)
        out.append((rank, Candidate(tuple(changes), new)))
    return [c for _, c in sorted(out, key=lambda x: x[0])]


def _state_bytes(cfg: Config, mesh: jax.sharding.Mesh, abstract_state) -> int:
    """Parameters + optimizer state (+ step, RNG key) on one device under `cfg`'s layout: exact,
    from the shardings alone (optimizer state offloaded to host memory not counted). Raises
    LayoutError when a parameter's split dims do not divide."""
    params_layout = parts.layout_for(cfg, dict(mesh.shape)).params
    trainer.check_params(abstract_state.params, params_layout)
    shardings = trainer.tree_shardings(abstract_state, params_layout, mesh)
    if getattr(getattr(cfg, "offload", None), "optimizer", False):  # in host memory: not the device's
        abstract_state, shardings = abstract_state.replace(opt_state=()), shardings.replace(opt_state=())
    return sum(
        math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
        for a, s in zip(jax.tree.leaves(abstract_state), jax.tree.leaves(shardings))
    )


def search(step: parts.AbstractStep, usable: int, scale: float = 1.0) -> Found:
    """The first change to the built `step`'s config whose analytic total, times `scale`, fits in
    `usable` bytes per device; `scale` (>= 1) corrects the analytic totals where XLA's figures
    for the config came out higher than the analytic model's."""
    cfg, element_spec = step.cfg, step.element_spec
    meshes: dict[str, jax.sharding.Mesh] = {}
    best: tuple[int, Candidate, bool] | None = None
    tried = 0
    skipped: list[tuple[str, str]] = []
    for cand in candidates(cfg, step.mesh, step.plan.abstract.params, element_spec, skipped):
        tried += 1
        key = cand.cfg.mesh_str
        try:
            mesh = meshes.get(key) or meshes.setdefault(key, mesh_lib.build_mesh(cand.cfg.mesh))
            state = _state_bytes(cand.cfg, mesh, step.plan.abstract)
        except ILLEGAL as e:
            skipped.append((str(cand), str(e)))
            continue
        if state * scale > usable:
            if best is None or state < best[0]:
                best = (state, cand, True)
            continue
        try:
            total = memory.analytic(parts.abstract_step(cand.cfg, mesh, element_spec)).total
        except ILLEGAL as e:
            skipped.append((str(cand), str(e)))
            continue
        if total * scale <= usable:
            return Found(cand, int(total * scale), tried=tried, skipped=tuple(skipped))
        if best is None or total < best[0]:
            best = (total, cand, False)
    if best is None:
        return Found(None, 0, tried=tried, skipped=tuple(skipped))
    return Found(None, int(best[0] * scale), best[1], best[2], tried, tuple(skipped))

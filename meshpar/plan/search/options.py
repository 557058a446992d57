"""The layout search's space: each option (a mesh, the batch's axes, the model split, FSDP, a
stage axis, the experts' axis, the microbatch count), enumerated, written as layout rules and a
config, and one option of each group of duplicates.

What is enumerated, which microbatch counts are tried and which options are duplicates is in
:mod:`meshpar.plan.search.layouts`'s docstring (**Enumerated**, **Microbatches**, **Duplicates**).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from meshpar import models
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config
from meshpar.plan.memory import stage_axis as stages
from meshpar.plan.search import candidates
from meshpar.plan.search.candidates import MODEL_AXIS, STAGE_AXIS
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class Option:
    """One point of the search space: a mesh and how the dims map onto it."""

    mesh: tuple[tuple[str, int], ...]
    batch: tuple[str, ...]  # mesh axes the batch is split over, first major
    model: bool  # the model dims on the model axis
    fsdp: bool  # parameters and optimizer state also split over the batch axes
    added: str | None = None  # a mesh axis the config does not have (left out of the mesh when 1-sized)
    stage: bool = False  # the layer stack over the stage axis (a pipeline); the stage axis carries nothing else
    microbatches: int = 1  # train.microbatches: gradient accumulation's, or the pipeline's
    experts: str | None = None  # a mixture of experts: the mesh axis its experts are split over (None: replicated)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def mesh_str(self) -> str:
        return ",".join(f"{a}:{n}" for a, n in self.mesh if not (a in (self.added, STAGE_AXIS) and n == 1))

    def key(self) -> tuple:
        """What it places where, up to axis names: the axes of more than one device in mesh
        order, each by its size, its place in the batch's axes (-1: none) and whether it
        carries the model dims; neighbours that act as one axis (consecutive batch axes, or
        two idle ones) merged, as the devices are the same row-major either way."""
        sizes = self.sizes
        batch = [a for a in self.batch if sizes[a] > 1]
        merged: list[list] = []
        for a, n in self.mesh:
            if n == 1:
                continue
            role = [
                n,
                batch.index(a) if a in batch else -1,
                self.model and a == MODEL_AXIS,
                self.stage and a == STAGE_AXIS,
                self.experts == a,
            ]
            last = merged[-1] if merged else None
            busy = last and (last[2] or last[3] or last[4] or role[2] or role[3] or role[4])
            if last and not busy and (last[1] == role[1] == -1 or -1 < last[1] == role[1] - 1):
                last[0], last[1] = last[0] * n, role[1]
            else:
                merged.append(role)
        order = sorted(b for _, b, _, _, _ in merged if b >= 0)
        roles = tuple((n, order.index(b) if b >= 0 else -1, m, st, e) for n, b, m, st, e in merged)
        return roles, self.fsdp and len(batch) > 0, self.microbatches

    def oddness(self) -> tuple[int, int]:
        """Rules that split nothing, and the batch on the model axis: the fewer, the plainer."""
        sizes = self.sizes
        ways = math.prod(sizes[a] for a in self.batch)
        empty = sum(sizes[a] == 1 for a in self.batch) + (self.model and sizes.get(MODEL_AXIS, 1) == 1)
        return empty + (self.fsdp and ways == 1), MODEL_AXIS in self.batch


def factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered `k`-tuple of positive integers whose product is `n`."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorisations(n // d, k - 1)]


def enumerate_options(cfg: Config, num_devices: int) -> list[Option]:
    """Every (stage axis, mesh, batch axes, model split, FSDP) choice over `num_devices`,
    duplicates included (a stage axis: see :mod:`meshpar.plan.search.layouts`)."""
    names = [a for a, _ in cfg.mesh if a != STAGE_AXIS]
    added = None
    if len(names) <= 1 and MODEL_AXIS not in names:
        added = MODEL_AXIS
        names.append(MODEL_AXIS)
    out = []
    for s in (1, *stages.stage_sizes(models.traits(cfg.model).stack_layers, num_devices)):
        for shape in factorisations(num_devices // s, len(names)):
            mesh = ((STAGE_AXIS, s), *zip(names, shape)) if s > 1 else tuple(zip(names, shape))
            subsets = [b for r in range(len(names) + 1) for b in itertools.combinations(names, r)]
            splits = (False, True) if MODEL_AXIS in names else (False,)
            for batch, model, fsdp in itertools.product(subsets, splits, (False, True)):
                out.append(Option(mesh, batch, model, fsdp, added, s > 1))
                out += [Option(mesh, batch, model, fsdp, added, s > 1, experts=a) for a in expert_axes(cfg, mesh)]
    return out


def expert_axes(cfg: Config, mesh: tuple[tuple[str, int], ...]) -> list[str]:
    """The mesh axes a mixture of experts' experts may be split over: each of more than one
    device whose size divides the expert count, but the stage axis (none for a dense model)."""
    experts = models.traits(cfg.model).experts
    return [a for a, n in mesh if experts and n > 1 and a != STAGE_AXIS and experts % n == 0]


def model_dims(cfg: Config) -> tuple[str, ...]:
    """The dims a model split puts on the model axis: the config's own, else the family's."""
    own = tuple(d for d, a in cfg.layout if d != "batch" and MODEL_AXIS in (a if isinstance(a, tuple) else (a,)))
    family = models.family(cfg.model.name)
    return own or (family.split_dims(cfg.model) if family.split_dims is not None else ())


def rules(option: Option, dims: tuple[str, ...], params: list, cfg: Config, element_spec: dict) -> tuple[str, str]:
    """The option's (layout, param_layout) rule texts; raises ConfigError when FSDP has no dim to split."""
    batch = option.batch[0] if len(option.batch) == 1 else option.batch
    layout = (("batch", batch),) if option.batch else ()
    layout += tuple((d, MODEL_AXIS) for d in dims) if option.model else ()
    layout += (("layers", STAGE_AXIS),) if option.stage else ()
    layout += (("experts", option.experts),) if option.experts else ()
    param_layout = ""
    if option.fsdp:  # replaces the config's own param_layout
        param_layout = candidates.fsdp_param_layout(cfg, element_spec, params, option.batch, option.sizes, layout, ())
    return layout_lib.format_rules(layout), param_layout


def with_layout(cfg: Config, mesh: str, layout: str, param_layout: str, stage: bool = False,
                microbatches: int | None = None) -> Config:  # fmt: skip
    """`cfg` with its mesh, layout and param_layout replaced (validated as a config is), and its
    ``train.microbatches`` where `microbatches` is given; without a stage axis (`stage`), without
    the pipeline's settings either."""
    raw = config_lib.to_dict(cfg)
    raw.update(mesh=mesh, layout=layout, param_layout=param_layout)
    if microbatches is not None:
        raw["train"] = {**raw["train"], "microbatches": microbatches}
    if not stage and "pipeline" in raw:
        raw["pipeline"] = {**raw["pipeline"], "schedule": "gpipe", "repeats": 1}
    return config_lib.from_dict(raw)


def _same_rules(a, b) -> bool:
    return set(layout_lib.parse_rules(a)) == set(layout_lib.parse_rules(b))


def is_own(cfg: Config, option: Option, new: Config, own_mesh: dict[str, int]) -> bool:
    mesh = {a: n for a, n in option.mesh if not (a in (option.added, STAGE_AXIS) and n == 1)}
    same = _same_rules(new.layout, cfg.layout) and _same_rules(new.param_layout, cfg.param_layout)
    return mesh == own_mesh and same and option.microbatches == cfg.train.microbatches


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(cfg: Config, option: Option, own_choice: tuple) -> list[int]:
    """The ``train.microbatches`` the search plans `option` with, in the order it tries them
    (see :mod:`meshpar.plan.search.layouts`): each count that divides a device's rows; with a stage axis of S
    stages those of at least S (fewer leave most of every tick idle), else the largest; without
    one, ascending (the search keeps the first that fits), and the config's own count on its own
    layout."""
    ways = math.prod(option.sizes[a] for a in option.batch)
    rows = cfg.train.batch_size // ways if cfg.train.batch_size % ways == 0 else 0
    counts = _divisors(rows) if rows else [cfg.train.microbatches]
    if option.stage:
        stages_ = option.sizes[STAGE_AXIS]
        return [k for k in counts if k >= stages_] or counts[-1:]
    if choice(option) == own_choice and cfg.train.microbatches in counts:
        counts = counts[: counts.index(cfg.train.microbatches) + 1]
    return counts


def choice(option: Option) -> tuple:
    """The option as the config's own choice is written: (mesh, batch axes, model split, FSDP,
    stage axis, experts' axis)."""
    mesh = {a: n for a, n in option.mesh if a not in (option.added, STAGE_AXIS) or n > 1}
    return mesh, option.batch, option.model, option.fsdp, option.stage, option.experts


def own_choice_of(cfg: Config, dims: tuple[str, ...], num_devices: int) -> tuple[dict[str, int], tuple]:
    """The config's own mesh, and its choice as :func:`choice` writes an option's."""
    try:
        own_mesh = dict(mesh_lib.resolve(cfg.mesh, num_devices))
    except mesh_lib.MeshError:
        own_mesh = {}
    batch_rule = dict(cfg.layout).get("batch")
    own = (
        own_mesh, (batch_rule,) if isinstance(batch_rule, str) else tuple(batch_rule or ()),
        any(a == MODEL_AXIS for d, a in cfg.layout if d in dims), bool(cfg.param_layout),
        dict(cfg.layout).get("layers") == STAGE_AXIS, dict(cfg.layout).get("experts"),
    )  # fmt: skip
    return own_mesh, own


def distinct(options: list[Option], own_choice: tuple) -> list[Option]:
    """One option of each group of duplicates (:meth:`Option.key`): the config's own, else the plainest."""

    def preference(option: Option) -> tuple:
        return (choice(option) != own_choice, *option.oddness())

    kept: dict[tuple, Option] = {}
    for option in options:
        key = option.key()
        if key not in kept or preference(option) < preference(kept[key]):
            kept[key] = option
    return [o for o in options if kept[o.key()] is o]

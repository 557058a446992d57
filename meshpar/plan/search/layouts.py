"""Layout search: every mesh and layout of a config's devices that is legal and fits, ranked by
predicted step time on a topology.

Meshes, layouts and microbatch counts are enumerated and deduplicated; each is built as a run
builds it (what fails is dropped, counted by the key it fails on) and checked by the analytic
memory plan; the rest are ranked by an analytic estimate (:mod:`meshpar.plan.search.estimates`),
and the best :data:`TOP_K` compiled and ranked again by the HLO-based model
(:func:`meshpar.plan.time.timing.predict`), predictions within :data:`TIE` of each other a tie
broken by fewer collective bytes. With `fp8` kinds (``--weigh-fp8``) each of those layouts is
also compiled with FP8 dots of those kinds and ranked beside its own precision's. The spec:
docs/search-model.md.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import time

import jax

from input_pipeline.errors import DataError
from meshpar import models
from meshpar.backend import compile_cache
from meshpar.configuration import config as config_lib
from meshpar.configuration.config import Config, ConfigError
from meshpar.plan import cost, gpu_target
from meshpar.plan.memory import analytic as memory
from meshpar.plan.report import fmt_bytes
from meshpar.plan.search import candidates, estimates
from meshpar.plan.search import options as options_lib
from meshpar.plan.time import timing
from meshpar.sharding import layout as layout_lib
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import aot, parts, trainer
from meshpar.step import inputs as inputs_lib

MODEL_AXIS = candidates.MODEL_AXIS
TOP_K = 5
# Predicted step times closer than this share are a tie: measured step times of the top layouts
# differ by a few percent and swap places from run to run on a shared host (docs/search-model.md).
TIE = 0.05


# ---------------------------------------------------------------------------------------------
# The search


@dataclasses.dataclass(eq=False)
class Row:
    """A legal candidate: its config, its plan, memory and time."""

    option: options_lib.Option
    cfg: Config
    step: parts.AbstractStep = dataclasses.field(repr=False)
    memory_bytes: int  # analytic total per device
    estimate: estimates.Estimate
    fits: bool
    own: bool = False  # the config's own mesh and layout
    predicted: timing.StepTime | None = None  # the HLO-based model, when compiled
    xla_bytes: int | None = None  # XLA's total for the compiled train step
    compile_s: float = 0.0
    compiled: object = dataclasses.field(default=None, repr=False)  # the train step, when compiled
    replaces_param_layout: bool = False  # the config has a param_layout of its own
    given_microbatches: int = 1  # the config's own train.microbatches
    given_fp8: tuple[str, ...] = ()  # the config's own model.fp8

    @property
    def option_key(self) -> tuple:
        """Its layout's key, whatever its microbatch count (:meth:`meshpar.plan.search.options.Option.key`)."""
        return dataclasses.replace(self.option, microbatches=1).key()

    @property
    def step_s(self) -> float:
        """The predicted step time: the HLO model's where compiled (with unified memory's paging,
        which no HLO holds), else the estimate."""
        if self.predicted is not None:
            return self.predicted.total_s + self.estimate.paging_s
        return self.estimate.total_s

    @property
    def overrides(self) -> list[str]:
        """The choice as shell-quoted ``key=value`` arguments of ``python -m meshpar.train``."""
        pairs = [("mesh", self.cfg.mesh_str), ("layout", self.cfg.layout_str)]
        if self.cfg.param_layout or self.replaces_param_layout:
            pairs.append(("param_layout", layout_lib.format_rules(self.cfg.param_layout)))
        if self.cfg.train.microbatches != self.given_microbatches:
            pairs.append(("train.microbatches", str(self.cfg.train.microbatches)))
        if self.fp8 != self.given_fp8:
            pairs.append((models.traits(self.cfg.model).key("fp8"), f"[{','.join(self.fp8)}]"))
        return [shlex.quote(f"{k}={v or '{}'}") for k, v in pairs]

    @property
    def fp8(self) -> tuple[str, ...]:
        """The kinds of dot its model runs in FP8 (``model.fp8``)."""
        return tuple(models.traits(self.cfg.model).fp8)


@dataclasses.dataclass
class Result:
    """The search's outcome: the ranked rows (fitting ones first) and its counts."""

    rows: list[Row]
    topology: object
    capacity: cost.Capacity
    num_devices: int
    enumerated: int
    duplicates: int
    illegal: dict[str, int]  # by the config key it fails on
    compiled: int
    seconds: float
    compiled_for: str = "cpu"  # what the best K were compiled for (a GPU machine's own compiler, or this host)
    note: str = ""  # why a GPU machine's best K were compiled for this host instead
    # What the search cannot give for the model's family, one line each (meshpar.models.missing).
    missing: list[str] = dataclasses.field(default_factory=list)

    @property
    def legal(self) -> int:
        return len(self.rows)

    @property
    def fitting(self) -> int:
        return sum(r.fits for r in self.rows)

    @property
    def best(self) -> Row | None:
        return self.rows[0] if self.rows and self.rows[0].fits else None


def rank_compiled(rows: list[Row]) -> list[Row]:
    """Compiled rows by predicted step time; those within TIE of the fastest by collective bytes."""
    rows = sorted(rows, key=lambda r: r.step_s)
    if not rows:
        return rows
    tied = [r for r in rows if r.step_s <= rows[0].step_s * (1 + TIE)]
    tied.sort(key=lambda r: (sum(c.bytes for c in r.predicted.collectives), r.step_s))
    return tied + rows[len(tied) :]


@dataclasses.dataclass
class _Planner:
    """Plans options of one config on one machine: each at its microbatch counts, legal or not
    (counted by the key they fail on), its memory, fit and estimate."""

    cfg: Config
    topo: object
    spec: dict
    dims: tuple[str, ...]
    params: list
    own_mesh: dict[str, int]
    own_choice: tuple
    illegal: dict[str, int] = dataclasses.field(default_factory=dict)
    meshes: dict[str, jax.sharding.Mesh] = dataclasses.field(default_factory=dict)
    cap: cost.Capacity | None = None
    kernels: int | None = None  # one pass's (estimates.pass_kernels): the same for every layout, counted once

    def _fail(self, key: str) -> None:
        self.illegal[key] = self.illegal.get(key, 0) + 1

    def row(self, option: options_lib.Option, new: Config) -> Row:
        """`option` planned as the config `new`; raises what makes it illegal."""
        mesh = self.meshes.get(new.mesh_str) or self.meshes.setdefault(new.mesh_str, mesh_lib.build_mesh(new.mesh))
        step = parts.abstract_step(new, mesh, self.spec)
        breakdown = memory.analytic(step)
        self.cap = self.cap or cost.machine_capacity(self.cfg, self.topo, mesh)
        if self.kernels is None:
            self.kernels = estimates.pass_kernels(step)
        est = estimates.estimate(step, option, breakdown, self.topo, self.dims, self.kernels)
        if self.cap.migrated(breakdown.total):  # unified memory: the bytes beyond the device page each step
            est = dataclasses.replace(est, paging_s=estimates.paging(step, breakdown, self.topo, self.cap))
        own = options_lib.is_own(self.cfg, option, new, self.own_mesh)
        return Row(option, new, step, breakdown.total, est, breakdown.total <= self.cap.usable_bytes, own,
                   replaces_param_layout=bool(self.cfg.param_layout),
                   given_microbatches=self.cfg.train.microbatches,
                   given_fp8=tuple(models.traits(self.cfg.model).fp8))  # fmt: skip

    def in_fp8(self, row: Row, kinds: tuple[str, ...]) -> Row:
        """`row`'s layout with FP8 dots of `kinds` (``model.fp8``), planned as any row is."""
        key = models.traits(row.cfg.model).key("fp8")
        new = config_lib.from_dict(
            config_lib.apply_overrides(config_lib.to_dict(row.cfg), [f"{key}=[{','.join(kinds)}]"])
        )
        return dataclasses.replace(self.row(row.option, new), own=False)

    def rows(self, option: options_lib.Option) -> list[Row]:
        """The rows `option` gives (see docs/search-model.md): with a stage axis one per count;
        without, the fewest microbatches that fit (and the config's own count on its own layout),
        or where none fits the one with the fewest bytes."""
        cfg = self.cfg
        try:
            layout, param_layout = options_lib.rules(option, self.dims, self.params, cfg, self.spec)
        except ConfigError as e:
            self._fail(e.key)
            return []
        counts = options_lib.microbatch_counts(cfg, option, self.own_choice)
        own_layout = options_lib.choice(option) == self.own_choice
        out: list[Row] = []
        last, least, found = None, None, False
        for k in counts:
            try:
                new = options_lib.with_layout(cfg, option.mesh_str, layout, param_layout, option.stage, k)
                row = self.row(dataclasses.replace(option, microbatches=k), new)
            except (ConfigError, DataError, layout_lib.LayoutError, mesh_lib.MeshError) as e:
                key = getattr(e, "key", None) or (
                    "layout" if isinstance(e, layout_lib.LayoutError) else type(e).__name__
                )
                self._fail(key)
                if key == "train.microbatches":
                    continue
                break  # the layout itself is illegal, whatever the microbatches
            if option.stage or row.own or (row.fits and not found):
                out.append(row)
            found = found or row.fits
            # from 2 microbatches on (the first adds the float32 running sum) more only save bytes
            # while the activations of one microbatch are still worth halving
            falls = last is None or last.cfg.train.microbatches == 1 or row.memory_bytes < last.memory_bytes
            least = row if least is None or row.memory_bytes < least.memory_bytes else least
            last = row
            if not option.stage and ((found and k >= counts[-1 if own_layout else 0]) or not falls):
                break  # gradient accumulation: the fewest microbatches that fit, or no more bytes saved
        if not (option.stage or found) and least is not None and all(least is not r for r in out):
            out.append(least)  # nothing fits: its fewest bytes, as its one row
        return out


def best_layouts(fitting: list[Row], top: int) -> list[Row]:
    """The `top` best estimates of distinct layouts, each at its best-estimated microbatch count:
    K counts of one layout would leave the others unread (and many microbatches compile slowest)."""
    layouts: set[tuple] = set()
    picked = []
    for row in sorted(fitting, key=lambda r: r.estimate.total_s):
        if len(picked) < top and row.option_key not in layouts:
            layouts.add(row.option_key)
            picked.append(row)
    return picked


def compile_row(row: Row, target: gpu_target.Target, topo, spec: dict, cap: cost.Capacity) -> None:
    """Compile `row`'s step ahead of time for `target` and rank it by the HLO model: its
    prediction, XLA's bytes, and whether it still fits with them."""
    t = time.perf_counter()
    if target.compile_only:  # the same mesh and layout over the GPU's compile-only devices
        on_target = mesh_lib.build_mesh(row.cfg.mesh, target.devices[: row.step.mesh.size])
        row.step = parts.abstract_step(row.cfg, on_target, spec)
    with compile_cache.suspended(target.compile_only):
        row.compiled = row.step.compile()  # with the config's XLA flags, as the run compiles it
    row.compile_s = time.perf_counter() - t
    row.predicted = timing.predict(row.step, row.compiled, topo, row.estimate.feed_s)
    row.xla_bytes = aot.memory(row.compiled)["total_bytes"]
    row.fits = max(row.xla_bytes, row.memory_bytes) <= cap.usable_bytes


def search(cfg: Config, topo, num_devices: int, top: int = TOP_K, progress=None, fp8: tuple[str, ...] = ()) -> Result:
    """Enumerate, drop illegal and duplicate choices and those that do not fit, estimate, compile
    the `top` best estimates and rank (see docs/search-model.md). `progress(text)`: called as
    it goes. On a GPU machine with XLA's GPU compiler installed the best estimates are compiled
    for that GPU (:mod:`meshpar.plan.gpu_target`): the enumeration and the estimates read the
    model on this host's devices (nothing compiled), the compiled ranking reads the GPU's program.
    `fp8`: kinds of dot (``model.fp8``) each compiled layout is also compiled and ranked with."""
    started = time.perf_counter()
    say = progress or (lambda text: None)
    try:
        mesh_lib.request_cpu_devices(num_devices)
    except RuntimeError:
        pass  # the backend is up already; build_mesh names a shortfall
    compile_cache.configure(cfg.compile_cache)  # as a run would: a rerun's compiles are cached
    spec = inputs_lib.element_spec(cfg.data, cfg.train.seed, cfg.checkpoint.init_from)
    family = models.family(cfg.model.name)
    _, abstract_params = trainer.abstract_model(functools.partial(family.build, cfg.model, spec))
    dims = options_lib.model_dims(cfg)
    options = options_lib.enumerate_options(cfg, num_devices)
    own_mesh, own_choice = options_lib.own_choice_of(cfg, dims, num_devices)
    kept = options_lib.distinct(options, own_choice)
    planner = _Planner(cfg, topo, spec, dims, candidates.param_dims(abstract_params), own_mesh, own_choice)
    rows: list[Row] = []
    for i, option in enumerate(kept):
        say(f"planning {i + 1}/{len(kept)}: {option.mesh_str}")
        rows += planner.rows(option)
    # nothing legal: the capacity of these devices, for the report
    cap = planner.cap or cost.machine_capacity(cfg, topo, mesh_lib.build_mesh((("devices", num_devices),)))
    picked = best_layouts([r for r in rows if r.fits], top)
    target = gpu_target.target(topo, ((MODEL_AXIS, num_devices),))
    picked += [planner.in_fp8(row, fp8) for row in picked if fp8 and row.fp8 != fp8]
    for i, row in enumerate(picked):
        say(f"compiling {i + 1}/{len(picked)}: {row.cfg.mesh_str} {row.cfg.layout_str}")
        compile_row(row, target, topo, spec, cap)
    rest = sorted((r for r in rows if r.fits and all(r is not p for p in picked)), key=lambda r: r.estimate.total_s)
    ranked = rank_compiled([r for r in picked if r.fits]) + rest
    ranked += sorted((r for r in rows if not r.fits), key=lambda r: r.memory_bytes)
    return Result(
        ranked, topo, cap, num_devices, len(options), len(options) - len(kept), planner.illegal, len(picked),
        time.perf_counter() - started, target.compiled_for or "cpu", target.note, search_missing(cfg, dims),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Output


def search_missing(cfg: Config, dims: tuple[str, ...]) -> list[str]:
    """What the search cannot give for the config's family, one line each: the model parts of
    :func:`meshpar.models.missing` it reads (FLOPs, split dims, activation all-reduces, FSDP
    dims), the split dims only where the config's layout names none on ``model``."""
    lines = []
    for m in models.missing(cfg.model.name):
        if m["part"] == "activation_names":
            continue
        if (m["part"] == "split_dims" and dims) or (m["part"] == "activation_all_reduces" and not dims):
            continue
        if m["part"] == "split_dims":
            lines.append(f"search: no model-axis candidates (family {cfg.model.name} gives no split_dims, and the "
                         "config's layout puts no dim on model)")  # fmt: skip
        else:
            lines.append(m["line"])
    return lines


def summary(result: Result) -> str:
    """The counts and the time the search took, in one line."""
    why = ", ".join(f"{k} {n}" for k, n in sorted(result.illegal.items()))
    illegal = sum(result.illegal.values())
    return (
        f"{result.enumerated} enumerated on {result.num_devices} devices ({result.duplicates} duplicates of another), "
        f"{illegal} illegal{f' ({why})' if why else ''}, {result.legal} legal, {result.fitting} fit in "
        f"{fmt_bytes(result.capacity.usable_bytes)} usable ({result.capacity.source}), {result.compiled} compiled; "
        f"search took {result.seconds:.1f} s"
    )


def to_json(result: Result) -> dict:
    """The search as plain JSON data: counts, capacity and every legal row in ranked order."""
    rows = []
    for r in result.rows:
        rows.append({
            "mesh": r.cfg.mesh_str, "layout": r.cfg.layout_str,
            "param_layout": layout_lib.format_rules(r.cfg.param_layout), "microbatches": r.cfg.train.microbatches,
            "own": r.own, "fits": r.fits, "fp8": list(r.fp8),
            "step_s": r.step_s, "memory_bytes": r.memory_bytes, "xla_bytes": r.xla_bytes,
            "estimate": {**dataclasses.asdict(r.estimate), "total_s": r.estimate.total_s},
            "predicted": r.predicted and timing.to_json(r.predicted), "compile_s": r.compile_s,
        })  # fmt: skip
    return {
        "topology": result.topology.name, "compiled_for": result.compiled_for, "num_devices": result.num_devices,
        "enumerated": result.enumerated,
        "duplicates": result.duplicates, "illegal": result.illegal, "legal": result.legal, "fitting": result.fitting,
        "compiled": result.compiled, "seconds": result.seconds, "usable_bytes": result.capacity.usable_bytes,
        "capacity_source": result.capacity.source, "rows": rows, "missing": result.missing,
    }  # fmt: skip

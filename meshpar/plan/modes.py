"""The plan command's modes, one function each: the default plan (memory, and with a machine
its time and offload comparison), the layout search, the out-of-core comparison and routed vs
direct feeding. The command (:mod:`meshpar.plan.__main__`) parses the flags and dispatches here."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shlex

from rich.console import Console

from meshpar import models
from meshpar.backend import compile_cache
from meshpar.configuration import errors
from meshpar.configuration.config import ConfigError
from meshpar.plan import cluster, cost, fp8_check, gpu_target, topology
from meshpar.plan import report as report_lib
from meshpar.plan.out_of_core import comparison as out_of_core
from meshpar.plan.pricing import Priced, price
from meshpar.plan.search import layouts as search_lib
from meshpar.plan.search import search_report
from meshpar.plan.time import feed_time, time_report, timing
from meshpar.sharding import mesh as mesh_lib
from meshpar.step import parts, programs


def machine(cfg, name: str, nodes: int | None = None, network: str | None = None):
    """The named machine, as `nodes` of it on `network` when `nodes` is given
    (:func:`meshpar.plan.cluster.machine`); for ``cpu-sim``, this host measured over the
    config's mesh's devices (started first, as a run would start them). A model with FP8 dots
    on a GPU without FP8 tensor cores is refused here (:func:`meshpar.plan.fp8_check.refuse`)."""
    if name == topology.CPU_SIM and nodes is None and network is None:
        return topology.load(name, devices=parts.make_mesh(cfg).size)
    topo = cluster.machine(name, nodes, network)
    fp8_check.refuse_machine(cfg, topo)
    if nodes is not None:  # a multi-process run's mesh takes every device of every node
        axes = mesh_lib.parse_mesh(cfg.mesh) if isinstance(cfg.mesh, str) else tuple(cfg.mesh)
        try:
            size = math.prod(n for _, n in mesh_lib.resolve(axes, topo.num_devices))
        except mesh_lib.MeshError as e:
            raise ConfigError("--nodes", f"{nodes} nodes of {name}: {e}") from None
        if size != topo.num_devices:
            raise ConfigError("--nodes", f"{nodes} nodes of {name} are {topo.num_devices} devices; the config's mesh "
                                         f"takes {size} (a run of one process per node uses every device)")  # fmt: skip
    return topo


def write(path: str, text: str) -> None:
    try:
        pathlib.Path(path).write_text(text)
    except OSError as e:
        raise errors.OutputError(f"cannot write {path}: {e.strerror}") from None


def compare_feeding(cfg, topo, png: str | None) -> int:
    """Print (and draw) routed vs direct placement for batch sizes 1 MiB … 1 GiB on `topo`."""

    split = cost.config_split(cfg, topo)
    rows = feed_time.compare(topo, split.num_devices, split.shards, split.fields)
    console = Console(width=max(Console().width, 120))
    if png:
        try:
            time_report.feeding_png(rows, topo, split, png)
        except ImportError:  # the table does not need matplotlib; only the plot does
            console.print(f"plot: skipped: matplotlib is not installed ({png} not written)")
            png = None
        except OSError as e:
            raise errors.OutputError(f"cannot write {png}: {e.strerror}") from None
    console.print(time_report.feeding_table(rows, topo, split))
    own = feed_time.compare(topo, split.num_devices, split.shards, split.fields, sizes=(split.batch_bytes,))[0]
    console.print(
        f"this config's batch ({report_lib.fmt_bytes(split.batch_bytes)}, feed.mode={cfg.feed.mode}): "
        f"direct {time_report.fmt_seconds(own.direct_s)}, routed {time_report.fmt_seconds(own.routed_s)} "
        f"({own.ratio:.2f}x)" + (f"; plot: {png}" if png else ""),
        markup=False,
    )
    return 0


def search(cfg, args, argv: list[str]) -> int:
    """Search the layouts of `cfg` on the named machine (default cpu-sim); print, and write
    the best as YAML (``--write``) and the search as JSON (``--json``)."""

    if args.top is not None and args.top < 0:
        raise ConfigError("--top", f"compiles that many layouts: a count >= 0, got {args.top}")
    topo = machine(cfg, args.topology or topology.CPU_SIM, args.nodes, args.network)
    fp8 = fp8_check.weighed_kinds(cfg, topo) if args.weigh_fp8 else ()
    console = Console(width=max(Console().width, 200))
    with Console(stderr=True).status("searching") as status:
        result = search_lib.search(cfg, topo, topo.num_devices, search_lib.TOP_K if args.top is None else args.top,
                                   progress=status.update, fp8=fp8)  # fmt: skip
    title = f"layout search: {args.config} on {topo.name} ({topo.description})"
    if result.note:
        console.print(result.note, markup=False, soft_wrap=True)
    for line in result.missing:  # what the model's family does not give the search
        console.print(line, markup=False, soft_wrap=True)
    console.print(f"best {result.compiled} compiled for: {result.compiled_for}", markup=False)
    console.print(search_report.table(result, title))
    command = shlex.join(["python", "-m", "meshpar.plan", *argv])
    if args.write and result.best is not None:
        write(args.write, search_report.experiment_yaml(result, args.config, args.overrides, command, args.write))
    if args.json:
        write(args.json, json.dumps(search_lib.to_json(result), indent=2) + "\n")
    best = result.best
    if best is None:
        console.print("no layout fits", markup=False)
        return 1
    written = f"; written to {args.write}" if args.write else ""
    console.print(f"best: {' '.join(best.overrides)}{written}", markup=False)
    return 0


def _batch_sizes(cfg, text: str) -> list[int]:
    return out_of_core.batch_sizes(cfg, text, "--offload-sweep", (1, 8, 64, 512))


def compare_out_of_core(cfg, args) -> int:
    """Print (and write as JSON) every way past the device's memory, per batch size on the
    named machine (:mod:`meshpar.plan.out_of_core.comparison`), and with ``--layer`` one layer's figures."""
    topo = machine(cfg, args.topology, args.nodes, args.network)
    sizes = out_of_core.batch_sizes(cfg, args.batch_sweep or "")
    target = gpu_target.target(topo, cfg.mesh)  # a GPU machine's own compiler, where installed
    with compile_cache.suspended(target.compile_only):
        mesh = parts.make_mesh(cfg, target.devices)
        if mesh.size > topo.num_devices:
            raise ConfigError(
                "--topology", f"{topo.name} has {topo.num_devices} devices, the config's mesh {mesh.size}"
            )
        with Console(stderr=True).status("pricing") as status:
            status.update(f"pricing {len(sizes)} batch sizes on {topo.name}")
            result = out_of_core.compare(cfg, topo, sizes, mesh, overlap=not args.no_overlap)
    compiled_for = target.compiled_for or gpu_target.host_label(mesh)
    if args.json:
        write(
            args.json,
            json.dumps({"compiled_for": compiled_for, **out_of_core.to_json(result, args.layer)}, indent=2) + "\n",
        )
    console = Console(width=max(Console().width, 150))
    if target.note:
        console.print(target.note, markup=False, soft_wrap=True)
    console.print(f"steps compiled for: {compiled_for}", markup=False)
    console.print(out_of_core.table(result))
    if args.layer:
        console.print(out_of_core.layer_table(result))
    for line in result.skipped:
        console.print(f"skipped: {line}", markup=False, soft_wrap=True)
    return 0


@dataclasses.dataclass
class Planned:
    """The default mode's figures, printed once nothing more can fail."""

    report: report_lib.Report
    compiled_for: str
    note: str
    missing: list
    topo: object = None
    priced: Priced | None = None
    rates: dict | None = None
    fp8: fp8_check.Check | None = None  # the model's FP8 dots as compiled (None: it has none)


def plan(cfg, args) -> Planned:
    """The default mode: the memory plan of the config's step (compiled for the named machine's
    GPU where its compiler is installed), with its time and offload priced on that machine;
    written as JSON to ``--json``."""
    topo = sizes = None
    if args.topology:
        topo = machine(cfg, args.topology, args.nodes, args.network)  # an unknown name fails before anything compiles
        sizes = None if args.offload_sweep is None else _batch_sizes(cfg, args.offload_sweep)  # so does this
    target = gpu_target.target(topo, cfg.mesh)  # a GPU machine's own compiler, where installed
    with compile_cache.suspended(target.compile_only):
        step = parts.abstract_step(cfg, devices=target.devices)
        fp8_check.refuse_device(cfg, step.mesh.devices.flat[0])  # this host's own GPU, planned without a machine
        parts.say_unused_rules(step)  # layout rules that cannot apply
        # The machine's device when a machine is named (on cpu-sim: this host's, as a run checks it).
        capacity = cost.machine_capacity(cfg, topo, step.mesh) if topo is not None else None
        report = report_lib.plan(step, programs.compile_all(step), capacity=capacity)
        compiled_for = target.compiled_for or gpu_target.host_label(step.mesh)
        missing = models.missing(cfg.model.name)  # the figures the family gives no part for
        out = Planned(report, compiled_for, target.note, missing, topo)
        out.fp8 = fp8_check.check(step.traits.fp8, report.compiled, report_lib.platform(step), compiled_for)
        if topo is not None:
            (out.priced,) = price(step, report, [topo], sizes, not args.no_overlap)
            out.rates = out.priced.step_time and time_report.model_rates(step, out.priced.step_time, topo)
    if args.json:
        write_plan_json(args.json, out)
    return out


def write_plan_json(path: str, p: Planned) -> None:
    out = {"compiled_for": p.compiled_for, **p.report.to_json(), "missing": p.missing}
    if p.topo is not None:
        timed = p.priced.step_time and {**timing.to_json(p.priced.step_time), **p.rates}
        out["time"] = {"topology": p.topo.name, "feed_s": p.priced.feed_s, "step": timed}
        out["offload"] = p.priced.offload and p.priced.offload.to_json()
        out["unfit"] = p.priced.unfit or None
    if p.fp8 is not None:
        out["fp8"] = p.fp8.to_json()
    try:
        pathlib.Path(path).write_text(json.dumps(out, indent=2) + "\n")
    except OSError as e:
        raise errors.OutputError(f"cannot write {path}: {e.strerror}") from None


def print_plan(p: Planned) -> int:
    console = Console(width=max(Console().width, 136))
    if p.note:
        console.print(p.note, markup=False, soft_wrap=True)
    console.print(f"compiled for: {p.compiled_for}", markup=False)
    console.print(report_lib.table(p.report))
    console.print(report_lib.programs_table(p.report))
    if p.report.analytic_missing:
        console.print(f"analytic: {p.report.analytic_missing}")
    console.print(f"{p.report.verdict()} (needed: {p.report.needed_from})", markup=False)
    for m in p.missing:
        console.print(m["line"], markup=False, soft_wrap=True)
    for line in p.fp8.lines() if p.fp8 is not None else ():
        console.print(line, markup=False, soft_wrap=True)
    if p.topo is not None and p.priced.unfit:
        console.print(p.priced.unfit, markup=False)
        return 1
    if p.topo is not None:
        console.print(time_report.step_table(p.priced.step_time, p.topo))
        console.print(time_report.rates_line(p.rates), markup=False)
        p.priced.offload.print(console, p.topo)
    return 0 if p.report.fits else 1

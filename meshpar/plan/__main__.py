"""``python -m meshpar.plan --config experiments/x.yaml [section.key=value ...] [--json PATH]``

Prints, per device, the analytic memory model next to XLA's figures for the config's train step
compiled ahead of time (nothing is allocated), the device capacity with its source, and a verdict.
``--json PATH`` also writes it all (see :meth:`meshpar.plan.report.Report.to_json`). A figure
the model's family gives no part for (a family from outside meshpar may leave the planner's
parts out) is named with why, one line each (:func:`meshpar.models.missing`; ``missing`` in the
JSON, and in ``--search``'s).

``--topology NAME`` (a shipped machine, see :func:`meshpar.plan.topology.names`, or a YAML
path) adds the predicted step time on that machine, by term, and the batch placement time.
With ``--topology`` it also compares host offload with the other ways of freeing device
memory (:mod:`meshpar.plan.out_of_core.offload_cost`): per offload setting (none, optimizer, params,
activations ``layer_outputs`` / ``dots``, and combinations), ``model.remat``, microbatches ×2/×4
and FSDP ``param_layout``, the predicted device and host memory per device and step time on
that machine. ``--offload-sweep [B,B,...]`` adds the same comparison at several global batch
sizes (default: the config's × 1, 8, 64, 512); ``--no-overlap`` prices transfers as not
overlapped with compute.
``--compare-feeding --topology NAME [--png PATH]`` predicts instead, for process batches of
1 MiB to 1 GiB, placement time and the relay device's extra memory, routed vs direct, for the
config's mesh and layout on that machine; nothing is compiled.
``--compare-out-of-core --topology NAME [--batch-sweep B,B,...] [--layer]`` prints instead every
way past the device's memory — none, swapping (each offload setting), CUDA Unified Memory
(alone and with the state swapped), remat, microbatches, FSDP — at each global batch size
(default: the config's × 1, 4, 16, 64), with device, host and migrated bytes per device and the
predicted step; ``--layer`` adds one layer's figures (:mod:`meshpar.plan.out_of_core.comparison`);
``--json PATH`` writes them.

``--search [--topology NAME] [--top K] [--write PATH]`` searches instead every mesh and layout
of the machine's devices (``cpu-sim`` when no topology is named) for the fastest one that fits
(:mod:`meshpar.plan.search.layouts`): a ranked table with the predicted step time by term and the
memory per device, the counts (enumerated, legal, fitting, compiled) and the search's time;
the best `K` (default 5) by an analytic estimate are compiled and ranked by the HLO-based
model. ``--write PATH`` writes the best one as an experiment YAML that
``python -m meshpar.train --config PATH`` runs; ``--json PATH`` writes the search.

Exit status: 0 when the plan fits (``--compare-feeding``, ``--compare-out-of-core``: always;
``--search``: when a layout fits), 1 when it does not; 2 on a
config or data mistake (an unknown ``--topology`` included), with one line ``config error:
<key>: <what is wrong>`` (``data error: ...``) on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys

from rich.console import Console

from meshpar import models
from meshpar.backend import compile_cache
from meshpar.configuration import config as config_lib
from meshpar.configuration import errors
from meshpar.configuration.config import ConfigError
from meshpar.plan import cost, gpu_target, topology
from meshpar.plan import report as report_lib
from meshpar.plan.out_of_core import comparison as out_of_core
from meshpar.plan.out_of_core import offload_cost
from meshpar.plan.search import layouts as search_lib
from meshpar.plan.search import search_report
from meshpar.plan.time import feed_time, time_report, timing
from meshpar.step import parts


def _topology(cfg, name: str):
    """The named machine; for ``cpu-sim``, this host measured over the config's mesh's devices
    (started first, as a run would start them)."""

    if name == topology.CPU_SIM:
        return topology.load(name, devices=parts.make_mesh(cfg).size)
    return topology.load(name)


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


def _write(path: str, text: str) -> None:
    try:
        pathlib.Path(path).write_text(text)
    except OSError as e:
        raise errors.OutputError(f"cannot write {path}: {e.strerror}") from None


def search(cfg, args, argv: list[str]) -> int:
    """Search the layouts of `cfg` on the named machine (default cpu-sim); print, and write
    the best as YAML (``--write``) and the search as JSON (``--json``)."""

    if args.top is not None and args.top < 0:
        raise ConfigError("--top", f"compiles that many layouts: a count >= 0, got {args.top}")
    topo = _topology(cfg, args.topology or topology.CPU_SIM)
    console = Console(width=max(Console().width, 200))
    with Console(stderr=True).status("searching") as status:
        result = search_lib.search(cfg, topo, topo.num_devices, search_lib.TOP_K if args.top is None else args.top,
                                   progress=status.update)  # fmt: skip
    title = f"layout search: {args.config} on {topo.name} ({topo.description})"
    if result.note:
        console.print(result.note, markup=False, soft_wrap=True)
    for line in result.missing:  # what the model's family does not give the search
        console.print(line, markup=False, soft_wrap=True)
    console.print(f"best {result.compiled} compiled for: {result.compiled_for}", markup=False)
    console.print(search_report.table(result, title))
    command = shlex.join(["python", "-m", "meshpar.plan", *argv])
    if args.write and result.best is not None:
        _write(args.write, search_report.experiment_yaml(result, args.config, args.overrides, command, args.write))
    if args.json:
        _write(args.json, json.dumps(search_lib.to_json(result), indent=2) + "\n")
    best = result.best
    if best is None:
        console.print("no layout fits", markup=False)
        return 1
    written = f"; written to {args.write}" if args.write else ""
    console.print(f"best: {' '.join(best.overrides)}{written}", markup=False)
    return 0


class _Offload:
    """The offload comparison of a config on a machine, and its batch-size sweep when asked."""

    def __init__(self, costs, sweep, bandwidth: float, usable: int, overlap: bool, skipped=()):
        self.costs, self.sweep, self.bandwidth, self.usable, self.overlap = costs, sweep, bandwidth, usable, overlap
        self.skipped = list(skipped)  # offload_cost.Skipped: options that do not apply, with why

    def print(self, console, topo) -> None:
        console.print(time_report.offload_table(self.costs, topo, self.bandwidth, self.usable, self.overlap))
        for line in time_report.skipped_lines(self.skipped):
            console.print(line, markup=False, soft_wrap=True)
        if self.sweep:
            console.print(time_report.offload_sweep_table(self.sweep, topo, self.bandwidth, self.usable, self.overlap))

    def to_json(self) -> dict:
        def one(costs):
            # the paging model's passes are left out (``--compare-out-of-core --json`` has its figures)
            return [{**{k: v for k, v in dataclasses.asdict(c).items() if k != "migration"}, "exposed_s": c.exposed_s}
                    for c in costs]  # fmt: skip

        return {"host_bandwidth": self.bandwidth, "usable_bytes": self.usable, "overlap": self.overlap,
                "options": one(self.costs), "sweep": [{"batch_size": b, "options": one(c)} for b, c in self.sweep],
                "skipped": [dataclasses.asdict(s) for s in self.skipped]}  # fmt: skip


def _batch_sizes(cfg, text: str) -> list[int]:
    return out_of_core.batch_sizes(cfg, text, "--offload-sweep", (1, 8, 64, 512))


def compare_out_of_core(cfg, args) -> int:
    """Print (and write as JSON) every way past the device's memory, per batch size on the
    named machine (:mod:`meshpar.plan.out_of_core.comparison`), and with ``--layer`` one layer's figures."""
    topo = _topology(cfg, args.topology)
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
        _write(
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


def _offload(cfg, step, topo, sizes: list[int] | None, overlap: bool, reference_s: float, prepared=None,
             skipped=None) -> _Offload:  # fmt: skip
    """The offload comparison on `topo`, with the sweep over `sizes` (global batch sizes) when given;
    `prepared`, `skipped`: its options planned already (:func:`meshpar.plan.out_of_core.offload_cost.prepare_all`)."""
    if prepared is None:
        skipped = []
        prepared = offload_cost.prepare_all(cfg, step, skipped)
    costs = offload_cost.priced(prepared, topo, overlap, reference_s)
    sweep = offload_cost.sweep(cfg, topo, sizes, overlap, mesh=step.mesh) if sizes else []
    # The config's planned device when it names one (hardware.memory_gib), else the machine's;
    # without unified memory (its options carry their own oversubscribed capacity).
    usable = cost.machine_capacity(offload_cost.without_unified(cfg), topo, step.mesh).usable_bytes
    return _Offload(costs, sweep, offload_cost.host_bandwidth(topo, step.mesh.size), usable, overlap, skipped or ())


@dataclasses.dataclass
class Priced:
    """The config's plan priced on one machine: feed, the step by term, the offload comparison;
    or, where the machine cannot hold the plan's mesh, why (and nothing priced)."""

    topology: object
    feed_s: float = 0.0
    step_time: timing.StepTime | None = None
    offload: _Offload | None = None
    unfit: str = ""  # why the plan does not fit this machine at all


def price(cfg, step, report, topos, sizes: list[int] | None = None, overlap: bool = True) -> list[Priced]:
    """The config's plan — its abstract `step` and `report` (:func:`meshpar.plan.report.plan`,
    the step compiled once) — priced on each machine of `topos`, as ``--topology`` prices it;
    the offload comparison's options are planned once for them all."""
    skipped: list = []
    prepared = None
    out = []
    for topo in topos:
        if step.mesh.size > topo.num_devices:  # a plan for more devices than the machine has
            out.append(Priced(topo, unfit=f"does not fit on {topo.name}: the plan's mesh "
                                          f"({','.join(f'{a}:{n}' for a, n in step.mesh.shape.items())}) has {step.mesh.size} devices, the machine "
                                          f"{topo.num_devices}"))  # fmt: skip
            continue
        if prepared is None:
            prepared = offload_cost.prepare_all(cfg, step, skipped)
        feed_s = cost.feed_seconds(cfg, topo)
        step_time = timing.predict(cfg, step, report.compiled, topo, feed_s)
        offload = _offload(cfg, step, topo, sizes, overlap, step_time.total_s, prepared, skipped)
        out.append(Priced(topo, feed_s, step_time, offload))
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshpar.plan", description="Per-device memory plan of a config.")
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. experiments/quickstart.yaml")
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON here")
    parser.add_argument("--topology", metavar="NAME", help="machine to predict time on (e.g. h100-sxm-8, cpu-sim)")
    parser.add_argument("--compare-feeding", action="store_true", help="routed vs direct placement, 1 MiB to 1 GiB")
    parser.add_argument("--png", metavar="PATH", help="with --compare-feeding: also draw it here")
    parser.add_argument("--search", action="store_true", help="rank every mesh and layout that fits by predicted time")
    parser.add_argument("--top", type=int, metavar="K", help="with --search: compile the best K estimates (default 5)")
    parser.add_argument("--write", metavar="PATH", help="with --search: write the best layout as an experiment YAML")
    parser.add_argument(
        "--offload-sweep", nargs="?", const="", metavar="B,B,...",
        help="with --topology: compare offload, remat, microbatches, FSDP at these global batch sizes",
    )  # fmt: skip
    parser.add_argument("--no-overlap", action="store_true", help="with --topology: offload transfers not overlapped")
    parser.add_argument(
        "--compare-out-of-core", action="store_true",
        help="with --topology: none, swap (each offload setting), unified memory, remat, microbatches per batch size",
    )  # fmt: skip
    parser.add_argument("--batch-sweep", metavar="B,B,...", help="with --compare-out-of-core: these global batch sizes")
    parser.add_argument("--layer", action="store_true", help="with --compare-out-of-core: also one layer's figures")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    return parser


def _mode(args) -> str:
    """The mode the flags pick (``search``, ``out-of-core``, ``feeding`` or ``plan``); a flag
    without its mode, two modes at once, or a mode without the machine it needs is a
    :class:`ConfigError` naming the flag."""
    if args.search or args.write or args.top is not None:
        if not args.search:
            raise ConfigError("--write" if args.write else "--top", "goes with --search: add --search")
        if args.compare_feeding:
            raise ConfigError("--search", "and --compare-feeding are separate commands: pick one")
        return "search"
    if (args.batch_sweep is not None or args.layer) and not args.compare_out_of_core:
        raise ConfigError("--batch-sweep" if args.batch_sweep is not None else "--layer",
                          "goes with --compare-out-of-core: add it")  # fmt: skip
    if args.compare_out_of_core:
        if args.compare_feeding or args.offload_sweep is not None:
            other = "--compare-feeding" if args.compare_feeding else "--offload-sweep"
            raise ConfigError("--compare-out-of-core", f"and {other} are separate commands: pick one")
        _needs_topology(args, "--compare-out-of-core")
        return "out-of-core"
    if args.compare_feeding or args.png:
        if not args.compare_feeding:
            raise ConfigError("--png", "draws the --compare-feeding plot: add --compare-feeding")
        _needs_topology(args, "--compare-feeding")
        return "feeding"
    if not args.topology and (args.offload_sweep is not None or args.no_overlap):
        raise ConfigError("--offload-sweep" if args.offload_sweep is not None else "--no-overlap",
                          "prices offload on a machine: add --topology NAME")  # fmt: skip
    return "plan"


def _needs_topology(args, flag: str) -> None:
    if not args.topology:
        raise ConfigError("--topology", f"{flag} needs a machine (known: {', '.join(topology.names())})")


@dataclasses.dataclass
class _Planned:
    """The default mode's figures, printed once nothing more can fail."""

    report: report_lib.Report
    compiled_for: str
    note: str
    missing: list
    topo: object = None
    priced: Priced | None = None
    rates: dict | None = None


def plan(cfg, args) -> _Planned:
    """The default mode: the memory plan of the config's step (compiled for the named machine's
    GPU where its compiler is installed), with its time and offload priced on that machine;
    written as JSON to ``--json``."""
    topo = sizes = None
    if args.topology:
        topo = _topology(cfg, args.topology)  # an unknown name fails before anything compiles
        sizes = None if args.offload_sweep is None else _batch_sizes(cfg, args.offload_sweep)  # so does this
    target = gpu_target.target(topo, cfg.mesh)  # a GPU machine's own compiler, where installed
    with compile_cache.suspended(target.compile_only):
        step = parts.abstract_step(cfg, devices=target.devices)
        parts.say_unused_rules(cfg, step.mesh, step.plan)  # layout rules that cannot apply
        # The machine's device when a machine is named (on cpu-sim: this host's, as a run checks it).
        capacity = cost.machine_capacity(cfg, topo, step.mesh) if topo is not None else None
        report = report_lib.plan(cfg, step, capacity=capacity)
        compiled_for = target.compiled_for or gpu_target.host_label(step.mesh)
        missing = models.missing(cfg.model.name)  # the figures the family gives no part for
        out = _Planned(report, compiled_for, target.note, missing, topo)
        if topo is not None:
            (out.priced,) = price(cfg, step, report, [topo], sizes, not args.no_overlap)
            out.rates = out.priced.step_time and time_report.model_rates(cfg, step, out.priced.step_time, topo)
    if args.json:
        _write_plan_json(args.json, out)
    return out


def _write_plan_json(path: str, p: _Planned) -> None:
    out = {"compiled_for": p.compiled_for, **p.report.to_json(), "missing": p.missing}
    if p.topo is not None:
        timed = p.priced.step_time and {**timing.to_json(p.priced.step_time), **p.rates}
        out["time"] = {"topology": p.topo.name, "feed_s": p.priced.feed_s, "step": timed}
        out["offload"] = p.priced.offload and p.priced.offload.to_json()
        out["unfit"] = p.priced.unfit or None
    try:
        pathlib.Path(path).write_text(json.dumps(out, indent=2) + "\n")
    except OSError as e:
        raise errors.OutputError(f"cannot write {path}: {e.strerror}") from None


def _print_plan(p: _Planned) -> int:
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
    if p.topo is not None and p.priced.unfit:
        console.print(p.priced.unfit, markup=False)
        return 1
    if p.topo is not None:
        console.print(time_report.step_table(p.priced.step_time, p.topo))
        console.print(time_report.rates_line(p.rates), markup=False)
        p.priced.offload.print(console, p.topo)
    return 0 if p.report.fits else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_intermixed_args(argv)
    try:
        cfg = config_lib.load(args.config, args.overrides)
        mode = _mode(args)
        if mode == "search":
            return search(cfg, args, argv)
        if mode == "out-of-core":
            return compare_out_of_core(cfg, args)
        if mode == "feeding":
            return compare_feeding(cfg, _topology(cfg, args.topology), args.png)
        planned = plan(cfg, args)
    except Exception as e:  # noqa: BLE001 - errors.report re-raises what it does not report
        return errors.report(e)
    return _print_plan(planned)


if __name__ == "__main__":
    sys.exit(main())

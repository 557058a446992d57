"""``python -m meshpar.plan --config experiments/x.yaml [section.key=value ...] [--json PATH]``

The memory plan of a config, per device: the analytic model next to XLA's figures for the
run's programs compiled ahead of time (nothing is allocated), the device capacity with its
source, and a verdict. ``--topology NAME`` adds the predicted step time on that machine and the
comparison of host offload with the other ways of freeing device memory; ``--search`` searches
the layouts instead, ``--compare-out-of-core`` compares every way past the device's memory and
``--compare-feeding`` routed vs direct placement (:mod:`meshpar.plan.modes` has each mode; the
flags and what each prints: docs/planning.md).

Exit status: 0 when the plan fits (``--compare-feeding``, ``--compare-out-of-core``: always;
``--search``: when a layout fits), 1 when it does not; 2 on a config or data mistake (an
unknown ``--topology`` included), with one line ``config error: <key>: <what is wrong>``
(``data error: ...``) on stderr.
"""

from __future__ import annotations

import argparse
import sys

from meshpar.configuration import config as config_lib
from meshpar.configuration import errors
from meshpar.configuration.config import ConfigError
from meshpar.plan import modes, topology


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshpar.plan", description="Per-device memory plan of a config.")
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. experiments/quickstart.yaml")
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON here")
    parser.add_argument("--topology", metavar="NAME", help="machine to predict time on (e.g. h100-sxm-8, cpu-sim)")
    parser.add_argument("--nodes", type=int, metavar="N", help="with --topology: N nodes of that machine (a cluster)")
    parser.add_argument("--network", metavar="NAME", help="with --nodes: the network between them (e.g. ndr-ib)")
    parser.add_argument("--compare-feeding", action="store_true", help="routed vs direct placement, 1 MiB to 1 GiB")
    parser.add_argument("--png", metavar="PATH", help="with --compare-feeding: also draw it here")
    parser.add_argument("--search", action="store_true", help="rank every mesh and layout that fits by predicted time")
    parser.add_argument("--top", type=int, metavar="K", help="with --search: compile the best K estimates (default 5)")
    parser.add_argument("--write", metavar="PATH", help="with --search: write the best layout as an experiment YAML")
    parser.add_argument(
        "--weigh-fp8", action="store_true",
        help="with --search on a GPU with FP8: also compile the best layouts with FP8 dots and rank both",
    )  # fmt: skip
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
    if (args.nodes is not None or args.network) and not args.topology:
        raise ConfigError(
            "--nodes" if args.nodes is not None else "--network", "clusters a machine: add --topology NAME"
        )
    if args.search or args.write or args.top is not None or args.weigh_fp8:
        if not args.search:
            flag = "--write" if args.write else "--top" if args.top is not None else "--weigh-fp8"
            raise ConfigError(flag, "goes with --search: add --search")
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_intermixed_args(argv)
    try:
        cfg = config_lib.load(args.config, args.overrides)
        mode = _mode(args)
        if mode == "search":
            return modes.search(cfg, args, argv)
        if mode == "out-of-core":
            return modes.compare_out_of_core(cfg, args)
        if mode == "feeding":
            return modes.compare_feeding(cfg, modes.machine(cfg, args.topology, args.nodes, args.network), args.png)
        planned = modes.plan(cfg, args)
    except Exception as e:  # noqa: BLE001 - errors.report re-raises what it does not report
        return errors.report(e)
    return modes.print_plan(planned)


if __name__ == "__main__":
    sys.exit(main())

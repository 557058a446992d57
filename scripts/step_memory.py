"""Per-device memory of a config's compiled train step, for each variant of some settings.

    python scripts/step_memory.py --config experiments/quickstart.yaml [k=v ...] \\
        --vary train.microbatches=1,2,4 [--vary model.n_layers=2,8] [--json out.json]

Each variant (every combination of the ``--vary`` values, applied on top of the overrides) is
the config's real train step, compiled ahead of time on abstract inputs (:mod:`meshpar.step.aot`):
nothing is allocated and no step runs. The figures are XLA's ``memory_analysis()`` of the
compiled program, per device: arguments, outputs, aliased (donated) bytes, temporaries, and
their total (argument + output + temp − alias). ``--vary`` values are split on ``,``, or on
``|`` when the value holds one (``--vary 'mesh=data:8|data:4,model:2'``); each is parsed as
YAML, like an override. ``--arrays`` adds a table of every train-state array (parameters,
optimizer state): its total bytes and, for each variant, the bytes each device holds (from its
sharding's shard shape), e.g. ``--vary param_layout=,embed:data`` for FSDP against the plain
layout.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import common


def variants(vary: list[str]) -> list[list[str]]:
    """Every combination of the ``key=v1,v2`` settings, as lists of overrides."""
    axes = []
    for item in vary:
        key, sep, values = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--vary {item!r} is not 'key=v1,v2,...'")
        axes.append([f"{key.strip()}={v.strip()}" for v in values.split("|" if "|" in values else ",")])
    return [list(combo) for combo in itertools.product(*axes)]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _spec(text: str) -> str:
    """``P(None, 'data', 'model')`` → ``[·,data,model]``: the split of each dim, compactly."""
    from rich.markup import escape

    inner = text.removeprefix("P(").removesuffix(")").replace("'", "").replace(" ", "").rstrip(",")
    return escape(f"[{inner.replace('None', '·')}]")  # not rich markup


def arrays_table(results: list[dict]):
    """Every state array: shape, total KiB, and KiB per device in each variant (with its spec)."""
    from rich.table import Table

    table = Table(title="train state arrays: KiB in total and per device")
    for name in ("array", "shape", "total"):
        table.add_column(name, justify="left" if name != "total" else "right", no_wrap=True)
    for r in results:
        table.add_column(" ".join(r["variant"]) or "per device", justify="right", no_wrap=True)
    first = results[0]["state"]
    for path, info in first.items():
        cells = []
        for r in results:
            a = r["state"].get(path)
            cells.append("-" if a is None else f"{a['per_device_bytes'] / 1024:,.1f} {_spec(a['spec'])}")
        table.add_row(path, "×".join(map(str, info["shape"])) or "()", f"{info['total_bytes'] / 1024:,.1f}", *cells)
    sums = [sum(a["per_device_bytes"] for a in r["state"].values()) for r in results]
    total = sum(a["total_bytes"] for a in first.values())
    table.add_row("all", "", f"{total / 1024:,.1f}", *(f"{b / 1024:,.1f}" for b in sums))
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/quickstart.yaml")
    parser.add_argument("--vary", action="append", default=[], help="key=v1,v2,...: one row per value (repeatable)")
    parser.add_argument("--arrays", action="store_true", help="also a per-device byte table of every state array")
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    import jax

    from meshpar.configuration import config
    from meshpar.configuration.config import ConfigError
    from meshpar.sharding import mesh

    rows = variants(args.vary)
    try:
        cfgs = [config.load(args.config, [*args.overrides, *extra, "train.progress=false"]) for extra in rows]
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    # Every variant compiles in this process: simulate as many CPU devices as the largest mesh needs.
    mesh.request_cpu_devices(max(mesh.cpu_device_count(c.mesh) for c in cfgs))
    from rich.console import Console
    from rich.table import Table

    from meshpar.step import aot, parts

    table = Table(title=f"{args.config} {' '.join(args.overrides)}: compiled train step, MiB per device")
    table.add_column("variant")
    for name in ("argument", "output", "alias", "temp", "total"):
        table.add_column(name, justify="right")
    results = []
    for extra, cfg in zip(rows, cfgs):
        try:
            step = parts.abstract_step(cfg)
            figures = aot.memory(step.compile())
        except ConfigError as e:
            print(f"config error: {' '.join(extra)}: {e}", file=sys.stderr)
            return 2
        results.append({"variant": extra, **figures, "state": aot.state_bytes(step.plan)})
        cells = [figures[f"{f}_bytes"] for f in ("argument", "output", "alias", "temp", "total")]
        table.add_row(" ".join(extra) or "(as configured)", *map(_mib, cells))
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    if args.arrays:
        console.print(arrays_table(results))
    if args.json:
        meta = {
            "config": args.config,
            "overrides": args.overrides,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
        }
        common.write_json(args.json, {**meta, "source": "XLA compiled.memory_analysis(), per device", "rows": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

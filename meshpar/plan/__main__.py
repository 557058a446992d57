"""``python -m meshpar.plan --config experiments/x.yaml [section.key=value ...] [--json PATH]``

Prints, per device, the analytic memory model next to XLA's figures for the config's train step
compiled ahead of time (nothing is allocated), the device capacity with its source, and a verdict.
``--json PATH`` also writes it all (see :meth:`meshpar.plan.report.Report.to_json`).

Exit status: 0 when the plan fits, 1 when it does not; 2 on a config or data mistake, with one
line ``config error: <key>: <what is wrong>`` (``data error: ...``) on stderr.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from meshpar import config as config_lib
from meshpar import errors
from meshpar.plan import report as report_lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshpar.plan", description="Per-device memory plan of a config.")
    parser.add_argument("--config", required=True, help="experiment YAML, e.g. experiments/quickstart.yaml")
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON here")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)
    try:
        report = report_lib.plan(config_lib.load(args.config, args.overrides))
        if args.json:
            try:
                pathlib.Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
            except OSError as e:
                raise errors.OutputError(f"cannot write {args.json}: {e.strerror}") from None
    except Exception as e:
        return errors.report(e)
    from rich.console import Console

    console = Console(width=max(Console().width, 136))
    console.print(report_lib.table(report))
    if report.analytic_missing:
        console.print(f"analytic: {report.analytic_missing}")
    console.print(f"{report.verdict()} (needed: {report.needed_from})", markup=False)
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())

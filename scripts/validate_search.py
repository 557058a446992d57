"""The layout search checked by running: measured step times of layouts across its ranking.

    python scripts/validate_search.py [--config experiments/quickstart.yaml] [--count 12]
        [--rounds 7] [--steps 3] [--json out.json]

Runs the search (:func:`meshpar.plan.search.layouts.search`, on ``cpu-sim``, the top 5 compiled) on
the config, then picks ``--count`` of the layouts that fit, spread over its ranking: the top 3
and the rest evenly spaced down to the last. For each: the train step compiled ahead of time
(the program a run calls), the state materialised in its shardings, random batches placed in
the layout's batch shardings, and the step timed in this process, each run waited for
(``block_until_ready``) before the next, so a time is one run of the program with nothing
beside it. Rounds run every layout in turn (one warm-up step, then ``--steps`` timed), so a
load change on a shared host hits all layouts alike; a layout's time is the median over
rounds of its rounds' medians.

Printed: the measured times in the search's order, the Spearman rank correlation between that
order and the measured times (numpy; average ranks for ties), the same for the HLO-based model
and for the analytic estimate alone over the same layouts (every measured layout is compiled
here, so the HLO model's figure exists for each), and whether the predicted best is within 10%
of the fastest measured. Targets: within 10%, correlation >= 0.7. Exit status 0 when both
are met, 1 when either is missed; a config or a layout it cannot plan or run is one line (the
error) and counts as a miss, never a traceback.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import common
import numpy as np

BEST_WITHIN = 0.10
MIN_CORRELATION = 0.7


def spread(n: int, count: int, top: int = 3) -> list[int]:
    """`count` indices of 0..n-1: the first `top`, then evenly spaced down to the last."""
    if count >= n:
        return list(range(n))
    rest = np.linspace(top, n - 1, count - top).round().astype(int).tolist()
    return sorted(set(range(top)) | set(rest))


def _batch(step, seed: int) -> dict:
    """Random values in the shapes and shardings of the step's batch (integers in {0, 1}: valid
    tokens and labels for any vocabulary)."""
    import jax

    rng = np.random.default_rng(seed)
    out = {}
    for name, b in step.args[1].items():
        if np.issubdtype(b.dtype, np.integer):
            host = rng.integers(0, 2, b.shape).astype(b.dtype)
        else:
            host = rng.standard_normal(b.shape).astype(b.dtype)
        out[name] = jax.device_put(host, b.sharding)
    return out


class Runner:
    """One layout's compiled step, state and batches, stepped on demand."""

    def __init__(self, row, topo):
        from meshpar.plan.time import timing
        from meshpar.processes import stop

        step = row.step
        self.row = row
        started = time.perf_counter()
        self.compiled = row.compiled or step.compile()  # the search's own, where it compiled it
        self.compile_s = time.perf_counter() - started
        self.hlo = timing.predict(step, self.compiled, topo, row.estimate.feed_s)
        self.state = step.plan.materialize(step.layout, step.mesh)
        self.batches = [_batch(step, i) for i in range(2)]
        self.flags = stop.make_flags(step.mesh, 0)
        self.times: list[float] = []  # one median per round

    def round(self, steps: int) -> None:
        self.state, times = common.step_times(self.compiled, self.state, self.batches, self.flags, 1 + steps)
        self.times.append(statistics.median(times[1:]))  # the first a warm-up

    @property
    def measured_s(self) -> float:
        return statistics.median(self.times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="experiments/quickstart.yaml")
    parser.add_argument("--count", type=int, default=12, help="layouts to run (the top 3 among them)")
    parser.add_argument("--top", type=int, default=5, help="layouts the search compiles")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout and round")
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from meshpar.configuration import config as config_lib
    from meshpar.plan import topology
    from meshpar.plan.search import candidates
    from meshpar.plan.search import layouts as search_lib
    from meshpar.plan.time.time_report import fmt_seconds
    from meshpar.sharding import layout as layout_lib
    from meshpar.step import parts

    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        cfg = config_lib.load(args.config, args.overrides)
        topo = topology.load(topology.CPU_SIM, devices=parts.make_mesh(cfg).size)
        result = search_lib.search(cfg, topo, topo.num_devices, args.top)
    except candidates.ILLEGAL as e:
        console.print(f"{args.config}: cannot plan: {e}", markup=False, soft_wrap=True)
        return 1
    console.print(search_lib.summary(result), markup=False)
    fitting = [r for r in result.rows if r.fits]
    picked = [(i, fitting[i]) for i in spread(len(fitting), args.count)]
    runners, failed = [], 0
    for i, row in picked:
        console.print(f"preparing rank {i + 1}: {' '.join(row.overrides)}", markup=False)
        try:
            runners.append((i, Runner(row, topo)))
        except candidates.ILLEGAL as e:
            console.print(f"rank {i + 1}: cannot run: {e}", markup=False, soft_wrap=True)
            failed += 1
    if len(runners) < 2:
        console.print(f"{len(runners)} layouts ran: nothing to rank (targets missed)", markup=False)
        return 1
    for _ in range(args.rounds):
        for _, runner in runners:
            runner.round(args.steps)
    measured = [runner.measured_s for _, runner in runners]
    fastest = min(measured)
    t = Table(title=f"{args.config}: layouts in the search's order on {topo.name}, measured", title_justify="left")
    columns = ("rank", "mesh", "layout", "param_layout", "search", "by", "HLO model", "estimate", "measured",
               "rounds min-max", "vs fastest")  # fmt: skip
    for name in columns:
        t.add_column(name, justify="left" if name in ("mesh", "layout", "param_layout", "by") else "right")
    rows = []
    for (i, runner), m in zip(runners, measured):
        row = runner.row
        t.add_row(
            str(i + 1), row.cfg.mesh_str, row.cfg.layout_str or "(replicated)",
            layout_lib.format_rules(row.cfg.param_layout) or "-", fmt_seconds(row.step_s),
            "HLO" if row.predicted else "estimate", fmt_seconds(runner.hlo.total_s),
            fmt_seconds(row.estimate.total_s), fmt_seconds(m),
            f"{fmt_seconds(min(runner.times))} - {fmt_seconds(max(runner.times))}", f"{m / fastest:.2f}x",
        )  # fmt: skip
        rows.append({
            "rank": i + 1, "overrides": row.overrides, "search_s": row.step_s,
            "compiled_by_search": row.predicted is not None, "hlo_s": runner.hlo.total_s,
            "estimate_s": row.estimate.total_s, "measured_s": m, "round_medians_s": runner.times,
        })  # fmt: skip
    console.print(t)
    order = [i for i, _ in runners]
    rho = common.spearman(order, measured)
    rho_hlo = common.spearman([r.hlo.total_s for _, r in runners], measured)
    rho_est = common.spearman([r.row.estimate.total_s for _, r in runners], measured)
    best_gap = measured[0] / fastest - 1
    console.print(
        f"Spearman rank correlation, predicted order vs measured: {rho:.3f} (target >= {MIN_CORRELATION}); "
        f"HLO model alone {rho_hlo:.3f}, analytic estimate alone {rho_est:.3f}, over {len(runners)} layouts",
        markup=False,
    )
    console.print(
        f"predicted best measured {fmt_seconds(measured[0])}, fastest measured {fmt_seconds(fastest)}: "
        f"{best_gap:+.1%} (target within {BEST_WITHIN:.0%})",
        markup=False,
    )
    if args.json:
        out = {
            "config": args.config, "search": search_lib.to_json(result), "spearman": rho, "spearman_hlo": rho_hlo,
            "spearman_estimate": rho_est, "best_gap": best_gap, "rows": rows,
        }  # fmt: skip
        common.write_json(args.json, out, indent=1)
    return 0 if rho >= MIN_CORRELATION and best_gap <= BEST_WITHIN and not failed else 1


if __name__ == "__main__":
    sys.exit(main())

"""What the scripts in this folder share (it is no script itself): the repository on
``sys.path``; timing, as medians over repeats after a warm-up, and in rounds against a baseline;
statistics over rounds (a 95% bootstrap interval of a median, Spearman's rank correlation); a
config's train step compiled ahead of time (:func:`compile_step`) and run on an experiment's real
state and batches (:func:`materialize`); XLA's figures of a compiled program; a feeder's own
timing of its placements; and a result's table and JSON, and a run's end: its JSON written, its
failed checks said, its exit status.

A script imports it as ``import common``: Python puts a script's own folder first on
``sys.path``. Importing it puts the repository there too, so that a script runs from a checkout
whose ``meshpar`` is not installed. It imports neither jax nor meshpar at its top: some scripts
set jax's environment (``JAX_PLATFORMS``) before jax is first imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ---------------------------------------------------------------------------------------------
# Timing


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """The median wall time of `repeats` calls of `fn` after `warmup` untimed ones (compilation,
    allocation, the page cache), and the last call's result.

    A result holding jax arrays is waited for (``jax.block_until_ready``) within its time. Each
    result is dropped before the next call, so that two are never alive at once (a placed batch
    holds device memory)."""
    times, result = [], None
    for i in range(warmup + repeats):
        result = None
        start = time.perf_counter()
        result = fn()
        jax = sys.modules.get("jax")  # a result can hold jax arrays only once jax is imported
        if jax is not None:
            jax.block_until_ready(result)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), result


def step_times(step, state, batches: Sequence, flags, n: int, first: int = 0) -> tuple[Any, list[float]]:
    """`n` calls of a compiled train step ``step(state, batch, flags) -> (state, metrics)`` on
    ``batches[(first + i) % len(batches)]``, each waited for (``jax.block_until_ready``) before
    the next is dispatched: a time is one run of the program with nothing beside it, and with
    simulated CPU devices more than two steps in flight can deadlock XLA's collectives. The
    state after them, and each call's wall time."""
    import jax  # here: see the module docstring

    times = []
    for i in range(n):
        start = time.perf_counter()
        state, metrics = step(state, batches[(first + i) % len(batches)], flags)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return state, times


def interleaved(arms: Sequence[T], rounds: int, block: Callable[[T], Any]) -> list[list]:
    """`rounds` rounds of one ``block(arm)`` per arm, the order reversed every other round, so
    that a drift of the shared machine falls on all arms alike. Per arm, in `arms`' order: what
    its blocks returned, round by round."""
    out = [[] for _ in arms]
    for r in range(rounds):
        for i in range(len(arms)) if r % 2 == 0 else reversed(range(len(arms))):
            out[i].append(block(arms[i]))
    return out


def timed_rounds(
    arms: Sequence[T],
    rounds: int,
    block: Callable[[T], Sequence[float]],
    baseline: int = 0,
    rng: np.random.Generator | None = None,
) -> list[dict]:
    """Timed blocks in :func:`interleaved` rounds, each arm's against the `baseline`-th arm's of
    the same round: ``block(arm)`` runs one block of `arm` and returns its wall times. Per arm, in
    `arms`' order: ``times``, every block's times in turn; ``block_median_s``, each round's block
    median; ``ratio``, the rounds' ratios of its block median over the baseline's, as their
    ``median``, ``ci95`` (:func:`bootstrap_median` with `rng`: one stream through the arms in
    turn, the baseline's included; a generator seeded 0 for each arm when None) and
    ``per_round``."""
    blocks = interleaved(arms, rounds, block)
    medians = [[statistics.median(times) for times in arm] for arm in blocks]
    out = []
    for arm, own in zip(blocks, medians):
        ratios = [b / a for a, b in zip(medians[baseline], own)]
        out.append({
            "times": [t for times in arm for t in times], "block_median_s": own,
            "ratio": {"median": statistics.median(ratios), "ci95": list(bootstrap_median(ratios, rng)),
                      "per_round": ratios},
        })  # fmt: skip
    return out


def rounds_parser(doc: str, quick: str, json_path: str) -> argparse.ArgumentParser:
    """The command line of a script that times rows of configurations in :func:`timed_rounds`,
    described by the first paragraph of `doc`: ``--quick`` (a smoke run; `quick` says what it
    runs), ``--rounds``, ``--steps`` per timed block, ``--warmup`` steps, ``--json`` (default
    `json_path`) and config overrides for every row."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")
    p.add_argument("--rounds", type=int, default=10, help="rounds of one timed block per row")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row after its first")
    p.add_argument("--json", default=json_path, help="where to write the results")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides for every row")
    return p


def rounds_meta(args: argparse.Namespace, config: str, model: Sequence[str], wall_s: float) -> dict:
    """What the JSON of a :func:`rounds_parser` script says of its run first: the platform, the
    device count and this process's cores, jax's version, the experiment (`config`, the `model`
    overrides of every row, the command line's), the rounds' settings and the wall time."""
    import jax  # here: see the module docstring

    return {
        "platform": jax.devices()[0].platform, "devices": jax.device_count(), "cores": len(os.sched_getaffinity(0)),
        "jax": jax.__version__, "config": config, "model": model, "overrides": args.overrides, "rounds": args.rounds,
        "steps_per_block": args.steps, "warmup": args.warmup, "quick": args.quick, "wall_s": wall_s,
    }  # fmt: skip


def placements(feeder, batches: Iterable, warmup: int = 1) -> list:
    """Each host batch of `batches` placed by `feeder` (an ``input_pipeline.feeding.Feeder``) in
    turn, each placed batch dropped at once (only a routed feeder's staging copy outlives it);
    the feeder's own timing of each (``Placement``: host batch in, every array ready on its
    devices), the first `warmup` left out."""
    out = []
    for i, host in enumerate(batches):
        placed, info = feeder.place(host)
        del placed
        if i >= warmup:
            out.append(info)
    return out


# ---------------------------------------------------------------------------------------------
# A config's train step, compiled and run
#
# Every script that measures a train step goes through these two: the step is the config's
# parts (:func:`meshpar.step.parts.abstract_step`: the mesh, the layout, the state plan, the
# jitted step and the abstract arguments a run lowers it with), compiled here, so that no script
# depends on how an experiment holds its step (jitted, or compiled by the pre-flight).


@dataclasses.dataclass
class CompiledStep:
    """A config's train step compiled ahead of time for its mesh: ``parts`` (a
    ``meshpar.step.parts.AbstractStep``), ``compiled`` (``jax.stages.Compiled``: called as
    ``compiled(state, batch, stop_flags) -> (state, metrics)``, the state donated) and
    ``compile_s``, the seconds its lowering and XLA compile took (jax's persistent compilation
    cache may have served the compile)."""

    parts: Any
    compiled: Any
    compile_s: float

    @property
    def mesh(self):
        return self.parts.mesh

    @property
    def element_spec(self) -> dict:
        """The train data's, per example (what a family's ``flops_per_example`` reads)."""
        return self.parts.element_spec

    @property
    def schedule(self):
        """The pipeline the layout runs (``meshpar.sharding.stages.Schedule``), or None."""
        return self.parts.plan.schedule

    def jaxpr(self):
        """The traced program (its jaxpr), from the abstract arguments."""
        return self.parts.step.trace(*self.parts.args).jaxpr

    def memory(self) -> dict:
        """XLA's ``memory_analysis()``, per device (:func:`memory_analysis`)."""
        return memory_analysis(self.compiled)

    def flops(self) -> float:
        """XLA's ``cost_analysis()["flops"]`` of the program, per device (a ``while`` body
        counted once, not once per trip)."""
        cost = self.compiled.cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    def collectives(self) -> list[tuple[str, int, str]]:
        """(kind, bytes per device, mesh axes) per collective of the compiled HLO, loops × their
        trip counts (:func:`meshpar.plan.time.timing.collectives`)."""
        from meshpar.plan.time import timing  # here: see the module docstring

        return timing.collectives(self.compiled, self.mesh)


def compile_step(cfg, mesh=None, element_spec=None, variant: Callable[[Any], Any] | None = None) -> CompiledStep:
    """`cfg`'s train step (:func:`meshpar.step.parts.abstract_step`, on `mesh` and with the train
    data's `element_spec` when given: an experiment's, so that its arrays fit the program)
    lowered and compiled, timed. `variant`: a function of the parts returning another jitted step
    over the same arguments, compiled instead of theirs (a reference program to compare with)."""
    from meshpar.step import parts as parts_lib  # here: see the module docstring

    return _compiled(parts_lib.abstract_step(cfg, mesh=mesh, element_spec=element_spec), variant)


def _compiled(parts, variant: Callable[[Any], Any] | None) -> CompiledStep:
    """`parts`' train step (or `variant`'s, over the same arguments) lowered and compiled, timed."""
    if variant is not None:
        parts = dataclasses.replace(parts, step=variant(parts))
    start = time.perf_counter()
    compiled = parts.compile()  # with the config's XLA flags, as the run compiles it
    return CompiledStep(parts, compiled, time.perf_counter() - start)


@dataclasses.dataclass
class Running:
    """A compiled train step on an experiment's real arrays: ``exp`` (as ``python -m
    meshpar.train`` builds it: ``meshpar.run.experiment.Experiment``; its own ``state`` handed
    over, so set to None), ``state``, placed ``batches``, the stop ``flags``, ``step``, and
    ``steps_done``; ``build_s``: the seconds the experiment took to build."""

    exp: Any
    step: CompiledStep
    state: Any
    batches: list
    flags: Any
    build_s: float
    steps_done: int = 0

    def __call__(self, batch) -> dict:
        """One step on `batch` (a placed batch); its metrics."""
        self.state, metrics = self.step.compiled(self.state, batch, self.flags)
        self.steps_done += 1
        return metrics

    def run(self, n: int) -> list[float]:
        """`n` steps on the batches in turn, each waited for (:func:`step_times`); their wall times."""
        self.state, times = step_times(self.step.compiled, self.state, self.batches, self.flags, n, self.steps_done)
        self.steps_done += n
        return times


def materialize(cfg, batches: int = 2, variant: Callable[[Any], Any] | None = None) -> Running:
    """`cfg`'s experiment built (:func:`meshpar.run.experiment.build`), its first `batches` train
    batches placed by its feeder, and the train step of its built step compiled (with `variant`),
    ready to run on its real state."""
    from meshpar.processes import stop  # here: see the module docstring
    from meshpar.run import experiment

    start = time.perf_counter()
    exp = experiment.build(cfg)
    build_s = time.perf_counter() - start
    placed = [exp.inputs.feeder.place(exp.inputs.train.batch(i))[0] for i in range(batches)]
    step = _compiled(exp.step, variant)
    state, exp.state = exp.state, None  # donated to the steps
    return Running(exp, step, state, placed, stop.make_flags(exp.mesh, 0), build_s)


# ---------------------------------------------------------------------------------------------
# Statistics


def bootstrap_median(values: Sequence[float], rng: np.random.Generator | None = None, samples: int = 10_000):
    """(low, high): the 95% bootstrap interval of the median of `values` (`samples` resamples
    with replacement). One `rng` for a whole run keeps its intervals on one seeded stream; by
    default a generator seeded 0."""
    rng = np.random.default_rng(0) if rng is None else rng
    values = np.asarray(values, dtype=float)
    medians = np.median(rng.choice(values, (samples, len(values))), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's on the average ranks (ties share theirs); 0 when
    either sequence is constant."""

    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(list(xs)), ranks(list(ys))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else 0.0


# ---------------------------------------------------------------------------------------------
# XLA's figures


def memory_analysis(compiled) -> dict:
    """XLA's ``memory_analysis()`` of a compiled program, per device: every ``*_in_bytes`` field
    (``host_*`` included) as an int."""
    # meshpar here, not at the top: importing it imports jax (see the module docstring).
    from meshpar import jax_compat

    stats = jax_compat.memory_analysis(compiled)
    return {name: int(getattr(stats, name)) for name in dir(stats) if name.endswith("_in_bytes")}


# ---------------------------------------------------------------------------------------------
# Reporting

_SPEC = re.compile(r"^(?P<align>(.?[<>=^])?)(?P<sign>[-+ ]?)(?P<zero>0?)(?P<width>\d*)(?P<rest>.*)$")


def table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence]) -> str:
    """A plain-text table. `columns` are (header, format spec) pairs, e.g. ``("step ms",
    ">.3f")`` or ``("feeder", "<")``; every column is as wide as its header or its spec's width,
    whichever is wider, and the header is aligned as the column (right unless the spec says).
    A None cell prints as ``-``."""
    specs, heads = [], []
    for header, spec in columns:
        m = _SPEC.match(spec)
        width = max(int(m["width"] or 0), len(header))
        align = m["align"][-1:] or ">"
        specs.append((f"{m['align']}{m['sign']}{m['zero']}{width}{m['rest']}", f"{align}{width}"))
        heads.append(f"{header:{align}{width}}")
    lines = [" ".join(heads)]
    for row in rows:
        cells = [f"{'-':{blank}}" if v is None else format(v, spec) for (spec, blank), v in zip(specs, row)]
        lines.append(" ".join(cells).rstrip())
    return "\n".join(lines)


def write_json(path: str | pathlib.Path, data: Any, indent: int = 2) -> pathlib.Path:
    """`data` as JSON at `path` (its folder made if missing), ending in a newline; the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path


def finish(path: str | pathlib.Path, data: Any, failures: Sequence[str], wall_s: float) -> int:
    """A checking script's end: `data` written as JSON at `path` (:func:`write_json`) and a line
    saying where and after how long (`wall_s`), then each of `failures` on stderr as a
    ``FAILED:`` line. The exit status: 1 when any check failed, else 0."""
    out = write_json(path, data)
    print(f"wrote {out} in {wall_s:.0f} s")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0

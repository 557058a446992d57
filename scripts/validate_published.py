"""The step-time model against published GPU measurements: predicted vs measured, per row.

    python scripts/validate_published.py [--published DIR] [--no-vtrain] [--sample N] [--groups N] [--memory]
        [--search] [--json rows.json] [--details all.json]

Rows (``DIR``: ``$MESHPAR_PUBLISHED``, else the ``published/`` folder beside the repository's
parent, as the development set is laid out; see its README for every source):

* ``vtrain_a100_dev.csv``: Megatron-DeepSpeed GPT iterations on 2-8 A100 SXM4 (vTrain). Each row
  becomes meshpar's ``transformer`` as Megatron's GPT (learned positions, GELU MLP of 4 × hidden,
  tied embeddings, vocabulary 50304, dropout 0.1), bf16 compute over float32 master weights,
  ``model.remat: full``, mesh ``data:D,stage:P,model:T``, layout ``batch:data; heads:model;
  d_ff:model; vocab:model; layers:stage``, ``train.microbatches`` = global / (micro × D), planned
  on ``a100-sxm-8``.
* ``jax_gpu_*.csv``: MaxText and Paxml steps on H100 and A100 clusters of 1 to 32 nodes, each row
  its model, batch, FSDP/DP split, remat policy by the framework's name, attention, XLA flags and
  cluster (node kind × nodes × network): :mod:`published_jax`. An ``fp8`` row is planned with its
  MLP and attention projections as FP8 dots (``model.fp8``), beside its bf16 partner: a bf16
  row of the same work, else the bf16 twin its source states (``published_jax.BF16_STEPS``).
  Rows meshpar cannot plan yet are listed with the reason.

Each row's train step is compiled by XLA's GPU compiler for its machine, deviceless (the
``gpu-plan`` extra), and priced by :func:`meshpar.plan.time.timing.predict`; the compiled HLO is
cached under ``--cache`` (keyed by the config, the machine, jax's version and meshpar's
program-building sources), so a rerun after a change to the time model alone compiles nothing.

Printed: per row measured and predicted; per source the MAPE, the share within 10% and the
signed mean (``jax``: the bf16 rows; ``jax fp8``; ``jax bf16 twin``); per fp8 row with a bf16
partner the step ratio bf16 / fp8, measured and predicted; per model group (same GPUs, hidden, layers, global batch; ≥ 5 rows selected) the
Spearman rank correlation of predicted and measured, and how much slower than the group's
fastest the predicted best measured; per weak-scaling series (same work per GPU, growing node
count) the growth from the fewest nodes to the most, measured and predicted. Exit 1 below the
targets — MAPE ≤ 10% on the JAX rows (bf16), each fp8 row within 15% and each bf16 / fp8 ratio
within 10% of the measured, each series' predicted growth within 5 points of the measured, MAPE ≤ 20% on the vTrain rows, Spearman ≥ 0.9 in every group, the predicted best within
10% of the fastest — 2 on bad input (a file or column missing), one line. ``--json``: a list of
``{"id", "measured_s", "predicted_s"}``, null (with ``reason``) where a row is not planned.

``--row ID`` (repeatable): only those JAX rows (an fp8 row with its bf16 partner); ``--sample N``: N vTrain rows drawn at random (seed ``--seed``); ``--groups N``: N whole groups
of ≥ 5 rows drawn at random (their rows added); ``--group NAME``: that group (as printed, e.g.
``"8xA100 h2048 L24 gb32"``; repeatable); none of them: every row. About 8 s per row to
compile on one core, nothing once cached.

``--memory``: also the analytic memory plan (:func:`meshpar.plan.memory.analytic.analytic`, the step's
total: less the batches queued outside it) against XLA's total for the same compiled step,
per vTrain row (the search filters its candidates with the plan). Target: every row within 10%.

``--search``: also ``python -m meshpar.plan --search`` (:func:`meshpar.plan.search.layouts.search`, the
top 5 compiled for the group's GPUs) on each group's model and global batch, on its machine:
the search starts from plain data parallelism (no measured layout is the config's own). Printed:
its recommendation (as ``key=value`` overrides, and as Megatron's TP, DP, PP and micro batch: a
search choice is one of Megatron's layouts when it has no FSDP, keeps the batch and the model
dims on separate axes and leaves no device idle), the group's measured times of that layout
(TP, DP, PP) at each micro batch the group has, and the first layout in its ranking that the
group measured at the micro batch the search chose. Target: the recommended layout, at its best
measured micro batch, within 10% of the group's fastest (exit 1 otherwise, or when the group
never measured that layout). A recommended micro batch the group did not measure is printed as
such: nothing says how fast it runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import random
import sys
import time

import common
import published_jax
from common import spearman
from published_jax import InputError, Row
from published_search import megatron_layout, row_layout, search_group  # noqa: F401 (the tests use them from here)

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = {"jax_mape": 0.10, "fp8_within": 0.15, "fp8_ratio_within": 0.10, "weak_scaling_points": 0.05, "vtrain_mape": 0.20, "spearman": 0.9, "best_within": 0.10,
           "memory_within": 0.10}  # fmt: skip
VTRAIN = "vtrain_a100_dev.csv"
JAX = "jax_gpu_*.csv"
VTRAIN_COLUMNS = ("# GPUs", "global batch", "micro batch", "hidden size", "attention heads", "# layers",
                  "sequence length", "tensor parallelism", "data parallelism", "pipeline parallelism",
                  "iteration time (ms)")  # fmt: skip
GROUP_MIN = 5
# Megatron pads GPT-2's 50257 tokens to a multiple of 128 (the published set's README).
MEGATRON_VOCAB = 50304


def _published_dir(arg: str | None) -> pathlib.Path:
    if arg:
        return pathlib.Path(arg)
    if os.environ.get("MESHPAR_PUBLISHED"):
        return pathlib.Path(os.environ["MESHPAR_PUBLISHED"])
    return ROOT.parent / "shared" / "published"


def _read(path: pathlib.Path, columns: tuple[str, ...]) -> list[dict]:
    return published_jax.read(path, columns, columns)


def _int(r: dict, c: str, path: str) -> int:
    try:
        return int(r[c])
    except ValueError:
        raise InputError(f"{path}: column {c!r} is {r[c]!r}, not an integer") from None


def gpt(hidden: int, heads: int, layers: int, seq: int, vocab: int, **extra) -> dict:
    """Megatron's GPT in meshpar's `transformer` family."""
    return {"name": "transformer", "d_model": hidden, "n_heads": heads, "d_head": hidden // heads,
            "d_ff": 4 * hidden, "n_layers": layers, "vocab_size": vocab, "max_length": seq, "positions": "learned",
            "tie_embeddings": True, "param_dtype": "float32", "compute_dtype": "bfloat16", **extra}  # fmt: skip


def _config(mesh: list[tuple[str, int]], layout: str, model: dict, seq: int, batch: int, microbatches: int,
            param_layout: str = "") -> dict:  # fmt: skip
    axes = [(a, n) for a, n in mesh if n > 1] or [("data", 1)]
    cfg = {
        "mesh": ",".join(f"{a}:{n}" for a, n in axes),
        "layout": "; ".join(rule for rule in layout.split("; ") if rule.split(":")[1].strip("()").split(",")[0] in dict(axes)),
        "model": model,
        "data": {"source": "text", "length": seq},
        "train": {"steps": 1, "batch_size": batch, "microbatches": microbatches},
    }  # fmt: skip
    if param_layout:
        cfg["param_layout"] = param_layout
    if "stage" in dict(axes):
        cfg["pipeline"] = {"schedule": "gpipe"}  # Megatron's 1F1B has GPipe's bubble
    return cfg


def vtrain_rows(path: pathlib.Path) -> list[Row]:
    out = []
    for r in _read(path, VTRAIN_COLUMNS):
        g, gb, mb, h, heads, layers, seq, tp, dp, pp = (_int(r, c, path.name) for c in VTRAIN_COLUMNS[:-1])
        if gb % (mb * dp):
            raise InputError(f"{path.name}: global batch {gb} is not a multiple of micro batch {mb} × data {dp}")
        layout = "batch:data; heads:model; d_ff:model; vocab:model; layers:stage"
        model = gpt(h, heads, layers, seq, MEGATRON_VOCAB, dropout=0.1, remat="full")
        cfg = _config([("data", dp), ("stage", pp), ("model", tp)], layout, model, seq, gb, gb // (mb * dp))
        name = f"{g}xA100 h{h} L{layers} gb{gb}: TP{tp} DP{dp} PP{pp} micro {mb}"
        out.append(Row("vtrain", name, f"{g}xA100 h{h} L{layers} gb{gb}", "a100-sxm-8", cfg,
                       float(r["iteration time (ms)"]) / 1e3))  # fmt: skip
    return out


def jax_rows(folder: pathlib.Path) -> list[Row]:
    """Every row of the folder's ``jax_gpu_*.csv`` files (:mod:`published_jax`)."""
    return [row for path in sorted(folder.glob(JAX)) for row in published_jax.rows(path)]


# ---------------------------------------------------------------------------------------------
# Compile (cached) and predict


def _program_sources_digest() -> str:
    """What the compiled program depends on in meshpar (every module but the planner's)."""
    h = hashlib.sha256()
    for p in sorted((ROOT / "meshpar").rglob("*.py")):
        if "plan" not in p.relative_to(ROOT / "meshpar").parts[:1]:
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _key(row: Row, digest: str) -> str:
    import jax

    text = json.dumps([row.config, row.topology, row.nodes, row.network, jax.__version__, digest], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def machine(row: Row):
    """The row's machine: its node kind, as a cluster of its nodes on its network."""
    from meshpar.plan import cluster

    return cluster.machine(row.topology, row.nodes, row.network)


def row_config(row: Row):
    """The row's meshpar config."""
    from meshpar.configuration import config as config_lib

    return config_lib.from_dict(json.loads(json.dumps(row.config)))


def compile_hlo(row: Row, cache: pathlib.Path, digest: str, need_memory: bool = False) -> tuple[str, float]:
    """The optimised HLO of the row's train step on its machine (cached), and the compile time
    (0 when cached). Beside it, XLA's memory figures of the compiled step (``.xla.json``:
    :func:`meshpar.step.aot.memory`); `need_memory`: compile again where an older cache entry lacks them."""
    import numpy as np

    from meshpar.backend import compile_cache
    from meshpar.plan import gpu_target
    from meshpar.step import aot, parts

    path = cache / f"{_key(row, digest)}.hlo"
    if path.is_file() and (not need_memory or path.with_suffix(".xla.json").is_file()):
        return path.read_text(), 0.0
    cfg = row_config(row)
    target = gpu_target.target(machine(row), cfg.mesh)
    if not target.compile_only:
        raise InputError(target.note or f"{row.topology}: XLA's GPU compiler is not available ({gpu_target.INSTALL})")
    started = time.perf_counter()
    spec = {"tokens": ((cfg.data.length + 1,), np.dtype(np.int32))}
    with compile_cache.suspended(True):
        compiled = parts.abstract_step(cfg, devices=target.devices, element_spec=spec).lower().compile()
    text = compiled.as_text()
    cache.mkdir(parents=True, exist_ok=True)
    for suffix, content in ((".xla.json", json.dumps(aot.memory(compiled))), (".hlo", text)):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(content)
        tmp.replace(path.with_suffix(suffix))
    return text, time.perf_counter() - started


def memory_ratio(row: Row, cache: pathlib.Path, digest: str) -> tuple[int, int]:
    """The analytic memory plan's step total (:func:`meshpar.plan.memory.analytic.analytic`, less the
    batches queued outside the step) and XLA's total for the row's compiled step, per device."""
    import numpy as np

    from meshpar.plan import gpu_target
    from meshpar.plan.memory import analytic as memory
    from meshpar.step import parts

    compile_hlo(row, cache, digest, need_memory=True)
    xla = json.loads((cache / f"{_key(row, digest)}.xla.json").read_text())["total_bytes"]
    cfg = row_config(row)
    target = gpu_target.target(machine(row), cfg.mesh)
    spec = {"tokens": ((cfg.data.length + 1,), np.dtype(np.int32))}
    plan = memory.analytic(parts.abstract_step(cfg, devices=target.devices, element_spec=spec))
    c = plan.categories
    return plan.total - c["queued_inputs"] - c.get("relay_inputs", 0), xla


def predict(row: Row, text: str):
    from meshpar import models
    from meshpar.plan.time import timing

    cfg = row_config(row)
    return timing.predict_program(text, dict(cfg.mesh), models.traits(cfg.model).compute_dtype, cfg.feed.prefetch,
                                  machine(row))  # fmt: skip


def price_rows(rows: list[Row], cache: pathlib.Path, digest: str) -> tuple[list[dict], list[dict], list[dict]]:
    """Each row compiled for its machine and priced, printed as it goes: (priced, failed, skipped:
    rows meshpar cannot plan yet, with the reason)."""
    results, failed, skipped = [], [], []
    print(f"{'row':60s} {'measured':>10s} {'predicted':>10s} {'error':>7s}  compute / collectives (hidden) / kernels")
    for row in rows:
        if row.unplannable:
            skipped.append({"id": row.id, "name": row.name, "reason": row.unplannable})
            print(f"{row.name:60s} not planned: {row.unplannable}", flush=True)
            continue
        try:
            text, _ = compile_hlo(row, cache, digest)
            t = predict(row, text)
        except Exception as e:  # noqa: BLE001 (one row that cannot be planned is reported, the rest go on)
            failed.append({"id": row.id, "name": row.name, "reason": " ".join(str(e).split())[:300]})
            print(f"{row.name:60s} cannot be planned: {failed[-1]['reason'][:120]}", flush=True)
            continue
        err = (t.total_s - row.measured_s) / row.measured_s
        results.append({"source": row.source, "id": row.id or row.name, "name": row.name, "group": row.group,
                        "series": row.series, "precision": row.precision, "work": row.work, "twin": row.twin, "nodes": row.nodes, "topology": machine(row).name,
                        "measured_s": row.measured_s, "predicted_s": t.total_s, "error": err,
                        "compute_s": t.compute_s, "collective_s": t.collective_s, "hidden_s": t.hidden_s,
                        "kernels": t.kernels, "launch_s": t.launch_s, "basis": t.basis, "components": t.components,
                        "collectives": [{"kind": c.kind, "axis": c.axis, "bytes": c.bytes, "seconds": c.seconds}
                                        for c in t.collectives]})  # fmt: skip
        print(f"{row.name:60s} {row.measured_s * 1e3:8.1f}ms {t.total_s * 1e3:8.1f}ms {err:+7.1%}  "
              f"{t.compute_s * 1e3:.1f} / {t.collective_s * 1e3:.1f} ({t.hidden_s * 1e3:.1f}) / {t.kernels}", flush=True)  # fmt: skip
    return results, failed, skipped


def per_row(rows: list[Row], results: list[dict], unplanned: list[dict]) -> list[dict]:
    """``[{"id", "measured_s", "predicted_s"}]`` for every row, null with the reason where not planned."""
    priced = {r["name"]: r["predicted_s"] for r in results}
    why = {u["name"]: u["reason"] for u in unplanned}
    out = []
    for row in rows:
        entry = {"id": row.id or row.name, "measured_s": row.measured_s, "predicted_s": priced.get(row.name)}
        if row.name not in priced:
            entry["reason"] = why.get(row.name, "not planned")
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------
# Statistics


def source_of(r: dict) -> str:
    """The summary's source of a priced row: ``jax`` (bf16), ``jax fp8``, ``jax bf16 twin``, ``vtrain``."""
    return (
        f"{r['source']} bf16 twin"
        if r.get("twin")
        else f"{r['source']} fp8"
        if r.get("precision") == "fp8"
        else r["source"]
    )


def fp8_ratios(results: list[dict]) -> list[dict]:
    """Per fp8 row with a bf16 partner priced (a row or twin of the same work): bf16 / fp8 step,
    measured and predicted, and the predicted ratio's error."""
    out = []
    for f in (r for r in results if r.get("precision") == "fp8"):
        partner = next((r for r in results if r.get("precision") == "bf16" and r.get("work") == f["work"]), None)
        if partner:
            measured, predicted = partner["measured_s"] / f["measured_s"], partner["predicted_s"] / f["predicted_s"]
            out.append({"fp8": f["id"], "bf16": partner["id"], "measured": measured, "predicted": predicted,
                        "error": predicted / measured - 1})  # fmt: skip
    return out


def summarize(results: list[dict]) -> dict:
    """Per source (:func:`source_of`): MAPE, share within 10%, signed mean; the fp8 rows' ratios to
    their bf16 partners; per group of ≥ GROUP_MIN rows: Spearman, and the predicted best's
    measured time over the group's fastest − 1."""
    out = {"sources": {}, "groups": {}, "weak_scaling": weak_scaling(results), "fp8_ratios": fp8_ratios(results)}
    for source in sorted({source_of(r) for r in results}):
        errs = [r["error"] for r in results if source_of(r) == source]
        out["sources"][source] = {
            "rows": len(errs), "mape": sum(abs(e) for e in errs) / len(errs),
            "within_10pct": sum(abs(e) <= 0.10 for e in errs) / len(errs), "signed_mean": sum(errs) / len(errs),
        }  # fmt: skip
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(r["group"], []).append(r)
    for name, rows in sorted(groups.items()):
        if len(rows) < GROUP_MIN:
            continue
        measured = [r["measured_s"] for r in rows]
        predicted = [r["predicted_s"] for r in rows]
        best = min(rows, key=lambda r: r["predicted_s"])
        out["groups"][name] = {
            "rows": len(rows), "spearman": spearman(predicted, measured),
            "best_slower_by": best["measured_s"] / min(measured) - 1, "predicted_best": best["name"],
        }  # fmt: skip
    return out


def weak_scaling(results: list[dict]) -> dict:
    """Per series of rows with the same work per GPU on growing node counts: the step's growth
    from the fewest nodes to the most, measured and predicted."""
    series: dict[str, list[dict]] = {}
    for r in results:
        if r.get("series"):
            series.setdefault(r["series"], []).append(r)
    out = {}
    for name, rows in sorted(series.items()):
        small, large = min(rows, key=lambda r: r["nodes"]), max(rows, key=lambda r: r["nodes"])
        if small["nodes"] == large["nodes"]:
            continue
        out[name] = {"from": small["id"], "to": large["id"],
                     "measured": large["measured_s"] / small["measured_s"] - 1,
                     "predicted": large["predicted_s"] / small["predicted_s"] - 1}  # fmt: skip
    return out


def verdict(summary: dict, fp8_rows: list[dict] = ()) -> list[str]:
    """The targets missed, one line each (empty: all met); `fp8_rows`: the priced fp8 rows."""
    missed = []
    for source, key in (("jax", "jax_mape"), ("vtrain", "vtrain_mape")):
        s = summary["sources"].get(source)
        if s and s["mape"] > TARGETS[key]:
            missed.append(f"{source}: MAPE {s['mape']:.1%} above {TARGETS[key]:.0%}")
    for r in fp8_rows:
        if abs(r["error"]) > TARGETS["fp8_within"]:
            missed.append(
                f"{r['name']}: predicted {r['error']:+.1%} from the measured, beyond {TARGETS['fp8_within']:.0%}"
            )
    for q in summary.get("fp8_ratios", []):
        if abs(q["error"]) > TARGETS["fp8_ratio_within"]:
            missed.append(f"{q['bf16']} / {q['fp8']}: predicted ratio {q['predicted']:.2f} where {q['measured']:.2f} was "
                          f"measured ({q['error']:+.1%}), beyond {TARGETS['fp8_ratio_within']:.0%}")  # fmt: skip
    for name, w in summary.get("weak_scaling", {}).items():
        if abs(w["predicted"] - w["measured"]) > TARGETS["weak_scaling_points"]:
            missed.append(f"weak scaling {name}: predicted {w['predicted']:+.1%} where {w['measured']:+.1%} was "
                          f"measured ({w['from']} -> {w['to']}), beyond {TARGETS['weak_scaling_points']:.0%} points")  # fmt: skip
    for name, g in summary["groups"].items():
        if g["spearman"] < TARGETS["spearman"]:
            missed.append(f"{name}: Spearman {g['spearman']:.2f} below {TARGETS['spearman']}")
        if g["best_slower_by"] > TARGETS["best_within"]:
            missed.append(f"{name}: the predicted best measured {g['best_slower_by']:.0%} slower than the fastest")
    return missed


# ---------------------------------------------------------------------------------------------


def only(rows: list[Row], ids: list[str]) -> list[Row]:
    """The rows of `ids` (all where none), each fp8 one with its bf16 partners (the same work)."""
    if not ids:
        return rows
    unknown = sorted(set(ids) - {r.id for r in rows})
    if unknown:
        raise InputError(f"--row {unknown[0]!r} is no row's id (e.g. {rows[0].id!r})")
    works = {r.work for r in rows if r.id in ids and r.precision == "fp8"}
    return [r for r in rows if r.id in ids or (r.work in works and r.precision == "bf16")]


def select(vtrain: list[Row], jax_: list[Row], sample: int | None, groups: int | None, seed: int,
           named: list[str] = ()) -> list[Row]:  # fmt: skip
    if sample is None and groups is None and not named:
        return jax_ + vtrain
    rng = random.Random(seed)
    chosen: dict[int, Row] = {i: r for i, r in enumerate(vtrain) if r.group in named}
    unknown = sorted(set(named) - {r.group for r in vtrain})
    if unknown:
        raise InputError(f"--group {unknown[0]!r} is no group of the rows (e.g. {vtrain[0].group!r})")
    if sample:
        for i in rng.sample(range(len(vtrain)), min(sample, len(vtrain))):
            chosen[i] = vtrain[i]
    if groups:
        by_group: dict[str, list[int]] = {}
        for i, r in enumerate(vtrain):
            by_group.setdefault(r.group, []).append(i)
        big = sorted(g for g, ids in by_group.items() if len(ids) >= GROUP_MIN)
        for g in rng.sample(big, min(groups, len(big))):
            chosen.update({i: vtrain[i] for i in by_group[g]})
    return jax_ + [chosen[i] for i in sorted(chosen)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--published", help="folder with the published rows (default: see above)")
    parser.add_argument("--sample", type=int, help="N vTrain rows at random")
    parser.add_argument("--groups", type=int, help="N whole vTrain groups of >= 5 rows at random")
    parser.add_argument("--group", action="append", default=[], help="a whole group by name (repeatable)")
    parser.add_argument("--row", action="append", default=[],
                        help="only this JAX row, by id (repeatable; an fp8 row with its bf16 partner)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-jax", action="store_true", help="leave the JAX rows out")
    parser.add_argument("--no-vtrain", action="store_true", help="leave vTrain's rows out")
    parser.add_argument("--cache", default=str(ROOT / "runs" / "published-hlo"), help="compiled HLO cache")
    parser.add_argument(
        "--json", help="write [{id, measured_s, predicted_s}] here (null, with the reason, where not planned)"
    )
    parser.add_argument("--details", help="write every row's terms, the summary and the targets here")
    parser.add_argument("--memory", action="store_true",
                        help="also the analytic memory plan against XLA's compiled step, per vTrain row")  # fmt: skip
    parser.add_argument("--search", action="store_true",
                        help="also run the layout search on each selected group's model and batch")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        folder = _published_dir(args.published)
        if not folder.is_dir():
            raise InputError(f"no published rows at {folder} (pass --published DIR or set MESHPAR_PUBLISHED)")
        vtrain = vtrain_rows(folder / VTRAIN) if (folder / VTRAIN).is_file() and not args.no_vtrain else []
        jax_ = [] if args.no_jax else only(jax_rows(folder), args.row)
        if not vtrain and not jax_:
            raise InputError(f"{folder}: no {VTRAIN} and no {JAX} rows")
    except InputError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2

    try:
        rows = select(vtrain, jax_, args.sample, args.groups, args.seed, args.group)
    except InputError as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    if args.search:  # the search plans on this host's CPU devices, one per GPU: asked for before jax starts
        from meshpar.sharding import mesh as mesh_lib

        mesh_lib.request_cpu_devices(max((int(r.group.split("x")[0]) for r in rows if r.source == "vtrain"), default=1))
    digest = _program_sources_digest()
    cache = pathlib.Path(args.cache)
    started = time.perf_counter()
    results, failed, skipped = price_rows(rows, cache, digest)
    if not results:
        print("no row could be planned", file=sys.stderr)
        return 1
    summary = summarize(results)
    print()
    for source, s in summary["sources"].items():
        print(f"{source}: {s['rows']} rows, MAPE {s['mape']:.1%}, within 10% {s['within_10pct']:.0%}, "
              f"signed mean {s['signed_mean']:+.1%}")  # fmt: skip
    for name, g in summary["groups"].items():
        print(f"group {name} ({g['rows']} rows): Spearman {g['spearman']:.2f}, predicted best "
              f"{g['predicted_best']!r} measured {g['best_slower_by']:.1%} slower than the fastest")  # fmt: skip
    for name, w in summary["weak_scaling"].items():
        print(f"weak scaling {name}: {w['from']} -> {w['to']}: measured {w['measured']:+.1%}, predicted "
              f"{w['predicted']:+.1%}")  # fmt: skip
    for q in summary["fp8_ratios"]:
        print(f"bf16 / fp8 {q['bf16']} / {q['fp8']}: measured {q['measured']:.3f}, predicted {q['predicted']:.3f} "
              f"({q['error']:+.1%})")  # fmt: skip
    fp8_rows = [r for r in results if r["precision"] == "fp8"]
    missed = verdict(summary, fp8_rows) + [f"{f['name']}: cannot be planned" for f in failed]
    memories = []
    for row in [r for r in rows if r.source == "vtrain"] if args.memory else ():
        try:
            planned, xla = memory_ratio(row, cache, digest)
        except Exception as e:  # noqa: BLE001 (one row that cannot be planned is reported, the rest go on)
            missed.append(f"{row.name}: memory cannot be planned: {' '.join(str(e).split())[:200]}")
            continue
        memories.append({"name": row.name, "analytic_bytes": planned, "xla_bytes": xla, "ratio": planned / xla})
        print(f"memory {row.name:52s} analytic {planned / 2**30:6.2f} GiB, XLA {xla / 2**30:6.2f} GiB, "
              f"{planned / xla:.3f}", flush=True)  # fmt: skip
    if memories:
        worst = max(memories, key=lambda m: abs(m["ratio"] - 1))
        within = sum(abs(m["ratio"] - 1) <= TARGETS["memory_within"] for m in memories)
        print(f"memory: {within} of {len(memories)} rows within {TARGETS['memory_within']:.0%} of XLA's; "
              f"ratios {min(m['ratio'] for m in memories):.3f}-{max(m['ratio'] for m in memories):.3f}")  # fmt: skip
        if abs(worst["ratio"] - 1) > TARGETS["memory_within"]:
            missed.append(f"memory: {len(memories) - within} rows beyond {TARGETS['memory_within']:.0%} of XLA's "
                          f"(worst {worst['name']}: {worst['ratio']:.3f})")  # fmt: skip
    searches = []
    for name in summary["groups"] if args.search else ():
        s = search_group([r for r in rows if r.group == name])
        searches.append(s)
        if "recommended" not in s:
            missed.append(f"{name}: nothing fits in the search")
            continue
        said = f"measured {s['recommended_measured_s'] * 1e3:.1f} ms" if s["recommended_measured_s"] else "not measured"
        print(
            f"search {name} ({s['seconds']:.0f} s): recommends {s['recommended']} ({s['recommended_layout']}, {said})"
        )
        if s["layout_measured"]:
            times = ", ".join(f"micro {m}: {t * 1e3:.1f} ms" for m, t in s["layout_measured"].items())
            print(f"  that layout measured at {times}; its best {s['layout_slower_by']:.1%} slower than the fastest "
                  f"({s['fastest_s'] * 1e3:.1f} ms)")  # fmt: skip
        if "first_measured" in s:
            print(f"  first layout in its ranking measured at its micro batch: #{s['first_measured_rank']} "
                  f"{s['first_measured']}, {s['first_measured_s'] * 1e3:.1f} ms, {s['slower_by']:.1%} slower")  # fmt: skip
        if s["layout_slower_by"] is None:
            missed.append(f"{name}: the search's recommended layout was not measured at any micro batch")
        elif s["layout_slower_by"] > TARGETS["best_within"]:
            missed.append(f"{name}: the search's recommended layout measured at best {s['layout_slower_by']:.0%} "
                          "slower than the fastest")  # fmt: skip
    print(
        f"{len(results)} rows priced in {time.perf_counter() - started:.0f} s; bases: "
        + "; ".join(sorted({r["basis"] for r in results}))
    )
    if args.json:
        common.write_json(args.json, per_row(rows, results, failed + skipped))
    if args.details:
        out = {"targets": TARGETS, "rows": results, "failed": failed, "skipped": skipped, "summary": summary,
               "memory": memories, "searches": searches, "missed": missed}  # fmt: skip
        common.write_json(args.details, out)
    for line in missed:
        print(f"missed: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

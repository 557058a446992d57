"""Section (e) of the GPU check and its summary: the time model's prediction next to every
measurement of sections (a)-(d), then one markdown page of the whole check.

    python scripts/device_report.py --results DIR [--command "bash scripts/device_check.sh ..."]

Reads ``DIR/{device,a_feed,plan,b_gpu_lm,c_feeding,f_kernels,d_offload,d_unified_memory}.json`` and ``DIR/sections.tsv``
(section, exit status, wall seconds, budget, as ``scripts/device_check.sh`` records them); writes
``DIR/e_predictions.json`` and ``DIR/summary.md``. A missing or failed section is a row that
says so, never a missing file. Predictions come from :mod:`meshpar.plan` on the topology
``device.json`` names (``h200-sxm-1`` for one H200; ``cpu-sim`` in a dry run, measured on this
host): placement from :mod:`meshpar.plan.time.feed_time`, the step and the memory from
``python -m meshpar.plan`` (section ``plan``), unified memory and swap from ``python -m
meshpar.plan --compare-out-of-core`` (section ``d_unified_memory``, which records them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SECTIONS = ("device", "a_feed", "plan", "b_gpu_lm", "c_feeding", "f_kernels", "d_offload", "d_unified_memory",
            "e_predictions")  # fmt: skip


def _read(results: pathlib.Path, name: str) -> dict:
    try:
        return json.loads((results / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {"section": name, "status": "missing", "note": f"no {name}.json (the section did not finish)"}


def _topology(device: dict):
    """The device's topology object, or None. cpu-sim is measured here on the check's devices."""
    name = device.get("topology")
    if not name:
        return None
    if name == "cpu-sim":
        import jax

        jax.config.update("jax_num_cpu_devices", device["devices"])
    from meshpar.plan import topology

    return topology.load(name, devices=device["devices"] if name == "cpu-sim" else None)


def _ratio(measured, predicted):
    return measured / predicted if measured is not None and predicted else None


def predictions(sections: dict) -> dict:
    """Every measured quantity that the time and memory models predict, with the prediction."""
    device = sections["device"]
    out = {"section": "e_predictions", "topology": device.get("topology"), "rows": []}
    if device.get("status") != "ok" or not device.get("topology"):
        return {**out, "status": "skipped", "note": f"skipped: no topology for {device.get('note', 'these devices')}"}
    try:
        topo = _topology(device)
    except Exception as e:
        return {**out, "status": "failed", "note": f"topology {device['topology']}: {' '.join(str(e).split())}"}
    from meshpar.plan import cost
    from meshpar.plan.time import feed_time

    rows = out["rows"]

    def add(section, quantity, measured, predicted, unit):
        rows.append({"section": section, "quantity": quantity, "measured": measured, "predicted": predicted,
                     "unit": unit, "measured_over_predicted": _ratio(measured, predicted)})  # fmt: skip

    for r in sections["a_feed"].get("rows", []):
        # bench_feed places one float32 field split over the mesh; pinned host buffers are never aliased.
        for mode in ("direct", "routed"):
            predicted = feed_time.placement_time(
                topo, mode, r["batch_bytes"], r["mesh"], r["mesh"], 1, bool(r["aliased"])
            )
            add("a", f"{mode} placement, {r['batch_mib']:g} MiB, mesh {r['mesh']}, {r['host_memory']}",
                r[f"{mode}_s"], predicted, "s")  # fmt: skip
    planned = sections["plan"].get("plan") or {}
    step = (planned.get("time") or {}).get("step") or {}
    lm = sections["b_gpu_lm"]
    if lm.get("status") == "ok":
        add("b", "gpu_lm step time (median)", lm["median_step_time_s"], step.get("total_s"), "s")
        tokens = lm["step_tokens_per_s"] * lm["median_step_time_s"]  # tokens per step
        add(
            "b",
            "gpu_lm tokens/s (per step)",
            lm["step_tokens_per_s"],
            tokens / step["total_s"] if step.get("total_s") else None,
            "1/s",
        )
        add("b", "gpu_lm peak memory per device", lm.get("memory_stats_peak_bytes"), planned.get("needed_bytes"), "B")
    from meshpar.configuration import config as config_lib

    for m in sections["c_feeding"].get("meshes", []):
        if m.get("status") != "ok":
            continue
        cfg = config_lib.load(str(ROOT / "experiments" / "quickstart.yaml"), [f"mesh={m['mesh']}"])
        split = cost.config_split(cfg, topo)
        for r in m["runs"]:
            predicted = feed_time.placement_time(topo, r["mode"], split.batch_bytes, split.num_devices, split.shards,
                                                 split.fields, split.aliased(r["mode"]))  # fmt: skip
            add("c", f"quickstart {r['mode']} placement, mesh {m['mesh']}, prefetch {r['prefetch']}",
                r["median_place_time_s"], predicted, "s")  # fmt: skip
    for name, result in (sections["d_offload"].get("results") or {}).items():
        for r in _offload_rows(result):
            for key in [k for k in r if k.startswith("predicted_")]:
                measured = r.get(key.removeprefix("predicted_"))
                if isinstance(measured, (int, float)):
                    add("d", f"{name}: {key.removeprefix('predicted_')} {r.get('name', r.get('variant', ''))}".strip(),
                        measured, r[key], "")  # fmt: skip
    for r in sections["d_unified_memory"].get("runs", []):
        what = f"{r['method']}, batch {r['batch_size']}"
        if r.get("median_step_time_s") is not None:
            add("d", f"out of core: {what}: step time (median)", r["median_step_time_s"], r["predicted"]["step_s"], "s")
        if r.get("memory_stats_peak_bytes") is not None:
            add(
                "d",
                f"out of core: {what}: peak memory ({_peak_versus(r)})",
                r["memory_stats_peak_bytes"],
                _peak_predicted(r),
                "B",
            )
    known = [r for r in rows if r["measured_over_predicted"] is not None]
    note = f"{len(known)} measurements beside their prediction on {topo.name}"
    return {**out, "status": "ok", "note": note}


def _peak_predicted(run: dict):
    """What a run's memory_stats() peak compares with: the device bytes, and under unified memory
    the migrated bytes too (its allocator counts managed memory wherever the pages lie)."""
    p = run["predicted"]
    if run["kind"] == "unified" and p.get("device_bytes") is not None:
        return p["device_bytes"] + (p.get("migrated_bytes") or 0)
    return p.get("device_bytes")


def _peak_versus(run: dict) -> str:
    return "vs device + migrated bytes" if run["kind"] == "unified" else "vs device bytes"


def _offload_rows(result) -> list[dict]:
    """The per-setting rows of one offload benchmark JSON (``results``, or ``rows``)."""
    rows = result.get("results", result.get("rows", [])) if isinstance(result, dict) else []
    return [r for r in rows if isinstance(r, dict)]


# ---- markdown ------------------------------------------------------------------------------


def _fmt(value, unit: str = "") -> str:
    if value is None:
        return "—"
    if unit == "s":
        return f"{value * 1e3:.3f} ms" if value < 1 else f"{value:.3f} s"
    if unit == "B":
        scale, name = next(
            (s, n) for s, n in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")) if abs(value) >= s or s == 1
        )
        return f"{value / scale:.2f} {name}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _times(results: pathlib.Path) -> dict[str, tuple[str, str, str]]:
    """section → (exit status, wall seconds, budget) as the shell recorded them."""
    out = {}
    try:
        for line in (results / "sections.tsv").read_text().splitlines():
            name, rc, wall, budget = line.split("\t")
            out[name] = (rc, wall, budget)
    except (OSError, ValueError):
        pass
    return out


def markdown(sections: dict, times: dict, command: str) -> str:
    device = sections["device"]
    title = "GPU check" + (" (dry run: every workload shrunk, simulated CPU devices)" if device.get("dry_run") else "")
    lines = [f"# {title}", "", f"`{command}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", ""]
    if device.get("status") == "ok":
        lines += [f"Devices: {device['devices']} x {device['device_kind']} ({device['platform']}); jax {device['jax']}, "
                  f"flax {device['flax']}, optax {device['optax']}, Python {device['python']}; time model on "
                  f"`{device.get('topology') or 'none'}`.", ""]  # fmt: skip
    lines += ["| section | status | wall (s) | budget (s) | result |", "|---|---|---|---|---|"]
    for name in SECTIONS:
        s = sections[name]
        rc, wall, budget = times.get(name, ("", f"{s.get('wall_s', '')}", f"{s.get('budget_s', '')}"))
        lines.append(f"| {name} | {s.get('status')} | {wall} | {budget} | {s.get('note', '')} |")
    total = sum(float(w) for _, w, _ in times.values() if w.replace(".", "", 1).isdigit())
    lines += ["", f"Sections' wall time together: {total:.1f} s.", ""]
    feed = sections["a_feed"]
    if feed.get("rows"):
        lines += ["## (a) host → device placement (bench_feed)", "",
                  "| MiB | mesh | host memory | direct | routed | direct GB/s | of nominal link | pinned speed-up over pageable |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in feed["rows"]:
            share = "—" if r["ratio_to_nominal"] is None else f"{r['ratio_to_nominal']:.0%}"
            lines.append(f"| {r['batch_mib']:g} | {r['mesh']} | {r['host_memory']}{' (aliased)' if r['aliased'] else ''} | "
                         f"{_fmt(r['direct_s'], 's')} | {_fmt(r['routed_s'], 's')} | {r['direct_gb_s']:.2f} | {share} | "
                         f"{_fmt(r['pinned_over_pageable'])} |")  # fmt: skip
        lines.append("")
    lm = sections["b_gpu_lm"]
    if lm.get("status") == "ok":
        mfu = "—" if lm["mfu"] is None else f"{lm['mfu']:.1%}"
        lines += ["## (b) gpu_lm", "", "| steps | mesh | median step | first step | tokens/s (wall) | MFU | peak TFLOP/s (source) | "
                  "memory_stats peak | plan needs | loss |", "|---|---|---|---|---|---|---|---|---|---|",
                  f"| {lm['steps']} | {lm['mesh']} | {_fmt(lm['median_step_time_s'], 's')} | {_fmt(lm['first_step_time_s'], 's')} | "
                  f"{lm['tokens_per_s']:,.0f} | {mfu} | {_fmt(lm['peak_tflops_per_device'])} "
                  f"({lm['peak_tflops_source']}) | {_fmt(lm['memory_stats_peak_bytes'], 'B')} | {_fmt(lm['plan_needed_bytes'], 'B')} | "
                  f"{lm['first_loss']:.3f} → {lm['final_loss']:.3f} |", ""]  # fmt: skip
    feeding = sections["c_feeding"]
    if feeding.get("meshes"):
        lines += ["## (c) routed vs direct, every mesh of the devices", ""]
        if feeding.get("coincide"):
            lines += [f"With {feeding['coincide']}.", ""]
        lines += ["| mesh | mode | prefetch | median placement | median step | stall | relay peak input bytes | losses identical |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for m in feeding["meshes"]:
            if m.get("status") != "ok":
                lines.append(f"| {m['mesh']} | {m.get('status')}: {m.get('note', '')} | | | | | | |")
                continue
            for r in m["runs"]:
                lines.append(f"| {m['mesh']} | {r['mode']} | {r['prefetch']} | {_fmt(r['median_place_time_s'], 's')} | "
                             f"{_fmt(r['median_step_time_s'], 's')} | {r['stall_fraction']:.1%} | {r['relay_peak_bytes']:,} | "
                             f"{'yes' if m['losses_identical'] else 'NO'} |")  # fmt: skip
        lines.append("")
    lines += _kernel_costs(sections["f_kernels"])
    lines += ["## (d) offload", "", sections["d_offload"].get("note", ""), ""]
    for name, result in (sections["d_offload"].get("results") or {}).items():
        rows = _offload_rows(result)
        if rows:
            lines += [f"`{name}`:", "", "| setting | median step | memory_stats peak | XLA temp (device) | XLA host bytes |",
                      "|---|---|---|---|---|"]  # fmt: skip
            for r in rows:
                xla = r.get("memory_analysis") or {}
                host = sum(v for k, v in xla.items() if k.startswith("host_") and isinstance(v, (int, float)))
                lines.append(f"| {r.get('setting', '')} | {_fmt(r.get('median_step_s'), 's')} | {_fmt(r.get('peak_bytes_in_use'), 'B')} | "
                             f"{_fmt(xla.get('temp_size_in_bytes'), 'B')} | {_fmt(host if xla else None, 'B')} |")  # fmt: skip
            lines.append("")
    lines += _unified_memory(sections["d_unified_memory"])
    pred = sections["e_predictions"]
    lines += ["## (e) the time model beside each measurement", "", pred.get("note", ""), ""]
    if pred.get("rows"):
        lines += ["| section | quantity | measured | predicted | measured / predicted |", "|---|---|---|---|---|"]
        for r in pred["rows"]:
            lines.append(f"| {r['section']} | {r['quantity']} | {_fmt(r['measured'], r['unit'])} | {_fmt(r['predicted'], r['unit'])} | "
                         f"{_fmt(r['measured_over_predicted'])} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _kernel_costs(section: dict) -> list[str]:
    """(f): the time model's components measured beside its figures (scripts/bench_kernels.py)."""
    found = section.get("results") or {}
    lines = ["## (f) kernel costs: measured beside the topology's figures", "", section.get("note", ""), ""]
    rows = [(f"GEMM {'x'.join(map(str, r['shape']))} ({r['tflops']:.0f} TFLOP/s)", r) for r in found.get("gemm", [])]
    rows += [("a kernel's fixed cost", found["launch"])] if found.get("launch") else []
    rows += (
        [(f"memory pass ({found['bandwidth']['gbps']:.0f} GB/s)", found["bandwidth"])] if found.get("bandwidth") else []
    )
    rows += [(f"all-reduce {r['bytes'] >> 20} MiB x {r['devices']}", r) for r in found.get("allreduce", [])]
    if rows:
        lines += ["| kernel | measured | predicted | measured / predicted |", "|---|---|---|---|"]
        for name, r in rows:
            lines.append(
                f"| {name} | {_fmt(r['measured_s'], 's')} | {_fmt(r.get('predicted_s'), 's')} | {_fmt(r.get('ratio'))} |"
            )
        lines.append("")
    return lines


def _planned_device(planner: dict) -> str:
    device = planner.get("device")
    return f"; {device}" if device and device != "the GPU" else ""


def _unified_memory(um: dict) -> list[str]:
    """Section (d)'s unified memory vs swap: each run's prediction beside its measurement."""
    lines = ["## (d) Unified memory vs swap", "", um.get("note", ""), ""]
    planner = um.get("planner")
    if not planner:
        return lines
    lines += [f"Batch size {um['batch_size']}, where the plan's need without offload is {planner['none_over_device']:.2f} x the "
              f"{_fmt(planner['device_bytes'], 'B')} of one device (`{um['topology']}`{_planned_device(planner)}), aiming at "
              f"{planner['factor']:g} x: the model's figures, not a measurement (steps compiled for "
              f"{planner.get('compiled_for') or '—'}). Unified memory's oversubscription: {_fmt(planner.get('oversubscription'))}.", ""]  # fmt: skip
    lines += ["| method | batch size | predicted step | measured step (median) | predicted device bytes | measured peak | "
              "migrated bytes (predicted) | host bytes (predicted) | status |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in um.get("runs", []):
        p = r["predicted"]
        status = r.get("status", "")
        if status != "ok" and r.get("note"):
            status += f": {r['note']}"
        if not p.get("fits"):
            status += "; predicted not to fit"
        lines.append(f"| {r['method']} | {r['batch_size']} | {_fmt(p.get('step_s'), 's')} | {_fmt(r.get('median_step_time_s'), 's')} | "
                     f"{_fmt(p.get('device_bytes'), 'B')} | {_fmt(r.get('memory_stats_peak_bytes'), 'B')} | "
                     f"{_fmt(p.get('migrated_bytes'), 'B')} | {_fmt(p.get('host_bytes'), 'B')} | {status} |")  # fmt: skip
    lines += ["", "Under unified memory `memory_stats()` counts managed memory wherever its pages lie, so that run's peak "
              "compares with device + migrated bytes, and its allocator limit (`bytes_limit`) reads oversubscription x "
              "the device's memory.", ""]  # fmt: skip
    refusal = um.get("refusal")
    if refusal:
        said = "refused it" if refusal["refused"] else "did NOT refuse it"
        lines += [
            f"On platform {um.get('platform')}, `meshpar.train` {said}: exit {refusal['rc']}, `{refusal['line']}`",
            "",
        ]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=pathlib.Path, required=True)
    p.add_argument("--command", default="bash scripts/device_check.sh")
    args = p.parse_args(argv)
    start = time.monotonic()
    sections = {name: _read(args.results, name) for name in SECTIONS if name != "e_predictions"}
    try:
        pred = predictions(sections)
    except Exception as e:  # a prediction's bug must not cost the summary of the measurements
        pred = {
            "section": "e_predictions",
            "status": "failed",
            "note": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
            "rows": [],
        }
    pred["wall_s"] = round(time.monotonic() - start, 2)
    (args.results / "e_predictions.json").write_text(json.dumps(pred, indent=2) + "\n")
    sections["e_predictions"] = pred
    text = markdown(sections, _times(args.results), args.command)
    (args.results / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

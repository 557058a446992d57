"""The sections of the GPU check, one subcommand each (``scripts/device_check.sh`` runs them in order).

    python scripts/device_check.py SECTION --results DIR --work DIR --seconds S [--dry-run]
    python scripts/device_check.py out-of-core-sweep --topology T --json PATH [k=v ...]

SECTION is one of:

- ``info``: the devices (platform, kind, count), versions, and the topology the time model
  predicts on (``DEVICE_CHECK_TOPOLOGY`` overrides the pick) → ``device.json``.
- ``feed`` (a): ``scripts/bench_feed.py``, pageable (aligned) and pinned host buffers: host→device
  bandwidth, pinned over pageable, and the ratio to the host link's nominal bandwidth → ``a_feed.json``.
- ``plan``: ``python -m meshpar.plan`` on ``experiments/gpu_lm.yaml`` with that topology: the
  memory plan and the predicted step time (its compile fills the compilation cache the run
  then reads) → ``plan.json``.
- ``lm`` (b): ``experiments/gpu_lm.yaml`` for a few dozen steps: step time, tokens/s, MFU
  against the bf16 peak, ``memory_stats()`` peak against the plan → ``b_gpu_lm.json``.
- ``feeding`` (c): ``python -m meshpar.compare_feeding`` (routed vs direct, prefetch 2) on the
  quickstart over every mesh of the devices present (``data:N/M,model:M``) →
  ``c_feeding.json``, rewritten as each mesh finishes; with one device it says the two coincide.
- ``offload`` (d): ``scripts/bench_offload.py`` when this tree has it → ``d_offload.json``.
- ``kernels`` (f): ``scripts/bench_kernels.py``: the time model's components measured — GEMMs
  by shape (bf16, and FP8 beside them on a GPU with FP8 tensor cores, else one skipped line), a kernel's fixed cost, memory bandwidth, all-reduce by size with two or more devices —
  each beside the topology's prediction → ``f_kernels.json``.
- ``unified`` (d): CUDA Unified Memory against host-offload swapping → ``d_unified_memory.json``.
  The planner's memory model over a geometric range of batch sizes (``out-of-core-sweep`` below)
  picks the one at which ``experiments/gpu_lm.yaml`` on one GPU needs closest to ``UM_FACTOR`` ×
  the GPU's memory without offload (the plan's figure); ``python -m meshpar.plan
  --compare-out-of-core`` prices every method at that size; then runs of ``UM_STEPS`` steps, each
  a process of its own: the plan's unified-memory row, and its fastest swap row where one fits,
  each measured (median step, ``memory_stats()`` peak) beside its prediction (step, device bytes,
  migrated bytes). Off a CUDA GPU (the dry run) it is skipped but still plans (the dry run's small
  gpu_lm on a small planned device, ``DRY_UM_DEVICE_GIB``) and records that ``meshpar.train``
  refuses the unified-memory run there (exit 2, one config error line).

Every section writes its JSON with ``status`` (ok | failed | timed out | skipped), a one-line
``note`` and ``wall_s``, also when what it runs fails or outlives its ``--seconds``; the
commands' output goes to ``<section>.log`` beside it. ``--dry-run`` shrinks every workload for
simulated CPU devices (``DRY_OVERRIDES``), so the whole check runs end to end on a laptop.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_LM = "experiments/gpu_lm.yaml"
# gpu_lm at laptop size: the same config, every dimension shrunk (the test suite runs it too).
DRY_OVERRIDES = [
    "model.d_model=128", "model.n_heads=4", "model.d_head=32", "model.d_ff=512", "model.n_layers=2",
    "model.max_length=128", "data.length=128", "data.max_bytes=1000000", "train.batch_size=8",
]  # fmt: skip
DRY_DEVICES = 2  # simulated CPU devices in a dry run: one mesh of 1, and the 2-device meshes
LM_STEPS = {False: 40, True: 4}  # a few dozen on the GPU: compile once, then steady steps
FEEDING_STEPS = {False: 30, True: 6}
OFFLOAD_STEPS = {False: 6, True: 2}
OFFLOAD_SETTINGS = "none,optimizer,params,layer_outputs"
# Unified memory vs swap: a config needing this many times one GPU's memory without offload
# (the plan's figure), where unified memory oversubscribes (1.5× by default) and pages the rest.
UM_FACTOR = 1.3
UM_STEPS = 6  # per run: the first compiles, the median of the other five is the step time
UM_TOPOLOGY = "h200-sxm-1"  # what the section predicts for off a CUDA GPU: the GPU it is written for
# The dry run plans its small gpu_lm for a 64 MiB device (hardware.memory_gib, the planner only),
# so that UM_FACTOR × the device falls inside the batch sweep as it does for gpu_lm on an H200.
DRY_UM_DEVICE_GIB = 0.0625


# ---- plumbing ------------------------------------------------------------------------------


def run(cmd: list[str], seconds: float, log: pathlib.Path, env: dict | None = None) -> tuple[int | None, str]:
    """Run `cmd` from the repository root (`env`: variables added to this environment), its
    output echoed and appended to `log`; killed with everything it started once `seconds` pass
    (returns None for the exit status then)."""
    lines: list[str] = []
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, **env} if env else None)  # fmt: skip

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                out.write(line)
                lines.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=max(seconds, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the runs it started go too
            proc.wait()
            rc = None
        reader.join(timeout=5)
    return rc, "".join(lines)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def failure(rc: int | None, seconds: float, text: str, what: str) -> dict:
    if rc is None:
        return {"status": "timed out", "note": f"{what}: still running after {seconds:.0f} s, stopped"}
    return {"status": "failed", "note": f"{what} exited {rc}: {last_line(text)}"}


def read_json(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write(results: pathlib.Path, name: str, out: dict) -> None:
    path = results / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(path)  # never a half-written file, whenever the section is stopped


# ---- topology ------------------------------------------------------------------------------


def pick_topology(platform: str, kind: str, count: int) -> str | None:
    """The shipped machine matching these devices, or None (no prediction then)."""
    if os.environ.get("DEVICE_CHECK_TOPOLOGY"):
        return os.environ["DEVICE_CHECK_TOPOLOGY"]
    if platform == "cpu":
        return "cpu-sim"
    kind = kind.upper()
    if "H200" in kind and "GH200" not in kind and "NVL" not in kind:
        return {1: "h200-sxm-1", 8: "h200-sxm-8"}.get(count)
    if "H100" in kind and "PCIE" not in kind and "NVL" not in kind and count == 8:
        return "h100-sxm-8"
    if "A100" in kind and count == 8:
        return "a100-pcie-8" if "PCIE" in kind else "a100-sxm-8"
    return None


def meshes(count: int) -> list[tuple[int, int]]:
    """Every (data, model) split of `count` devices, most data-parallel first: a mesh on an
    accelerator must use every device, so these are all the meshes the device count allows."""
    return [(count // m, m) for m in range(1, count + 1) if count % m == 0]


# ---- sections ------------------------------------------------------------------------------


def info(args) -> dict:
    import jax

    if args.dry_run:
        jax.config.update("jax_num_cpu_devices", DRY_DEVICES)
    devices = jax.devices()
    d = devices[0]
    import flax
    import optax

    stats = d.memory_stats()
    out = {
        "status": "ok", "platform": d.platform, "device_kind": d.device_kind, "devices": len(devices),
        "bytes_limit": (stats or {}).get("bytes_limit"), "dry_run": args.dry_run,
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__, "python": sys.version.split()[0],
        "topology": pick_topology(d.platform, d.device_kind, len(devices)),
    }  # fmt: skip
    # Which attention gpu_lm's `attention: cudnn` gets here (cuDNN, or blockwise where it does not apply).
    import jax.numpy as jnp
    import yaml

    from meshpar.models import attention

    model = yaml.safe_load((ROOT / GPU_LM).read_text())["model"]
    shape = (1, model["max_length"], model["n_heads"], model["d_head"])
    out["gpu_lm_attention"] = attention.resolve(model["attention"], shape, jnp.bfloat16, model["attention_block"])
    out["note"] = (f"{len(devices)} x {d.device_kind} ({d.platform}); gpu_lm attention: {out['gpu_lm_attention']}; "
                   f"time model on {out['topology'] or 'no known topology'}")  # fmt: skip
    return out


def feed(args, device: dict) -> dict:
    n = device["devices"]
    bench = [
        sys.executable,
        "scripts/bench_feed.py",
        "--host-memory",
        "aligned,pinned",
        "--out",
        str(args.work / "bench_feed.json"),
    ]
    if args.dry_run:
        bench += ["--sizes-mib", "1,4", "--meshes", f"1,{n}", "--repeats", "3", "--cpu-devices", str(n)]
    else:
        bench += ["--sizes-mib", "1,16,64,256", "--meshes", f"1,{n}", "--repeats", "7"]
    rc, text = run(bench, args.seconds, args.log)
    data = read_json(args.work / "bench_feed.json")
    if rc != 0 or data is None:
        return failure(rc, args.seconds, text, "bench_feed.py")
    nominal = nominal_link_gbps(device.get("topology"))
    pageable = {(r["batch_mib"], r["mesh"]): r["direct_s"] for r in data["rows"] if r["host_memory"] == "aligned"}
    rows = []
    for r in data["rows"]:
        nbytes = r["batch_mib"] * 2**20
        row = {k: r[k] for k in ("batch_mib", "mesh", "host_memory", "direct_s", "routed_s", "np_copy_s", "aliased")}
        row["batch_bytes"] = int(nbytes)
        row["direct_gb_s"] = nbytes / r["direct_s"] / 1e9
        # Each device has its own host link on the shipped GPU machines: the mesh's links together.
        row["ratio_to_nominal"] = row["direct_gb_s"] / (nominal * r["mesh"]) if nominal else None
        base = pageable.get((r["batch_mib"], r["mesh"]))
        row["pinned_over_pageable"] = base / r["direct_s"] if r["host_memory"] == "pinned" and base else None
        rows.append(row)
    best = max((r for r in rows if r["mesh"] == 1), key=lambda r: r["direct_gb_s"])
    note = (
        f"best one-device host→device {best['direct_gb_s']:.2f} GB/s ({best['host_memory']}, {best['batch_mib']:g} MiB)"
    )
    if nominal:
        note += f", {best['ratio_to_nominal']:.0%} of the link's nominal {nominal:g} GB/s"
    else:
        note += "; no nominal link on this machine (simulated devices share host memory)"
    if best["aliased"]:
        note += "; aliased: the host buffer was wrapped, not copied (a lower bound)"
    return {"status": "ok", "note": note, "nominal_link_gb_s": nominal, "rows": rows, "bench_feed": data}


def nominal_link_gbps(name: str | None) -> float | None:
    """The raw host→device link figure (GB/s, one direction) of a shipped topology file."""
    import yaml

    path = ROOT / "meshpar" / "plan" / "topologies" / f"{name}.yaml"
    spec = yaml.safe_load(path.read_text()) if name and path.is_file() else None
    link = (spec or {}).get("host_link")
    return float(link["gbps"]) if isinstance(link, dict) and "gbps" in link else None


def lm_overrides(args, device: dict) -> list[str]:
    # The same steps for the plan and the run: the schedule's horizon is a constant of the
    # compiled step, so only then is the plan's compile the run's (a compilation cache hit).
    out = [f"mesh=data:{device['devices']}", f"train.steps={LM_STEPS[args.dry_run]}"]
    return out + DRY_OVERRIDES if args.dry_run else out  # on a GPU: planned against XLA's allocator limit


def plan(args, device: dict) -> dict:
    topo = device.get("topology")
    cmd = [
        sys.executable,
        "-m",
        "meshpar.plan",
        "--config",
        GPU_LM,
        *lm_overrides(args, device),
        "--json",
        str(args.work / "plan.json"),
    ]
    if topo:
        cmd += ["--topology", topo]
    rc, text = run(cmd, args.seconds, args.log)
    data = read_json(args.work / "plan.json")
    if rc not in (0, 1) or data is None:  # 1 = does not fit: still a plan
        return failure(rc, args.seconds, text, "python -m meshpar.plan")
    step = (data.get("time") or {}).get("step") or {}
    note = data["verdict"]
    if step:
        note += f"; predicted step {step['total_s'] * 1e3:.1f} ms on {topo}"
    return {"status": "ok", "note": note, "topology": topo, "plan": data}


def lm(args, device: dict) -> dict:
    workdir = args.work / "gpu_lm"
    steps = LM_STEPS[args.dry_run]
    cmd = [sys.executable, "-m", "meshpar.train", "--config", GPU_LM, *lm_overrides(args, device), "train.progress=false",
           "checkpoint.every=0", f"workdir={workdir}"]  # fmt: skip
    rc, text = run(cmd, args.seconds, args.log)
    summary = read_json(workdir / "summary.json")
    if rc != 0 or summary is None:
        return failure(rc, args.seconds, text, "python -m meshpar.train (gpu_lm)")
    for name in ("summary.json", "metrics.jsonl"):  # the run's own record, beside the section's
        shutil.copy(workdir / name, args.results / f"b_gpu_lm_{name}")
    planned = read_json(args.results / "plan.json") or {}
    needed = (planned.get("plan") or {}).get("needed_bytes")
    stats = summary.get("input_memory", {}).get("memory_stats_peak_bytes_in_use")
    peak = max(stats.values()) if stats else None
    out = {
        "status": "ok", "steps": steps, "mesh": summary["mesh"],
        "median_step_time_s": summary["median_step_time_s"], "first_step_time_s": summary["first_step_time_s"],
        "tokens_per_s": summary["tokens_per_s"], "step_tokens_per_s": summary["step_tokens_per_s"],
        "mfu": summary["mfu"], "step_mfu": summary["step_mfu"], "peak_tflops_per_device": summary["peak_tflops_per_device"],
        "peak_tflops_source": summary["peak_tflops_source"], "first_loss": summary["first_loss"], "final_loss": summary["final_loss"],
        "memory_stats_peak_bytes": peak, "memory_source": "memory_stats() peak_bytes_in_use" if stats else None,
        "plan_needed_bytes": needed, "peak_over_plan": peak / needed if peak and needed else None,
    }  # fmt: skip
    mfu = (
        "no MFU (no peak for this device)"
        if out["mfu"] is None
        else f"MFU {out['mfu']:.1%} of {out['peak_tflops_per_device']:.4g} TFLOP/s"
    )
    memory = (f"memory_stats peak {peak / 2**30:.2f} GiB, plan {needed / 2**30:.2f} GiB" if peak and needed
              else "no memory_stats() on this backend (CPU): peak not measured")  # fmt: skip
    out["note"] = (
        f"median step {out['median_step_time_s'] * 1e3:.1f} ms, {out['tokens_per_s']:,.0f} tokens/s, {mfu}; {memory}"
    )
    return out


def feeding(args, device: dict) -> dict:
    n = device["devices"]
    splits = meshes(n)
    one = n == 1
    # Prefetch 2 (the default) only: two runs per mesh, each a process of its own (start-up and
    # compile dominate a short run), so one GPU's mesh takes about half the section's limit.
    prefetch = "2"
    out = {"status": "ok", "devices": n, "meshes": [], "note": ""}
    if one:
        out["coincide"] = ("one device: the relay is the only destination, so routed and direct send the same bytes over "
                           "the same link; routed only adds its slicing program on that device")  # fmt: skip
    deadline = time.monotonic() + args.seconds
    for data_n, model_n in splits:
        mesh = f"data:{data_n},model:{model_n}"
        workdir = args.work / f"feeding_{data_n}x{model_n}"
        cmd = [sys.executable, "-m", "meshpar.compare_feeding", "--config", "experiments/quickstart.yaml", "--prefetch", prefetch,
               f"mesh={mesh}", f"train.steps={FEEDING_STEPS[args.dry_run]}", "train.eval_every=0", "checkpoint.every=0",
               f"workdir={workdir}"]  # fmt: skip
        left = deadline - time.monotonic()
        if left < 5:
            out["meshes"].append({"mesh": mesh, "status": "skipped", "note": "no time left in this section"})
            continue
        rc, text = run(cmd, left, args.log)
        table = read_json(workdir / "feed_comparison.json")
        if rc in (0, 1) and table is not None:  # 1: losses differ between runs, a result too
            shutil.copy(workdir / "feed_comparison.md", args.results / f"c_feeding_{data_n}x{model_n}.md")
            out["meshes"].append({"mesh": mesh, "status": "ok", **table})
        else:
            out["meshes"].append({"mesh": mesh, **failure(rc, left, text, "compare_feeding")})
        write(args.results, "c_feeding", {**out, "section": "c_feeding", "status": "running"})
    done = [m for m in out["meshes"] if m["status"] == "ok"]
    if not done:
        out["status"] = "failed" if out["meshes"] and out["meshes"][0]["status"] == "failed" else "timed out"
    parts = []
    for m in done:
        by = {(r["mode"], r["prefetch"]): r for r in m["runs"]}
        ratio = [by[("routed", k)]["median_place_time_s"] / by[("direct", k)]["median_place_time_s"]
                 for k in (2, 0) if ("routed", k) in by and ("direct", k) in by and by[("direct", k)]["median_place_time_s"]]  # fmt: skip
        parts.append(f"{m['mesh']}: routed/direct placement {ratio[0]:.2f}x" if ratio else m["mesh"])
    out["note"] = "; ".join(parts) + (f" ({out['coincide']})" if one else "")
    return out


def offload(args, device: dict) -> dict:
    script = ROOT / "scripts" / "bench_offload.py"
    if not script.is_file():
        return {"status": "skipped", "note": "skipped: scripts/bench_offload.py is not in this tree"}
    outdir = args.work / "offload"
    cmd = [
        sys.executable,
        str(script.relative_to(ROOT)),
        "--steps",
        str(OFFLOAD_STEPS[args.dry_run]),
        "--out",
        str(outdir),
    ]
    if args.dry_run:
        cmd.append("--dry-run")  # its own shrinking: a tiny model on the CPU backend
    else:
        # The quickstart over every device present; the settings whose device memory differs
        # (each is a process of its own on a GPU: four fit the section's minute).
        cmd += ["--settings", OFFLOAD_SETTINGS, "mesh=data:-1,model:1"]
    rc, text = run(cmd, args.seconds, args.log)
    found = {p.name: read_json(p) for p in sorted(outdir.glob("*.json"))} if outdir.is_dir() else {}
    if rc != 0 or not found:
        bad = failure(rc, args.seconds, text, "bench_offload.py")
        return {"status": "skipped", "note": f"skipped: {bad['note']}", "results": found}
    settings = sum(len(r.get("results", [])) for r in found.values() if isinstance(r, dict))
    return {"status": "ok", "note": f"bench_offload.py: {settings} settings measured", "results": found}


def batch_sweep(base: int, per_doubling: int = 4, doublings: tuple[int, int] = (-1, 7), multiple: int = 8) -> list[int]:
    """Global batch sizes from ``base × 2**doublings[0]`` to ``base × 2**doublings[1]``,
    `per_doubling` to each doubling, each a multiple of `multiple`."""
    lo, hi = doublings
    return sorted({max(multiple, round(base * 2 ** (k / per_doubling) / multiple) * multiple)
                   for k in range(lo * per_doubling, hi * per_doubling + 1)})  # fmt: skip


def out_of_core_sweep(argv: list[str]) -> int:
    """``device_check.py out-of-core-sweep --topology T --json PATH [k=v ...]``: the batch size at
    which gpu_lm (under the overrides) needs closest to UM_FACTOR × one device's memory without
    offload, by the planner's memory model (:func:`meshpar.plan.out_of_core.comparison.compare` without its
    per-size compile: a compile of gpu_lm per batch size would take the check's whole budget).
    Doublings from half the config's batch size to 128 × it, then quarter-doublings inside the
    pair that brackets the target: the pick of the whole four-per-doubling range for a need that
    grows with the batch. Writes what it priced to PATH."""
    p = argparse.ArgumentParser(prog="device_check.py out-of-core-sweep")
    p.add_argument("--topology", required=True)
    p.add_argument("--json", type=pathlib.Path, required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    from meshpar.backend import compile_cache
    from meshpar.configuration import config
    from meshpar.plan import gpu_target, topology
    from meshpar.plan.out_of_core import comparison as out_of_core
    from meshpar.step import parts

    cfg = config.load(str(ROOT / GPU_LM), args.overrides)
    topo = topology.load(args.topology)
    target = gpu_target.target(topo, cfg.mesh)  # the planner's own choice of compiler and devices
    needs: dict[int, int] = {}
    with compile_cache.suspended(target.compile_only):
        mesh = parts.make_mesh(cfg, target.devices)

        def price(sizes):
            out = out_of_core.to_json(out_of_core.compare(cfg, topo, sizes, mesh, with_reference=False))
            needs.update({r["batch_size"]: r["device_bytes"] for r in out["rows"] if r["kind"] == "none"})
            return out

        out = price(batch_sweep(cfg.train.batch_size, per_doubling=1))
        target_bytes = UM_FACTOR * out["device_bytes"]
        coarse = sorted(needs)
        above = next((i for i, b in enumerate(coarse) if needs[b] >= target_bytes), None)
        if above:  # a quarter-doubling sweep between the two doublings around the target
            lo, hi = coarse[above - 1], coarse[above]
            fine = [b for b in batch_sweep(lo, doublings=(0, 1)) if lo < b < hi]
            if fine:
                price(fine)
    batch = min(needs, key=lambda b: abs(needs[b] - target_bytes))
    result = {"topology": topo.name, "device_bytes": out["device_bytes"], "usable_bytes": out["usable_bytes"],
              "oversubscription": out["oversubscription"], "factor": UM_FACTOR, "target_bytes": int(target_bytes),
              "batch_size": batch, "none_device_bytes": dict(sorted(needs.items()))}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"batch {batch}: no offload needs {needs[batch] / out['device_bytes']:.3f} x the device ({len(needs)} sizes priced)"
    )
    return 0


def is_cuda(device: dict) -> bool:
    return device.get("platform") == "gpu" and "NVIDIA" in str(device.get("device_kind", "")).upper()


def swaps(row: dict) -> bool:
    """Whether a row's overrides swap anything to host memory (an offload setting on)."""
    return any(o in ("offload.optimizer=true", "offload.params=true") or (o.startswith("offload.activations=") and o != "offload.activations=none")
               for o in row["overrides"])  # fmt: skip


def out_of_core_runs(rows: list[dict], batch: int) -> dict[str, dict]:
    """The plan's rows at `batch` that the section trains: ``unified`` (unified memory alone,
    without swapping beside it, where the plan has that row) and ``swap``, each the fastest
    predicted to fit (where none does, the one needing the least device memory), and ``none``
    (not run: the baseline that does not fit)."""
    picked = {}
    for kind in ("none", "unified", "swap"):
        rows_ = [r for r in rows if r["batch_size"] == batch and r["kind"] == kind]
        if kind == "unified":
            rows_ = [r for r in rows_ if not swaps(r)] or rows_
        fitting = [r for r in rows_ if r["fits"]]
        if fitting:
            picked[kind] = min(fitting, key=lambda r: r["step_s"])
        elif rows_:
            picked[kind] = min(rows_, key=lambda r: r["device_bytes"])
    return picked


def step_times(workdir: pathlib.Path) -> tuple[list[float], str]:
    """Every step's time of a run: its ``step_times.json``, or, for a run stopped before writing
    it, the per-step rows of its ``metrics.jsonl`` (logged every step)."""
    times = (read_json(workdir / "step_times.json") or {}).get("step_time_s")
    if times:
        return times, "step_times.json"
    rows = []
    try:
        for line in (workdir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "step_time_s" in row:
                rows.append(row["step_time_s"])
    except (OSError, ValueError):
        pass
    return rows, "metrics.jsonl (the run did not finish)"


def train_out_of_core(args, name: str, row: dict, overrides: list[str], seconds: float, env: dict | None) -> dict:
    """Train `row`'s setting (its overrides over `overrides`) and measure it beside its prediction."""
    workdir = args.work / f"unified_{name}"
    cmd = [sys.executable, "-m", "meshpar.train", "--config", GPU_LM, *overrides, *row["overrides"], "train.progress=false",
           "train.log_every=1", "train.eval_every=0", "checkpoint.every=0", f"workdir={workdir}"]  # fmt: skip
    rc, text = run(cmd, seconds, args.log, env)
    summary = read_json(workdir / "summary.json")
    times, source = step_times(workdir)
    steady = times[1:]  # the first step compiles
    stats = (summary or {}).get("input_memory", {}).get("memory_stats_peak_bytes_in_use")
    out = {
        "status": "ok", "rc": rc, "steps_timed": len(steady), "step_time_source": source if times else None,
        "first_step_time_s": times[0] if times else None,
        "median_step_time_s": statistics.median(steady) if steady else None,
        "memory_stats_peak_bytes": max(stats.values()) if stats else None,
        "memory_source": "memory_stats() peak_bytes_in_use" if stats else None,
    }  # fmt: skip
    if rc != 0 or summary is None:
        out.update(failure(rc, seconds, text, f"python -m meshpar.train ({row['method']})"))
        return out
    shutil.copy(workdir / "summary.json", args.results / f"d_unified_memory_{name}_summary.json")
    peak = (
        "no memory_stats() peak"
        if stats is None
        else f"memory_stats peak {out['memory_stats_peak_bytes'] / 2**30:.2f} GiB"
    )
    out["note"] = f"median step {out['median_step_time_s'] * 1e3:.1f} ms over {len(steady)} steps, {peak}"
    return out


def unified(args, device: dict) -> dict:
    deadline = time.monotonic() + args.seconds
    cuda = is_cuda(device)
    # One GPU (the first one visible where there are more): a mesh on an accelerator uses every device.
    env = (
        {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}
        if cuda and device["devices"] > 1
        else None
    )
    topo = (
        (device.get("topology") if device["devices"] == 1 else pick_topology("gpu", device["device_kind"], 1))
        if cuda
        else UM_TOPOLOGY
    )
    if not topo:
        return {
            "status": "skipped",
            "note": f"skipped: no topology for one {device['device_kind']}: no plan to pick the batch size",
        }
    # remat none: activation offload (swapping the residuals, the study's swap) needs it, and it
    # is what frees a step of 1.3x the device; unified memory pages the same residuals.
    base = ["mesh=data:1", "model.remat=none", *(DRY_OVERRIDES if args.dry_run else [])]
    # The runs' steps, so that the planner's compile of the chosen batch size is the unified-memory run's.
    planned_for = [
        *base,
        f"train.steps={UM_STEPS}",
        *([f"hardware.memory_gib={DRY_UM_DEVICE_GIB}"] if args.dry_run else []),
    ]
    # 1. The batch size, by the planner's memory model over a geometric range (nothing compiled).
    sweep = [sys.executable, str(pathlib.Path(__file__).resolve()), "out-of-core-sweep", "--topology", topo,
             "--json", str(args.work / "out_of_core_sweep.json"), *planned_for]  # fmt: skip
    seconds = min(deadline - time.monotonic(), 90.0)
    rc, text = run(sweep, seconds, args.log, env)
    picked_batch = read_json(args.work / "out_of_core_sweep.json")
    if rc != 0 or not picked_batch:
        return failure(rc, seconds, text, "the batch-size sweep (meshpar.plan.out_of_core.comparison)")
    batch = picked_batch["batch_size"]
    # 2. The planner's comparison at that size, its step compiled: the rows the runs are set beside.
    path = args.work / "out_of_core.json"
    cmd = [sys.executable, "-m", "meshpar.plan", "--config", GPU_LM, "--topology", topo, "--compare-out-of-core",
           "--batch-sweep", str(batch), "--json", str(path), *planned_for]  # fmt: skip
    seconds = min(deadline - time.monotonic(), 120.0)
    rc, text = run(cmd, seconds, args.log, env)
    data = read_json(path)
    if rc not in (0, 1) or not data or not data.get("rows"):
        return failure(rc, seconds, text, "python -m meshpar.plan --compare-out-of-core")
    device_bytes = data["device_bytes"]
    picked = out_of_core_runs(data["rows"], batch)
    need = picked["none"]["device_bytes"]
    out = {
        "status": "ok", "platform": device["platform"], "topology": topo, "cuda": cuda, "batch_size": batch,
        "planner": {"sweep": " ".join(["python", *sweep[1:]]), "command": " ".join(["python", *cmd[1:]]),
                    "compiled_for": data.get("compiled_for"), "device_bytes": device_bytes, "usable_bytes": data.get("usable_bytes"),
                    "oversubscription": data.get("oversubscription"), "factor": UM_FACTOR, "target_bytes": int(UM_FACTOR * device_bytes),
                    "none_over_device": need / device_bytes, "none_device_bytes": picked_batch["none_device_bytes"],
                    "device": f"hardware.memory_gib={DRY_UM_DEVICE_GIB:g}, the dry run's small device" if args.dry_run else "the GPU",
                    "source": "the plan's figures (meshpar.plan), not a measurement"},
        "rows": data["rows"],
        "runs": [{"name": k, "batch_size": batch, **{f: picked[k][f] for f in ("method", "kind", "overrides")},
                  "predicted": {f: picked[k].get(f) for f in ("step_s", "device_bytes", "host_bytes", "migrated_bytes", "fits")}}
                 for k in ("none", "unified", "swap") if k in picked],
    }  # fmt: skip
    plan_note = (f"batch {batch}: no offload needs {out['planner']['none_over_device']:.2f} x the planned device's "
                 f"{device_bytes / 2**30:.3g} GiB on {topo} (the plan's figure)")  # fmt: skip
    overrides = [
        *(o for o in base if not o.startswith("train.batch_size=")),
        f"train.steps={UM_STEPS}",
        f"train.batch_size={batch}",
    ]
    if not cuda:
        for r in out["runs"]:
            r.update(status="not run (no CUDA GPU)", note="")
        # The unified-memory run as a GPU would start it: meshpar.train must refuse it here, in one line.
        row = picked.get("unified") or {"overrides": ["offload.unified_memory=true"]}
        refuse = [sys.executable, "-m", "meshpar.train", "--config", GPU_LM, *overrides, *row["overrides"], "train.progress=false",
                  "checkpoint.every=0", f"workdir={args.work / 'unified_refused'}"]  # fmt: skip
        seconds = max(min(deadline - time.monotonic(), 60.0), 1.0)
        rc, text = run(refuse, seconds, args.log)
        line = next(
            (x.strip() for x in text.splitlines() if x.startswith("config error: offload.unified_memory")),
            last_line(text),
        )
        refused = rc == 2 and line.startswith("config error: offload.unified_memory")
        out["refusal"] = {"command": " ".join(["python", *refuse[1:]]), "rc": rc, "line": line, "refused": refused}
        if not refused:
            return {
                **out,
                "status": "failed",
                "note": f"unified memory on platform {device['platform']} was not refused: exit {rc}: {line}",
            }
        return {**out, "status": "skipped", "note": f"skipped: unified memory needs a CUDA GPU (platform {device['platform']})",
                "plan_note": plan_note}  # fmt: skip
    notes = [plan_note]
    for r in out["runs"]:
        if r["name"] == "none":
            r.update(status="not run", note=f"predicted to need {out['planner']['none_over_device']:.2f} x the device")
        elif (
            r["name"] == "swap" and not r["predicted"]["fits"]
        ):  # a certain out-of-memory: its compile's minute goes to unified memory
            usable = data.get("usable_bytes") or device_bytes
            r.update(status="not run", note=f"no swap setting fits at batch {batch}: the one needing least, {r['method']}, "
                                            f"needs {r['predicted']['device_bytes'] / usable:.2f} x the usable device")  # fmt: skip
            notes.append(f"swap: {r['note']}")
    measured = [r for r in out["runs"] if r["name"] != "none" and r.get("status") != "not run"]
    for i, r in enumerate(measured):
        left = deadline - time.monotonic()
        share = left * 0.55 if i + 1 < len(measured) else left  # unified memory first: its steps page
        if share < 10:
            r.update(status="skipped", note="no time left in this section")
        else:
            r.update(train_out_of_core(args, r["name"], r, overrides, share, env))
        notes.append(f"{r['method']}: {r['status']}{': ' + r['note'] if r.get('note') else ''}")
        write(
            args.results,
            "d_unified_memory",
            {**out, "section": "d_unified_memory", "status": "running", "note": "; ".join(notes)},
        )
    # A run the plan says does not fit may fail (the pre-flight refuses it): only the others decide the status.
    bad = [r for r in measured if r["status"] != "ok" and r["predicted"]["fits"]]
    if bad:
        out["status"] = "timed out" if all(r["status"] == "timed out" for r in bad) else "failed"
    out["note"] = "; ".join(notes)
    return out


def kernel_costs(args, device: dict) -> dict:
    """The time model's components measured (scripts/bench_kernels.py): GEMMs by shape, a
    kernel's fixed cost, memory bandwidth and, with two or more devices, all-reduce by size,
    each beside the topology's prediction."""
    out_json = args.work / "kernels.json"
    cmd = [sys.executable, "scripts/bench_kernels.py", "--json", str(out_json)]
    if device.get("topology") and device["topology"] != "cpu-sim":
        cmd += ["--topology", device["topology"]]
    if args.dry_run:
        cmd.append("--dry-run")
    rc, text = run(cmd, args.seconds, args.log)
    found = read_json(out_json)
    if rc != 0 or not found:
        return failure(rc, args.seconds, text, "bench_kernels.py")
    ratios = [r["ratio"] for r in found["gemm"] if "ratio" in r]
    spread = f"GEMM measured / predicted {min(ratios):.2f} to {max(ratios):.2f}" if ratios else "no topology to compare"
    fp8 = found.get("fp8_gemm", {"skipped": "skipped: not measured by this bench_kernels.py"})
    if "skipped" in fp8:
        spread += f"; FP8 GEMMs {fp8['skipped']}"
    elif fp8["rows"]:
        faster = [r["bf16_over_fp8"] for r in fp8["rows"] if "bf16_over_fp8" in r]
        emitted = sum(r["emitted"] for r in fp8["rows"])
        spread += (f"; FP8 GEMMs ({emitted} of {len(fp8['rows'])} emitted as FP8) bf16 / FP8 time "
                   f"{min(faster, default=0):.2f} to {max(faster, default=0):.2f}")  # fmt: skip
    return {"status": "ok", "note": f"bench_kernels.py on {found['device']}: {spread}", "results": found}


SECTIONS = {"feed": ("a_feed", feed), "plan": ("plan", plan), "lm": ("b_gpu_lm", lm),
            "feeding": ("c_feeding", feeding), "offload": ("d_offload", offload),
            "unified": ("d_unified_memory", unified), "kernels": ("f_kernels", kernel_costs)}  # fmt: skip


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["out-of-core-sweep"]:  # the unified section's helper, a process of its own
        return out_of_core_sweep(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=["info", *SECTIONS])
    p.add_argument("--results", type=pathlib.Path, required=True)
    p.add_argument("--work", type=pathlib.Path, required=True)
    p.add_argument("--seconds", type=float, default=60.0, help="this section's time budget")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    name, fn = ("device", None) if args.section == "info" else SECTIONS[args.section]
    args.log = args.results / f"{name}.log"
    start = time.monotonic()
    try:
        if fn is None:
            out = info(args)
        else:
            device = read_json(args.results / "device.json")
            if not device or device.get("status") != "ok":
                out = {"status": "skipped", "note": "skipped: no device.json (the info section failed)"}
            else:
                out = fn(args, device)
    except Exception as e:  # the section's own bug must not stop the check: it is reported
        out = {"status": "failed", "note": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    out = {"section": name, **out, "wall_s": round(time.monotonic() - start, 2), "budget_s": args.seconds}
    write(args.results, name, out)
    print(f"[{name}] {out['status']}: {out['note']}", flush=True)
    return 0 if out["status"] in ("ok", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())

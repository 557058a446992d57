"""Host offload on a config's real train step: step time, device memory and host placement, per setting.

    python scripts/bench_offload.py [--config experiments/quickstart.yaml] [--steps N] [--dry-run] [--out DIR] [k=v ...]

Settings, each the config with one ``offload`` change: ``none``; ``optimizer``; ``params``;
``optimizer+params``;
``layer_outputs`` and ``dots`` (``offload.activations``), each beside its reference
``<setting>@device``, the same names *saved* on the devices (``save_only_these_names``): the
program activation offload changes is the remat policy's, so that is what it is compared with.
For each setting the experiment is built as ``python -m meshpar.train`` builds it
(:func:`meshpar.run.experiment.build`; checkpoints, eval and the pre-flight off), its train step is
compiled ahead of time, and N steps run on the first batches, each waited for. Reported:

* the median wall time of a step (the first, warm-up, left out) and its ratio to ``none``;
* the peak device memory, ``device.memory_stats()["peak_bytes_in_use"]`` (the largest over the
  devices), where the backend reports it ("n/a (cpu)" otherwise);
* XLA's ``memory_analysis()`` of the compiled step, per device, ``host_*`` fields included;
* where the offloaded values go: per offloaded name, whether the traced program moves it to
  host memory (read from the jaxpr, :func:`meshpar.sharding.offload.names_moved_to_host`) and whether
  the compiled HLO holds a host-memory array of its value's size (by size only: names of one
  shape, such as query, key and value, are not told apart); for the whole program,
  instructions with a host-memory (``S(5)``) shape, ``copy-start`` / ``copy-done`` pairs,
  host-placement custom calls; and the state's memory kinds after the steps;
* whether the losses are bit-identical to the reference (``none``, or ``<setting>@device``).

A table is printed and ``<out>/bench_offload.json`` written. ``peak_bytes_in_use`` is a high-water
mark since the process started, so off CPU every setting runs in a process of its own, whose
XLA warnings about computing in host memory ("converting into host compute") are counted too.

**CPU shows plumbing, not savings.** The CPU backend has the memory kinds (``pinned_host``
arrays exist and survive the step) but XLA ignores memory spaces inside a computation: no bytes
move, the in-step moves compile to nothing, ``memory_analysis()`` reports no host bytes and
``memory_stats()`` nothing. On CPU (and with ``--dry-run``, which also forces the CPU backend)
the model is shrunk to a tiny one so that the whole table takes well under a minute
(``--full-model`` keeps the config's model: the losses of the real model, slowly).

Known jax / XLA bugs and limits of GPU offload, as reported upstream (open unless said otherwise),
and where they apply here:

* jax-ml/jax#21438, #16905: ``jax.device_put`` device→host outside a jitted program runs far
  below the link's bandwidth (~2.7 GB/s reported on H100 PCIe). The step's own moves are
  compiled copies, not ``device_put`` calls, so they are not affected; placing or fetching a
  whole offloaded state from Python (initialisation copies, checkpoint saves) may be.
* openxla/xla#47362: a (static) ``slice`` of a host-memory tensor is turned into host compute
  (and can fail the HLO verifier next to a ``dynamic-update-slice``). Parameter offload slices
  the layer stacks in host memory: inside the layer loop (one layer per iteration, the default
  off CPU) that is a ``dynamic-slice``, which XLA's host offloader turns into a copy; layers run
  unrolled (``model.scan_layers: false``, or ``model.scan_unroll`` = all layers) slice
  statically and may meet this. Count the host-compute warnings in the table.
* openxla/xla#34565, #47380: any other operation left on host memory (a scatter, a broadcast)
  is computed on the host with a warning, or crashes the offloader. meshpar moves every
  offloaded array to the devices before its first use; the warnings column checks it.
* jax-ml/jax#23869 / openxla/xla#17541 (closed): offloading the layer loop's carry (the block's
  output) saves nothing, the loop keeps it on the device. Here that is ``layer_in``: the program
  asks for it in host memory, the device peak may not move.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import common

# The quickstart's model shrunk for CPU and --dry-run (the byte-level text data, 16-token windows).
TINY = [
    "model.d_model=32", "model.n_heads=2", "model.d_head=16", "model.d_ff=64", "model.max_length=16",
    "data.length=16", "data.max_bytes=200000", "train.batch_size=32",
]  # fmt: skip
# What every setting runs without: outputs, eval and the memory pre-flight (a setting the plan
# refuses on this device is still measured).
QUIET = ["train.progress=false", "checkpoint.every=0", "train.eval_every=0", "plan.check=false"]
# label → (overrides, where the activation names are kept: None = not by name)
SETTINGS: dict[str, tuple[list[str], str | None]] = {
    "none": ([], None),
    "optimizer": (["offload.optimizer=true"], None),
    "params": (["offload.params=true"], None),
    "optimizer+params": (["offload.optimizer=true", "offload.params=true"], None),
    "layer_outputs": (["offload.activations=layer_outputs"], "pinned_host"),
    "layer_outputs@device": (["offload.activations=layer_outputs"], "device"),
    "dots": (["offload.activations=dots"], "pinned_host"),
    "dots@device": (["offload.activations=dots"], "device"),
}
HOST_COMPUTE = ("host compute", "in host memory space")  # XLA host offloader warnings


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/quickstart.yaml")
    p.add_argument("--steps", type=int, default=8, help="steps per setting (the first is left out of the median)")
    p.add_argument("--dry-run", action="store_true", help="CPU backend, tiny model: the whole table in seconds")
    p.add_argument("--full-model", action="store_true", help="on CPU too, the config's own model (slower; losses only)")
    p.add_argument("--out", default="runs/bench_offload", help="folder for bench_offload.json")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    p.add_argument("--one", help=argparse.SUPPRESS)  # run this one setting, print its JSON (a child process)
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p.parse_args(argv)


def _hlo_placement(text: str) -> dict:
    """What the compiled HLO shows of host memory: S(5) is the host memory space in a layout."""
    lines = text.splitlines()
    header = next((line for line in lines if line.startswith("HloModule")), "")
    body = [line for line in lines if not line.startswith("HloModule")]
    return {
        "entry_host_arrays": header.count("S(5)"),  # arguments and results placed in host memory
        "host_instructions": sum("S(5)" in line for line in body),
        "host_dynamic_update_slices": sum("S(5)" in line and "dynamic-update-slice" in line for line in body),
        "copy_start": sum(" copy-start(" in line for line in body),
        "copy_done": sum(" copy-done(" in line for line in body),
        "placement_custom_calls": sum(
            any(t in line for t in ("annotate_device_placement", "MoveToHost", "MoveToDevice")) for line in body
        ),
    }


def _host_buffer_sizes(text: str) -> set[int]:
    """Element counts of every array the compiled HLO places in host memory (``S(5)`` layouts)."""
    import re

    body = "\n".join(line for line in text.splitlines() if not line.startswith("HloModule"))  # not the arguments
    sizes = set()
    for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]\{[^}]*S\(5\)", body):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        sizes.add(n)
    return sizes


def _seen_by_size(moves: dict, sizes: set[int], layers: int, devices: int) -> dict[str, bool]:
    """Per name moved to host: whether the HLO has a host-memory array of its size (one layer's
    value or the loop's stack of them, whole or split some number of ways over the devices).
    A heuristic: names of one shape (query, key, value) cannot be told apart this way."""
    splits = [k for k in range(1, devices + 1) if devices % k == 0]
    out = {}
    for name, shape in moves.items():
        n = 1
        for d in shape:
            n *= d
        out[name] = any(total % k == 0 and total // k in sizes for total in (n, n * layers) for k in splits)
    return out


def _peak_bytes(devices) -> int | None:
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 — a backend without allocator statistics
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def run_one(label: str, args) -> dict:
    """One setting, in this process: build, compile, step; its figures as a dict."""
    import jax

    from meshpar import models
    from meshpar.configuration import config
    from meshpar.sharding import mesh as mesh_lib
    from meshpar.sharding import offload
    from meshpar.step import trainer

    overrides, memory = SETTINGS[label]
    workdir = tempfile.mkdtemp(prefix="meshpar-bench-offload-")

    def load(extra):
        return config.load(args.config, [*args.overrides, *extra, *QUIET, f"workdir={workdir}", *overrides])

    cfg = load([])
    mesh_lib.request_cpu_devices(mesh_lib.cpu_device_count(cfg.mesh))  # before the backend starts
    devices = jax.devices()
    notes, extra = [], []
    if devices[0].platform == "cpu" and not args.full_model:
        extra += TINY
        notes.append(
            "cpu: tiny model; XLA ignores memory spaces inside a computation, so no bytes move and the "
            "step times are not offload's cost (only which arrays are placed where, and the losses, mean anything)"
        )
    elif len(cfg.mesh) and all(n > 0 for _, n in cfg.mesh) and _prod(n for _, n in cfg.mesh) != len(devices):
        # A mesh for another device count: every device on the first axis, the others of size 1.
        first, *rest = (a for a, _ in cfg.mesh)
        extra.append("mesh=" + ",".join([f"{first}:-1", *(f"{a}:1" for a in rest)]))
        notes.append(f"{extra[-1]} (the config's mesh is for another device count)")
    cfg = load(extra)

    def saved_on_device(parts):  # the reference: the same names saved on the devices
        return trainer.make_train_step(
            parts.plan.graphdef, parts.tx, parts.layout, parts.mesh, parts.plan.shardings, parts.batch_shardings,
            cfg.train.microbatches, cfg.offload.activations, activations_memory="device",
        )  # fmt: skip

    running = common.materialize(cfg, min(args.steps, 4), variant=saved_on_device if memory == "device" else None)
    step, exp = running.step, running.exp
    moves = offload.host_moves(step.jaxpr())
    hlo_text = step.compiled.as_text()
    seen = _seen_by_size(moves, _host_buffer_sizes(hlo_text), getattr(cfg.model, "n_layers", 1), exp.mesh.size)
    times, losses = [], []
    for i in range(args.steps):
        t = time.perf_counter()
        metrics = running(running.batches[i % len(running.batches)])
        losses.append(float(metrics["loss"]))  # waits for the step
        times.append(time.perf_counter() - t)
    state = running.state
    asked = models.family(cfg.model.name).kept_activations(cfg.offload.activations) if memory else ()
    return {
        "setting": label,
        "overrides": overrides + ([f"(names kept in {memory})"] if memory else []),
        "notes": notes,
        "backend": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(exp.mesh.devices.flat),
        "mesh": cfg.mesh_str,
        "compile_s": step.compile_s,
        "step_s": times,
        "median_step_s": statistics.median(times[1:] or times),
        "losses": losses,
        "peak_bytes_in_use": _peak_bytes(exp.mesh.devices.flat),
        "memory_analysis": step.memory(),
        "hlo": _hlo_placement(hlo_text),
        "names_asked": list(asked),
        "names_moved_to_host": sorted(moves),
        "names_with_a_host_buffer_of_their_size_in_hlo": sorted(n for n, ok in seen.items() if ok),
        "state_memory_kinds": {
            "params": sorted(offload.memory_kinds(state.params)),
            "opt_state": sorted(offload.memory_kinds(state.opt_state)),
        },
    }


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def run_isolated(label: str, args) -> dict:
    """One setting in a process of its own: its memory_stats peak is its own."""
    cmd = [sys.executable, __file__, "--one", label, "--config", args.config, "--steps", str(args.steps)]
    cmd += [*(["--full-model"] if args.full_model else []), *args.overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    warnings = [line for line in proc.stderr.splitlines() if any(w in line for w in HOST_COMPUTE)]
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.strip().splitlines()[-1:]) or f"exit {proc.returncode}"
        return {"setting": label, "error": tail[:400], "host_compute_warnings": len(warnings)}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["host_compute_warnings"] = len(warnings)
    result["host_compute_examples"] = warnings[:3]
    return result


def _reference(label: str) -> str:
    """The setting whose losses `label`'s must equal bit for bit (itself: a reference)."""
    if label.endswith("@device"):
        return label
    return f"{label}@device" if label in ("layer_outputs", "dots") else "none"


def _mib(n) -> str:
    return "n/a (cpu)" if n is None else f"{n / 2**20:,.1f}"


def report(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    by = {r["setting"]: r for r in results}
    base = by.get("none", {}).get("median_step_s")
    table = Table(title="host offload: the train step per setting (per device)")
    left = ("setting", "names moved to host / asked", "losses")
    for name in ("setting", "step ms", "× none", "peak MiB", "XLA MiB", "XLA host MiB", "HLO host args",
                 "HLO host instr", "copy-start/done", "host-compute warnings", *left[1:]):  # fmt: skip
        table.add_column(name, justify="left" if name in left else "right")
    for r in results:
        if "error" in r:
            table.add_row(r["setting"], f"[red]failed: {r['error']}[/red]")
            continue
        ma, hlo = r["memory_analysis"], r["hlo"]
        xla = sum(ma[f"{f}_size_in_bytes"] for f in ("argument", "output", "temp")) - ma["alias_size_in_bytes"]
        host = sum(v for k, v in ma.items() if k.startswith("host_") and "alias" not in k and "generated" not in k)
        ref = by.get(_reference(r["setting"]))
        same = "reference" if ref is r else "-" if ref is None or "losses" not in ref else (
            "bit-identical" if ref["losses"] == r["losses"] else "[red]differ[/red]")  # fmt: skip
        in_hlo = set(r.get("names_with_a_host_buffer_of_their_size_in_hlo", []))
        names = ", ".join(f"{n}{'*' if n in in_hlo else ''}" for n in r["names_moved_to_host"]) or "-"
        asked = len(r["names_asked"])
        table.add_row(
            r["setting"], f"{r['median_step_s'] * 1e3:,.1f}", f"{r['median_step_s'] / base:.2f}" if base else "-",
            _mib(r["peak_bytes_in_use"]), _mib(xla), _mib(host),
            str(hlo["entry_host_arrays"]), str(hlo["host_instructions"]),
            f"{hlo['copy_start']}/{hlo['copy_done']}", str(r.get("host_compute_warnings", "-")),
            f"{names} ({len(r['names_moved_to_host'])}/{asked})" if asked else "-", same,
        )  # fmt: skip
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    for note in sorted({n for r in results for n in r.get("notes", [])}):
        console.print(f"note: {note}")
    console.print(
        "names: moved to host memory by the traced program; * = the compiled HLO holds a host-memory "
        "array of that value's size (by size only: equal shapes cannot be told apart)"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return 0
    labels = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in labels if s not in SETTINGS]
    if unknown:
        print(f"unknown setting {unknown[0]!r} (known: {', '.join(SETTINGS)})", file=sys.stderr)
        return 2
    if args.dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu"
    from meshpar.configuration.config import ConfigError

    started = time.perf_counter()
    results = []
    for label in labels:
        try:
            # On CPU nothing to isolate (no memory_stats) and one process compiles faster.
            results.append(run_one(label, args) if cpu else run_isolated(label, args))
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
    report(results)
    meta = {
        "config": args.config, "overrides": args.overrides, "steps": args.steps, "dry_run": args.dry_run,
        "wall_s": time.perf_counter() - started,
        "sources": {
            "step time": "wall clock per step, the step's loss fetched (blocking); median without the first",
            "peak_bytes_in_use": "device.memory_stats(), the largest over the mesh's devices; null where unreported",
            "memory_analysis": "XLA compiled.memory_analysis() of the train step, per device",
            "names_moved_to_host": "the traced program (jaxpr): checkpoint names whose values are put in host memory",
            "hlo": "compiled.as_text(): S(5) = host memory space; copy-start/copy-done = async copies",
        },
    }  # fmt: skip
    out = common.write_json(pathlib.Path(args.out) / "bench_offload.json", {**meta, "results": results})
    print(f"wrote {out} in {meta['wall_s']:.0f} s")
    failed = [r["setting"] for r in results if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

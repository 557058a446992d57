"""Routed vs direct feeding in one process: batch placement alone, or whole train steps.

Every figure of a feeder comes from the library's feeders themselves (``input_pipeline.feeding``:
``direct``, ``routed``, and any other ``Feeder`` subclass given as ``--feeder
LABEL=MODULE:CLASS``, e.g. an earlier implementation): their own timing of each placement
(``Placement.seconds``: host batch in → every array ready on its devices), the bytes the host
sent to the relay device (the mesh's first; ``Placement.relay_bytes``) and the peak input bytes
each device held (the feeder's live-buffer ledger, ``Feeder.memory_report()``: the relay's, and
the largest of any other device). Everything runs in this one process, so every ratio compares
runs on the same machine at the same time. Prints a table and writes JSON (``--out``). It sets
no target: exit 0, or 2 with one line for a config error.

**Placement** (the default): for each global batch size (``--sizes-mib``, float32 rows of
16 KiB) and data-axis mesh (``--meshes``), with nothing else running: ``np.copy`` of the same
bytes (the host memory limit), the host loader alone (gather rows into a batch) and each
feeder's placement of the batch, medians over ``--repeats`` after one warm-up. Host buffers
(``--host-memory``):

- ``aligned``: pageable numpy memory on a 64-byte boundary. On CPU, placement may then alias
  the buffer instead of copying it (the ``aliased`` column says when): a lower bound, not a copy.
- ``unaligned``: pageable numpy memory 8 bytes off that boundary, which forces a real copy.
- ``pinned``: JAX arrays in pinned host memory (``memory_kind="pinned_host"``), what a GPU's
  DMA engine reads fastest. Feeders take numpy batches, so here ``direct`` is one
  ``device_put`` to the batch's sharding and ``routed`` one to the relay and one from there,
  timed from outside (no ledger: no relay bytes; other feeders are not run).

**Steps** (``--config X [section.key=value ...]``): one experiment is built from the config
(its mesh, layout, model, optimizer, batch shardings; in a temporary workdir) and its train step
compiled ahead of time (``scripts/common.py``); then, in alternating blocks of ``--block`` steps
(the order of the feeders flips every round), each feeder places the host batch of the next
step and the compiled train step runs on it, its loss
fetched before the next batch is placed (``feed.prefetch=0``: placement is on the step's
critical path). A step's time is host batch ready → placed → stepped → loss on the host; the
host loader's own time is left out (it is the same for every feeder). Every feeder trains the
same state in turn, so all see the same program and the same data sizes. Reported per feeder:
the median step and placement times, and the median of the per-round ratios against direct with
a 95% interval (bootstrap over rounds).

    python scripts/bench_feed.py                                  # placement; CPU: 8 simulated devices
    python scripts/bench_feed.py --sizes-mib 1,16,64 --meshes 2,4,8 --out runs/bench_feed.json
    python scripts/bench_feed.py --config experiments/mlp_model_parallel.yaml \\
        model.hidden=[1024] train.batch_size=256 optimizer.name=sgd   # whole steps

``python -m meshpar.compare_feeding`` compares the two end to end instead: whole runs, each in a
process of its own, at several prefetch depths, with plots.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import statistics
import sys
import tempfile
import time

import common
import numpy as np

import meshpar  # noqa: F401 - before anything imports jax: it quiets jax's CUDA plugin where no GPU is
from input_pipeline.batching import HostLoader, aligned_empty
from input_pipeline.feeding import FEEDERS
from meshpar.configuration import config as config_lib
from meshpar.configuration import errors
from meshpar.sharding import mesh as mesh_lib

ROW_FLOATS = 4096  # 16 KiB per example row, so a batch of B MiB has 64·B rows
MEMORIES = ("aligned", "unaligned", "pinned")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="time whole train steps of this experiment (else: placement alone)")
    p.add_argument(
        "--feeder",
        action="append",
        default=[],
        metavar="LABEL=MODULE:CLASS",
        help="another Feeder class to time beside direct and routed (repeatable)",
    )
    p.add_argument("--out", help="the JSON (default runs/bench_feed.json; with --config, runs/bench_feed_steps.json)")
    placement = p.add_argument_group("placement")
    placement.add_argument("--sizes-mib", default="1,4,16,64", help="global batch sizes in MiB")
    placement.add_argument("--meshes", default="2,4,8", help="data-axis sizes; capped at the device count")
    placement.add_argument("--repeats", type=int, default=7, help="timed placements per row, after one warm-up")
    placement.add_argument("--host-memory", default=",".join(MEMORIES), help="comma-separated: " + ", ".join(MEMORIES))
    placement.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices (none on accelerators)")
    steps = p.add_argument_group("steps (with --config)")
    steps.add_argument("--rounds", type=int, default=15, help="rounds; each runs one block per feeder")
    steps.add_argument("--block", type=int, default=20, help="steps per feeder per round")
    steps.add_argument("--warmup", type=int, default=5, help="steps per feeder before timing")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides (with --config)")
    args = p.parse_args(argv)
    if args.overrides and not args.config:
        p.error(f"{args.overrides[0]!r}: overrides apply to a --config")
    args.out = args.out or ("runs/bench_feed_steps.json" if args.config else "runs/bench_feed.json")
    return args


def feeder_classes(specs: list[str]) -> dict[str, type]:
    """direct, routed and every ``LABEL=MODULE:CLASS`` of `specs`, by label."""
    classes = {"direct": FEEDERS["direct"], "routed": FEEDERS["routed"]}
    for spec in specs:
        label, _, target = spec.partition("=")
        module, _, name = target.partition(":")
        if not (label and module and name):
            raise SystemExit(f"--feeder {spec!r} is not LABEL=MODULE:CLASS")
        classes[label] = getattr(importlib.import_module(module), name)
    return classes


def relay_memory(feeder) -> dict:
    """The feeder's peak input bytes on its relay device and the largest on any other (its ledger)."""
    report = feeder.memory_report()
    peaks = {int(k): v for k, v in report["peak_input_bytes"].items()}
    relay = feeder.relay.id
    return {
        "relay_peak_bytes": peaks.get(relay, 0),
        "other_peak_bytes": max((v for k, v in peaks.items() if k != relay), default=0),
        "input_memory": report,
    }


# ---------------------------------------------------------------------------------------------
# Placement alone


class RowSource:
    """The benchmark's rows as a source: the loader gathers them like any dataset's."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def element_spec(self):
        return {"inputs": (self.rows.shape[1:], self.rows.dtype)}

    def read(self, indices):
        return {"inputs": self.rows[indices]}

    def read_into(self, indices, out):
        np.take(self.rows, indices, axis=0, out=out["inputs"])


def pinned_times(batch: np.ndarray, sharding, relay, repeats: int) -> dict:
    """Direct and routed placement of `batch` held in pinned host memory, timed from outside."""
    import jax
    from jax.sharding import NamedSharding

    pinned = jax.device_put(batch, NamedSharding(sharding.mesh, sharding.spec, memory_kind="pinned_host"))
    direct_s, _ = common.timed(lambda: jax.device_put(pinned, sharding), repeats)
    on_device = jax.sharding.SingleDeviceSharding(relay, memory_kind="device")
    on_relay = jax.device_put(batch, on_device.with_memory_kind("pinned_host"))
    routed_s, _ = common.timed(lambda: jax.device_put(jax.device_put(on_relay, on_device), sharding), repeats)
    return {"direct_s": direct_s, "routed_s": routed_s, "aliased": False}


def feeder_times(classes: dict, batch: dict, sharding, rows: int, repeats: int) -> dict:
    """Each feeder's median placement of `batch` (a fresh feeder each, so its ledger's peaks are
    this row's), what it sent the relay and held there."""
    out, aliased = {}, False
    for label, cls in classes.items():
        feeder = cls({"inputs": sharding}, rows)
        timed = common.placements(feeder, itertools.repeat(batch, repeats + 1), warmup=1)
        memory = relay_memory(feeder)
        out[f"{label}_s"] = statistics.median(p.seconds for p in timed)
        out[f"{label}_relay_received_bytes"] = timed[-1].relay_bytes
        out[f"{label}_relay_peak_bytes"] = memory["relay_peak_bytes"]
        out[f"{label}_other_peak_bytes"] = memory["other_peak_bytes"]
        if label == "direct":
            aliased = any(p.aliased for p in timed)
        del feeder
    return {**out, "aliased": aliased}


def placement(args, classes: dict) -> dict:
    mesh_lib.request_cpu_devices(args.cpu_devices)  # before the backend starts; only shapes the CPU client
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    meshes = sorted({min(int(m), len(devices)) for m in args.meshes.split(",")})
    memories = [m.strip() for m in args.host_memory.split(",")]
    if not set(memories) <= set(MEMORIES):
        raise SystemExit(f"--host-memory: {args.host_memory!r}: choose from {', '.join(MEMORIES)}")
    print(
        f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}); meshes {meshes}; "
        f"host memory {memories}; medians of {args.repeats} after a warm-up"
    )
    rows = []
    for mib in (float(s) for s in args.sizes_mib.split(",")):
        n = max(int(mib * 64), 8)
        host = aligned_empty((n, ROW_FLOATS), np.float32)
        host[:] = np.random.default_rng(0).standard_normal(host.shape, np.float32)
        raw = np.empty(host.nbytes + 64 + 8, np.uint8)  # the same rows, 8 bytes off alignment
        offset = (-raw.ctypes.data) % 64 + 8
        unaligned = raw[offset : offset + host.nbytes].view(np.float32).reshape(host.shape)
        unaligned[:] = host
        nbytes = host.nbytes
        copy_s, _ = common.timed(lambda: np.copy(host), args.repeats)
        loader = HostLoader(RowSource(host), n, seed=0, reuse_buffers=True)
        step = itertools.count()
        load_s, _ = common.timed(lambda: loader.batch(next(step)), args.repeats)
        for size in meshes:
            mesh = jax.make_mesh((size,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:size])
            sharding = NamedSharding(mesh, P("data", None))
            whole = (n // size) * size  # rows, split evenly over the mesh
            for memory in memories:
                batch = (unaligned if memory == "unaligned" else host)[:whole]
                row = {"batch_mib": nbytes / 2**20, "mesh": size, "host_memory": memory, "np_copy_s": copy_s}
                if memory == "pinned":
                    row.update(pinned_times(batch, sharding, devices[0], args.repeats))
                else:
                    row.update(feeder_times(classes, {"inputs": batch}, sharding, whole, args.repeats))
                row["loader_batches_per_s"] = 1.0 / load_s
                row["direct_gib_s"] = nbytes / row["direct_s"] / 2**30
                row["direct_over_copy"] = row["direct_s"] / copy_s
                for label in list(classes)[1:]:
                    seconds = row.get(f"{label}_s")
                    row[f"{label}_over_direct"] = None if seconds is None else seconds / row["direct_s"]
                rows.append(row)
    others = list(classes)[1:]
    columns = [("MiB", ">6.1f"), ("mesh", ">4"), ("host", ">9"), ("np.copy ms", ">.3f"),
               *((f"{label} ms", ">9.3f") for label in classes), ("direct GiB/s", ">.2f"), ("direct/copy", ">.2f"),
               *((f"{label}/direct", ">.2f") for label in others),
               *((f"{label} relay peak MiB", ">.3f") for label in classes), ("loader b/s", ">.1f"),
               ("aliased", "<")]  # fmt: skip

    def cells(r: dict) -> list:
        ms = {k: None if r.get(k) is None else r[k] * 1e3 for k in ("np_copy_s", *(f"{x}_s" for x in classes))}
        peak = {
            x: None if r.get(f"{x}_relay_peak_bytes") is None else r[f"{x}_relay_peak_bytes"] / 2**20 for x in classes
        }
        return [r["batch_mib"], r["mesh"], r["host_memory"], ms["np_copy_s"], *(ms[f"{x}_s"] for x in classes),
                r["direct_gib_s"], r["direct_over_copy"], *(r[f"{x}_over_direct"] for x in others),
                *peak.values(), r["loader_batches_per_s"], str(r["aliased"])]  # fmt: skip

    print(common.table(columns, map(cells, rows)))
    d = devices[0]
    return {"mode": "placement", "platform": d.platform, "device_kind": d.device_kind, "devices": len(devices),
            "repeats": args.repeats, "feeders": list(classes), "rows": rows}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Whole train steps


def steps(args, classes: dict, workdir: str) -> dict:
    cfg = config_lib.load(args.config, [*args.overrides, "feed.prefetch=0", "checkpoint.every=0", f"workdir={workdir}"])
    running = common.materialize(cfg, batches=0)  # the compiled step on the experiment's state
    exp = running.exp
    feeders = {label: cls(exp.inputs.shardings, cfg.train.batch_size) for label, cls in classes.items()}
    loader, step_index = exp.inputs.train, 0
    received = {}

    def run(label: str, n: int) -> tuple[list[float], list[float]]:
        nonlocal step_index
        totals, places = [], []
        for _ in range(n):
            host = loader.batch(step_index)
            step_index += 1
            start = time.perf_counter()
            arrays, info = feeders[label].place(host)
            float(running(arrays)["loss"])
            totals.append(time.perf_counter() - start)
            places.append(info.seconds)
            received[label] = info.relay_bytes
            del arrays
        return totals, places

    labels = list(feeders)
    for label in labels:
        run(label, args.warmup)
    place_s = {k: [] for k in labels}

    def block(label: str) -> list[float]:
        totals, places = run(label, args.block)
        place_s[label] += places
        return totals

    timed = common.timed_rounds(labels, args.rounds, block, baseline=labels.index("direct"))
    rows = []
    for label, t in zip(labels, timed):
        rows.append({
            "feeder": label,
            "median_step_ms": statistics.median(t["times"]) * 1e3,
            "median_place_ms": statistics.median(place_s[label]) * 1e3,
            "ratio_vs_direct": t["ratio"]["median"],
            "ratio_95": t["ratio"]["ci95"],
            "relay_received_bytes": received[label],
            **relay_memory(feeders[label]),
        })  # fmt: skip
    print(
        f"config {args.config} {' '.join(args.overrides)}; mesh {dict(exp.mesh.shape)}; "
        f"{args.rounds} rounds x {args.block} steps per feeder, alternating; input bytes from each feeder's ledger"
    )
    columns = [("feeder", ">16"), ("step ms", ">9.3f"), ("place ms", ">9.3f"), ("step / direct", ">.3f"),
               ("95% interval", ">16"), ("relay received B", ">,"), ("relay peak B", ">,"),
               ("other max peak B", ">,")]  # fmt: skip

    def cells(r: dict) -> list:
        return [r["feeder"], r["median_step_ms"], r["median_place_ms"], r["ratio_vs_direct"],
                "[{:.3f}, {:.3f}]".format(*r["ratio_95"]), r["relay_received_bytes"], r["relay_peak_bytes"],
                r["other_peak_bytes"]]  # fmt: skip

    print(common.table(columns, map(cells, rows)))
    return {"mode": "steps", "config": args.config, "overrides": args.overrides, "mesh": dict(exp.mesh.shape),
            "rounds": args.rounds, "block": args.block, "warmup": args.warmup, "rows": rows}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    classes = feeder_classes(args.feeder)
    if args.config:
        with tempfile.TemporaryDirectory(prefix="bench_feed-") as workdir:
            try:
                result = steps(args, classes, workdir)
            except Exception as e:  # noqa: BLE001 - a config error is one line (exit 2); anything else re-raised
                return errors.report(e)
    else:
        result = placement(args, classes)
    print(f"wrote {common.write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

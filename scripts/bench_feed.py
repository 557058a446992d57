"""Host pipeline throughput: raw host copy vs direct vs routed placement vs the host loader.

For each global batch size and mesh size, in this one process (so ratios compare runs on the
same machine at the same time): ``np.copy`` of the same bytes (the host memory limit), direct
placement, routed placement, and the host loader alone (gather rows into a batch). Host buffers (``--host-memory``):

- ``aligned``: pageable numpy memory on a 64-byte boundary. On CPU, placement may then alias
  the buffer instead of copying it (the ``aliased`` column says when): a lower bound, not a copy.
- ``unaligned``: pageable numpy memory 8 bytes off that boundary, which forces a real copy.
- ``pinned``: JAX arrays in pinned host memory (``memory_kind="pinned_host"``), what a GPU's
  DMA engine reads fastest.

    python scripts/bench_feed.py                          # CPU: 8 simulated devices
    python scripts/bench_feed.py --sizes-mib 1,16,64 --meshes 2,4,8 --out runs/bench_feed.json

Prints a table and writes JSON. Times are medians over ``--repeats`` after one warm-up, each
blocked until ready.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import numpy as np

ROW_FLOATS = 4096  # 16 KiB per example row, so a batch of B MiB has 64·B rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", default="1,4,16,64", help="global batch sizes in MiB")
    p.add_argument("--meshes", default="2,4,8", help="data-axis sizes; capped at the device count")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--host-memory", default="aligned,unaligned,pinned", help="comma-separated: aligned, unaligned, pinned"
    )
    p.add_argument("--cpu-devices", type=int, default=8, help="simulated CPU devices when there is no accelerator")
    p.add_argument("--out", default="runs/bench_feed.json")
    return p.parse_args(argv)


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


def timed(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # warm-up: compile, allocate
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
        del out
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    if not os.environ.get("JAX_PLATFORMS", "").strip() or "cpu" in os.environ.get("JAX_PLATFORMS", ""):
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from input_pipeline.batching import HostLoader, aligned_empty
    from input_pipeline.feeding import DirectFeeder, RoutedFeeder, aliases_host

    devices = jax.devices()
    meshes = sorted({min(int(m), len(devices)) for m in args.meshes.split(",")})
    memories = [m.strip() for m in args.host_memory.split(",")]
    if not set(memories) <= {"aligned", "unaligned", "pinned"}:
        raise SystemExit(f"--host-memory: {args.host_memory!r}: choose from aligned, unaligned, pinned")
    print(
        f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}); meshes {meshes}; host memory {memories}"
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
        copy_s = timed(lambda: np.copy(host), args.repeats)
        loader = HostLoader(RowSource(host), n, seed=0, reuse_buffers=True)
        step = iter(range(10**9))
        load_s = timed(lambda: loader.batch(next(step)), args.repeats)
        for size in meshes:
            mesh = jax.make_mesh((size,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices[:size])
            sharding = NamedSharding(mesh, P("data", None))
            per_device = (n // size) * size
            direct, routed = (
                DirectFeeder({"inputs": sharding}, per_device),
                RoutedFeeder({"inputs": sharding}, per_device),
            )
            for memory in memories:
                row = {"batch_mib": nbytes / 2**20, "mesh": size, "host_memory": memory, "np_copy_s": copy_s}
                batch = {"inputs": (unaligned if memory == "unaligned" else host)[:per_device]}
                if memory == "pinned":
                    pinned = jax.device_put(
                        batch["inputs"], NamedSharding(mesh, P("data", None), memory_kind="pinned_host")
                    )
                    row["direct_s"] = timed(lambda: jax.device_put(pinned, sharding), args.repeats)
                    relay = jax.sharding.SingleDeviceSharding(devices[0], memory_kind="device")
                    on_relay = jax.device_put(batch["inputs"], relay.with_memory_kind("pinned_host"))
                    row["routed_s"] = timed(
                        lambda: jax.device_put(jax.device_put(on_relay, relay), sharding), args.repeats
                    )
                    row["aliased"] = False
                else:
                    row["direct_s"] = timed(lambda: direct.place(batch)[0], args.repeats)
                    row["routed_s"] = timed(lambda: routed.place(batch)[0], args.repeats)
                    row["aliased"] = aliases_host(direct.place(batch)[0]["inputs"], batch["inputs"])
                row["loader_batches_per_s"] = 1.0 / load_s
                row["direct_gib_s"] = nbytes / row["direct_s"] / 2**30
                row["direct_over_copy"] = row["direct_s"] / copy_s
                row["routed_over_direct"] = row["routed_s"] / row["direct_s"]
                rows.append(row)
    header = f"{'MiB':>6} {'mesh':>4} {'host':>9} {'np.copy ms':>10} {'direct ms':>9} {'routed ms':>9} {'direct GiB/s':>12} {'direct/copy':>11} {'routed/direct':>13} {'loader b/s':>10} aliased"
    print(header)
    for r in rows:
        print(
            f"{r['batch_mib']:6.1f} {r['mesh']:4d} {r['host_memory']:>9} {r['np_copy_s'] * 1e3:10.3f} {r['direct_s'] * 1e3:9.3f} "
            f"{r['routed_s'] * 1e3:9.3f} {r['direct_gib_s']:12.2f} {r['direct_over_copy']:11.2f} {r['routed_over_direct']:13.2f} "
            f"{r['loader_batches_per_s']:10.1f} {r['aliased']}"
        )
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"platform": devices[0].platform, "device_kind": devices[0].device_kind, "devices": len(devices)}
    out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    sys.exit(main())

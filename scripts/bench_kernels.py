"""The time model's component costs measured on this host's first device, beside what the model
predicts for them on a topology.

    python scripts/bench_kernels.py [--topology NAME] [--json out.json] [--repeats 5] [--dry-run]

Measured, each as the median of ``--repeats`` runs after a warm-up, a run of ``REPS`` kernels
timed as one jitted program (so a run's dispatch is spread over its kernels):

* **GEMMs by shape**: bf16 ``[M, K] @ [K, N]`` for large, square and thin shapes (a
  tensor-parallel projection of few tokens, a long-K weight gradient) → achieved TFLOP/s against
  :func:`meshpar.plan.time.kernels.gemm_seconds`' prediction;
* **FP8 GEMMs** of the same shapes, on a GPU with FP8 tensor cores (else one ``skipped:`` line):
  e4m3 operands dequantized into the product (:mod:`meshpar.models.fp8`'s pattern, compiled with
  ``xla_flags.FP8_GEMMS``), whether XLA emitted a cuBLASLt FP8 GEMM for it, TFLOP/s against the
  prediction at the topology's float8 peak, and the bf16 GEMM's time over the FP8 one's;
* **the fixed cost of a kernel**: a chain of tiny dependent matrix products XLA cannot fuse
  (a product of [8, 8] matrices: next to no work), per kernel → against ``kernels.launch_us``;
* **memory bandwidth**: an elementwise pass over a large array (reads and writes every byte)
  → against ``memory_fraction`` × the datasheet bandwidth;
* **all-reduce by size** (two or more devices): ``psum`` over every local device at 1 MiB to
  256 MiB → against the link's measured curve (``device_link.allreduce_us``) or its ring model.

The topology is ``--topology``, else the shipped machine matching the devices
(``scripts/device_check.py``'s pick). Prints one table and writes the JSON (measured,
predicted, measured / predicted per row). ``--dry-run`` shrinks every size for a CPU host: the
figures are then the CPU's and only show that the benchmark runs. This measures; it sets no
target and exits 0 unless it cannot run.
"""

from __future__ import annotations

import argparse
import sys

import common

REPS = 8  # kernels per timed program
GEMMS = [  # (M, N, K): tokens × output width × contracted width
    (8192, 8192, 8192),  # large, square: the library's sustained rate
    (16384, 4096, 4096),  # a big projection
    (4096, 12288, 4096),  # qkv of d_model 4096
    (2048, 384, 1024),  # tensor-parallel qkv of d_model 1024 over 8 devices, 2 sequences of 1024
    (1024, 128, 1024),  # thinner still: a fraction of one wave of tiles
    (4096, 4096, 65536),  # a weight gradient over many tokens (long K)
]
DRY_GEMMS = [(256, 256, 256), (128, 64, 128)]


def gemms(shapes, repeats: int, topo) -> list[dict]:
    import jax
    import jax.numpy as jnp

    out = []
    for m, n, k in shapes:
        a = jnp.ones((REPS, m, k), jnp.bfloat16)
        b = jnp.ones((k, n), jnp.bfloat16)

        # REPS separate products (a loop XLA keeps as REPS kernels: each reads its own slice).
        @jax.jit
        def run(a, b):
            return jax.lax.map(lambda x: x @ b, a)

        seconds = common.timed(lambda: run(a, b).block_until_ready(), repeats)[0] / REPS  # noqa: B023
        row = {"shape": [m, n, k], "measured_s": seconds, "tflops": 2 * m * n * k / seconds / 1e12}
        out.append({**row, **_predicted(topo, (m, n, k), "bf16", "bfloat16", seconds)})
    return out


def _predicted(topo, shape: tuple[int, int, int], element_type: str, peak: str, seconds: float) -> dict:
    """The time model's seconds for one GEMM of `shape` ``(m, n, k)`` in `element_type` (the
    launch and the waves at the `peak` entry's rate) and the measured `seconds` over them; {}
    without the topology's kernel costs."""
    from meshpar.plan.time import kernels

    if topo is None or topo.kernels is None:
        return {}
    g = kernels.Gemm(1, *shape, element_type)
    predicted = topo.kernels.launch_s + kernels.gemm_seconds(g, topo.peak(peak), topo.gpu.sm_count, topo.kernels)
    return {"predicted_s": predicted, "ratio": seconds / predicted}


def launch(repeats: int, topo, chain: int) -> dict:
    """Seconds per kernel of a chain of tiny dependent products."""
    import jax
    import jax.numpy as jnp

    x = jnp.eye(8, dtype=jnp.float32)

    @jax.jit
    def run(x):
        for _ in range(chain):  # unrolled: `chain` dependent dots, none fusible with the next
            x = jnp.dot(x, x) * 0.5
        return x

    seconds = common.timed(lambda: run(x).block_until_ready(), repeats)[0] / chain
    row = {"kernels": chain, "measured_s": seconds}
    if topo is not None and topo.kernels is not None:
        row["predicted_s"] = topo.kernels.launch_s
        row["ratio"] = seconds / row["predicted_s"]
    return row


def bandwidth(nbytes: int, repeats: int, topo) -> dict:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 4,), jnp.float32)
    run = jax.jit(lambda x: x * 1.0001)
    seconds = common.timed(lambda: run(x).block_until_ready(), repeats)[0]
    moved = 2 * nbytes  # read and written
    row = {"bytes": moved, "measured_s": seconds, "gbps": moved / seconds / 1e9}
    if topo is not None and topo.kernels is not None:
        rate = topo.device_memory_bandwidth * topo.kernels.memory_fraction
        row["predicted_s"] = topo.kernels.launch_s + moved / rate
        row["ratio"] = seconds / row["predicted_s"]
    return row


def allreduce(sizes, repeats: int, topo) -> list[dict]:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from meshpar.plan import cost

    devices = jax.local_devices()
    n = len(devices)
    if n < 2:
        return []
    mesh = Mesh(np.array(devices), ("d",))
    spec = PartitionSpec("d")
    reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=spec, out_specs=spec))
    out = []
    for nbytes in sizes:
        x = jax.device_put(np.ones((n, nbytes // 4), np.float32), NamedSharding(mesh, spec))
        seconds = common.timed(lambda: reduce(x).block_until_ready(), repeats)[0]  # noqa: B023
        row = {"bytes": nbytes, "devices": n, "measured_s": seconds}
        if topo is not None:
            row["predicted_s"] = cost.collective_seconds("all-reduce", nbytes, n, topo.device_link)
            row["ratio"] = seconds / row["predicted_s"]
        out.append(row)
    return out


def fp8_gemms(shapes, repeats: int, topo, bf16: list[dict]) -> dict:
    """``{"rows": [...]}``: FP8 GEMMs by shape beside their prediction and the bf16 row of the same
    shape (`bf16`); or ``{"skipped": line}`` on a device without FP8 tensor cores."""
    import jax
    import jax.numpy as jnp

    from meshpar.backend import xla_flags
    from meshpar.models import fp8
    from meshpar.plan import fp8_check

    device = jax.local_devices()[0]
    cc = fp8_check.capability(getattr(device, "compute_capability", None))
    if device.platform != "gpu" or cc is None or cc < fp8_check.FP8_CAPABILITY:
        at = f"compute capability {cc[0]}.{cc[1]}" if cc else device.platform
        return {"skipped": f"skipped: {device.device_kind} ({at}) has no FP8 tensor cores (8.9 or later)"}
    one = jnp.float32(1.0)
    rows, bf16_s = [], {tuple(r["shape"]): r["measured_s"] for r in bf16}
    for m, n, k in shapes:
        a, b = jnp.ones((REPS, m, k), fp8.E4M3), jnp.ones((k, n), fp8.E4M3)

        def run(a, b, sa, sb):  # REPS products, each of dequantized e4m3 operands: one FP8 GEMM each
            w = fp8.dequantize(b, sb, jnp.bfloat16)
            return jax.lax.map(lambda x: fp8.dequantize(x, sa, jnp.bfloat16) @ w, a)

        compiled = jax.jit(run).lower(a, b, one, one).compile(compiler_options=dict(xla_flags.FP8_GEMMS))
        seconds = common.timed(lambda: compiled(a, b, one, one).block_until_ready(), repeats)[0] / REPS  # noqa: B023
        row = {"shape": [m, n, k], "measured_s": seconds, "tflops": 2 * m * n * k / seconds / 1e12,
               "emitted": fp8_check.CUBLAS_F8 in compiled.as_text()}  # fmt: skip
        if (m, n, k) in bf16_s:
            row["bf16_over_fp8"] = bf16_s[(m, n, k)] / seconds
        rows.append({**row, **_predicted(topo, (m, n, k), "f8e4m3fn", "float8", seconds)})
    return {"rows": rows}


def _topology(name: str | None):
    import jax

    from meshpar.plan import topology

    if name:
        return topology.load(name)
    from device_check import pick_topology  # the GPU check's pick: the same machine for the same devices

    d = jax.local_devices()[0]
    picked = pick_topology(d.platform, d.device_kind, len(jax.local_devices()))
    return None if picked in (None, topology.CPU_SIM) else topology.load(picked)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", help="the machine whose figures the measurements are set beside")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, for a CPU host")
    args = parser.parse_args(argv)
    import jax

    topo = _topology(args.topology)
    mib = 1 << 20
    out = {
        "device": jax.local_devices()[0].device_kind,
        "topology": topo.name if topo is not None else None,
        "gemm": gemms(DRY_GEMMS if args.dry_run else GEMMS, args.repeats, topo),
        "launch": launch(args.repeats, topo, 16 if args.dry_run else 256),
        "bandwidth": bandwidth(mib if args.dry_run else 2048 * mib, args.repeats, topo),
        "allreduce": allreduce([mib] if args.dry_run else [mib << k for k in range(0, 9, 2)], args.repeats, topo),
    }
    out["fp8_gemm"] = fp8_gemms(DRY_GEMMS if args.dry_run else GEMMS, args.repeats, topo, out["gemm"])

    def fmt(row: dict) -> str:
        predicted = f"{row['predicted_s'] * 1e6:10.1f} µs  ×{row['ratio']:.2f}" if "predicted_s" in row else ""
        return f"{row['measured_s'] * 1e6:10.1f} µs  {predicted}"

    print(f"on {out['device']}, against {out['topology'] or 'no topology'}: measured, predicted, measured / predicted")
    for r in out["gemm"]:
        print(f"gemm {'x'.join(map(str, r['shape'])):>20s} {r['tflops']:8.1f} TFLOP/s {fmt(r)}")
    for r in out["fp8_gemm"].get("rows", []):
        said = f"bf16 / fp8 ×{r['bf16_over_fp8']:.2f}" if "bf16_over_fp8" in r else ""
        print(f"fp8 gemm {'x'.join(map(str, r['shape'])):>16s} {r['tflops']:8.1f} TFLOP/s {fmt(r)}  {said}"
              f"{'' if r['emitted'] else '  (no FP8 GEMM emitted)'}")  # fmt: skip
    if "skipped" in out["fp8_gemm"]:
        print(f"fp8 gemm: {out['fp8_gemm']['skipped']}")
    print(f"kernel (tiny dot chain)       {fmt(out['launch'])}")
    print(f"memory {out['bandwidth']['gbps']:8.1f} GB/s            {fmt(out['bandwidth'])}")
    for r in out["allreduce"]:
        print(f"all-reduce {r['bytes'] / mib:6.0f} MiB × {r['devices']}       {fmt(r)}")
    if args.json:
        common.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

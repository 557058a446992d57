"""The planner's shared figures, each defined once: device capacity, collective cost, feed time,
the exposed feed, the batch axes and the batches resident beside a step.

The step-time model (:mod:`meshpar.plan.time.timing`), the search's analytic ranking
(:mod:`meshpar.plan.search.layouts`), the offload cost (:mod:`meshpar.plan.out_of_core.offload_cost`),
compare-feeding and the pre-flight (:mod:`meshpar.plan.preflight`) all call these.
The spec: docs/planning.md ("Capacity", "Shared figures").
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import numpy as np

from meshpar.backend.allocator import allocator_fraction
from meshpar.configuration.config import Config, ConfigError
from meshpar.plan.time import feed_time, nccl
from meshpar.step import inputs

GIB = 1 << 30
# Kept free: neither the analytic model nor XLA's figures count allocator fragmentation or the small
# buffers outside the step; a fraction, as fragmentation grows with the buffers (docs/planning.md).
HEADROOM_FRACTION = 0.05

# ---------------------------------------------------------------------------------------------
# Capacity


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Per-device memory: ``bytes`` in all, where the figure came from, and the headroom kept."""

    bytes: int
    source: str
    headroom_bytes: int
    # Under unified memory (offload.unified_memory) the device's own memory, which the
    # allocator's `bytes` oversubscribe; 0: no oversubscription (`bytes` is all on the device).
    device_bytes: int = 0

    @property
    def usable_bytes(self) -> int:
        """What a plan may use: the capacity less its headroom."""
        return self.bytes - self.headroom_bytes

    @property
    def device_usable_bytes(self) -> int:
        """What a plan may keep in the device's own memory: the usable bytes, or under unified
        memory the device's own memory less the same share of headroom."""
        if not self.device_bytes:
            return self.usable_bytes
        return self.device_bytes - int(self.device_bytes * HEADROOM_FRACTION)

    def migrated(self, need: int) -> int:
        """Bytes of a plan needing `need` that unified memory pages to host memory: what does
        not fit the device's own memory (0 without unified memory)."""
        return max(need - self.device_usable_bytes, 0) if self.device_bytes else 0


def oversubscription(cfg: Config) -> float | None:
    """The config's ``offload.oversubscription`` under unified memory, else None."""
    off = getattr(cfg, "offload", None)
    return off.oversubscription if getattr(off, "unified_memory", False) else None


def capacity(memory_bytes: int, source: str, fraction: float = 1.0) -> Capacity:
    """The capacity of a device of `memory_bytes` under an allocator that may take `fraction`
    of it, with the headroom kept: the one formula every capacity comes from. A fraction above
    1 is unified memory's oversubscription: the device's own bytes are kept beside."""
    total = int(memory_bytes * fraction)
    return Capacity(total, source, int(total * HEADROOM_FRACTION), int(memory_bytes) if fraction > 1 else 0)


def host_memory_bytes() -> int | None:
    """This host's RAM in bytes, or its cgroup's memory limit when that is lower (a container);
    None when neither can be read."""
    found = []
    try:
        found.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        found.append(int(line.split()[1]) * 1024)  # reported in kB
        except (OSError, ValueError, IndexError):
            pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            found.append(int(text))  # "max" (v2) means no limit; v1 reports a huge number then
    found = [n for n in found if n > 0]
    return min(found) if found else None


def capacity_from(
    memory_stats: Sequence[Mapping[str, int] | None],
    memory_gib: float,
    platform: str,
    host_bytes: int | None,
    oversubscription: float | None = None,
) -> Capacity:
    """The per-device capacity from what each of this process's mesh devices reports
    (``device.memory_stats()``, None where it reports nothing), ``hardware.memory_gib``
    (0 = unset), the platform and the host's RAM. Pure: the inputs are passed in. A backend
    limit already is memory × the allocator fraction (see docs/planning.md).

    `oversubscription` (unified memory, :func:`oversubscription`): the backend's limit is the
    device's memory × the fraction in effect (:func:`allocator_fraction`), and
    ``hardware.memory_gib`` the device's own memory; a CPU is a ConfigError."""
    if oversubscription is not None and platform == "cpu":
        raise ConfigError("offload.unified_memory", "needs a CUDA GPU, and this plan's devices are cpu: plan it for "
                                                    "one with --topology NAME (e.g. h100-sxm-8)")  # fmt: skip
    limits = [int(s["bytes_limit"]) for s in memory_stats if s and s.get("bytes_limit")]
    backend = None
    if limits and len(limits) == len(memory_stats):
        backend = min(limits)  # the smallest device bounds every device of the layout
        fraction = allocator_fraction(oversubscription=oversubscription)
        backend_source = f"{platform} bytes_limit (XLA's allocator; preallocated fraction {fraction[1]})"
    if oversubscription is not None:  # the device's own memory × the fraction in effect
        fraction = allocator_fraction(oversubscription=oversubscription)
        if backend is not None and memory_gib <= 0:
            return capacity(int(backend / fraction[0]), backend_source, fraction[0])
        if memory_gib > 0:
            return capacity(int(memory_gib * GIB), f"hardware.memory_gib={memory_gib:g} × {fraction[0]:g} ({fraction[1]})",
                            fraction[0])  # fmt: skip
    if memory_gib > 0:
        wanted = int(memory_gib * GIB)
        if backend is not None and backend < wanted:
            return capacity(backend, f"{backend_source}, below hardware.memory_gib={memory_gib:g}")
        return capacity(wanted, f"hardware.memory_gib={memory_gib:g}")
    if backend is not None:
        return capacity(backend, backend_source)
    n = len(memory_stats)
    if platform == "cpu" and host_bytes and n:
        return capacity(host_bytes // n, f"host RAM {host_bytes / GIB:.1f} GiB / {n} simulated cpu devices")
    raise ValueError(f"the {platform} backend reports no memory limit: set hardware.memory_gib")


def device_capacity(cfg: Config, mesh) -> Capacity:
    """The capacity of each device of `mesh` in this process, for `cfg`.

    A backend that reports no limit on a platform other than CPU, with ``hardware.memory_gib``
    unset, is a :class:`~meshpar.configuration.config.ConfigError` on that key."""
    devices = list(mesh.local_devices)
    stats = [d.memory_stats() for d in devices]  # None on CPU (jax 0.10 and 0.12)
    try:
        return capacity_from(stats, cfg.hardware.memory_gib, devices[0].platform, host_memory_bytes(),
                             oversubscription(cfg))  # fmt: skip
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError("hardware.memory_gib", str(e)) from None


def machine_capacity(cfg: Config, topo, mesh=None) -> Capacity:
    """The capacity of one device of the machine `topo`: on ``cpu-sim`` (this host's simulated
    devices, `mesh` over them) what a run checks (:func:`device_capacity`); on another machine
    its memory × the allocator fraction, or ``hardware.memory_gib`` when that is smaller."""
    if topo.device_link.kind == "memcpy" and mesh is not None:
        return device_capacity(cfg, mesh)
    over = oversubscription(cfg)
    if over is not None and topo.gpu is None and topo.device_link.kind == "memcpy":
        raise ConfigError("offload.unified_memory", f"needs a CUDA GPU, and {topo.name} has none")
    fraction, why = allocator_fraction(oversubscription=over)
    gib = cfg.hardware.memory_gib
    memory = topo.memory_bytes
    if over is not None and 0 < gib and gib * GIB < memory:  # a smaller device, oversubscribed alike
        return capacity(int(gib * GIB), f"hardware.memory_gib={gib:g} × {fraction:g} ({why})", fraction)
    machine = capacity(memory, f"{topo.name} {memory / GIB:.0f} GiB × {fraction:g} ({why})", fraction)
    if over is None and 0 < gib and gib * GIB < machine.bytes:
        return capacity(int(gib * GIB), f"hardware.memory_gib={gib:g}")
    return machine


# ---------------------------------------------------------------------------------------------
# Collectives


def ring(kind: str, n: int) -> tuple[float, int]:
    """(share of its bytes each device sends, sequential steps) of a ring `kind` on `n` devices."""
    if kind == "all-reduce":
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind == "collective-permute":
        return 1.0, 1
    return (n - 1) / n, n - 1


def axis_link(topo, mesh_shape: Mapping[str, int], axes):
    """The link a collective over `axes` (a name, ``"a,b"``, or a sequence) runs on: over
    several axes, the slowest of theirs."""
    names = axes.split(",") if isinstance(axes, str) else list(axes)
    whole = topo.axis_link(dict(mesh_shape), ",".join(names))
    if whole.span is not None:  # a group across nodes: priced whole, as NCCL lays its rings over the nodes
        return whole
    links = [topo.axis_link(dict(mesh_shape), a) for a in names]
    return min(links, key=lambda link: (link.bandwidth, -link.latency))


def collective_seconds(kind: str, nbytes: float, n: int, link, executions: int = 1) -> float:
    """Seconds of `executions` collectives of `kind` moving `nbytes` per device each over `n`
    devices on `link`: across nodes as NCCL runs it there (:mod:`meshpar.plan.time.nccl`), from
    the link's measured NCCL curve where its file gives one (:class:`meshpar.plan.time.kernels.Curve`),
    else as a ring (see docs/time-model.md)."""
    if n <= 1:
        return 0.0
    factor, steps = ring(kind, n)
    as_ring = nbytes * factor / link.bandwidth + link.latency * steps
    if getattr(link, "span", None) is not None:
        return executions * nccl.seconds(kind, nbytes, link.span, (factor, steps), ring(kind, link.span.nodes)[1])
    curve = getattr(link, "curve", None)
    if curve is not None:
        measured = curve.seconds_of(kind, nbytes, n)
        # An all-reduce curve may run faster than a ring (NVLink SHARP reduces in the switch);
        # all-gather and reduce-scatter run as rings (NVIDIA/nccl-tests#212, NCCL's team: ~370
        # GB/s ring bus bandwidth on H100 NVLink, ~480 GB/s for the NVLS all-reduce), so the
        # link's ring bounds them.
        return executions * (max(measured, as_ring) if kind in ("all-gather", "reduce-scatter") else measured)
    return executions * as_ring


# ---------------------------------------------------------------------------------------------
# Feed


def feed_seconds(cfg: Config, topo) -> float:
    """Predicted seconds to place one process batch of `cfg` on `topo` in its ``feed.mode``."""
    split = config_split(cfg, topo)
    mode = cfg.feed.mode
    return feed_time.placement_time(
        topo, mode, split.batch_bytes, split.num_devices, split.shards, split.fields, split.aliased(mode)
    )


def exposed_feed_seconds(feed_s: float, compute_s: float, prefetch: int) -> float:
    """The part of the feed a step waits for: beyond the step's compute when batches are
    placed ahead (``feed.prefetch`` ≥ 1), all of it otherwise."""
    return max(0.0, feed_s - compute_s) if prefetch >= 1 else feed_s


# ---------------------------------------------------------------------------------------------
# Batches


def batch_axes(rules) -> tuple[str, ...]:
    """The mesh axes a layout's ``batch`` rule names (a config's ``layout``, as pairs)."""
    axes = dict(rules).get("batch")
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def resident_batches(cfg: Config) -> int:
    """Batches on a device outside the step program: those placed ahead, and the one a
    dispatched step still holds under the lagged loop (none with ``train.sync_every_step``)."""
    return cfg.feed.prefetch + (0 if cfg.train.sync_every_step else 1)


# ---------------------------------------------------------------------------------------------
# The batch on a machine: its bytes and its split, without building a mesh


def example_bytes(spec: dict) -> int:
    """Bytes of one example over every field of `spec`."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in spec.values())


def process_batch_bytes(cfg: Config) -> int:
    """Bytes of the batch one process places per step: its share of ``train.batch_size``
    examples (processes split the batch evenly) × the bytes of one example."""
    rows = cfg.train.batch_size // cfg.distributed.num_processes
    return rows * example_bytes(inputs.element_spec(cfg.data, cfg.train.seed, cfg.checkpoint.init_from))


@dataclasses.dataclass(frozen=True)
class Split:
    """How a config's batch lands on a machine: devices, distinct slices, fields, bytes."""

    num_devices: int
    shards: int
    fields: int
    batch_bytes: int
    # The loader's reused 64-byte-aligned buffers (feed.reuse_buffers): a whole field starts
    # aligned; `aligned_slices`: every slice of every field does too.
    aligned_buffers: bool = False
    aligned_slices: bool = False

    def aliased(self, mode: str) -> bool:
        """Whether a placement in `mode` hands the devices host buffers they can wrap."""
        return self.aligned_buffers and (mode == "routed" or self.aligned_slices)


def config_split(cfg: Config, topo) -> Split:
    """The config's mesh on the machine `topo` (a -1 axis takes the devices left), how many
    distinct batch slices the layout makes, and the process batch's bytes. No mesh is built."""
    axes = dict(cfg.mesh)
    fixed = math.prod(n for n in axes.values() if n != -1)
    if -1 in axes.values():
        if topo.num_devices % fixed:
            raise ConfigError("mesh", f"{topo.num_devices} devices of {topo.name} do not divide by {fixed}")
        axes = {a: topo.num_devices // fixed if n == -1 else n for a, n in axes.items()}
    n = math.prod(axes.values())
    if n > topo.num_devices:
        raise ConfigError("mesh", f"needs {n} devices; topology {topo.name} has {topo.num_devices}")
    shards = math.prod(axes.get(a, 1) for a in batch_axes(cfg.layout))
    spec = inputs.element_spec(cfg.data, cfg.train.seed, cfg.checkpoint.init_from)
    rows = cfg.train.batch_size // cfg.distributed.num_processes
    slices = all(rows // shards * example_bytes({k: s}) % 64 == 0 for k, s in spec.items())
    reuse = cfg.feed.reuse_buffers
    return Split(n, shards, len(spec), rows * example_bytes(spec), reuse, reuse and slices)

"""Machines the time model predicts for: per-device peak FLOP/s and memory, host memory
bandwidth, host→device links (and which devices share a switch uplink), device↔device links.

Each shipped machine is a YAML file in ``meshpar/plan/topologies/`` with every figure's public
source in a comment beside it (vendor datasheets, the PCIe and NVLink generation bandwidths).
Figures in the files are the datasheet's raw ones; each link states the efficiency a transfer
reaches over it and why, and :class:`Link` holds the effective figure (raw × efficiency).

``cpu-sim`` is this host's simulated CPU devices, measured at first use on separate
microbenchmarks (never on the experiments a prediction is checked against):
:func:`calibrate` — memcpy bandwidth, a float32 matmul with every simulated device busy,
host→device placement, a device→device copy, and a small all-reduce at two sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time
from collections.abc import Collection

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from input_pipeline.feeding import DirectFeeder, RoutedFeeder
from meshpar.configuration.schema import ConfigError, is_number, parse_yaml
from meshpar.plan import cost
from meshpar.plan.time import kernels as kernels_lib
from meshpar.plan.time import nccl

DIR = pathlib.Path(__file__).parent / "topologies"
CPU_SIM = "cpu-sim"
KEY = "--topology"
GIB = 1 << 30
# Kinds of device↔device link: NVLink behind NVSwitch (any pair at full bandwidth), PCIe peer
# to peer (full bandwidth under one switch, the switches' uplinks shared beyond it), or staged
# through host memory (no peer-to-peer: every copy crosses both devices' PCIe links); between
# hosts, the network (``node_link``).
LINK_KINDS = ("nvlink", "pcie", "host", "memcpy", "network")
# Unified Memory's defaults, for a topology file that does not say (``unified_memory:
# {page_mib, fault_us}``): the CUDA driver migrates 2 MiB pages on x86 hosts (its large-page
# size), and servicing one fault (the GPU's fault buffer read by the driver, the page unmapped
# and mapped again) costs tens of microseconds in published measurements of the UVM driver
# (20-50 µs per batch of faults): an estimate until a device check measures it.
UM_PAGE_BYTES = 2 << 20
UM_FAULT_S = 30e-6


@dataclasses.dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, one direction, effective (raw × the efficiency its file states)
    latency: float = 0.0  # s per transfer / per collective step
    kind: str = "pcie"  # one of LINK_KINDS
    # NCCL's measured all-reduce times over this link (its file's ``allreduce_us``), which price
    # its collectives (meshpar.plan.time.kernels); None: the ring model from bandwidth and latency.
    curve: kernels_lib.Curve | None = None
    # A group that spans nodes (kind "network"): how it lies over them, which prices its
    # collectives as NCCL runs them across nodes (meshpar.plan.time.nccl).
    span: nccl.Span | None = None


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA's GPU compiler needs to know of one GPU to compile for it (its target
    description, :mod:`meshpar.plan.gpu_target`), beside the machine's memory size and bandwidth:
    datasheet and CUDA programming-guide facts, each with its source in the topology's file."""

    name: str  # as CUDA names the device, e.g. "NVIDIA H100 80GB HBM3"
    compute_capability: tuple[int, int]  # (major, minor), e.g. (9, 0)
    sm_count: int
    clock_ghz: float  # SM boost clock
    l2_cache_bytes: int
    shared_memory_per_sm: int  # bytes
    shared_memory_per_block: int  # bytes a block may opt in to
    registers_per_sm: int  # 32-bit registers
    registers_per_block: int
    threads_per_sm: int  # resident threads per SM
    fp32_lanes_per_sm: int  # FP32 CUDA cores per SM
    cuda_runtime: str  # CUDA runtime the compile assumes, "12.8.0"
    cudnn: str  # cuDNN the compile assumes, "9.8.0"


GPU_KEYS = {"name": str, "compute_capability": str, "sm_count": int, "clock_ghz": float, "l2_cache_mib": float,
            "shared_memory_per_sm_kib": int, "shared_memory_per_block_kib": int, "registers_per_sm": int,
            "registers_per_block": int, "threads_per_sm": int, "fp32_lanes_per_sm": int, "cuda_runtime": str,
            "cudnn": str}  # fmt: skip


def _version(text: str, parts: int, where: str) -> str:
    """A dotted version of at most `parts` numbers, padded with zeros ("12.8" → "12.8.0")."""
    numbers = text.split(".")
    if not 1 <= len(numbers) <= parts or not all(n.isdigit() for n in numbers):
        raise ConfigError(KEY, f"{where}: expected a version such as {'.'.join(['9', '0', '0'][:parts])}, got {text!r}")
    return ".".join(numbers + ["0"] * (parts - len(numbers)))


def gpu_spec(spec, where: str) -> GpuSpec:
    """A topology file's ``gpu:`` mapping as a GpuSpec (every key of GPU_KEYS, of its type)."""
    if not isinstance(spec, dict):
        raise ConfigError(KEY, f"{where}: expected a mapping with {', '.join(GPU_KEYS)}")
    _known_keys(spec, GPU_KEYS, where)
    values = {}
    for key, kind in GPU_KEYS.items():
        value = spec.get(key)
        if kind is str:
            if not (isinstance(value, str) or is_number(value)) or value == "":
                raise ConfigError(KEY, f"{where}.{key}: expected text, got {value!r}")
            values[key] = str(value)
        else:
            values[key] = kind(_positive(spec, key, where))
    major, minor = _version(values["compute_capability"], 2, f"{where}.compute_capability").split(".")
    kib = 1 << 10
    return GpuSpec(
        name=values["name"], compute_capability=(int(major), int(minor)), sm_count=values["sm_count"],
        clock_ghz=values["clock_ghz"], l2_cache_bytes=int(values["l2_cache_mib"] * (1 << 20)),
        shared_memory_per_sm=values["shared_memory_per_sm_kib"] * kib,
        shared_memory_per_block=values["shared_memory_per_block_kib"] * kib,
        registers_per_sm=values["registers_per_sm"], registers_per_block=values["registers_per_block"],
        threads_per_sm=values["threads_per_sm"], fp32_lanes_per_sm=values["fp32_lanes_per_sm"],
        cuda_runtime=_version(values["cuda_runtime"], 3, f"{where}.cuda_runtime"),
        cudnn=_version(values["cudnn"], 3, f"{where}.cudnn"),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    description: str
    num_devices: int
    peak_flops: dict[str, float]  # per device, FLOP/s, by dtype name ("float32", "bfloat16", "tf32", ...)
    efficiency: float  # share of peak a step's FLOPs reach (stated in the file, with why)
    memory_bytes: int  # per device
    host_memory_bandwidth: float  # bytes/s, host memcpy
    host_link: Link  # one device's own host→device link (e.g. PCIe gen5 x16)
    host_groups: tuple[tuple[int, ...], ...]  # devices that share one uplink (switch) to the host
    uplink: Link | None  # the shared uplink of a group; None = every device has its own path
    device_link: Link  # device↔device link (NVLink / PCIe peer) collectives run over
    # Used by the feed-time model (meshpar.plan.time.feed_time):
    device_memory_bandwidth: float = 0.0  # bytes/s within one device (HBM; cutting slices on the relay)
    copy_link: Link | None = None  # device→device copy when it differs from the collective link (cpu-sim)
    relay_fanout: str = "shared"  # "shared": the relay's slices leave through one port; "parallel": a link per peer
    # Host-side cost of one placement per field beyond its transfers (building the global
    # array, the feeder's bookkeeping), s: direct, routed.
    placement_overhead: tuple[float, float] = (0.0, 0.0)
    host_aliasing: bool = False  # devices wrap a 64-byte-aligned host buffer instead of copying it (CPU)
    source: str = ""  # where the figures came from (file, or "measured on this host")
    hosts: int = 1  # machines (processes) the devices are spread over, num_devices / hosts each
    node_link: Link | None = None  # one device's share of the network between hosts (hosts > 1)
    gpu: GpuSpec | None = None  # an NVIDIA GPU's compile target (None: not a GPU, e.g. cpu-sim)
    # CUDA Unified Memory's paging (meshpar.plan.out_of_core.unified): the page the driver migrates on a
    # fault, and what servicing one fault costs beyond moving its bytes.
    page_bytes: int = UM_PAGE_BYTES
    fault_s: float = UM_FAULT_S
    # A GPU's kernel costs (its file's ``kernels:``, meshpar.plan.time.kernels): GEMMs by shape, fused
    # attention, memory-bound kernels, the fixed cost per kernel. None (cpu-sim): each op priced
    # at the roofline of the measured rates.
    kernels: kernels_lib.KernelCosts | None = None
    network: str = ""  # the network between nodes (meshpar/plan/networks/), or the node kind's default

    def peak(self, dtype: str) -> float:
        """FLOP/s of one device for matmuls in `dtype`. ``float32`` is what XLA runs a float32
        matmul as: on NVIDIA GPUs at JAX's default matmul precision that is TF32 tensor cores
        (the ``tf32`` figure), under "highest"/"float32" plain FP32. A dtype the file has no
        figure for falls back to ``float32``."""
        if dtype == "float32" and "tf32" in self.peak_flops:
            precision = jax.config.jax_default_matmul_precision
            if precision in (None, "default", "high", "tensorfloat32", "TF32_TF32_F32"):
                return self.peak_flops["tf32"]
        return self.peak_flops[dtype] if dtype in self.peak_flops else self.peak("float32")

    def group_of(self, device: int) -> tuple[int, ...]:
        """The devices that share `device`'s uplink (itself alone when it has its own path)."""
        return next((g for g in self.host_groups if device in g), (device,))

    def axis_link(self, mesh_shape: dict[str, int], axis: str) -> Link:
        """The link a collective over `axis` (or ``"a,b"``: several axes at once) runs on.

        Devices are numbered row-major over `mesh_shape` (as ``jax.make_mesh`` lays out a
        single host's devices). NVLink (NVSwitch) and memcpy links reach every pair at full
        bandwidth; a collective whose groups span several hosts runs at the network's
        (``node_link``: each device's share of its host's NICs). Over PCIe, a collective whose device groups each sit under one switch runs
        at the peer bandwidth; one that crosses switches sends through their uplinks, which
        every crossing group of the collective shares (ring order: one crossing transfer per
        group and switch at a time), so each gets ``uplink / crossing groups``. Host-staged
        copies always cross the uplink."""
        names = list(mesh_shape)
        axes = [a.strip() for a in axis.split(",")]
        if any(a not in names for a in axes):
            raise ValueError(f"axis {axis!r} is not in mesh {mesh_shape}")
        shape = [mesh_shape[a] for a in names]
        if math.prod(shape) > self.num_devices:
            raise ValueError(f"mesh {mesh_shape} has more devices than {self.name}'s {self.num_devices}")
        link = self.device_link
        ids = np.arange(math.prod(shape)).reshape(shape)
        moved = np.moveaxis(ids, [names.index(a) for a in axes], range(-len(axes), 0))
        groups = moved.reshape(-1, math.prod(mesh_shape[a] for a in axes))
        if self.hosts > 1 and self.node_link is not None:
            per_host = self.num_devices // self.hosts  # devices are numbered host by host
            nodes = max(len({int(d) // per_host for d in g}) for g in groups)
            if nodes > 1:  # priced as NCCL runs it across nodes; its share: per_node devices' worth of the cards
                per_node = max(len(groups[0]) // nodes, 1)
                span = nccl.Span(nodes, per_node, self.node_link.bandwidth * per_node, link.bandwidth)
                return Link(span.bus_bps, nccl.RING_NET_S, "network", None, span)
        if link.kind in ("nvlink", "memcpy") or self.uplink is None:
            return link
        worst = 0
        for switch in self.host_groups:
            inside = set(switch)
            crossing = sum(1 for g in groups if (link.kind == "host" or not inside.issuperset(g)) and inside & set(g))
            worst = max(worst, crossing)
        if worst == 0:
            return link
        bandwidth = min(link.bandwidth, self.uplink.bandwidth / worst)
        return Link(bandwidth, max(link.latency, self.uplink.latency), link.kind)


def names() -> list[str]:
    """The shipped topology names (``cpu-sim`` included)."""
    return sorted(p.stem for p in DIR.glob("*.yaml"))


def load(name_or_path: str, devices: int | None = None) -> Topology:
    """A shipped topology by name, or a YAML file by path. ``cpu-sim`` is calibrated on this
    host's first `devices` simulated CPU devices (default: all of them) at first use, cached
    per process and device count. Raises ConfigError (key ``--topology``) for an unknown name
    or a malformed file."""
    path = pathlib.Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        if name_or_path not in names():
            raise ConfigError(KEY, f"unknown topology {name_or_path!r} (known: {', '.join(names())})")
        path = DIR / f"{name_or_path}.yaml"
    try:
        spec = parse_yaml(path.read_text(), path.name)
    except ConfigError as e:  # a key twice in one mapping
        raise ConfigError(KEY, str(e)) from None
    except (OSError, yaml.YAMLError, ValueError) as e:
        raise ConfigError(KEY, f"cannot read {path.name}: {' '.join(str(e).split())}") from None
    if isinstance(spec, dict) and spec.get("calibrated"):
        return calibrated(devices or len(jax.devices("cpu")), spec.get("description", ""))
    return from_dict(spec, path.name)


LINK_KEYS = ("kind", "gbps", "efficiency", "latency_us", "allreduce_us")


def _link(spec, where: str) -> Link:
    if not isinstance(spec, dict):
        raise ConfigError(KEY, f"{where}: expected a mapping with gbps, efficiency, latency_us")
    _known_keys(spec, LINK_KEYS, where)
    bw = _positive(spec, "gbps", where) * 1e9 * _fraction(spec, where)
    kind = spec.get("kind", "pcie")
    if kind not in LINK_KINDS:
        raise ConfigError(KEY, f"{where}.kind: {kind!r} is not one of {', '.join(LINK_KINDS)}")
    curve = kernels_lib.parse_curve(spec["allreduce_us"], f"{where}.allreduce_us") if "allreduce_us" in spec else None
    return Link(bw, float(spec.get("latency_us", 0.0)) * 1e-6, kind, curve)


def _known_keys(spec: dict, known: Collection, where: str) -> None:
    """A topology file's mapping names only `known` keys; else one line naming the first other one."""
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise ConfigError(KEY, f"{where}: unknown key {unknown[0]!r}")


def _positive(spec: dict, key: str, where: str) -> float:
    value = spec.get(key)
    if not is_number(value) or not value > 0:
        raise ConfigError(KEY, f"{where}.{key}: expected a positive number, got {value!r}")
    return float(value)


def _fraction(spec: dict, where: str) -> float:
    value = _positive(spec, "efficiency", where)
    if value > 1:
        raise ConfigError(KEY, f"{where}.efficiency: {value} is above 1")
    return value


def from_dict(spec: dict, where: str = "topology") -> Topology:
    """A Topology from a file's mapping (raw figures × their stated efficiencies)."""
    if not isinstance(spec, dict):
        raise ConfigError(KEY, f"{where}: expected a mapping")
    known = {"name", "description", "num_devices", "peak_tflops", "efficiency", "memory_gib", "device_memory_gbps",
             "host_memory", "host_link", "host_groups", "uplink", "device_link", "relay_fanout",
             "placement_overhead_us", "hosts", "node_link", "gpu", "unified_memory", "kernels", "network"}  # fmt: skip
    _known_keys(spec, known, where)
    n = int(_positive(spec, "num_devices", where))
    hosts = int(_positive(spec, "hosts", where)) if "hosts" in spec else 1
    if n % hosts:
        raise ConfigError(KEY, f"{where}.hosts: {hosts} hosts do not share {n} devices evenly")
    if hosts > 1 and spec.get("node_link") is None:
        raise ConfigError(KEY, f"{where}.node_link: {hosts} hosts need the link between them")
    peaks = spec.get("peak_tflops")
    if not isinstance(peaks, dict) or "float32" not in peaks:
        raise ConfigError(KEY, f"{where}.peak_tflops: expected a mapping by dtype that has float32")
    groups = tuple(tuple(int(d) for d in g) for g in spec.get("host_groups") or [[d] for d in range(n)])
    if sorted(d for g in groups for d in g) != list(range(n)):
        raise ConfigError(KEY, f"{where}.host_groups: must list every device 0..{n - 1} once")
    uplink = spec.get("uplink")
    fanout = spec.get("relay_fanout", "shared")
    overhead = spec.get("placement_overhead_us") or {}
    if not isinstance(overhead, dict) or set(overhead) - {"direct", "routed"}:
        raise ConfigError(KEY, f"{where}.placement_overhead_us: expected a mapping with direct and routed")
    if fanout not in ("shared", "parallel"):
        raise ConfigError(KEY, f"{where}.relay_fanout: expected shared or parallel, got {fanout!r}")
    um = spec.get("unified_memory") or {}
    if not isinstance(um, dict) or set(um) - {"page_mib", "fault_us"}:
        raise ConfigError(KEY, f"{where}.unified_memory: expected a mapping with page_mib and fault_us")
    page = _positive(um, "page_mib", f"{where}.unified_memory") * (1 << 20) if "page_mib" in um else UM_PAGE_BYTES
    fault = um.get("fault_us", UM_FAULT_S * 1e6)
    if not is_number(fault) or not 0 <= fault < math.inf:
        raise ConfigError(KEY, f"{where}.unified_memory.fault_us: expected a number >= 0, got {fault!r}")
    fault = float(fault) * 1e-6
    if spec.get("gpu") is not None and spec.get("kernels") is None:
        keys = ", ".join(kernels_lib.KERNEL_KEYS)
        raise ConfigError(KEY, f"{where}.kernels: a GPU machine needs its kernel costs ({keys})")
    return Topology(
        name=str(spec.get("name", where)), description=str(spec.get("description", "")), num_devices=n,
        peak_flops={k: _positive(peaks, k, f"{where}.peak_tflops") * 1e12 for k in peaks},
        efficiency=_fraction(spec, where), memory_bytes=int(_positive(spec, "memory_gib", where) * GIB),
        host_memory_bandwidth=_link(spec.get("host_memory"), f"{where}.host_memory").bandwidth,
        host_link=_link(spec.get("host_link"), f"{where}.host_link"), host_groups=groups,
        uplink=None if uplink is None else _link(uplink, f"{where}.uplink"),
        device_link=_link(spec.get("device_link"), f"{where}.device_link"),
        device_memory_bandwidth=_positive(spec, "device_memory_gbps", where) * 1e9,
        relay_fanout=fanout, source=where, hosts=hosts,
        node_link=_link(spec["node_link"], f"{where}.node_link") if hosts > 1 else None,
        gpu=None if spec.get("gpu") is None else gpu_spec(spec["gpu"], f"{where}.gpu"),
        placement_overhead=tuple(float(overhead.get(m, 0.0)) * 1e-6 for m in ("direct", "routed")),
        page_bytes=int(page), fault_s=fault,
        kernels=None if spec.get("kernels") is None else kernels_lib.parse(spec["kernels"], f"{where}.kernels"),
        network=str(spec.get("network") or ""),
    )  # fmt: skip


# ---- cpu-sim: measured on this host -------------------------------------------------------


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up (compilation, first-touch of pages)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _two_point(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(fixed cost, bytes/s) of ``t = fixed + bytes / bw`` through two (bytes, seconds) points."""
    (b0, t0), (b1, t1) = small, large
    bw = (b1 - b0) / max(t1 - t0, 1e-9)
    return max(t0 - b0 / bw, 0.0), bw


def _unaligned(nbytes: int) -> np.ndarray:
    """A float32 host array whose data does not start on a 64-byte boundary: the CPU client
    aliases a 64-byte-aligned numpy buffer instead of copying it (then no bytes move), so the
    placement benchmarks use this to time a real copy."""
    n = nbytes // 4
    raw = np.ones(n + 16, np.float32)
    skip = next(k for k in range(16) if (raw.ctypes.data + 4 * k) % 64 == 4)
    return raw[skip : skip + n]


def measure(devices) -> dict[str, float]:
    """This host's figures on separate microbenchmarks over `devices` (simulated CPU devices);
    about a second. Keys: memcpy_bps, matmul_flops (per device, every device busy at once),
    put_latency_s, put_bps (host→device), direct_fixed_s, routed_fixed_s (a one-byte
    placement through each feeder), copy_latency_s, copy_bps (device→device),
    allreduce_latency_s, allreduce_bps (per ring step and per device, ring model)."""
    n = len(devices)
    out = {"memcpy_bps": _memcpy_bps()}
    mesh = Mesh(np.array(devices), ("devices",))
    split = NamedSharding(mesh, PartitionSpec("devices"))
    out["matmul_flops"] = _matmul_flops(split, n)
    out.update(_host_to_device(split, n))
    out.update(_feeders_fixed(mesh, n))
    if n < 2:  # nothing to copy between or reduce over: a device copy is a memcpy
        return {**out, "copy_bps": out["memcpy_bps"], "copy_latency_s": out["put_latency_s"],
                "allreduce_bps": out["memcpy_bps"], "allreduce_latency_s": 0.0}  # fmt: skip
    out.update(_device_to_device(devices))
    out.update(_allreduce(mesh, split, n))
    return out


def _memcpy_bps() -> float:
    """Host memory bandwidth: bytes one memcpy copies per second."""
    # 64 MiB, beyond any last-level cache, so it is DRAM bandwidth (bytes copied / s).
    src = np.ones(64 << 20, np.uint8)
    dst = np.empty_like(src)
    return src.nbytes / _median_time(functools.partial(np.copyto, dst, src), 3)


def _matmul_flops(split: NamedSharding, n: int) -> float:
    """FLOP/s of one device's float32 matmul, all `n` devices (`split` over them) busy at once."""
    # One float32 [512, 512] product per device, all devices at once in one sharded program.
    # The simulated devices share the host's cores, so a step (which keeps every device busy)
    # gets this per-device rate, not what one device alone would reach.
    size = 512
    # Inputs are made on the host: a jnp array would cost a compilation each (of `ones`, and
    # of cutting it into shards), a second of this benchmark's time.
    a = jax.device_put(np.ones((n, size, size), np.float32), split)
    mm = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), out_shardings=split)
    return 2 * size**3 / _median_time(lambda: mm(a).block_until_ready(), 5)


def _host_to_device(split: NamedSharding, n: int) -> dict[str, float]:
    """put_bps and put_latency_s: host→device placements of one array `split` over `n` devices."""
    # The placement a direct feed makes (one array split over every device), from an unaligned
    # buffer so the bytes are copied; two sizes give the per-device fixed cost (the transfers
    # start one after another) and the bandwidth they share.
    points = []
    for nbytes in (64 << 10, 16 << 20):
        host = _unaligned(nbytes).reshape(n, -1)
        t = _median_time(lambda: jax.make_array_from_process_local_data(split, host).block_until_ready(), 5)
        points.append((nbytes, t))
    fixed, bps = _two_point(*points)
    return {"put_bps": bps, "put_latency_s": fixed / n}


def _feeders_fixed(mesh: Mesh, n: int) -> dict[str, float]:
    """direct_fixed_s and routed_fixed_s: a one-byte-per-device placement through each feeder."""
    # The feeders' own host-side cost per placement beyond the transfers (building the global
    # array, their bookkeeping): one byte per device, so no bandwidth term. A separate tiny
    # batch, never an experiment's.
    tiny, shard = {"x": np.zeros((n, 1), np.uint8)}, {"x": NamedSharding(mesh, PartitionSpec("devices", None))}
    out = {}
    for mode, feeder in (("direct", DirectFeeder(shard, n)), ("routed", RoutedFeeder(shard, n))):
        out[f"{mode}_fixed_s"] = _median_time(lambda: feeder.place(tiny), 9)  # noqa: B023 (called at once)
    return out


def _device_to_device(devices) -> dict[str, float]:
    """copy_bps and copy_latency_s: slices copied from the first of `devices` to every other."""
    # What a routed feed does after the host leg (slices from the relay to every other device,
    # one call).
    n = len(devices)
    points = []
    for nbytes in (64 << 10, 16 << 20):
        pieces = [jax.device_put(_unaligned(nbytes // n), devices[0]) for _ in range(n - 1)]
        t = _median_time(lambda: jax.block_until_ready(jax.device_put(pieces, devices[1:])), 5)
        points.append((nbytes * (n - 1) // n, t))
    fixed, bps = _two_point(*points)
    return {"copy_bps": bps, "copy_latency_s": fixed / max(n - 1, 1)}


def _allreduce(mesh: Mesh, split: NamedSharding, n: int) -> dict[str, float]:
    """allreduce_bps and allreduce_latency_s: an all-reduce over every device, ring model."""
    # At 4 KiB and 4 MiB per device. Ring model (the one the step-time model uses):
    # t = 2(n-1) · latency + 2(n-1)/n · bytes / bandwidth.
    reduce = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "devices"), mesh=mesh,
                               in_specs=PartitionSpec("devices"), out_specs=PartitionSpec("devices")))  # fmt: skip
    points = []
    factor, steps = cost.ring("all-reduce", n)
    for nbytes in (4 << 10, 4 << 20):
        x = jax.device_put(np.ones((n, nbytes // 4), np.float32), split)
        t = _median_time(lambda: reduce(x).block_until_ready(), 5)
        points.append((factor * nbytes, t))
    fixed, bps = _two_point(*points)
    return {"allreduce_bps": bps, "allreduce_latency_s": fixed / steps}


@functools.cache
def calibrated(num_devices: int, description: str = "") -> Topology:
    """``cpu-sim`` for the first `num_devices` simulated CPU devices, measured once per process."""
    devices = jax.devices("cpu")[:num_devices]
    m = measure(devices)
    ram = cost.host_memory_bytes() or 0
    all_devices = tuple(range(num_devices))
    return Topology(
        name=CPU_SIM, description=description or "this host's simulated CPU devices, measured",
        num_devices=num_devices,
        # Only float32 is measured; other dtypes fall back to it (a bfloat16 [512, 512] matmul
        # ran within 10% of float32 on a 2-core x86 host: no faster path to model).
        peak_flops={"float32": m["matmul_flops"]},
        # The peak is itself a measured matmul rate on this host, not a datasheet figure.
        efficiency=1.0,
        memory_bytes=ram // max(num_devices, 1),
        host_memory_bandwidth=m["memcpy_bps"],
        # Every simulated device's memory is host memory: placements are copies by the host's
        # cores, so all devices share one "uplink" (the measured placement bandwidth).
        host_link=Link(m["put_bps"], m["put_latency_s"], "memcpy"),
        host_groups=(all_devices,),
        uplink=Link(m["put_bps"], 0.0, "memcpy"),
        device_link=Link(m["allreduce_bps"], m["allreduce_latency_s"], "memcpy"),
        device_memory_bandwidth=m["memcpy_bps"],
        copy_link=Link(m["copy_bps"], m["copy_latency_s"], "memcpy"),
        relay_fanout="shared",
        # What a one-byte placement costs beyond the transfers the model counts for it.
        placement_overhead=(
            max(m["direct_fixed_s"] - num_devices * m["put_latency_s"], 0.0),
            max(m["routed_fixed_s"] - m["put_latency_s"] - (num_devices - 1) * m["copy_latency_s"], 0.0),
        ),
        host_aliasing=True,
        source=(
            f"measured on this host: memcpy {m['memcpy_bps'] / 1e9:.2f} GB/s, float32 matmul "
            f"{m['matmul_flops'] / 1e9:.1f} GFLOP/s per device with {num_devices} busy, host→device "
            f"{m['put_bps'] / 1e9:.2f} GB/s + {m['put_latency_s'] * 1e6:.0f} µs per device, one-byte placement "
            f"{m['direct_fixed_s'] * 1e6:.0f} µs direct / {m['routed_fixed_s'] * 1e6:.0f} µs routed, device copy "
            f"{m['copy_bps'] / 1e9:.2f} GB/s + {m['copy_latency_s'] * 1e6:.0f} µs, all-reduce "
            f"{m['allreduce_bps'] / 1e9:.2f} GB/s + {m['allreduce_latency_s'] * 1e6:.0f} µs per ring step"
        ),
    )  # fmt: skip

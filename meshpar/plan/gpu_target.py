"""XLA's GPU compiler as a compile target: plan the program an NVIDIA GPU will run, on a host with
or without one.

jax compiles for devices it does not have through a *compile-only* client:
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology=...)``
gives devices that programs lower and compile for (``memory_analysis()`` and ``as_text()``
work; nothing runs). The target config is XLA's ``GpuTargetConfigProto`` in text form: the GPU's
SM count, clock, memory size and bandwidth, L2, shared memory and registers, compute capability,
and the CUDA runtime and cuDNN versions the compile assumes. It is written here from a topology's
``gpu:`` section (:class:`meshpar.plan.topology.GpuSpec`, datasheet facts with their sources in
the file) and the machine's ``memory_gib`` and ``device_memory_gbps``, using only fields that
every supported jaxlib parses (jaxlib 0.10 refuses e.g. ``collective_memory_granularity``, which
newer target descriptions carry).

The compiler comes with the ``gpu-plan`` extra (``pip install -e '.[gpu-plan]'``: jax's CUDA
plugin matching the installed jaxlib, ptxas/libdevice from ``nvidia-cuda-nvcc-cu12``, and
cuDNN's library, without which jax's checks refuse to trace cuDNN's fused attention); no driver.
Without it :func:`missing` says how to install it and the
planner compiles for this host's CPU instead, labelled as such (``compiled_for``: ``"cpu"``).

A topology of several hosts (``hosts: H``) is compiled as ``1xHxD``: H processes of D devices,
numbered host by host, as a multi-process run lays them out.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax

from meshpar.backend import quiet
from meshpar.configuration.config import ConfigError
from meshpar.plan.topology import KEY, Topology
from meshpar.sharding import mesh as mesh_lib

INSTALL = "pip install -e '.[gpu-plan]'"


def missing() -> str | None:
    """Why XLA's GPU compiler cannot be used here (one line, with how to install it), or None."""
    if quiet.cuda_plugin_installed():
        return None
    return f"XLA's GPU compiler is not installed ({INSTALL})"


def target_config(topo: Topology) -> str:
    """The ``GpuTargetConfigProto`` text for one device of `topo` (which has a ``gpu`` spec)."""
    g = topo.gpu
    if g is None:
        raise ValueError(f"{topo.name} is not a GPU machine")
    major, minor = g.compute_capability
    runtime = [int(x) for x in g.cuda_runtime.split(".")]
    dnn = [int(x) for x in g.cudnn.split(".")]
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024",  # CUDA: every compute capability since 2.0
        "  threads_per_warp: 32",
        "  shared_memory_per_block: 49152",  # 48 KiB without opting in, every capability since 2.0
        f"  shared_memory_per_core: {g.shared_memory_per_sm}",
        f"  threads_per_core_limit: {g.threads_per_sm}",
        f"  core_count: {g.sm_count}",
        f"  fpus_per_core: {g.fp32_lanes_per_sm}",
        "  block_dim_limit_x: 2147483647",  # grid limits: every capability since 3.0
        "  block_dim_limit_y: 65535",
        "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {int(topo.device_memory_bandwidth)}",
        f"  l2_cache_size: {g.l2_cache_bytes}",
        f"  clock_rate_ghz: {g.clock_ghz}",
        f"  device_memory_size: {topo.memory_bytes}",
        f"  shared_memory_per_block_optin: {g.shared_memory_per_block}",
        "  cuda_compute_capability {",
        f"    major: {major}",
        f"    minor: {minor}",
        "  }",
        f"  registers_per_core_limit: {g.registers_per_sm}",
        f"  registers_per_block_limit: {g.registers_per_block}",
        f'  runtime_version: "{g.cuda_runtime}"',
        f'  dnn_version: "{g.cudnn}"',
        "}",
        'platform_name: "CUDA"',
        f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} patch: {dnn[2]} }}",
        f"runtime_version {{ major: {runtime[0]} minor: {runtime[1]} patch: {runtime[2]} }}",
        f'device_description_str: "{g.name}"',
    ]) + "\n"  # fmt: skip


def _topology_desc(text: str, shape: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", target_config=text, topology=shape)


def _unparsed_field(text: str, shape: str) -> str | None:
    """The first field of `text` without which jaxlib parses it (jaxlib's own error names none)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        field = re.match(r"\s*(\w+)\s*[:{]", line)
        if not field or line.strip().endswith("{") or line.strip() == "}":
            continue
        try:
            _topology_desc("\n".join(lines[:i] + lines[i + 1 :]), shape)
        except Exception:  # noqa: BLE001 (any failure: this field is not the one)
            continue
        return field.group(1)
    return None


def devices(topo: Topology) -> tuple:
    """`topo`'s devices as compile-only devices of XLA's GPU compiler (nothing runs on them).
    ConfigError (``--topology``) when the compiler is missing or jaxlib refuses the target
    description, naming the field it cannot parse."""
    if topo.gpu is None:
        raise ConfigError(KEY, f"{topo.name} is not a GPU machine: it has no gpu: section to compile for")
    why = missing()
    if why:
        raise ConfigError(KEY, why)
    return _devices(topo.name, target_config(topo), f"1x{topo.hosts}x{topo.num_devices // topo.hosts}")


@functools.cache
def _devices(name: str, text: str, shape: str) -> tuple:
    """The compile-only devices of one target description and shape, made once per process.
    Compile for them under :func:`meshpar.backend.compile_cache.suspended`: a compile-only client cannot
    load back the executables jax's persistent cache would hand it."""
    try:
        with quiet.native_stderr_filtered():
            return tuple(_topology_desc(text, shape).devices)
    except jax.errors.JaxRuntimeError as e:
        field = _unparsed_field(text, shape)
        if field is None:
            raise ConfigError(
                KEY, f"{name}: XLA's GPU compiler refuses the target: {' '.join(str(e).split())}"
            ) from None
        raise ConfigError(KEY, f"{name}: jaxlib {jax.__version__} cannot parse the target description's field "
                               f"{field!r}")  # fmt: skip


def label(topo: Topology, count: int | None = None) -> str:
    """What a plan compiled for `topo` was compiled for: ``"NVIDIA H200 x8 (cuda, compile-only)"``."""
    n = topo.num_devices if count is None else count
    return f"{topo.gpu.name} x{n} (cuda, compile-only)"


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a plan compiles for, and what to call them."""

    devices: tuple | None  # None: this host's devices, as a run on it builds its mesh
    compiled_for: str  # e.g. "NVIDIA H200 x8 (cuda, compile-only)", or "cpu"
    note: str = ""  # why a GPU machine's plan is compiled for this host instead (one line)

    @property
    def compile_only(self) -> bool:
        return self.devices is not None


def host_label(mesh) -> str:
    """What a plan compiled on this host's devices of `mesh` was compiled for: ``"cpu"``, or the
    accelerator's kind and count (``"NVIDIA H100 80GB HBM3 x8 (gpu)"``)."""
    device = mesh.devices.flat[0]
    return "cpu" if device.platform == "cpu" else f"{device.device_kind} x{mesh.size} ({device.platform})"


def target(topo: Topology | None, mesh_spec) -> Target:
    """What a plan of a config whose mesh is `mesh_spec` compiles for on the machine `topo`: the
    machine's GPUs through XLA's GPU compiler when it has a ``gpu:`` section and the compiler is
    installed (the first devices the mesh takes, every one for a ``-1`` axis), else this host's
    devices — with a note saying why, for a GPU machine. A mesh larger than the machine is left
    to the plan's own "does not fit" line (compiled on this host), and a host that has the
    machine's GPUs compiles for them."""
    if topo is None or topo.gpu is None:
        return Target(None, "")
    why = missing()
    if why:
        return Target(None, "cpu", f"compiled for this host's CPU as a stand-in for {label(topo)}: {why}")
    axes = mesh_lib.parse_mesh(mesh_spec) if isinstance(mesh_spec, str) else tuple(mesh_spec)
    try:
        needed = math.prod(n for _, n in mesh_lib.resolve(axes, topo.num_devices))
    except mesh_lib.MeshError:
        return Target(None, "")  # the mesh cannot be laid over the machine: the plan says so
    if needed > topo.num_devices:
        return Target(None, "")
    if _has_own(topo, needed):
        return Target(None, "")  # a host with these GPUs compiles for them: the very program a run executes
    return Target(devices(topo)[:needed], label(topo, needed))


def _has_own(topo: Topology, needed: int) -> bool:
    """Whether this host's backend is `topo`'s GPU, with at least `needed` devices."""
    if jax.default_backend() != "gpu":
        return False
    local = jax.devices()
    return len(local) >= needed and local[0].device_kind == topo.gpu.name

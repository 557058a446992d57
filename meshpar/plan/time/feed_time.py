"""Predicted placement time of one batch, routed vs direct, from a topology; the relay's memory.

- **direct**: the host sends each device its own slice over that device's link. Devices under
  one switch share its uplink (the group's slices go through it one after another), and all
  of it is read from host memory, so the slowest of: one slice over a device's own link, a
  group's slices over its uplink, every slice out of host memory. The host starts the copies
  one after another: one fixed cost per device and field.
- **routed**: the whole batch goes over the relay's host link (and its uplink), the relay cuts
  every distinct slice (one pass over the batch in device memory), then sends every other
  device its slice. With ``relay_fanout: shared`` (NVSwitch, a PCIe port, host-staged copies,
  the host's cores on ``cpu-sim``) the slices leave one after another through the relay's one
  port; with ``parallel`` (a dedicated link per peer) at once.

Both modes also pay the topology's ``placement_overhead`` per field: the host-side work of one
placement beyond its transfers (building the global array, the feeder's bookkeeping). On
``cpu-sim`` host buffers that start on a 64-byte boundary are wrapped, not copied
(``aliased``): then only the fixed costs remain of the host leg.

The batch is this process's share of the global batch (``train.batch_size`` × the bytes of one
example, from the data source's element spec), split into ``shards`` distinct slices (the
mesh axes the layout puts ``batch`` on); the other devices hold copies of those slices.
"""

from __future__ import annotations

import dataclasses
import math

MODES = ("direct", "routed")


def _check(mode: str, process_batch_bytes: int, num_devices: int, shards: int, topology) -> None:
    if mode not in MODES:
        raise ValueError(f"feed mode must be one of {MODES}, got {mode!r}")
    if num_devices < 1 or num_devices > topology.num_devices:
        raise ValueError(f"{num_devices} devices: {topology.name} has {topology.num_devices}")
    if shards < 1 or num_devices % shards:
        raise ValueError(f"{shards} batch shards do not divide {num_devices} devices")
    if process_batch_bytes < 0:
        raise ValueError(f"batch bytes must be >= 0, got {process_batch_bytes}")


def direct_time(topology, batch: int, num_devices: int, shards: int, fields: int = 1, aliased: bool = False) -> float:
    """Seconds to place a `batch`-byte process batch directly (see the module docstring)."""
    fixed = fields * (topology.placement_overhead[0] + num_devices * topology.host_link.latency)
    if aliased and topology.host_aliasing:
        return fixed
    piece = batch / shards
    link = topology.host_link
    slowest = piece / link.bandwidth  # one device's own link
    if topology.uplink is not None:
        for group in topology.host_groups:
            members = sum(1 for d in group if d < num_devices)
            if members > 1:
                slowest = max(slowest, members * piece / topology.uplink.bandwidth)
    slowest = max(slowest, num_devices * piece / topology.host_memory_bandwidth)
    return fixed + slowest


def routed_time(topology, batch: int, num_devices: int, shards: int, fields: int = 1, aliased: bool = False) -> float:
    """Seconds to place a `batch`-byte process batch through the relay (device 0)."""
    piece = batch / shards
    host = min(topology.host_link.bandwidth, topology.host_memory_bandwidth)
    if topology.uplink is not None and len(topology.group_of(0)) > 1:
        host = min(host, topology.uplink.bandwidth)
    moved = 0 if aliased and topology.host_aliasing else batch
    host_leg = fields * (topology.placement_overhead[1] + topology.host_link.latency) + moved / host
    split = batch / topology.device_memory_bandwidth if topology.device_memory_bandwidth else 0.0
    copy = topology.copy_link or topology.device_link
    # The host starts each copy as it starts a host copy (a collective step's latency is less).
    per_copy = copy.latency if topology.copy_link else max(copy.latency, topology.host_link.latency)
    others = num_devices - 1
    if topology.relay_fanout == "parallel":
        out_leg = others * fields * per_copy + (piece / copy.bandwidth if others else 0.0)
    else:
        out_leg = others * (fields * per_copy + piece / copy.bandwidth)
    return host_leg + split + out_leg


def placement_time(
    topology,
    mode: str,
    process_batch_bytes: int,
    num_devices: int,
    shards: int | None = None,
    fields: int = 1,
    aliased: bool = False,
) -> float:
    """Predicted seconds to place one process batch of `process_batch_bytes` on `num_devices`
    devices of `topology` in feed `mode` ("direct" or "routed"). `shards`: distinct batch
    slices (default: one per device); `fields`: arrays per batch (inputs, targets, ...);
    `aliased`: the host arrays (and, direct, every slice) start on 64-byte boundaries, which
    a topology with ``host_aliasing`` (cpu-sim) wraps instead of copying: no host bytes move."""
    shards = shards or num_devices
    _check(mode, process_batch_bytes, num_devices, shards, topology)
    fn = direct_time if mode == "direct" else routed_time
    return fn(topology, process_batch_bytes, num_devices, shards, fields, aliased)


def relay_bytes(mode: str, process_batch_bytes: int, shards: int | None = None) -> int:
    """Input bytes the relay device holds during a placement beyond its own slice (which every
    device holds in either mode): routed, the staged whole batch plus every distinct slice cut
    from it, less its own (``2·batch − batch/shards``; with `shards` unknown, ``2·batch``);
    direct, none."""
    if mode not in MODES:
        raise ValueError(f"feed mode must be one of {MODES}, got {mode!r}")
    if mode == "direct":
        return 0
    return 2 * process_batch_bytes - (process_batch_bytes // shards if shards else 0)


@dataclasses.dataclass(frozen=True)
class Row:
    batch_bytes: int
    direct_s: float
    routed_s: float
    relay_routed_bytes: int
    relay_direct_bytes: int

    @property
    def ratio(self) -> float:
        """routed / direct placement time."""
        return self.routed_s / self.direct_s if self.direct_s else math.inf


SIZES = tuple(1 << k for k in range(20, 31))  # 1 MiB … 1 GiB, powers of 2


def compare(topology, num_devices: int, shards: int, fields: int = 1, sizes=SIZES) -> list[Row]:
    """Predicted placement time and relay memory, routed vs direct, for each batch size."""
    return [
        Row(
            b,
            placement_time(topology, "direct", b, num_devices, shards, fields),
            placement_time(topology, "routed", b, num_devices, shards, fields),
            relay_bytes("routed", b, shards),
            relay_bytes("direct", b, shards),
        )  # fmt: skip
        for b in sizes
    ]

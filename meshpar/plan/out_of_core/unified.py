"""What CUDA Unified Memory costs a step that needs more than the device holds: a per-layer
model after the 2019 out-of-core training study's, beside explicit swapping
(:mod:`meshpar.plan.out_of_core.offload_cost`).

One device's data in blocks, as the memory plan counts them, and the step's accesses to them in
program order, replayed through a least-recently-used device of the room left: the bytes faulted
in and evicted per layer pass and for the update. Their stall adds to the step, overlapped with
nothing. The spec: docs/out-of-core-model.md ("Unified memory").
"""

from __future__ import annotations

import collections
import dataclasses
import math

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Blocks:
    """One device's data in the model's blocks, bytes (see docs/out-of-core-model.md)."""

    layers: int  # L
    layer_weights: int  # one layer's
    other_weights: int
    layer_grads: int  # one layer's gradient (and its share of the running sum)
    other_grads: int
    layer_optimizer: int  # one layer's optimizer state
    other_optimizer: int  # the rest's, the step counter and RNG key among it
    before: int  # residuals made before the layer loop
    per_layer: int  # residuals one layer makes
    after: int  # residuals made after the layer loop (the head, the loss)
    pinned: int  # workspace and batches: touched throughout, always resident
    microbatches: int = 1

    @property
    def total(self) -> int:
        L = self.layers
        return (L * (self.layer_weights + self.layer_grads + self.layer_optimizer + self.per_layer) + self.other_weights
                + self.other_grads + self.other_optimizer + self.before + self.after + self.pinned)  # fmt: skip


def blocks(categories: dict[str, int], layers: int, layer_weights: int, split: tuple[int, int, int],
           microbatches: int) -> Blocks:  # fmt: skip
    """The blocks of a memory plan's `categories` (:class:`meshpar.plan.memory.analytic.Breakdown`),
    `layers` layers of `layer_weights` bytes each, residuals split as the plan traced them
    (`split`: made before the layer loop, by it in all, after it), scaled to the plan's
    activations (which also hold gathered weights the backward reads); untraced, all made by
    the layers."""
    params, grads = categories.get("params", 0), categories.get("grads", 0)
    activations = max(categories.get("activations", 0), 0)
    L = max(layers, 1)
    lw = min(layer_weights, params // L)
    share = lw / params if params else 0.0
    lg = int(grads * share)
    optimizer = categories.get("optimizer", 0)
    lo = int(optimizer * share)
    before, looped, _ = split
    traced = sum(split)
    before_bytes = int(activations * before / traced) if traced else 0
    looped_bytes = int(activations * looped / traced) if traced else activations
    pinned = max(categories.get("workspace", 0), 0) + sum(
        categories.get(k, 0) for k in ("inputs", "queued_inputs", "relay_inputs")
    )
    return Blocks(
        L, lw, params - L * lw, lg, grads - L * lg, lo, optimizer - L * lo, before_bytes, looped_bytes // L,
        activations - before_bytes - (looped_bytes // L) * L, pinned, max(microbatches, 1),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Phase:
    """What one pass of the step migrates: bytes faulted in, bytes evicted, page faults."""

    name: str  # "forward 3", "backward 3", "update", ...
    bytes_in: int
    bytes_out: int
    faults: int


@dataclasses.dataclass(frozen=True)
class Migration:
    """One step's migration under UM (see docs/out-of-core-model.md)."""

    need: int  # bytes the step's data takes (the plan's total)
    room: int  # device bytes the blocks may occupy (the device less what stays resident)
    device_bytes: int  # device memory in use: the smaller of the need and the device's
    migrated_bytes: int  # the rest: in host memory at the step's peak
    phases: tuple[Phase, ...]  # the steady state's passes, in order
    page_bytes: int

    @property
    def bytes_in(self) -> int:
        return sum(p.bytes_in for p in self.phases)

    @property
    def bytes_out(self) -> int:
        return sum(p.bytes_out for p in self.phases)

    @property
    def faults(self) -> int:
        return sum(p.faults for p in self.phases)

    def stall_s(self, bandwidth: float, fault_s: float, phases=None) -> float:
        """Seconds the faults stall the step (or `phases` of it) at `bandwidth` bytes/s and
        `fault_s` per page."""
        chosen = self.phases if phases is None else phases
        return sum((p.bytes_in + p.bytes_out) / bandwidth + p.faults * fault_s for p in chosen)

    def layer(self, index: int) -> tuple[Phase, Phase]:
        """Layer `index`'s forward and backward passes (their sums over the microbatches)."""
        names = (f"forward {index}", f"backward {index}")
        out = []
        for name in names:
            hits = [p for p in self.phases if p.name == name]
            out.append(
                Phase(name, sum(p.bytes_in for p in hits), sum(p.bytes_out for p in hits), sum(p.faults for p in hits))
            )
        return out[0], out[1]


class _Device:
    """A device of `room` bytes holding parts of blocks, evicting the least recently used."""

    def __init__(self, room: int, page: int):
        self.room, self.page = room, page
        self.on_device: dict[str, int] = {}  # block -> its bytes on the device
        self.on_host: dict[str, int] = {}  # block -> its bytes in host memory
        self.order: collections.OrderedDict[str, None] = collections.OrderedDict()  # least recent first
        self.bytes_in = self.bytes_out = self.faults = 0

    def used(self) -> int:
        return sum(self.on_device.values())

    def _make_room(self, nbytes: int, keep: str) -> None:
        short = self.used() + nbytes - self.room
        for name in list(self.order):
            if short <= 0:
                break
            if name == keep:
                continue
            moved = min(self.on_device.get(name, 0), short)
            if moved:
                self.on_device[name] -= moved
                self.on_host[name] = self.on_host.get(name, 0) + moved
                self.bytes_out += moved
                short -= moved

    def touch(self, name: str, nbytes: int) -> None:
        """Use block `name` of `nbytes` (made here when it does not exist yet)."""
        if nbytes <= 0:
            return
        if name not in self.on_device:  # made: first touched on the device, nothing to fault in
            self.on_device[name] = 0
            self.order[name] = None
            self._make_room(nbytes, name)
            self.on_device[name] = min(nbytes, max(self.room - self.used(), 0))
            self.on_host[name] = nbytes - self.on_device[name]  # larger than the room: written out as made
            self.bytes_out += self.on_host[name]
            return
        away = self.on_host.get(name, 0)
        self.order.move_to_end(name)
        if away:
            self._make_room(away, name)
            fits = min(away, max(self.room - self.used(), 0))  # a block larger than the room stays partly away
            self.on_host[name] -= fits
            self.on_device[name] += fits
            self.bytes_in += away
            self.faults += math.ceil(away / self.page)

    def free(self, name: str) -> None:
        """Block `name` dies: its bytes go, wherever they are, with no traffic."""
        self.on_device.pop(name, None)
        self.on_host.pop(name, None)
        self.order.pop(name, None)

    def take(self) -> tuple[int, int, int]:
        out = (self.bytes_in, self.bytes_out, self.faults)
        self.bytes_in = self.bytes_out = self.faults = 0
        return out


def _step(device: _Device, b: Blocks, phases: list[Phase]) -> None:
    """One training step's accesses (see docs/out-of-core-model.md), each pass recorded in `phases`."""

    def done(name: str) -> None:
        phases.append(Phase(name, *device.take()))

    for _ in range(b.microbatches):
        device.touch("weights other", b.other_weights)
        device.touch("residuals before", b.before)
        done("forward embedding")
        for i in range(b.layers):
            device.touch(f"weights {i}", b.layer_weights)
            device.touch(f"residuals {i}", b.per_layer)
            done(f"forward {i}")
        device.touch("weights other", b.other_weights)
        device.touch("residuals after", b.after)
        device.touch("grads other", b.other_grads)
        device.free("residuals after")
        done("head")
        for i in reversed(range(b.layers)):
            device.touch(f"residuals {i}", b.per_layer)
            device.touch(f"weights {i}", b.layer_weights)
            device.touch(f"grads {i}", b.layer_grads)
            device.free(f"residuals {i}")
            done(f"backward {i}")
        device.touch("residuals before", b.before)
        device.touch("grads other", b.other_grads)
        device.free("residuals before")
        done("backward embedding")
    # The update, parameter by parameter: its weights, gradient and optimizer state; the
    # gradient dies there.
    for part, (w, g, o) in [("other", (b.other_weights, b.other_grads, b.other_optimizer)),
                            *((str(i), (b.layer_weights, b.layer_grads, b.layer_optimizer)) for i in range(b.layers))]:  # fmt: skip
        device.touch(f"weights {part}", w)
        device.touch(f"grads {part}", g)
        device.touch(f"optimizer {part}", o)
        device.free(f"grads {part}")
    done("update")


def migration(b: Blocks, device_bytes: int, page_bytes: int = 2 * MIB, need: int | None = None) -> Migration:
    """The steady-state migration of a step of blocks `b` on a device whose plan may use
    `device_bytes` (see docs/out-of-core-model.md). `need`: the plan's total, when it differs from
    the blocks' (a negative workspace, which the blocks count as none)."""
    room = max(device_bytes - b.pinned, 0)
    device = _Device(room, page_bytes)
    first: list[Phase] = []
    _step(device, b, first)  # the first step starts with everything on the device
    steady: list[Phase] = []
    _step(device, b, steady)
    need = b.total if need is None else need
    return Migration(need, room, min(need, device_bytes), max(need - device_bytes, 0), tuple(steady), page_bytes)

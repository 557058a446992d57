"""Feeders: put a host batch onto the mesh as global ``jax.Array``s, two ways (``direct``,
``routed``), each timing its own placements and keeping a ledger of the input bytes it holds
on each device.

The spec (what each feeder moves, why these JAX primitives, the measurements behind them, the
input-memory ledger) is in docs/data.md, "Feeders".
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...]) -> slice:
    """The contiguous rows (dim 0) of a global array that this process's devices hold."""
    index = sharding.addressable_devices_indices_map(global_shape)
    spans = {(s[0].start or 0, global_shape[0] if s[0].stop is None else s[0].stop) for s in index.values()}
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    covered = sum(b - a for a, b in spans)
    if covered != stop - start:
        raise ValueError(f"this process's rows of {global_shape} are not one contiguous block: {sorted(spans)}")
    return slice(start, stop)


@dataclasses.dataclass(frozen=True)
class Placement:
    """What placing one batch cost."""

    seconds: float  # host batch in → every array ready on its devices
    relay_bytes: int  # bytes the host sent to the relay device (the mesh's first local device)
    total_bytes: int  # bytes of this process's batch
    aliased: bool  # some shard shares memory with the host batch instead of holding a copy


def aliases_host(array: jax.Array, rows: np.ndarray) -> bool:
    """Whether any shard of `array` lives inside `rows`'s memory (CPU may alias, not copy)."""
    lo = rows.__array_interface__["data"][0]
    hi = lo + rows.nbytes
    for shard in array.addressable_shards:
        try:
            pointer = shard.data.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - backends without raw pointers do not alias host memory
            return False
        if lo <= pointer < hi:
            return True
    return False


def memory_stats_peak(devices: Iterable[jax.Device]) -> dict[int, int] | None:
    """``peak_bytes_in_use`` per device id, or None where the backend does not report it (CPU).

    Covers everything the device held since the process started (state, activations,
    inputs), not inputs alone."""
    peaks = {}
    for device in devices:
        stats = device.memory_stats()
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks[device.id] = int(stats["peak_bytes_in_use"])
    return peaks


def device_bytes(array: jax.Array) -> dict[int, int]:
    """Bytes `array` holds on each of this process's devices, from its shape and sharding alone.

    Never from its buffers: reading one (a raw pointer, a shard's data) waits until it is
    ready, which would make every copy of a placement wait for the one before."""
    devices = array.sharding.device_set
    if len(devices) == 1:  # the relay's staging copy and slices: the common case, made cheap
        return {next(iter(devices)).id: array.nbytes}
    itemsize = array.dtype.itemsize
    return {
        device.id: itemsize * math.prod(len(range(*s.indices(n))) for s, n in zip(index, array.shape))
        for device, index in array.sharding.addressable_devices_indices_map(array.shape).items()
    }


class LiveBytes:
    """Bytes per device of the device buffers one feeder created that are still alive, and
    their running peak.

    ``add(array)`` counts the array's buffers when it is created; a weak reference uncounts
    them when the array is released (its last Python reference dropped). An array that reuses
    buffers already counted — the routed relay's own slice is first a temporary, then a shard
    of the placed batch — names them in ``shared`` (device id → the token ``add`` returned for
    that buffer): a buffer counts once, for as long as any array over it is alive. The peak is
    updated at every increment, so it is the true maximum, not a sample. Thread-safe:
    placement runs in the prefetch thread and releases happen in whichever thread drops the
    last reference; the lock is reentrant because a release can fire (by garbage collection)
    inside a locked section of the same thread.
    """

    def __init__(self, devices: Iterable[jax.Device]):
        self._lock = threading.RLock()
        self._tokens = itertools.count()
        # id of a weak reference to an array → (the reference, kept alive here; its buffer tokens)
        self._arrays: dict[int, tuple[weakref.ref, list[int]]] = {}
        self._buffers: dict[int, list] = {}  # token → [device id, bytes, live arrays over it]
        self._live = {d.id: 0 for d in devices}
        self._peak = dict(self._live)

    def add(self, array: jax.Array, shared: Mapping[int, int] | None = None) -> dict[int, int]:
        """Count `array`; returns each device's buffer token (for arrays that share them)."""
        shared = shared or {}
        sizes = device_bytes(array)
        ref = weakref.ref(array, self._release)
        with self._lock:
            tokens = {device: shared[device] if device in shared else next(self._tokens) for device in sizes}
            for device, token in tokens.items():
                buffer = self._buffers.setdefault(token, [device, sizes[device], 0])
                buffer[2] += 1
                if buffer[2] == 1:  # a new buffer (or a shared one whose other users are gone)
                    live = self._live[device] = self._live.get(device, 0) + sizes[device]
                    self._peak[device] = max(self._peak.get(device, 0), live)
            self._arrays[id(ref)] = (ref, list(tokens.values()))
        return tokens

    def _release(self, ref: weakref.ref) -> None:
        with self._lock:
            _, tokens = self._arrays.pop(id(ref), (None, ()))
            for token in tokens:
                buffer = self._buffers[token]
                buffer[2] -= 1
                if buffer[2] == 0:
                    del self._buffers[token]
                    self._live[buffer[0]] -= buffer[1]

    def live(self) -> dict[int, int]:
        """Current bytes per device id, devices holding none left out."""
        with self._lock:
            return {d: n for d, n in self._live.items() if n}

    def peak(self) -> dict[int, int]:
        """Running peak per device id (every device of the feeder, zero where nothing was placed)."""
        with self._lock:
            return dict(self._peak)


class Feeder:
    """Places host batches as global arrays sharded by ``shardings[field]``.

    ``global_batch`` is the batch size summed over processes; each call gets this process's
    rows only (see :func:`process_rows`). ``place`` is safe to call from one background
    thread while the train step runs.
    """

    mode = ""

    def __init__(self, shardings: Mapping[str, NamedSharding], global_batch: int):
        self.shardings = dict(shardings)
        self.global_batch = global_batch
        mesh = next(iter(self.shardings.values())).mesh
        # The relay is the first of the mesh's devices that this process can address.
        local = {d.id for d in mesh.local_devices}
        self.devices = [d for d in np.asarray(mesh.devices).flat if d.id in local]
        self.relay = self.devices[0]
        self.ledger = LiveBytes(self.devices)

    def live_bytes(self) -> dict[int, int]:
        """Bytes per device id of the input arrays this feeder made that are still alive:
        placed batches (in use, prefetched) and routed staging. A batch the program has
        dropped does not count."""
        return self.ledger.live()

    def memory_report(self) -> dict:
        """Per-device peak of live input bytes over this feeder's life (``live_buffers``), and
        the backend's own ``peak_bytes_in_use`` where it reports one (GPU; all memory, not
        just inputs)."""
        out = {"source": "live_buffers", "peak_input_bytes": {str(k): v for k, v in self.ledger.peak().items()}}
        stats = memory_stats_peak(self.devices)
        if stats is not None:
            out["memory_stats_peak_bytes_in_use"] = {str(k): v for k, v in stats.items()}
        return out

    def place(self, batch: Mapping[str, np.ndarray]) -> tuple[dict[str, jax.Array], Placement]:
        start = time.perf_counter()
        host = {k: np.asarray(v) for k, v in batch.items()}
        out, relay_bytes = self._place(host)
        jax.block_until_ready(out)
        info = Placement(
            seconds=time.perf_counter() - start,
            relay_bytes=relay_bytes,
            total_bytes=sum(rows.nbytes for rows in host.values()),
            aliased=any(aliases_host(out[k], rows) for k, rows in host.items()),
        )
        return out, info

    def _global_shape(self, rows: np.ndarray) -> tuple[int, ...]:
        return (self.global_batch, *rows.shape[1:])

    def _place(self, host: dict[str, np.ndarray]) -> tuple[dict[str, jax.Array], int]:
        """Every field's global array (counted in the ledger), and the bytes the host sent to
        the relay."""
        raise NotImplementedError


class DirectFeeder(Feeder):
    """Each device gets its own slice from the host, one call per field."""

    mode = "direct"

    def _place(self, host):
        out, relay = {}, 0
        for field, rows in host.items():
            array = jax.make_array_from_process_local_data(self.shardings[field], rows, self._global_shape(rows))
            self.ledger.add(array)
            relay += device_bytes(array).get(self.relay.id, 0)
            out[field] = array
        return out, relay


@dataclasses.dataclass(frozen=True)
class Route:
    """How one batch's fields leave the relay: one program cuts every distinct slice of every
    field on the relay, then each device receives its slice (``which``: index into the cuts)."""

    split: Callable[[dict[str, jax.Array]], dict[str, list[jax.Array]]]  # jitted; runs on the relay
    devices: dict[str, list[jax.Device]]  # field → this process's devices, in its sharding's order
    which: dict[str, list[int]]  # field → for each of those devices, the index of its slice


def route(shardings: Mapping[str, NamedSharding], host: Mapping[str, np.ndarray], global_batch: int) -> Route:
    """The route of a host batch with these fields' shapes (this process's rows) to `shardings`.

    A slice that several devices hold (the batch is replicated over some mesh axes) is cut
    once and copied to each of them, so the relay never holds a slice twice."""
    cuts, devices, which = {}, {}, {}
    for field, rows in host.items():
        shape = (global_batch, *rows.shape[1:])
        offset = process_rows(shardings[field], shape).start  # the relay holds this process's rows only
        cuts[field], devices[field], which[field] = [], [], []
        for device, index in shardings[field].addressable_devices_indices_map(shape).items():
            spans = [s.indices(n)[:2] for s, n in zip(index, shape)]
            spans[0] = (spans[0][0] - offset, spans[0][1] - offset)
            cut = (tuple(a for a, _ in spans), tuple(b for _, b in spans))  # (starts, limits)
            if cut not in cuts[field]:
                cuts[field].append(cut)
            devices[field].append(device)
            which[field].append(cuts[field].index(cut))

    @jax.jit
    def split(staged: dict[str, jax.Array]) -> dict[str, list[jax.Array]]:
        return {f: [jax.lax.slice(staged[f], start, limit) for start, limit in cuts[f]] for f in cuts}

    return Route(split, devices, which)


def assemble(shape, sharding: NamedSharding, pieces: list[jax.Array], devices: list[jax.Device]) -> jax.Array:
    """The global array of `shape` whose shard on ``devices[i]`` is ``pieces[i]``, copied there
    (device to device) unless it already is there (then it is the same buffer)."""
    return jax.make_array_from_single_device_arrays(shape, sharding, jax.device_put(pieces, devices))


class RoutedFeeder(Feeder):
    """The whole host batch goes to the relay device, which then hands each device its slice.

    Whatever the mesh, one host → relay transfer of every field, one program on the relay that
    cuts every distinct slice of every field, and per field one call that copies each slice to
    its device (the relay's own slice stays where it is: no copy, the same buffer). The
    relay keeps the whole batch of the latest placement (``staging``) until the next
    placement, as Mesh TensorFlow's relay GPU holds the full batch tensor: that is the memory
    cost the comparison measures. While a batch is placed the relay holds its staging copy
    and every distinct slice at once (2x the batch), since all slices are cut before any is
    copied out.
    """

    mode = "routed"

    def __init__(self, shardings, global_batch):
        super().__init__(shardings, global_batch)
        self.staging: dict[str, jax.Array] = {}
        self._routes: dict[tuple, Route] = {}  # per field shapes and dtypes (fixed for a run)

    def _place(self, host):
        key = tuple((k, v.shape, v.dtype.str) for k, v in host.items())
        if key not in self._routes:
            self._routes[key] = route(self.shardings, host, self.global_batch)
        plan, ledger, relay = self._routes[key], self.ledger, self.relay.id
        self.staging = {}  # the previous batch's copy goes before the next one arrives
        staged = jax.device_put(host, self.relay)  # one transfer: this process's whole batch
        for array in staged.values():
            ledger.add(array)
        pieces = plan.split(staged)  # temporaries on the relay, freed when this returns
        tokens = {f: [ledger.add(piece)[relay] for piece in cut] for f, cut in pieces.items()}
        out = {}
        for f, rows in host.items():
            shards = [pieces[f][i] for i in plan.which[f]]  # relay → every device, one call
            array = assemble(self._global_shape(rows), self.shardings[f], shards, plan.devices[f])
            # The relay's shard is its slice's buffer, counted above; every other shard is new.
            shared = {d.id: tokens[f][i] for d, i in zip(plan.devices[f], plan.which[f]) if d.id == relay}
            ledger.add(array, shared=shared)
            out[f] = array
        self.staging = staged
        return out, sum(rows.nbytes for rows in host.values())


FEEDERS: dict[str, type[Feeder]] = {"direct": DirectFeeder, "routed": RoutedFeeder}

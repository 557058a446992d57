"""Feeders: put a host batch onto the mesh as global ``jax.Array``s, two ways.

``direct`` (the default): every device receives only its own slice, straight from the host.
``routed``: the whole host batch goes to one relay device first, which then hands each device
its slice — Mesh TensorFlow's GPU path. Both return arrays with the same values and the same
``NamedSharding``; they differ in transfer time and in what the relay device must hold.

Which JAX primitive ``direct`` uses (8 simulated CPU devices, batch sharded 8 ways, median of
5 after warm-up): ``make_array_from_process_local_data`` 0.32 / 1.19 / 4.49 ms for 1 / 16 /
64 MiB, per-device ``device_put`` + ``make_array_from_single_device_arrays`` 0.48 / 1.34 /
4.68 ms, ``device_put(x, sharding)`` 0.39 / 1.67 / 4.64 ms. All three are within noise at
large sizes; ``make_array_from_process_local_data`` is fastest at small ones and is also the
one that is correct multi-host (it takes this process's rows only), so it is used. On CPU,
placement can alias a 64-byte-aligned host buffer instead of copying it (64 MiB placed faster
than ``np.copy`` of it), so a CPU figure may understate a real host→device copy.

Input memory (the ``live_buffers`` source): every device array a feeder creates — placed
batch shards, the routed relay's staging copy of the whole batch, the routed path's temporary
slices on the relay — is counted in a :class:`LiveBytes` ledger when it is created and
uncounted when it is released, so the per-device peak is exact, not sampled.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
import weakref
from collections.abc import Iterable, Mapping

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
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
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
        placed = {k: self._place(k, self.shardings[k], rows) for k, rows in host.items()}
        out = {k: array for k, (array, _) in placed.items()}
        jax.block_until_ready(out)
        info = Placement(
            seconds=time.perf_counter() - start,
            relay_bytes=sum(relay for _, relay in placed.values()),
            total_bytes=sum(rows.nbytes for rows in host.values()),
            aliased=any(aliases_host(out[k], rows) for k, rows in host.items()),
        )
        return out, info

    def _global_shape(self, rows: np.ndarray) -> tuple[int, ...]:
        return (self.global_batch, *rows.shape[1:])

    def _place(self, field: str, sharding: NamedSharding, rows: np.ndarray) -> tuple[jax.Array, int]:
        """One field: its global array (counted in the ledger), and the bytes the host sent
        to the relay for it."""
        raise NotImplementedError


class DirectFeeder(Feeder):
    """Each device gets its own slice from the host, all in one call."""

    mode = "direct"

    def _place(self, field, sharding, rows):
        array = jax.make_array_from_process_local_data(sharding, rows, self._global_shape(rows))
        self.ledger.add(array)
        return array, device_bytes(array).get(self.relay.id, 0)


class RoutedFeeder(Feeder):
    """The whole host batch goes to the relay device, which then copies each device its slice.

    The relay keeps the whole batch of the latest placement (``staging``) until the next
    placement of that field, as Mesh TensorFlow's relay GPU holds the full batch tensor: that
    is the memory cost the comparison measures. While a batch is placed the relay holds its
    staging copy and every device's slice at once (2x the batch), since all slices are cut
    before any is copied out.
    """

    mode = "routed"

    def __init__(self, shardings, global_batch):
        super().__init__(shardings, global_batch)
        self.staging: dict[str, jax.Array] = {}

    def _place(self, field, sharding, rows):
        shape = self._global_shape(rows)
        offset = process_rows(sharding, shape).start
        relay, ledger = self.relay.id, self.ledger
        self.staging.pop(field, None)  # the previous batch's copy goes before the next one arrives
        on_relay = jax.device_put(rows, self.relay)  # [rows, ...]: this process's whole batch
        ledger.add(on_relay)
        slices: dict[tuple, tuple[jax.Array, int]] = {}  # temporaries on the relay, freed when this returns
        shards, tokens = [], {}  # tokens: device id → the counted buffer its shard lives in
        for device, idx in sharding.addressable_devices_indices_map(shape).items():
            local = (slice((idx[0].start or 0) - offset, (idx[0].stop or shape[0]) - offset), *idx[1:])
            key = tuple((s.start, s.stop) for s in local)
            if key not in slices:  # a device that replicates another's slice gets the same copy
                piece = on_relay[local]
                slices[key] = piece, ledger.add(piece)[relay]
            piece, token = slices[key]
            shard = jax.device_put(piece, device)  # device → device; to the relay itself: no copy, same buffer
            tokens[device.id] = token if device.id == relay else ledger.add(shard)[device.id]
            shards.append(shard)
        self.staging[field] = on_relay
        array = jax.make_array_from_single_device_arrays(shape, sharding, shards)
        ledger.add(array, shared=tokens)  # its shards are the buffers counted above
        return array, rows.nbytes


FEEDERS: dict[str, type[Feeder]] = {"direct": DirectFeeder, "routed": RoutedFeeder}

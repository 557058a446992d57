"""Stopping on SIGINT/SIGTERM at a step every process agrees on.

A signal only sets a flag. The flag travels into the next train step as a tiny input (one
int32 per device, this process's signal number or 0; see :func:`flag_sharding`) and comes back
in the step's replicated outputs as ``metrics["stop"]``, the largest signal number of any
process. Every process reads
the same value at the same step and makes the same choice, so all save the same step and stop
there: no host collective is added to any step. The loop reads a step's results one step late
(:mod:`meshpar.run.loop`): when the flag is read after the next step has already taken the flagged
step's state, the run stops at that next step instead, on every process alike.

``jax.distributed.initialize`` installs the preemption service's own SIGTERM notifier;
:mod:`meshpar.processes.joining` turns that service off, so SIGTERM is this module's alone.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class Interrupted(Exception):
    """SIGINT/SIGTERM arrived; the state was checkpointed at `step` and the run stopped."""

    def __init__(self, signum: int, step: int, saved: bool):
        super().__init__(f"{signal.Signals(signum).name} at step {step}")
        self.signum, self.step, self.saved = signum, step, saved


def flag_sharding(mesh: Mesh) -> NamedSharding:
    """The flags' sharding, one element per device (``[devices]``). With several processes it
    is split over every mesh axis: each process puts its own flag on its devices, and the
    step's max over the array is the exchange that makes them agree. With one process every
    device holds the same flag, so the array is replicated and the max needs no collective (a
    cross-device all-reduce of 8 integers cost about 7% of mlp_model_parallel's step on CPU)."""
    if jax.process_count() == 1:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, PartitionSpec(mesh.axis_names))


def make_flags(mesh: Mesh, signum: int) -> jax.Array:
    """The step's ``stop`` input: this process's devices all hold `signum` (0 = keep going)."""
    sharding, shape = flag_sharding(mesh), (mesh.size,)
    local = [
        jax.device_put(np.full(sharding.shard_shape(shape), signum, np.int32), d)
        for d in sharding.addressable_devices_indices_map(shape)
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, local)


class StopSignals:
    """Turns the first SIGINT/SIGTERM into a flag (a second one acts as usual), so a stop never
    lands in the middle of a step or a save. ``flags()`` is the step input that carries it."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.signum: int | None = None
        self._previous: dict = {}
        self._clear = make_flags(mesh, 0)  # reused every step until a signal comes
        self._raised: jax.Array | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        signal.signal(signum, self._previous[signum])
        self.signum = signum

    def flags(self) -> jax.Array:
        if self.signum is None:
            return self._clear
        if self._raised is None:
            self._raised = make_flags(self.mesh, self.signum)
        return self._raised

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

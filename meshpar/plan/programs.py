"""The per-device peak of every program a run executes (compiled once by
:mod:`meshpar.step.programs`; read here, never compiled).

A run executes more than its train step, and each program peaks with different buffers alive
beside it. Per device, in bytes, each peak is XLA's total for the program (argument + output +
temp − alias of ``memory_analysis()``) plus what is resident outside it at that moment:

* **train step** — the state and one batch are its arguments; outside it, the batches placed
  ahead (``feed.prefetch``) and the one a dispatched step still holds under the lagged loop
  (see :mod:`meshpar.run.loop`; none with ``train.sync_every_step``);
* **eval step** (when ``train.eval_every`` > 0) — its arguments are the parameters and one
  eval batch; the rest of the train state (optimizer state, step, RNG key) stays resident —
  on the device, unless offloaded to host memory — and so do the prefetched train batches.
  The loop waits for the step before it evaluates, so no train batch is in flight;
* **checkpoint digest** (when the run saves) — the program that digests every state array
  before a save (:mod:`meshpar.checkpoints.integrity`): the whole state is its argument; its temporaries
  are the arrays' bits. The prefetched train batches stay resident.

XLA's figures are device bytes (:func:`meshpar.step.aot.memory`): with host offload, the arguments
and outputs in ``pinned_host`` memory are taken out of them — by XLA itself where the backend
honours memory kinds, else (CPU) from their shardings.

In routed feeding the relay device also holds the whole process batch it received, and the
slices cut from it, while the prefetch thread places the next batch: at any of these peaks.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from meshpar.configuration.config import Config
from meshpar.plan import cost
from meshpar.plan.time import feed_time
from meshpar.sharding import offload
from meshpar.step import aot, parts
from meshpar.step.programs import Programs


@dataclasses.dataclass(frozen=True)
class Peak:
    """One program's per-device peak: XLA's figures for it and the bytes resident beside it."""

    program: str
    xla: dict[str, int]  # aot.memory(compiled)
    resident: dict[str, int]  # what lives outside the program at its peak, by what it is
    compiled: object = dataclasses.field(default=None, repr=False, compare=False)  # for a run to call

    @property
    def bytes(self) -> int:
        return self.xla["total_bytes"] + sum(self.resident.values())


def relay_bytes(cfg: Config, batch: dict) -> int:
    """Routed feeding: the relay device's copy of the whole process batch and the other slices
    cut from it while it places them (:func:`meshpar.plan.time.feed_time.relay_bytes`); 0 in direct
    feeding. `batch`: the global batch, ShapeDtypeStructs with their shardings."""
    processes = cfg.distributed.num_processes
    process_batch = sum(math.prod(b.shape) * b.dtype.itemsize for b in batch.values()) // processes
    first = next(iter(batch.values()))
    shards = first.shape[0] // first.sharding.shard_shape(first.shape)[0]  # distinct batch slices
    return feed_time.relay_bytes(cfg.feed.mode, process_batch, max(shards // processes, 1))


def _device_bytes(abstract) -> int:
    """Per-device bytes of the leaves of `abstract` that live in device memory (host offload
    keeps the others in pinned host memory, outside every device's peak)."""
    return aot.shard_bytes([a for a in jax.tree.leaves(abstract) if not offload.on_host(a.sharding)])


def peaks(step: parts.AbstractStep, programs: Programs) -> list[Peak]:
    """The peak of every program the step's run executes (`programs`, compiled once from the
    step), each with what is resident beside it."""
    cfg = step.cfg
    state, batch, _ = step.args
    one_batch = aot.shard_bytes(batch)
    prefetched = {"prefetched batches": one_batch * cfg.feed.prefetch} if cfg.feed.prefetch else {}
    relay = {"relay copy of the process batch": relay_bytes(cfg, batch)} if cfg.feed.mode == "routed" else {}
    lagged = cost.resident_batches(cfg) - cfg.feed.prefetch  # the one a dispatched step still holds
    in_flight = {"batch of the step in flight": one_batch * lagged} if lagged else {}
    resident = {
        "train step": {**prefetched, **in_flight, **relay},
        "eval step": {"optimizer state, step, rng": _device_bytes(state) - _device_bytes(state.params),
                      **prefetched, **relay},
        "checkpoint digest": {**prefetched, **relay},
    }  # fmt: skip
    return [Peak(name, aot.memory(compiled), resident[name], compiled) for name, compiled in programs.named()]

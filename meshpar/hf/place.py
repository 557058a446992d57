"""Host tensors straight into their target shardings, a tensor at a time.

A parameter that is one tensor is placed with ``device_put`` into its sharding. A stacked one
(leading ``layers`` dim; a mixture of experts' ``[layers, experts]``: a slot is one expert of one
layer) is first allocated in its sharding (zeros, computed on the devices) and each slot is
then written into it by a jitted ``dynamic_update_slice`` that donates the stack, so the stack
is updated in place and the host never holds more than one slot of it. Below, "a layer" is
such a slot.

A layer's slice is sent to the devices in the stack's split (its other dims as the stack's);
where those leave it replicated over R devices, each of them receives a copy, R copies of the
layer in device memory before they are written in — on a CPU host, R copies in host memory.
So a layer is sent in R pieces along a dim the sharding leaves whole (where one divides),
keeping what is in flight to about one layer's bytes.

Every program is compiled before the first tensor is read (:meth:`Placer.compile`), so the
compiler's own memory is not counted in the loader's peak: :func:`peak_rss` is the process's
high-water resident memory, and :mod:`meshpar.hf.load` reports it against the baseline taken
after compiling.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

HOST = "pinned_host"


def peak_rss() -> int:
    """The process's high-water resident memory in bytes: ``getrusage``'s ``ru_maxrss``, except
    that on Linux, where the kernel folds into ``ru_maxrss`` the high-water mark of the process
    this one was started from (the memory that process had when this one was exec'd), the
    process's own mark is read from ``/proc/self/status`` (VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def placed_bytes(x: jax.Array) -> int:
    """Bytes `x` occupies over all its devices, replicas included."""
    return sum(s.data.nbytes for s in x.addressable_shards)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Stack:
    """How one stacked parameter is filled: its sharding on the devices, the split of a layer
    piece, and the pieces a layer is sent in (`pieces` along `dim` of the layer, None: whole).
    The first `lead` dims are the stack's (a layer is the rest)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: NamedSharding  # the parameter's own (device memory while it is filled)
    piece: NamedSharding  # a piece of one layer: the stack's split without its stack dims
    dim: int | None
    pieces: int
    lead: int = 1

    @classmethod
    def plan(cls, shape: tuple[int, ...], dtype, sharding: NamedSharding, lead: int = 1) -> Stack:
        spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
        piece = NamedSharding(sharding.mesh, PartitionSpec(*spec[lead:]))
        used = {a for entry in spec[lead:] for a in _axes(entry)}
        replicas = math.prod(n for a, n in sharding.mesh.shape.items() if a not in used)
        dim, pieces = None, 1
        if replicas > 1:
            # A whole dim that splits into at least `replicas` equal pieces: the layer's first (its
            # pieces are views of the host array, sent without a copy) where it can, else the largest.
            whole = [d for d in range(lead, len(shape)) if spec[d] is None]
            for d in sorted(whole, key=lambda d: (d != lead, -shape[d])):
                n = next((n for n in range(replicas, shape[d] + 1) if shape[d] % n == 0), None)
                if n is not None:
                    dim, pieces = d - lead, n  # a dim of the layer (without the stack dims)
                    break
        return cls(tuple(shape), np.dtype(dtype), sharding, piece, dim, pieces, lead)

    @property
    def layers(self) -> int:
        """The slots of the stack: the product of its stack dims."""
        return math.prod(self.shape[: self.lead])

    def piece_shape(self) -> tuple[int, ...]:
        layer = list(self.shape[self.lead :])
        if self.dim is not None:
            layer[self.dim] //= self.pieces
        return tuple(layer)


# (shape, dtype, sharding, stack dims) of a stack → its zeros and write programs, lowered or compiled: kept
# for the process, so that loading a model of the same shapes again compiles nothing.
_ZEROS: dict = {}
_WRITES: dict = {}


class Placer:
    """Places parameters one at a time into their shardings; compile first, then :meth:`put`
    and :meth:`fill`."""

    def __init__(self):
        self._zeros, self._writes = _ZEROS, _WRITES

    def stack(self, shape: tuple[int, ...], dtype, sharding: NamedSharding, lead: int = 1) -> Stack:
        """Plan the filling of a stack of `lead` leading stack dims (see :class:`Stack`)."""
        on_device = sharding.with_memory_kind("device") if sharding.memory_kind == HOST else sharding
        plan = Stack.plan(shape, dtype, on_device, lead)
        key = (plan.shape, plan.dtype, plan.sharding, plan.lead)
        if key not in self._zeros:
            zeros = jax.jit(lambda: jnp.zeros(plan.shape, plan.dtype), out_shardings=plan.sharding)
            starts = jax.ShapeDtypeStruct((len(plan.shape),), jnp.int32)
            piece = jax.ShapeDtypeStruct(plan.piece_shape(), plan.dtype, sharding=plan.piece)
            stacked = jax.ShapeDtypeStruct(plan.shape, plan.dtype, sharding=plan.sharding)
            write = jax.jit(_write, out_shardings=plan.sharding, donate_argnums=0)
            self._zeros[key] = zeros.lower()
            self._writes[key] = write.lower(stacked, piece, starts)
        return plan

    def compile(self) -> None:
        """Compile every program :meth:`stack` has planned (before any tensor is read)."""
        for programs in (self._zeros, self._writes):
            for key, program in programs.items():
                if isinstance(program, jax.stages.Lowered):
                    programs[key] = program.compile()

    def put(self, host: np.ndarray, sharding: NamedSharding) -> jax.Array:
        # Waited for, so that the host array is released before the next tensor is read.
        return jax.device_put(host, sharding).block_until_ready()

    def fill(self, plan: Stack, layer: Callable[[int], np.ndarray], target: NamedSharding) -> jax.Array:
        """The stacked parameter of `plan`, layer i (the stack dims' flat index, C order) being
        ``layer(i)`` (host, its final dtype), in `target` (which may be pinned host memory: it
        is filled on the devices, then moved)."""
        self.compile()
        key = (plan.shape, plan.dtype, plan.sharding, plan.lead)
        stack = self._zeros[key]()
        write = self._writes[key]
        slot = plan.shape[plan.lead :]
        for i in range(plan.layers):
            host = layer(i)
            if host.shape != slot or host.dtype != plan.dtype:
                raise ValueError(
                    f"layer {i} is {host.dtype}{list(host.shape)}, the stack holds {plan.dtype}{list(slot)}"
                )
            size = plan.piece_shape()[plan.dim] if plan.dim is not None else 0
            for p in range(plan.pieces):
                where = [slice(None)] * host.ndim
                if plan.dim is not None:
                    where[plan.dim] = slice(p * size, (p + 1) * size)
                starts = np.zeros(len(plan.shape), np.int32)
                starts[: plan.lead] = np.unravel_index(i, plan.shape[: plan.lead])
                if plan.dim is not None:
                    starts[plan.dim + plan.lead] = p * size
                stack = write(stack, jax.device_put(host[tuple(where)], plan.piece), starts)
                # One piece in flight at a time: without the wait, dispatch runs ahead and the
                # pieces sent to the devices pile up until the writes have run.
                stack.block_until_ready()
            del host
        return stack if target == plan.sharding else jax.device_put(stack, target)


def _write(stack: jax.Array, piece: jax.Array, starts: jax.Array) -> jax.Array:
    """`piece` (a slice of one layer) written into `stack` at `starts` (the stack dims first)."""
    piece = piece.reshape((1,) * (stack.ndim - piece.ndim) + piece.shape)
    return jax.lax.dynamic_update_slice(stack, piece, tuple(starts[i] for i in range(stack.ndim)))

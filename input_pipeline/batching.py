"""Host batching: a deterministic sequence of global batches, read per process.

Batch ``step`` is a pure function of ``(seed, step)``: epoch ``e`` visits the source in the
order of a permutation seeded by ``(seed, e)``, and each batch is the next ``batch_size``
rows of it (the tail that does not fill a batch is dropped). Resuming at step ``s`` therefore
needs nothing but ``s``. Each process reads only ``rows`` of every global batch: the rows its
own devices hold, so a multi-host run never reads a row twice.

With ``reuse_buffers`` the loader reads into a pool of 64-byte-aligned host buffers instead of
allocating every batch. A buffer goes back to the pool only when the caller says the placed
batch does not alias it: on CPU, placement may wrap an aligned host buffer instead of copying
it, and overwriting that buffer would silently change a batch already on the "device".
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from input_pipeline.errors import DataError


class HostLoader:
    def __init__(
        self,
        source,
        batch_size: int,
        seed: int,
        rows: slice | None = None,
        shuffle: bool = True,
        reuse_buffers: bool = False,
    ):
        if reuse_buffers and not hasattr(source, "read_into"):
            raise ValueError(f"{type(source).__name__} cannot read into reused buffers (it has no read_into)")
        if len(source) < batch_size:
            raise DataError(f"split has {len(source)} examples, fewer than one batch of {batch_size}")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.rows = rows if rows is not None else slice(0, batch_size)
        self.shuffle = shuffle
        self.batches_per_epoch = len(source) // batch_size
        self._epoch, self._order = -1, np.arange(0)
        self.reuse_buffers = reuse_buffers
        self._free: list[dict[str, np.ndarray]] = []  # host buffers no placed batch aliases
        self.allocated = 0  # buffer sets ever allocated (a pool that never recycles keeps growing)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            n = len(self.source)
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._order = epoch, rng.permutation(n) if self.shuffle else np.arange(n)
        return self._order

    def indices(self, step: int) -> np.ndarray:
        """Source indices of this process's rows of global batch `step`."""
        epoch, i = divmod(step, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        return order[i * self.batch_size : (i + 1) * self.batch_size][self.rows]

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`: ``{field: [rows, ...]}``."""
        indices = self.indices(step)
        if not self.reuse_buffers:
            return self.source.read(indices)
        out = self._free.pop() if self._free else self._allocate(len(indices))
        self.source.read_into(indices, out)
        return out

    def recycle(self, batch: dict[str, np.ndarray], aliased: bool) -> None:
        """Hand `batch`'s buffers back for reuse, unless the placed batch aliases them."""
        if self.reuse_buffers and not aliased:
            self._free.append(batch)

    def _allocate(self, rows: int) -> dict[str, np.ndarray]:
        self.allocated += 1
        return {k: aligned_empty((rows, *shape), dtype) for k, (shape, dtype) in self.source.element_spec.items()}

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        step = start
        while stop is None or step < stop:
            yield self.batch(step)
            step += 1


def checked_indices(indices, length: int, what: str) -> np.ndarray:
    """`indices` as int64 positions into a source of `length` examples (`what`, for the message):
    every source's read checks them this way; IndexError for a shape, dtype or position that
    is not one."""
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise IndexError(f"indices must be a 1-D integer array, got {idx.dtype}{idx.shape}")
    if idx.size and (idx.min() < 0 or idx.max() >= length):
        raise IndexError(f"indices out of range [0, {length}) for {what}: min={idx.min()} max={idx.max()}")
    return idx.astype(np.int64, copy=False)


def aligned_empty(shape: tuple[int, ...], dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)
